"""`flowgrpo bench memory`: peak memory of short training runs, per process.

Three runs of ``flowgrpo train`` (``iterations`` iterations each, held-out evaluation off so that
only training is measured), every one in fresh processes, after a process that only imports them:

* ``imports-only``: Python, torch, diffusers, transformers and flowgrpo's trainer imported, nothing
  run (the fixed part of every other row);
* ``default``: the default recipe (``flowgrpo train`` with no preset: shapes-nft on the shapes world);
* ``sd3-tiny-lora``: the flow-grpo preset on the tiny random SD3 with a LoRA adapter (CFG 4.5, KL
  0.04, 4 prompts x 4 chains, T = 10, 64 px, JPEG reward);
* ``sd3-tiny-lora-fsdp2``: the same run on 2 processes with FSDP2 (the settings of
  ``configs/accelerate/fsdp.yaml``; gloo processes on a CPU-only machine).

Each process runs the CLI under :mod:`flowgrpo.benchmarks.memory_probe`, which writes its own peak
resident set size (``ru_maxrss``: the whole process, Python and torch included) and, where CUDA is
available, ``torch.cuda.max_memory_allocated`` (tensors only; the caching allocator's reserve and
the CUDA context are not in it). The table gives the largest value over a run's processes.

Run ``flowgrpo bench memory [--out DIR] [--json PATH]``; prints a table, writes ``memory.csv`` and
``memory.png`` into ``--out`` and the JSON ``{"device", "iterations", "rows": [{"run", "processes",
"peak_rss_mb", "peak_cuda_mb", "wall_s"}]}``.

``flowgrpo bench memory --recipe NAME [--gpus N] [--json PATH]`` (or ``--all [--markdown FILE]``)
sizes a real-size recipe without weights instead (:func:`run_recipe_memory`, :mod:`flowgrpo.realsize`):
parameter and LoRA counts, and every module the recipe's pipeline loads (transformer, text encoders,
VAE, LoRA / AdamW / EMA / reference state) with the rollout's and the update's working memory, per
phase, on 1 GPU, 8 GPUs DDP, 8 GPUs FSDP and FSDP + CPU offload (each row's ``budget``; ``fits_80`` /
``fits_24``: the first layout that fits an 80 / 24 GB GPU). Each row's ``per_gpu`` keeps the
transformer-only figures on 1 and N GPUs.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import output_dir, write_json

PROMPTS = ("a photo of a cat", "a red circle on a white table", "a mountain lake at dawn", "a blue vintage car")
#: the accelerate config of the FSDP2 run: ``configs/accelerate/fsdp.yaml``'s settings, written into the
#: benchmark's temporary folder (so the benchmark runs from any directory, installed or not)
FSDP_SETTINGS = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "num_machines": 1, "machine_rank": 0,
    "mixed_precision": "no", "dynamo_config": {}, "main_training_function": "main", "rdzv_backend": "static",
    "same_network": True, "use_cpu": False, "gpu_ids": "all",
    "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                    "fsdp_reshard_after_forward": True, "fsdp_offload_params": False,
                    "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_cpu_ram_efficient_loading": False,
                    "fsdp_activation_checkpointing": False},
}


def _sd3_overrides(prompts_file: Path) -> list[str]:
    return ["--preset", "flow-grpo", "model.name=sd3-tiny", "model.train_mode=lora", "model.guidance_scale=4.5",
            "loss.grpo.kl_beta=0.04", "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompts_file}",
            "data.prompts_per_iteration=4", "data.trees_per_prompt=4", "sampler.num_steps=10"]


def runs(prompts_file: Path) -> dict[str, tuple[int, list[str]]]:
    """Run name -> (processes, ``flowgrpo train`` arguments before the common ones)."""
    return {"imports-only": (1, ["--imports-only"]), "default": (1, []),
            "sd3-tiny-lora": (1, _sd3_overrides(prompts_file)), "sd3-tiny-lora-fsdp2": (2, _sd3_overrides(prompts_file))}


def _env() -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def measure(name: str, processes: int, args: list[str], iterations: int, work: Path, timeout: float = 1200) -> dict:
    """Run one configuration under the probe; returns its row (peaks are the maximum over processes)."""
    probe_dir = work / name
    probe_dir.mkdir(parents=True, exist_ok=True)
    common = [f"train.iterations={iterations}", "train.max_minutes=0", "eval.evaluator=none", "train.threads=1",
              "log.progress=false", f"log.out_dir={work / 'runs'}", f"log.run_name={name}"]
    probe = ["-m", "flowgrpo.benchmarks.memory_probe", str(probe_dir), "train"]
    if args == ["--imports-only"]:
        cmd = [sys.executable, *probe[:3], *args]
    elif processes == 1:
        cmd = [sys.executable, *probe, *args, *common]
    else:
        import yaml

        config = work / "fsdp.yaml"
        config.write_text(yaml.safe_dump({**FSDP_SETTINGS, "num_processes": processes}))
        cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config),
               "--num_processes", str(processes), *probe, *args, *common]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"bench memory: run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    reports = [json.loads(p.read_text()) for p in sorted(probe_dir.glob("rank*.json"))]
    if len(reports) != processes:
        raise RuntimeError(f"bench memory: run {name} wrote {len(reports)} reports for {processes} processes")
    cuda = [r["peak_cuda_mb"] for r in reports if r["peak_cuda_mb"] is not None]
    return {"run": name, "processes": processes, "peak_rss_mb": max(r["peak_rss_mb"] for r in reports),
            "peak_cuda_mb": max(cuda) if cuda else None, "wall_s": wall}


def run_bench_memory(json_path=None, *, iterations: int = 3, only: list[str] | None = None, out_dir=None,
                     quiet: bool = False, recipe: str | None = None, all_recipes: bool = False, gpus: int = 0,
                     markdown: str | None = None, resolution: int = 0, frames: int = 0, micro_batch: int = 0) -> dict:
    """Measure every run of :func:`runs` (or those named in ``only``); table, CSV, PNG and JSON.

    With ``recipe`` (or ``all_recipes``) it instead sizes real models without weights
    (:func:`run_recipe_memory`)."""
    if recipe or all_recipes:
        return run_recipe_memory(json_path, recipes=None if all_recipes else [recipe], gpus=gpus or 8,
                                 markdown=markdown, resolution=resolution, frames=frames, micro_batch=micro_batch,
                                 quiet=quiet)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts_file = work / "prompts.txt"
        prompts_file.write_text("\n".join(PROMPTS) + "\n")
        for name, (n, args) in runs(prompts_file).items():
            if only is None or name in only:
                rows.append(measure(name, n, args, iterations, work))
    result = {"device": device, "iterations": iterations, "rows": rows}
    out = output_dir(out_dir)
    with (out / "memory.csv").open("w", newline="") as f:
        wr = csv.writer(f)
        cols = ("run", "processes", "peak_rss_mb", "peak_cuda_mb", "wall_s")
        wr.writerow(cols + ("device", "iterations"))
        for r in rows:
            wr.writerow([("" if r[k] is None else f"{r[k]:.1f}" if isinstance(r[k], float) else r[k]) for k in cols]
                        + [device, iterations])
    _plot(out / "memory.png", result)
    write_json(json_path, result)
    if not quiet:
        print(f"peak memory per process, {iterations} training iterations, device {device}")
        print(f"{'run':24s} {'procs':>5s} {'peak RSS MB':>12s} {'peak CUDA MB':>13s} {'wall s':>8s}")
        for r in rows:
            cuda = "n/a" if r["peak_cuda_mb"] is None else f"{r['peak_cuda_mb']:.1f}"
            print(f"{r['run']:24s} {r['processes']:5d} {r['peak_rss_mb']:12.1f} {cuda:>13s} {r['wall_s']:8.1f}")
    return result


def run_recipe_memory(json_path=None, *, recipes: list[str] | None = None, gpus: int = 8, markdown: str | None = None,
                      resolution: int = 0, frames: int = 0, micro_batch: int = 0, quiet: bool = False) -> dict:
    """Per-GPU training memory of real-size recipes, counted on the meta device (no weights, no GPU):
    :func:`flowgrpo.realsize.table.memory_rows` for ``recipes`` (None: all) on 1 and ``gpus`` GPUs, with
    and without FSDP. Prints the rich table; writes the JSON ``{"gpus", "rows": [...]}`` (every row has
    ``transformer_params``, ``lora_params`` and ``per_gpu`` bytes); ``markdown``: a file whose
    ``memory-table`` markers get the markdown table in between (the file is left alone without them)."""
    from flowgrpo.errors import UserError
    from flowgrpo.realsize.configs import recipe_names
    from flowgrpo.realsize.table import has_markers, markdown_table, memory_row, print_table, replace_marked

    if markdown and not has_markers(markdown):
        raise UserError(f"--markdown {markdown}: not a text file holding the lines <!-- memory-table:begin --> and "
                        "<!-- memory-table:end -->, between which the table goes")
    rows = []
    for recipe in recipes or recipe_names():
        try:
            rows.append(memory_row(recipe, gpus, resolution=resolution or None, frames=frames or None,
                                   micro_batch=micro_batch or None))
        except (ValueError, RuntimeError) as exc:  # the model's own shape checks at a size it cannot take
            sizes = ", ".join(f"{k} {v}" for k, v in (("resolution", resolution), ("frames", frames),
                                                        ("micro-batch", micro_batch)) if v)
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise UserError(f"recipe {recipe} cannot be sized at {sizes or 'its own sizes'}: {first}") from None
    result = {"gpus": gpus, "rows": rows}
    write_json(json_path, result)
    if not quiet:
        print_table(rows)
    if markdown:
        done = replace_marked(markdown, markdown_table(rows))
        print(f"{markdown}: table {'written between the memory-table markers' if done else 'NOT written (no markers)'}")
        result["markdown_written"] = done
    return result


def _plot(path: Path, result: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # pragma: no cover - matplotlib missing
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.bar(range(len(rows)), [r["peak_rss_mb"] for r in rows], label="peak RSS (process)")
    if any(r["peak_cuda_mb"] is not None for r in rows):
        ax.bar(range(len(rows)), [r["peak_cuda_mb"] or 0 for r in rows], width=0.4, label="peak CUDA allocated")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["run"] for r in rows], fontsize=8)
    ax.set_ylabel("MB (largest over the run's processes)")
    ax.set_title(f"bench memory: {result['iterations']} training iterations, {result['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flowgrpo.benchmarks.bench_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None, help="run names to measure (default: all)")
    args = ap.parse_args(argv)
    run_bench_memory(args.json, iterations=args.iterations, only=args.only, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
