"""Iteration time of the default shapes-world training on 1 and on N processes (accelerate, gloo),
with each multi-process engine: data parallel (ddp), FSDP2 (fsdp) and DeepSpeed ZeRO-2 (zero2).

Each configuration is a real ``flowgrpo train`` run (``--num-processes N`` for N > 1, with
``configs/accelerate/<engine>.yaml`` for fsdp and zero2) of the default preset with evaluation
off, ``iterations`` iterations on one torch thread per process; the table gives the median of the
main process's ``iter_s`` over all but the first iteration (which pays warm-up), its rollout /
update parts, samples per second and the speed-up over 1 process. On this 2-core machine N = 2
is the most that can scale. zero2 is skipped where DeepSpeed is not installed.

    flowgrpo bench scaling [--out DIR] [--json PATH]
    python -m flowgrpo.benchmarks.bench_scaling --processes 1 2 --engines ddp fsdp zero2 --iterations 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from . import output_dir, write_csv, write_json


#: the engines' accelerate configs, relative to the repository root (where the benchmarks run)
CONFIGS = Path("configs") / "accelerate"


def _run(processes: int, engine: str, iterations: int, run_dir: Path, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "flowgrpo", "train"]
    if processes > 1:
        cmd += ["--num-processes", str(processes)]
        if engine != "ddp":
            config = CONFIGS / f"{engine}.yaml"
            if not config.is_file():
                raise FileNotFoundError(f"{config} not found: run the scaling benchmark from the repository root")
            cmd += ["--accelerate-config", str(config.resolve())]
    cmd += [f"train.iterations={iterations}", "eval.evaluator=none", "log.trackers=[]", "log.progress=false",
            "log.grid_every=0", f"log.checkpoint_every={iterations}", "train.threads=1",
            f"log.out_dir={run_dir.parent}", f"log.run_name={run_dir.name}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def run_bench_scaling(json_path=None, out_dir=None, processes=(1, 2), iterations: int = 6,
                      extra: list[str] | None = None, engines=("ddp", "fsdp", "zero2")) -> list[dict]:
    """Time the configurations; print a table, write scaling.csv / scaling.png to ``out_dir``."""
    import importlib.util

    out = output_dir(out_dir)
    extra = list(extra or [])
    if "zero2" in engines and importlib.util.find_spec("deepspeed") is None:
        print("zero2 skipped: DeepSpeed is not installed (pip install 'flowgrpo[deepspeed]')")
        engines = [e for e in engines if e != "zero2"]
    configs = [(n, e) for n in processes for e in (engines if n > 1 else ["-"])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, engine in configs:
            recs = _run(n, engine, iterations, Path(tmp) / f"p{n}-{engine}", extra)[1:]
            med = lambda k: statistics.median(r[k] for r in recs)  # noqa: E731
            rows.append({"processes": n, "engine": engine, "iter_s": med("iter_s"), "rollout_s": med("rollout_s"),
                         "train_s": med("train_s"), "nfe_rollout": recs[0]["nfe_rollout"]})
    from flowgrpo.config import load_config

    cfg = load_config("shapes", None, extra)
    samples = cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt
    base = rows[0]["iter_s"]
    for r in rows:
        r["samples_per_iteration"] = samples
        r["samples_per_s"] = samples / r["iter_s"]
        r["speedup"] = base / r["iter_s"]
        r["efficiency"] = r["speedup"] / r["processes"]
    print(f"{'processes':>9} {'engine':>6} {'iter_s':>8} {'rollout_s':>9} {'train_s':>8} {'samples/s':>9} "
          f"{'speed-up':>8} {'eff.':>6}")
    for r in rows:
        print(f"{r['processes']:>9} {r['engine']:>6} {r['iter_s']:>8.2f} {r['rollout_s']:>9.2f} {r['train_s']:>8.2f} "
              f"{r['samples_per_s']:>9.1f} {r['speedup']:>8.2f} {r['efficiency']:>6.2f}")
    write_csv(out / "scaling.csv", rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    labels = [f"{r['processes']}" + ("" if r["engine"] == "-" else f" {r['engine']}") for r in rows]
    ax.bar(labels, [r["speedup"] for r in rows], color="tab:blue", label="measured")
    ax.plot(labels, [r["processes"] for r in rows], "_", color="gray", markersize=30, mew=2, label="linear")
    ax.set_xlabel("processes, engine")
    ax.set_ylabel("speed-up over 1 process")
    ax.set_title(f"shapes world, {samples} samples / iteration")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    plt.close(fig)
    write_json(json_path, {"rows": rows, "iterations": iterations})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--engines", nargs="+", default=["ddp", "fsdp", "zero2"], choices=["ddp", "fsdp", "zero2"])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of the shapes preset")
    a = ap.parse_args(argv)
    run_bench_scaling(a.json, a.out, a.processes, a.iterations, a.overrides, a.engines)


if __name__ == "__main__":
    main()
