"""``flowgrpo eval TARGET --bench NAME [--prompts FILE] --out DIR``: a benchmark of any run, pipeline or LoRA.

The prompts are ``--prompts FILE``, or where it is not given the benchmark's shipped set
(:attr:`~flowgrpo.benches.suites.Bench.shipped`: GenEval, OCR, PickScore; :func:`~flowgrpo.benches.suites.bench_prompts`).

TARGET is one of

* a run folder (or one of its checkpoint folders): its trained policy and its base model, side by side
  (a LoRA run's base is the same policy with the adapter off; a full fine-tune's the model it started from);
* a diffusers pipeline folder: that model alone;
* an exported LoRA folder (``pytorch_lora_weights.safetensors``, ``flowgrpo export``) with ``--base``
  the pipeline folder it was trained on: the LoRA and the base, side by side.

The protocol is the official one: images are drawn and written as PNG files first (image ``j`` of
prompt ``i`` from the noise seed ``noise_seed(seed, i, j)``, the same for every model, so the columns pair
up image by image), then scored from those files. Both stages resume: a rerun into the same ``--out``
draws only the images that are missing and scores only those without a score, and is refused when
its settings (benchmark, target, prompts, seed, steps) differ from the folder's. Output: ``bench.json``
(settings and every model's numbers), ``bench.csv`` (model x tag), ``grid_<tag>.png`` (a row per prompt
of the tag, a column per model) and the table printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..disk import write_text_atomically
from ..errors import UserError
from ..benches.scoring import build_scorer, summarise
from ..benches.suites import bench_prompts, get_bench
from ..text_inputs import loads_json

LORA_FILE = "pytorch_lora_weights.safetensors"
SETTINGS_FILE = "bench_settings.json"
#: prompts shown per tag in the grids
GRID_PROMPTS = 8


@dataclass
class BenchOptions:
    """What ``flowgrpo eval --bench`` runs (None: the benchmark's or the model's own value)."""

    bench: str
    #: the prompt file (None: the benchmark's shipped one, :func:`~flowgrpo.benches.suites.bench_prompts`)
    prompts: str | None
    out: str
    base: str | None = None
    seed: int = 0
    steps: int | None = None
    images_per_prompt: int | None = None
    max_prompts: int | None = None
    batch_size: int = 4
    options: dict = field(default_factory=dict)
    model_overrides: tuple[str, ...] = ()


@dataclass
class Variant:
    """One model of the table: its column name, the policy and a context that switches it on."""

    name: str
    policy: object
    switch: object = contextlib.nullcontext
    shift: float = 1.0
    steps: int = 20


def frozen(model_cfg):
    """``model_cfg`` with nothing trainable (a benchmark only draws)."""
    import dataclasses

    return dataclasses.replace(model_cfg, train_mode="frozen")


def _lora_variants(folder: Path, base: str | None, overrides: tuple[str, ...]) -> list[Variant]:
    from ..config import load_config
    from ..policies import build_policy

    if base is None:
        raise UserError(f"{folder} is a LoRA folder: name the pipeline it was trained on with --base DIR")
    cfg = load_config(None, None, [f"model.name={base}", *overrides])
    policy = build_policy(frozen(cfg.model))
    experts = ["transformer", *(p.name for p in sorted(folder.iterdir()) if (p / LORA_FILE).is_file())]
    for expert in experts:
        source = folder if expert == "transformer" else folder / expert
        getattr(policy, expert).load_lora_adapter(str(source), prefix="transformer", weight_name=LORA_FILE,
                                                  adapter_name="bench")

    @contextlib.contextmanager
    def lora_off():
        for expert in experts:
            getattr(policy, expert).disable_lora()
        try:
            yield
        finally:
            for expert in experts:
                getattr(policy, expert).enable_lora()

    return [Variant("lora", policy, shift=cfg.sampler.shift, steps=cfg.eval.num_steps),
            Variant("base", policy, lora_off, cfg.sampler.shift, cfg.eval.num_steps)]


def model_variants(target: str, base: str | None = None, overrides: tuple[str, ...] = ()) -> list[Variant]:
    """The models a TARGET stands for (see the module docstring), each a :class:`Variant`."""
    from ..config import load_config
    from ..policies import build_policy
    from ..trainer.checkpoint import CONFIG_FILE, STATE_FILE, load_trained_policy

    path = Path(target)
    if (path / CONFIG_FILE).is_file() or (path / STATE_FILE).is_file():
        run = load_trained_policy(path)
        cfg, policy = run.cfg, run.policy
        steps, shift = cfg.eval.num_steps, cfg.sampler.shift
        if cfg.model.train_mode == "lora":
            base_variant = Variant("base", policy, policy.adapter_disabled, shift, steps)
        else:
            torch.manual_seed(cfg.train.seed)
            base_variant = Variant("base", build_policy(cfg.model), shift=shift, steps=steps)
        return [Variant(f"trained ({run.weights.kind})", policy, shift=shift, steps=steps), base_variant]
    if (path / LORA_FILE).is_file():
        return _lora_variants(path, base, overrides)
    cfg = load_config(None, None, [f"model.name={target}", *overrides])
    return [Variant("model", build_policy(frozen(cfg.model)), shift=cfg.sampler.shift, steps=cfg.eval.num_steps)]


def _settings(opts: BenchOptions, target: str, rows: list[dict], steps: int, per_prompt: int, prompts: str) -> dict:
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"bench": opts.bench, "target": str(Path(target).resolve()), "base": opts.base, "prompts": prompts,
            "prompts_sha256": digest, "num_prompts": len(rows), "images_per_prompt": per_prompt, "seed": opts.seed,
            "steps": steps, "options": opts.options, "model_overrides": list(opts.model_overrides)}


def _check_resume(out: Path, settings: dict) -> None:
    """Write the settings of a new output folder; refuse, in one line, a folder made with other ones."""
    file = out / SETTINGS_FILE
    if file.is_file():
        old = loads_json(file.read_text())
        changed = sorted(k for k in settings if old.get(k) != settings[k])
        if changed:
            raise UserError(f"{out} holds a benchmark run with other settings ({', '.join(changed)}); give a new --out "
                            "or the same settings to resume it")
        return
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty and holds no benchmark run")
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(file, json.dumps(settings, indent=2))


def _draw_missing(variant: Variant, folder: Path, rows: list[dict], items: list[tuple[int, int]], opts, steps) -> None:
    from ..images import png_bytes
    from ..output.drawing import draw, noise_seed

    folder.mkdir(parents=True, exist_ok=True)
    todo = [(i, j) for i, j in items if not (folder / f"{i:05d}_{j}.png").is_file()]
    policy = variant.policy
    policy.eval()
    with variant.switch():
        for start in range(0, len(todo), opts.batch_size):
            batch = todo[start:start + opts.batch_size]
            images = draw(policy, [rows[i]["prompt"] for i, _ in batch], [noise_seed(opts.seed, i, j) for i, j in batch],
                          steps, variant.shift)
            if images.ndim != 4:
                raise UserError("the benchmarks score images; this model draws videos")
            for (i, j), image in zip(batch, images):
                tmp = folder / f".{i:05d}_{j}.png.tmp"  # renamed whole: a killed run leaves no half image
                tmp.write_bytes(png_bytes(image))
                tmp.replace(folder / f"{i:05d}_{j}.png")


def _read_png(path: Path) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        return torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)


def _score_missing(scorer, folder: Path, rows: list[dict], items: list[tuple[int, int]], batch: int) -> dict:
    """Scores of every item, read from ``folder/scores.jsonl`` where there, the others scored and appended."""
    file = folder / "scores.jsonl"
    done = {}
    if file.is_file():
        for line in file.read_text().splitlines():
            if line.strip():
                rec = loads_json(line)
                done[(rec["i"], rec["j"])] = rec["score"]
    todo = [it for it in items if it not in done]
    with file.open("a") as fh:
        for start in range(0, len(todo), batch):
            part = todo[start:start + batch]
            images = torch.stack([_read_png(folder / f"{i:05d}_{j}.png") for i, j in part])
            for (i, j), s in zip(part, scorer(images, [rows[i] for i, _ in part])):
                done[(i, j)] = s
                fh.write(json.dumps({"i": i, "j": j, "score": s}) + "\n")
            fh.flush()
    return done


def run_bench(target: str, opts: BenchOptions) -> dict:
    """Run the benchmark on ``target`` into ``opts.out`` (see the module docstring); returns ``bench.json``'s dict."""
    from ..data import load_prompt_file
    from ..output.drawing import check_draw_flags

    bench = get_bench(opts.bench)
    prompts = bench_prompts(bench, opts.prompts)  # --prompts, else the shipped set; before any model loads
    rows = load_prompt_file(prompts)
    if opts.max_prompts:
        rows = rows[:opts.max_prompts]
    check_draw_flags(num_prompts=len(rows), source=str(prompts))
    variants = model_variants(target, opts.base, opts.model_overrides)
    steps = opts.steps or variants[0].steps
    per_prompt = opts.images_per_prompt or bench.images_per_prompt
    out = Path(opts.out)
    _check_resume(out, _settings(opts, target, rows, steps, per_prompt, prompts))
    items = [(i, j) for i in range(len(rows)) for j in range(per_prompt)]
    scorer = build_scorer(bench, opts.options)
    result = {"settings": loads_json((out / SETTINGS_FILE).read_text()), "models": {}}
    for k, variant in enumerate(variants):
        folder = out / f"model{k}"
        _draw_missing(variant, folder, rows, items, opts, steps)
        scores = _score_missing(scorer, folder, rows, items, opts.batch_size)
        summary = summarise(bench, [scores[it] for it in items], [rows[i] for i, _ in items], [i for i, _ in items])
        result["models"][variant.name] = {"folder": folder.name, **summary.to_json()}
    write_text_atomically(out / "bench.json", json.dumps(result, indent=2))
    _write_csv(out / "bench.csv", result)
    _write_grids(out, result, rows, items)
    print_bench_table(bench, result)
    return result


