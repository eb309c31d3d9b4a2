"""End-to-end benchmark: held-out accuracy and image fidelity against training time (wall-clock, or
CPU time under ``train.clock=cpu``) on the shapes world, for each preset over several training seeds.

    flowgrpo bench e2e [--minutes 10]                      (the defaults below)
    python -m flowgrpo.benchmarks.bench_e2e --presets flow-grpo diffusion-nft --seeds 0 1 \\
        --minutes 10 --eval-every 60 --jobs 2 --runs-dir bench_runs --out results
    python -m flowgrpo.benchmarks.bench_e2e --runs-dir bench_runs --aggregate-only

Each (preset, seed) is one ordinary ``flowgrpo train`` run (``RUNS_DIR/<preset>-s<seed>``) with
``train.max_minutes`` and ``eval.every_minutes``: the run's own periodic held-out evaluation
(clock paused while it runs) gives the curve, its ``summary.json`` holds it. A run that already
has its summary is reused and an interrupted one is resumed, so the benchmark, hours long, can be
stopped and restarted; ``--aggregate-only`` summarises whatever runs the folder holds (any run
folder named ``<label>-s<seed>`` counts, e.g. runs made by hand).

The target is flow-grpo's final accuracy (mean over its seeds). A seed's ``seconds_to_target`` is
the first training time > 0 at which its accuracy reaches it with fidelity >= ``--min-fidelity``
(0.9); a preset's is the mean over its seeds
that reached it, and ``time_ratio`` is that over flow-grpo's. Writes ``e2e.csv`` (one row per
evaluation) and ``e2e.png`` (accuracy and fidelity against minutes, each seed thin, the mean over
seeds thick) into ``--out``, prints a table and writes the JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import output_dir, write_json

# the method race (issues 29 and 30): the default, the published samplers and the objectives
PRESETS = ("flow-grpo", "mix-grpo", "branch-grpo", "tempflow-grpo", "shapes-nft", "diffusion-nft", "awm", "dgpo",
           "flow-dppo", "diffusion-dpo")
TARGET_PRESET = "flow-grpo"
# an evaluation whose images drifted below this fidelity (1 = the base model's) does not count as
# having reached the target: accuracy bought with broken images is not alignment
MIN_FIDELITY = 0.9
MIX_CLAIM = 0.6  # MixGRPO's claim: it reaches Flow-GRPO's result in <= 0.6x the time


@dataclass(frozen=True)
class CurvePoint:
    """One held-out evaluation of a run: training seconds, accuracy and fidelity (0-1; None for runs
    from before fidelity was measured)."""

    seconds: float
    accuracy: float
    fidelity: float | None = None


def run_curve(run_dir: Path) -> list[CurvePoint]:
    """A finished run's evaluations from its summary.json: the base model at 0 s, then the run's
    ``eval_curve`` (the final evaluation included)."""
    s = json.loads((Path(run_dir) / "summary.json").read_text())
    before = s.get("eval_before") or {}
    points = [CurvePoint(0.0, before["accuracy"], before.get("fidelity"))]
    for c in s.get("eval_curve") or []:
        if c["train_seconds"] > points[-1].seconds:
            points.append(CurvePoint(float(c["train_seconds"]), float(c["accuracy"]), c.get("fidelity")))
    return points


def seconds_to(points: list[CurvePoint], target: float, min_fidelity: float = 0.0) -> float | None:
    """First training time > 0 whose accuracy reaches ``target`` while its fidelity is at least
    ``min_fidelity`` (None if never; a point without a fidelity measurement passes the gate)."""
    for p in points:
        if p.seconds > 0 and p.accuracy >= target - 1e-9 and (p.fidelity is None or p.fidelity >= min_fidelity):
            return p.seconds
    return None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _se(xs: list[float]) -> float | None:
    """Standard error of the mean over seeds (None below 2 seeds)."""
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def summarize(curves: dict[str, dict[int, list[CurvePoint]]], minutes: float | None = None,
              out_dir: str | Path | None = None, json_path: str | None = None, quiet: bool = False,
              min_fidelity: float = MIN_FIDELITY, clock: str = "wall") -> dict:
    """Rows per preset from its seeds' curves (``curves[preset][seed]``), CSV/PNG into ``out_dir``,
    table and JSON. The target preset is flow-grpo where it ran, else the first; an evaluation
    counts toward the target only with fidelity >= ``min_fidelity``."""
    target_name = TARGET_PRESET if TARGET_PRESET in curves else next(iter(curves))
    target = _mean([c[-1].accuracy for c in curves[target_name].values()])
    rows = []
    for preset, seeds in curves.items():
        finals = [c[-1].accuracy for c in seeds.values()]
        gains = [c[-1].accuracy - c[0].accuracy for c in seeds.values()]
        peaks = [max(p.accuracy for p in c) for c in seeds.values()]
        fid = [c[-1].fidelity for c in seeds.values() if c[-1].fidelity is not None]
        reached = [t for t in (seconds_to(c, target, min_fidelity) for c in seeds.values()) if t is not None]
        rows.append({"preset": preset, "seeds": sorted(seeds), "final_accuracy": _mean(finals),
                     "final_accuracy_se": _se(finals), "gain": _mean(gains), "gain_se": _se(gains),
                     "peak_accuracy": _mean(peaks), "final_fidelity": _mean(fid),
                     "seeds_reaching_target": len(reached), "seconds_to_target": _mean(reached)})
    t_ref = next(r["seconds_to_target"] for r in rows if r["preset"] == target_name)
    for r in rows:
        s = r["seconds_to_target"]
        r["time_ratio"] = s / t_ref if (s is not None and t_ref) else None
    out = output_dir(out_dir)
    with (out / "e2e.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["preset", "seed", "train_seconds", "accuracy", "fidelity"])
        for preset, seeds in curves.items():
            for seed, c in sorted(seeds.items()):
                for p in c:
                    w.writerow([preset, seed, f"{p.seconds:.1f}", f"{p.accuracy:.4f}",
                                "" if p.fidelity is None else f"{p.fidelity:.4f}"])
    plot_e2e(curves, target, target_name, out / "e2e.png", min_fidelity, clock)
    if not quiet:
        _print_table(rows, target, target_name)
    mix = next((r for r in rows if r["preset"] == "mix-grpo"), None)
    result = {"rows": rows, "target": target, "target_preset": target_name, "minutes": minutes,
              "min_fidelity": min_fidelity,
              "mix_grpo_within_claim": None if mix is None else (mix["time_ratio"] is not None
                                                                 and mix["time_ratio"] <= MIX_CLAIM),
              "curves": {p: {str(s): [[c.seconds, c.accuracy, c.fidelity] for c in cs] for s, cs in seeds.items()}
                         for p, seeds in curves.items()}}
    write_json(json_path, result)
    return result


def _print_table(rows: list[dict], target: float, target_name: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x, fmt=".3f"):
        return "-" if x is None else format(x, fmt)

    table = Table(title=f"bench e2e: mean over seeds (target = {target_name} final accuracy {target:.3f})")
    for col in ("preset", "seeds", "final acc", "gain (s.e.)", "peak", "fidelity", "reached", "s to target",
                f"x {target_name}"):
        table.add_column(col, justify="right")
    for r in rows:
        gain = f"{f(r['gain'], '+.3f')} ({f(r['gain_se'])})"
        table.add_row(r["preset"], str(len(r["seeds"])), f(r["final_accuracy"]), gain, f(r["peak_accuracy"]),
                      f(r["final_fidelity"], ".2f"), f"{r['seeds_reaching_target']}/{len(r['seeds'])}",
                      f(r["seconds_to_target"], ".0f"), f(r["time_ratio"], ".2f"))
    Console().print(table)


def plot_e2e(curves: dict[str, dict[int, list[CurvePoint]]], target: float | None, target_name: str, path: Path,
             min_fidelity: float = 0.0, clock: str = "wall") -> None:
    """Two panels against training minutes: held-out accuracy (with the target line) and image
    fidelity (with the ``min_fidelity`` gate); each seed a thin line, the mean over seeds (on the
    union of their evaluation times, interpolated) a thick one. ``clock``: what the runs' minutes
    count (their ``train.clock``: wall or cpu), named on the x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(13.5, 4.2))
    for i, (preset, seeds) in enumerate(curves.items()):
        # ten colours, then the next line style: a race with its older or paper-settings rows has more
        # than ten presets, and two presets must never share a look
        color, style = f"C{i % 10}", ("-", "--", ":", "-.")[(i // 10) % 4]
        for key, ax in (("accuracy", axes[0]), ("fidelity", axes[1])):
            runs = [[(p.seconds / 60, getattr(p, key)) for p in c if getattr(p, key) is not None] for c in seeds.values()]
            runs = [r for r in runs if r]
            for r in runs:
                ax.plot([x for x, _ in r], [y for _, y in r], color=color, ls=style, lw=0.7, alpha=0.35)
            if runs:
                grid = np.array(sorted({x for r in runs for x, _ in r if x <= min(rr[-1][0] for rr in runs)}))
                mean = np.mean([np.interp(grid, [x for x, _ in r], [y for _, y in r]) for r in runs], axis=0)
                ax.plot(grid, mean, color=color, ls=style, lw=2,
                        label=f"{preset} ({len(runs)} seed{'s' if len(runs) > 1 else ''})" if key == "accuracy" else None)
    if target is not None:  # None: a comparison without a target (e.g. training on another reward)
        axes[0].axhline(target, color="gray", ls="--", lw=0.8, label=f"target ({target_name} final)")
    if min_fidelity > 0:
        axes[1].axhline(min_fidelity, color="gray", ls="--", lw=0.8, label="fidelity gate: counts toward the target above")
    axes[0].set_ylabel("held-out accuracy")
    axes[1].set_ylabel("image fidelity (1 = the base model's)")
    for ax in axes:
        ax.set_xlabel(f"training {'CPU time' if clock == 'cpu' else 'wall-clock'} (min; evaluation not counted)")
        ax.grid(alpha=0.3)
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    fig.legend(handles=handles, loc="center right", fontsize=7)  # one legend beside both panels
    fig.suptitle("shapes world: thin lines one training seed, thick the mean over seeds", fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_name(preset: str, seed: int) -> str:
    return f"{preset}-s{seed}"


def collect_runs(runs_dir: Path) -> dict[str, dict[int, list[CurvePoint]]]:
    """Every finished run ``<label>-s<seed>`` under ``runs_dir``: label -> seed -> curve, presets in
    :data:`PRESETS` order first."""
    found: dict[str, dict[int, list[CurvePoint]]] = {}
    for d in sorted(Path(runs_dir).iterdir()) if Path(runs_dir).is_dir() else []:
        label, sep, seed = d.name.rpartition("-s")
        if sep and seed.isdigit() and (d / "summary.json").is_file():
            found.setdefault(label, {})[int(seed)] = run_curve(d)
    order = [p for p in PRESETS if p in found] + sorted(p for p in found if p not in PRESETS)
    return {p: found[p] for p in order}


@dataclass(frozen=True)
class RunSpec:
    """One ``flowgrpo train`` run of a benchmark: its folder name under RUNS_DIR and its arguments after
    ``flowgrpo train`` (preset and overrides; the output keys are added by :func:`spec_command`)."""

    name: str
    args: tuple[str, ...]


def spec_command(spec: RunSpec, runs_dir: Path) -> list[str]:
    """The ``flowgrpo train`` command of ``spec``: ``--resume`` where an interrupted run left a checkpoint."""
    run_dir = Path(runs_dir) / spec.name
    base = [sys.executable, "-m", "flowgrpo.cli", "train"]
    if (run_dir / "config.yaml").is_file() and any(run_dir.glob("checkpoints/ckpt_*")):
        return [*base, "--resume", str(run_dir)]
    return [*base, *spec.args, f"log.out_dir={runs_dir}", f"log.run_name={spec.name}", "log.progress=false"]


def train_command(preset: str, seed: int, minutes: float, eval_every_s: float, runs_dir: Path,
                  overrides: list[str] = ()) -> list[str]:
    """The ``flowgrpo train`` command of one race run (``--resume`` where it was interrupted)."""
    return spec_command(race_spec(preset, seed, minutes, eval_every_s, overrides), runs_dir)


def race_spec(preset: str, seed: int, minutes: float, eval_every_s: float, overrides: list[str] = ()) -> RunSpec:
    """The run of ``preset`` on training seed ``seed`` for ``minutes`` with an evaluation every ``eval_every_s``."""
    return RunSpec(run_name(preset, seed), ("--preset", preset, f"train.seed={seed}", f"train.max_minutes={minutes}",
                                            f"eval.every_minutes={eval_every_s / 60}", *overrides))


def run_specs(specs: list[RunSpec], runs_dir: Path, jobs: int = 1, tag: str = "e2e") -> None:
    """Train every spec without a ``summary.json`` yet, in the given order, ``jobs`` at a time (each run uses
    ``train.threads`` threads: the presets' one thread lets 2 runs share 2 cores). A spec whose ``args``
    name a run folder of an earlier spec (a teacher) waits until that run has its summary. Each run's
    output goes to ``RUNS_DIR/<name>.log``; a failed run is reported and skipped, and so are the runs
    that wait on it."""
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    done = lambda name: (runs_dir / name / "summary.json").is_file()  # noqa: E731
    names = {sp.name for sp in specs}
    # a run folder named in an argument, not a longer name that starts with it (teacher-a vs teacher-ab)
    named = {n: re.compile(re.escape(str(runs_dir / n)) + r"(?![\w.-])") for n in names}
    needs = {sp.name: {n for n in names if n != sp.name and any(named[n].search(a) for a in sp.args)} for sp in specs}
    todo = [sp for sp in specs if not done(sp.name)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    running: list[tuple[str, subprocess.Popen, object]] = []
    failed: set[str] = set()
    while todo or running:
        for sp in [sp for sp in todo if needs[sp.name] & failed]:
            todo.remove(sp)
            failed.add(sp.name)
            print(f"[{tag}] {sp.name} skipped: it needs {', '.join(sorted(needs[sp.name] & failed))}", flush=True)
        ready = [sp for sp in todo if all(done(n) for n in needs[sp.name])]
        while ready and len(running) < max(1, jobs):
            sp = ready.pop(0)
            todo.remove(sp)
            log = (runs_dir / f"{sp.name}.log").open("a")
            print(f"[{tag}] start {sp.name}", flush=True)
            running.append((sp.name, subprocess.Popen(spec_command(sp, runs_dir), stdout=log,
                                                      stderr=subprocess.STDOUT, env=env), log))
        if todo and not running and not ready:
            raise SystemExit(f"[{tag}] {', '.join(sp.name for sp in todo)} wait on runs that never finish")
        time.sleep(1.0)
        for item in list(running):
            name, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                if proc.returncode != 0:
                    failed.add(name)
                status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}; see {name}.log)"
                print(f"[{tag}] {name} {status}", flush=True)


def add_runner_arguments(ap: argparse.ArgumentParser, jobs: int = 2) -> None:
    """The arguments every :func:`run_specs` orchestrator shares (``--jobs``, ``--runs-dir``, ``--out``,
    ``--aggregate-only`` and trailing ``key=value`` overrides for every run)."""
    ap.add_argument("--jobs", type=int, default=jobs, help="runs at a time (each one thread by the presets)")
    ap.add_argument("--runs-dir", required=True, help="where the runs go; reused on restart")
    ap.add_argument("--out", required=True, help="where the table's CSV, JSON and PNG go")
    ap.add_argument("--aggregate-only", action="store_true", help="only tabulate the finished runs in --runs-dir")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every run")


def run_all(presets, seeds, minutes: float, eval_every_s: float, runs_dir: Path, jobs: int = 1,
            overrides: list[str] = ()) -> None:
    """Train every (preset, seed) without a summary yet, ``jobs`` at a time. Seed-major order: every
    preset's first seed before any second seed, so an interrupted race compares all presets."""
    run_specs([race_spec(p, s, minutes, eval_every_s, overrides) for s in seeds for p in presets], runs_dir, jobs)


def run_bench_e2e(json_path: str | None = None, presets=PRESETS, seeds=(0, 1), minutes: float = 10.0,
                  eval_every_s: float = 60.0, runs_dir: str | Path | None = None, jobs: int = 2,
                  overrides: list[str] = (), out_dir: str | Path | None = None, quiet: bool = False,
                  aggregate_only: bool = False, min_fidelity: float = MIN_FIDELITY) -> dict:
    """Train (unless ``aggregate_only``) and summarise; ``runs_dir`` defaults to ``OUT/e2e_runs``."""
    runs = Path(runs_dir) if runs_dir is not None else output_dir(out_dir) / "e2e_runs"
    if not aggregate_only:
        run_all(presets, seeds, minutes, eval_every_s, runs, jobs, overrides)
    curves = collect_runs(runs)
    if not aggregate_only:
        curves = {p: {s: c for s, c in curves[p].items() if s in seeds} for p in presets if p in curves}
    if not curves:
        raise SystemExit(f"bench e2e: no finished run (summary.json) under {runs}")
    return summarize(curves, minutes, out_dir, json_path, quiet, min_fidelity, runs_clock(runs))


def runs_clock(runs_dir: Path) -> str:
    """``train.clock`` of the runs under ``runs_dir`` (every run of a bench shares it): the first run's
    resolved config, the trainer's default ("wall") when there is no run."""
    from ..trainer.checkpoint import read_run_config

    first = next(iter(sorted(Path(runs_dir).glob("*/config.yaml"))), None)
    return "wall" if first is None else read_run_config(first.parent).train.clock


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="training seeds (train.seed)")
    ap.add_argument("--minutes", type=float, default=10.0, help="training budget per run (train.max_minutes)")
    ap.add_argument("--eval-every", type=float, default=60.0, help="seconds of training between evaluations")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (each one thread by the presets)")
    ap.add_argument("--runs-dir", default=None, help="where the runs go (default: OUT/e2e_runs); reused on restart")
    ap.add_argument("--aggregate-only", action="store_true", help="only summarise the finished runs in --runs-dir")
    ap.add_argument("--min-fidelity", type=float, default=MIN_FIDELITY,
                    help="an evaluation counts toward the target only at this fidelity or above (1 = the base model's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", "--out-dir", dest="out", default=None, help="where e2e.csv / e2e.png go")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every run")
    a = ap.parse_args(argv)
    run_bench_e2e(a.json, a.presets, a.seeds, a.minutes, a.eval_every, a.runs_dir, a.jobs, a.overrides, a.out,
                  aggregate_only=a.aggregate_only, min_fidelity=a.min_fidelity)


if __name__ == "__main__":
    main()
