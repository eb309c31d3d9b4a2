"""The bar chart (``scores.png``) and the self-contained ``report.html`` of a scored folder.

``report.html`` needs nothing but a browser: the chart and a JPEG thumbnail of every image are
embedded as data URLs, the styles and the filter script are inline. It lists the accuracy per
primary dimension (click one to filter), then one card per prompt with its images, and a table of
its checkpoints (name, what the prompt asks, the verdict per image; hover a verdict for the judge's
analysis). Filters: a dimension (primary or sub), "a checkpoint scored 0", "failed judgements", and
a text search over the prompts; they live in the URL's ``#dim=...&show=zero&q=...``, so a filtered
view can be bookmarked or linked.
"""

from __future__ import annotations

import base64
import functools
import html
import io
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .protocol import data_path
from .summary import primary_of

THUMB_PIXELS = 160


@functools.lru_cache(maxsize=1)
def _english_names() -> dict[str, str]:
    """Chinese dimension name -> English (for chart labels, which need no CJK font)."""
    dims = json.loads(data_path("dimensions.json").read_text(encoding="utf-8"))
    names = {d["zh"]: d["en"] for d in dims}
    names.update({s["zh"]: s["en"] for d in dims for s in d["sub"]})
    return names


def write_chart(path: Path, summary: dict) -> None:
    """Horizontal bars (percent): Overall and the primary dimensions left, the sub-dimensions right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    en = _english_names()
    panels = [(["Overall"] + [en.get(k, k) for k in summary["primary"]],
               [summary["overall"] or 0.0] + list(summary["primary"].values()), "primary dimensions"),
              ([en.get(k, k) for k in summary["sub"]], list(summary["sub"].values()), "sub-dimensions")]
    fig, axes = plt.subplots(1, 2, figsize=(14, max(4.0, 0.3 * len(summary["sub"]) + 1.5)),
                             gridspec_kw={"width_ratios": [1, 1.3]})
    for ax, (labels, values, title) in zip(axes, panels):
        y = list(range(len(labels)))[::-1]
        colors = ["#444444" if lab == "Overall" else "#3b7dd8" for lab in labels]
        ax.barh(y, [100 * v for v in values], color=colors)
        ax.set_yticks(y, labels, fontsize=8)
        ax.set_xlim(0, 100)
        ax.set_xlabel("accuracy (%)")
        ax.set_title(title)
        for yy, v in zip(y, values):
            ax.text(100 * v + 1, yy, f"{100 * v:.1f}", va="center", fontsize=7)
    fig.suptitle(f"UniGenBench {summary['set']} - judge {summary['judge_model']} - {summary['images']} images, "
                 f"{summary['failed']} failed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _thumb(path: Path) -> str | None:
    from PIL import Image

    try:
        with Image.open(path) as img:
            img = img.convert("RGB")
            img.thumbnail((THUMB_PIXELS, THUMB_PIXELS))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=80)
    except OSError:
        return None
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f4f5f7;color:#222}
header{background:#1f2d3d;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;opacity:.85}.wrap{padding:16px 24px}
.dims{display:grid;grid-template-columns:repeat(auto-fill,minmax(250px,1fr));gap:6px;margin-bottom:12px}
.dim{background:#fff;border-radius:6px;padding:6px 10px;cursor:pointer;border:1px solid #dde}
.dim:hover{border-color:#3b7dd8}.dim b{float:right}.bar{height:6px;background:#e3e7ee;border-radius:3px;margin-top:4px}
.bar i{display:block;height:6px;background:#3b7dd8;border-radius:3px}
.controls{position:sticky;top:0;background:#f4f5f7;padding:8px 0;z-index:2;display:flex;gap:12px;align-items:center}
.controls select,.controls input{font:inherit;padding:3px 6px}
.card{background:#fff;border-radius:8px;padding:10px 14px;margin:10px 0;box-shadow:0 1px 2px #0002}
.card h3{margin:0 0 4px;font-size:15px}.cat{font-weight:normal;color:#667;font-size:12px;margin-left:8px}
.prompt{margin:0 0 8px}.imgs{display:flex;gap:8px;flex-wrap:wrap}
figure{margin:0;text-align:center;font-size:11px;color:#555}figure img{display:block;width:160px;border-radius:4px}
.noimg{width:160px;height:90px;display:flex;align-items:center;justify-content:center;background:#eee}
table{border-collapse:collapse;margin-top:8px;width:100%}td,th{border-bottom:1px solid #eee;padding:3px 6px;text-align:left;font-size:12px}
td.v{text-align:center;width:38px;font-weight:bold;cursor:help}.v1{color:#1a8f3a}.v0{color:#c62828}.vx{color:#999}
tr.dimmed{opacity:.35}.hidden{display:none}.chart{max-width:min(100%,900px);background:#fff;border-radius:6px}
"""