def _write_csv(path: Path, result: dict) -> None:
    lines = ["model,tag,value"]
    for name, m in result["models"].items():
        lines += [f"{name},{tag},{v:.6f}" for tag, v in m["per_tag"].items()]
        lines.append(f"{name},headline,{m['headline']:.6f}")
    write_text_atomically(path, "\n".join(lines) + "\n")


def _write_grids(out: Path, result: dict, rows: list[dict], items) -> None:
    """``grid_<tag>.png``: the first image of up to :data:`GRID_PROMPTS` prompts of each tag, a column per model."""
    from ..output.plots import save_captioned_grid

    models = list(result["models"].values())
    for tag in sorted({r["tag"] for r in rows}):
        picked = [i for i, r in enumerate(rows) if r["tag"] == tag][:GRID_PROMPTS]
        cells = torch.stack([_read_png(out / m["folder"] / f"{i:05d}_0.png") for i in picked for m in models])
        names = list(result["models"])
        captions = [(rows[i]["prompt"], names) for i in picked]
        save_captioned_grid(out / f"grid_{''.join(c if c.isalnum() else '_' for c in tag)}.png", cells, len(models),
                            captions)


def print_bench_table(bench, result: dict) -> None:
    """The models side by side: every tag, then the headline with its standard error."""
    from rich.console import Console
    from rich.table import Table

    s = result["settings"]
    table = Table(title=f"{bench.name}: {s['num_prompts']} prompts x {s['images_per_prompt']} images, {s['steps']} steps, "
                        f"seed {s['seed']}", caption=bench.source)
    table.add_column("tag")
    for name in result["models"]:
        table.add_column(name, justify="right")
    tags = list(next(iter(result["models"].values()))["per_tag"])
    for tag in tags:
        table.add_row(tag, *(f"{m['per_tag'][tag]:.3f}" for m in result["models"].values()))
    table.add_row("[bold]overall", *(f"[bold]{m['headline']:.3f} ± {m['stderr']:.3f}" for m in result["models"].values()))
    table.add_row("unscored images", *(str(m["num_failed"]) for m in result["models"].values()))
    Console().print(table)
