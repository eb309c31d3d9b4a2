"""Accuracies per dimension, ``summary.json``, the leaderboard CSV and the comparison of two runs.

As in the official scripts, a checkpoint's sub-dimension is its full name and its primary dimension
the part before the first ``-`` (``Attribute - Color`` -> ``Attribute``, ``属性-颜色`` -> ``属性``; a name
without one, such as ``Style``, is both). Accuracy is the share of checkpoint instances scored 1,
pooled over every judged image of the dimension. ``overall`` is the mean of the primary-dimension
accuracies (as the public leaderboard's Overall), not the pooled share of all checkpoints. Failed
judgements are left out of every accuracy and counted in ``failed``. ``summary.json`` holds
fractions in [0, 1]; the CSV and ``compare`` show percentages (0-100) as the leaderboard does.
"""

from __future__ import annotations

import csv
import functools
from pathlib import Path

from ..errors import UserError
from .protocol import data_path
from ..text_inputs import loads_json


def primary_of(testpoint: str) -> str:
    """The primary dimension of a checkpoint name (the part before the first ``-``, stripped)."""
    return testpoint.split("-", 1)[0].strip() if "-" in testpoint else testpoint


@functools.lru_cache(maxsize=2)
def leaderboard_columns(language: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """((primary, (its sub-dimensions, ...)), ...) in the leaderboard's column order, in ``language``'s names."""
    dims = loads_json(data_path("dimensions.json").read_text(encoding="utf-8"))
    return tuple((d[language], tuple(s[language] for s in d["sub"])) for d in dims)


def _ordered(counts: dict[str, list[int]], order: list[str]) -> dict[str, float]:
    names = [n for n in order if n in counts] + sorted(n for n in counts if n not in order)
    return {n: counts[n][0] / counts[n][1] for n in names}


def build_summary(set_name: str, language: str, judge_model: str, records: list[dict], **extra) -> dict:
    """``summary.json`` from judgement records (dicts with ``ok``, ``testpoints``, ``scores``).

    Returns ``{"set", "judge_model", "images", "failed", "overall", "primary", "sub", "checkpoints",
    "counts", **extra}``: ``images`` judged images (failed ones included), ``failed`` those without a
    readable verdict (left out of the accuracies), ``primary`` / ``sub`` accuracy in [0, 1] per
    dimension in leaderboard order, ``overall`` their primary mean (None when nothing was judged),
    ``checkpoints`` the checkpoint instances behind them and ``counts`` the [scored 1, total] pairs."""
    primary: dict[str, list[int]] = {}
    sub: dict[str, list[int]] = {}
    for rec in records:
        if not rec.get("ok"):
            continue
        for tp, score in zip(rec["testpoints"], rec["scores"]):
            for table, name in ((primary, primary_of(tp)), (sub, tp)):
                cell = table.setdefault(name, [0, 0])
                cell[0] += int(score == 1)
                cell[1] += 1
    columns = leaderboard_columns(language)
    p_acc = _ordered(primary, [p for p, _ in columns])
    s_acc = _ordered(sub, [s for p, subs in columns for s in (subs or (p,))])
    failed = sum(1 for r in records if not r.get("ok"))
    return {"set": set_name, "judge_model": judge_model, "images": len(records), "failed": failed,
            "overall": sum(p_acc.values()) / len(p_acc) if p_acc else None, "primary": p_acc, "sub": s_acc,
            "checkpoints": sum(t for _, t in primary.values()),
            "counts": {"primary": {k: primary[k] for k in p_acc}, "sub": {k: sub[k] for k in s_acc}}, **extra}


def leaderboard_row(summary: dict, language: str) -> tuple[list[str], list[str]]:
    """(header, values) of the summary in the leaderboard's column order: Overall, then each primary
    dimension followed by its sub-dimensions; percentages with two decimals, empty where unjudged."""
    def pct(v):
        return "" if v is None else f"{100 * v:.2f}"

    header, values = ["set", "judge_model", "images", "failed", "Overall"], [
        summary["set"], summary["judge_model"], str(summary["images"]), str(summary["failed"]), pct(summary["overall"])]
    for primary, subs in leaderboard_columns(language):
        header.append(primary)
        values.append(pct(summary["primary"].get(primary)))
        for s in subs:
            header.append(s)
            values.append(pct(summary["sub"].get(s)))
    return header, values


def write_leaderboard_csv(path: Path, summary: dict, language: str) -> None:
    """One-row CSV of :func:`leaderboard_row` (UTF-8 with a BOM, so spreadsheet programs read Chinese)."""
    header, values = leaderboard_row(summary, language)
    with open(path, "w", encoding="utf-8-sig", newline="") as fh:
        csv.writer(fh).writerows([header, values])


def read_summary(results_dir: str | Path) -> dict:
    """``RESULTS_DIR/summary.json`` (a UserError names a folder without one)."""
    path = Path(results_dir) / "summary.json"
    if not path.is_file():
        raise UserError(f"{results_dir} holds no summary.json (run `flowgrpo unigenbench score ... --out {results_dir}`)")
    return loads_json(path.read_text(encoding="utf-8"))


def compare_summaries(a: dict, b: dict) -> list[tuple[str, str, float | None, float | None, float | None]]:
    """Rows (level, dimension, A %, B %, B - A in points) in leaderboard order: overall, then every
    primary dimension followed by its sub-dimensions. Summaries of different sets raise a UserError."""
    if a["set"] != b["set"]:
        raise UserError(f"cannot compare set {a['set']!r} with set {b['set']!r}: the prompts differ")
    language = "zh" if a["set"].startswith("zh") else "en"

    def row(level, name, va, vb):
        pa, pb = (None if v is None else 100 * v for v in (va, vb))
        return level, name, pa, pb, (pb - pa if pa is not None and pb is not None else None)

    rows = [row("overall", "Overall", a["overall"], b["overall"])]
    known = set()
    for primary, subs in leaderboard_columns(language):
        known |= {primary, *subs}
        if primary in a["primary"] or primary in b["primary"]:
            rows.append(row("primary", primary, a["primary"].get(primary), b["primary"].get(primary)))
        rows += [row("sub", s, a["sub"].get(s), b["sub"].get(s)) for s in subs if s in a["sub"] or s in b["sub"]]
    extra = sorted((set(a["primary"]) | set(b["primary"])) - known)
    rows += [row("primary", p, a["primary"].get(p), b["primary"].get(p)) for p in extra]
    return rows