_SCRIPT = """
const q=id=>document.getElementById(id);
function apply(){const dim=q('dim').value,show=q('show').value,text=q('q').value.toLowerCase();let n=0;
for(const c of document.querySelectorAll('.card')){let rows=[...c.querySelectorAll('tr[data-sub]')];
 for(const r of rows){r.classList.toggle('dimmed',!!dim&&r.dataset.sub!==dim&&r.dataset.primary!==dim);}
 const sel=rows.filter(r=>!dim||r.dataset.sub===dim||r.dataset.primary===dim);
 let ok=sel.length>0;
 if(ok&&show==='zero')ok=sel.some(r=>r.querySelector('td.v0'));
 if(ok&&show==='failed')ok=c.dataset.failed==='1';
 if(ok&&text)ok=c.dataset.prompt.includes(text);
 c.classList.toggle('hidden',!ok);n+=ok;}
q('count').textContent=n+' prompts shown';
 history.replaceState(null,'','#'+new URLSearchParams({dim:q('dim').value,show:q('show').value,q:q('q').value}));}
const h=new URLSearchParams(location.hash.slice(1));
for(const id of ['dim','show','q']){if(h.get(id))q(id).value=h.get(id);q(id).addEventListener('input',apply);}
for(const d of document.querySelectorAll('.dim'))d.addEventListener('click',()=>{q('dim').value=d.dataset.dim;apply();});
apply();
"""


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _card(p, records: dict, images_per_prompt: int, thumbs: dict) -> str:
    e = html.escape
    keys = [f"{p.index}_{j}" for j in range(images_per_prompt)]
    figs = []
    for k in keys:
        rec, src = records.get(k), thumbs.get(k)
        if rec and rec.get("ok"):
            cap = f"{k}.png · {sum(rec['scores'])}/{len(rec['scores'])}"
        else:
            cap = f"{k}.png · " + ("failed" if rec else "not judged")
        img = f'<img src="{src}" alt="{e(k)}">' if src else '<div class="noimg">missing</div>'
        figs.append(f"<figure>{img}<figcaption>{e(cap)}</figcaption></figure>")
    head = "".join(f"<th>{e(k.split('_')[1])}</th>" for k in keys)
    rows = []
    for t, (tp, desc) in enumerate(zip(p.testpoints, p.descriptions)):
        cells = []
        for k in keys:
            rec = records.get(k)
            if rec and rec.get("ok"):
                v = rec["scores"][t]
                tip = rec["analysis"][t] if rec.get("analysis") else ""
                cells.append(f'<td class="v v{v}" title="{e(tip)}">{"✓" if v == 1 else "✗"}</td>')
            else:
                tip = (rec or {}).get("error") or "not judged"
                cells.append(f'<td class="v vx" title="{e(tip)}">–</td>')
        rows.append(f'<tr data-sub="{e(tp)}" data-primary="{e(primary_of(tp))}"><td>{e(tp)}</td>'
                    f'<td>{e(desc)}</td>{"".join(cells)}</tr>')
    failed = any(k in records and not records[k].get("ok") for k in keys)
    return (f'<article class="card" data-prompt="{e(p.prompt.lower())}" data-failed="{int(failed)}">'
            f'<h3>#{p.index}<span class="cat">{e(p.category)}</span></h3><p class="prompt">{e(p.prompt)}</p>'
            f'<div class="imgs">{"".join(figs)}</div><table><tr><th>checkpoint</th><th>in this prompt</th>{head}</tr>'
            f'{"".join(rows)}</table></article>')


def write_report(results_dir: Path, summary: dict, prompts: list, records: list[dict], images_dir: Path,
                 language: str, images_per_prompt: int = 4) -> Path:
    """Write ``scores.png`` and ``report.html`` into ``results_dir``; returns the report's path."""
    e = html.escape
    write_chart(results_dir / "scores.png", summary)
    chart = base64.b64encode((results_dir / "scores.png").read_bytes()).decode("ascii")
    by_key = {r["key"]: r for r in records}
    per_prompt = max([images_per_prompt] + [r["j"] + 1 for r in records])
    names = [f"{p.index}_{j}" for p in prompts for j in range(per_prompt)]
    paths = {k: images_dir / f"{k}.png" for k in names if (images_dir / f"{k}.png").is_file()}
    with ThreadPoolExecutor(4) as pool:
        thumbs = {k: v for k, v in zip(paths, pool.map(_thumb, paths.values())) if v}
    counts = summary.get("counts", {})
    dims = "".join(
        f'<div class="dim" data-dim="{e(name)}">{e(name)} <b>{_pct(acc)}</b>'
        f'<div class="bar"><i style="width:{100 * acc:.1f}%"></i></div>'
        f'<small>{counts.get("primary", {}).get(name, [0, 0])[1]} checkpoints</small></div>'
        for name, acc in summary["primary"].items())
    options = ('<option value="">all dimensions</option><optgroup label="primary">'
               + "".join(f'<option value="{e(n)}">{e(n)}</option>' for n in summary["primary"])
               + '</optgroup><optgroup label="sub-dimension">'
               + "".join(f'<option value="{e(n)}">{e(n)}</option>' for n in summary["sub"]) + "</optgroup>")
    cards = "".join(_card(p, by_key, per_prompt, thumbs) for p in prompts)
    title = f"UniGenBench {summary['set']} · judge {summary['judge_model']}"
    doc = (f'<!doctype html><html lang="{language}"><head><meta charset="utf-8"><title>{e(title)}</title>'
           f'<style>{_STYLE}</style></head><body><header><h1>{e(title)}</h1>'
           f"<p>overall {_pct(summary['overall'])} (mean of the primary dimensions) · {summary['images']} images judged · "
           f"{summary['failed']} failed (left out) · {summary['checkpoints']} checkpoints · "
           f"{summary.get('missing_images', 0)} images missing · {summary.get('skipped_rows', 0)} malformed prompt rows skipped</p>"
           f'</header><div class="wrap"><div class="dims">{dims}</div>'
           f'<img class="chart" src="data:image/png;base64,{chart}" alt="accuracy per dimension">'
           f'<div class="controls"><label>dimension <select id="dim">{options}</select></label>'
           '<label>show <select id="show"><option value="">every prompt</option>'
           '<option value="zero">a checkpoint scored 0</option><option value="failed">failed judgements</option>'
           '</select></label><input id="q" placeholder="search the prompts"><span id="count"></span></div>'
           f"<main>{cards}</main></div><script>{_SCRIPT}</script></body></html>")
    out = results_dir / "report.html"
    out.write_text(doc, encoding="utf-8")
    return out
