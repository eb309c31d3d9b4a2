"""End-to-end benchmark: held-out accuracy against training wall-clock on the shapes world.

    flowgrpo bench e2e [--out DIR] [--json PATH]    (or: python -m flowgrpo.benchmarks.bench_e2e --minutes 4)

Each preset trains from the same shipped base model under the same wall-clock budget. Every
``--eval-every`` seconds of training the held-out accuracy is measured. Evaluation time is not
counted: the clock is paused while it runs. Every preset starts from the same weights and the
evaluation is deterministic, so the base model is evaluated once and shared. The target is
flow-grpo's final accuracy, and ``seconds_to_target`` is the first training time (> 0: the base
point does not count) at which a preset reaches it; when flow-grpo ends no higher than the base,
the JSON says so (``target_above_base: false``) and the times only say who first matched it.
Writes ``e2e.csv`` and ``e2e.png`` into ``--out`` (default: the current directory), and the JSON
``{"rows": [{"preset", "final_accuracy", "seconds_to_target"}], "target": x}`` to ``--json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import torch

from flowgrpo.config import load_config
from flowgrpo.trainer.trainer import GRPOTrainer

try:  # the shapes-world evaluation (moving from flowgrpo.evaluate to flowgrpo.shapes.evaluate)
    from flowgrpo.shapes.evaluate import evaluate_policy
except ImportError:  # pragma: no cover - older layout
    from flowgrpo.evaluate import evaluate_policy

from . import output_dir, write_json

PRESETS = ("flow-grpo", "dance-grpo", "mix-grpo", "mix-grpo-flash-star", "branch-grpo-mix", "tempflow-grpo",
           "pref-grpo")
MIX_CLAIM = 0.6  # MixGRPO's claim: it reaches Flow-GRPO's result in <= 0.6x the time


def _accuracy(trainer: GRPOTrainer, num_prompts: int, seeds: int) -> float:
    cfg = trainer.cfg
    with trainer.ema_weights():
        res = evaluate_policy(trainer.policy, num_prompts, seeds, cfg.eval.num_steps, cfg.sampler.shift)
    return res["accuracy"] if isinstance(res, dict) else res.accuracy


def train_curve(preset: str, minutes: float, eval_every_s: float, num_prompts: int, seeds: int,
                overrides: list[str] = (), base_accuracy: float | None = None) -> tuple[list[tuple[float, float]], int]:
    """(training seconds, held-out accuracy) points for one preset, starting with the base model
    (``base_accuracy`` when the caller already measured it, else evaluated here), and the number of
    iterations run."""
    cfg = load_config(preset, None, ["train.iterations=100000", *overrides])
    trainer = GRPOTrainer(cfg)
    if base_accuracy is None:
        base_accuracy = _accuracy(trainer, num_prompts, seeds)
    points = [(0.0, base_accuracy)]
    spent, next_eval = 0.0, eval_every_s
    while spent < minutes * 60:
        t0 = time.perf_counter()
        trainer.iteration_step()
        spent += time.perf_counter() - t0
        if spent >= next_eval or spent >= minutes * 60:
            points.append((spent, _accuracy(trainer, num_prompts, seeds)))
            next_eval += eval_every_s
            print(f"  {preset}: {spent:7.1f} s  iteration {trainer.iteration}  accuracy {points[-1][1]:.3f}", flush=True)
    return points, trainer.iteration


def target_preset(presets) -> str:
    """The preset whose final accuracy is the target: flow-grpo when it ran, else the first."""
    presets = list(presets)
    return "flow-grpo" if "flow-grpo" in presets else presets[0]


def seconds_to(points: list[tuple[float, float]], target: float) -> float | None:
    """First training time > 0 whose accuracy reaches ``target`` (None if never)."""
    for s, acc in points:
        if s > 0 and acc >= target - 1e-9:
            return s
    return None


def plot_e2e(curves: dict, target: float, target_name: str, minutes: float, n_samples: int, path: Path) -> None:
    """Accuracy against training seconds per preset, each curve with its band of +-1 standard error
    of an ``n_samples``-sample accuracy (binomial), and the target line, so that differences smaller
    than the evaluation noise read as such."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p, c in curves.items():
        t, acc = [s for s, _ in c], [a for _, a in c]
        se = [math.sqrt(a * (1 - a) / max(1, n_samples)) for a in acc]
        (line,) = ax.plot(t, acc, "o-", ms=3, label=p)
        ax.fill_between(t, [a - e for a, e in zip(acc, se)], [a + e for a, e in zip(acc, se)],
                        color=line.get_color(), alpha=0.12)
    ax.axhline(target, color="gray", ls="--", lw=0.8, label=f"target ({target_name} final)")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"shapes world, {minutes:g} min of training per preset (bands: +-1 s.e., {n_samples} samples)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_bench_e2e(json_path: str | None = None, presets=PRESETS, minutes: float = 4.0, eval_every_s: float = 80.0,
                  num_prompts: int = 64, seeds: int = 4, overrides: list[str] = (), out_dir: str | Path | None = None,
                  quiet: bool = False) -> dict:
    """Train each preset for ``minutes`` of wall-clock, evaluating every ``eval_every_s`` seconds.

    Writes ``e2e.csv`` (preset, train_seconds, accuracy per evaluation) and ``e2e.png`` under
    ``out_dir`` (default: the current directory) and returns the JSON-able result.
    """
    curves: dict[str, list[tuple[float, float]]] = {}
    iterations: dict[str, int] = {}
    base_acc = None
    for p in presets:
        print(f"[e2e] {p}: {minutes} min of training", flush=True)
        curves[p], iterations[p] = train_curve(p, minutes, eval_every_s, num_prompts, seeds, overrides, base_acc)
        base_acc = curves[p][0][1]
    return summarize(curves, iterations, minutes, num_prompts * seeds, out_dir, json_path, quiet)


def summarize(curves: dict, iterations: dict, minutes: float, samples: int, results: str | Path | None = None,
              json_path: str | None = None, quiet: bool = False) -> dict:
    """Rows (final accuracy, time to the target and its ratio to the target preset's), CSV and PNG
    in ``results`` (default: the current directory), table and JSON from per-preset curves (from
    one run or merged from several)."""
    from rich.console import Console
    from rich.table import Table

    results = output_dir(results)
    base_acc = next(iter(curves.values()))[0][1]
    base = target_preset(curves)
    target = curves[base][-1][1]
    t_ref = seconds_to(curves[base], target)
    rows = []
    for p, c in curves.items():
        s_to = seconds_to(c, target)
        rows.append({"preset": p, "final_accuracy": c[-1][1], "seconds_to_target": s_to,
                     "time_ratio": (s_to / t_ref) if (s_to is not None and t_ref) else None})
    with (results / "e2e.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["preset", "train_seconds", "accuracy"])
        for p, c in curves.items():
            for s, a in c:
                w.writerow([p, f"{s:.1f}", f"{a:.4f}"])
    plot_e2e(curves, target, base, minutes, samples, results / "e2e.png")
    table = Table(title=f"bench e2e (target = {base} final accuracy {target:.3f})")
    for col in ("preset", "iterations", "base acc", "final acc", "s to target", f"x {base}"):
        table.add_column(col, justify="right")
    for r in rows:
        s, ratio = r["seconds_to_target"], r["time_ratio"]
        table.add_row(r["preset"], str(iterations.get(r["preset"], "?")), f"{curves[r['preset']][0][1]:.3f}",
                      f"{r['final_accuracy']:.3f}", "-" if s is None else f"{s:.0f}",
                      "-" if ratio is None else f"{ratio:.2f}")
    if not quiet:
        Console().print(table)
    out = {"rows": rows, "target": target, "base_accuracy": base_acc, "target_preset": base,
           "target_above_base": target > base_acc,
           "mix_grpo_within_claim": next((r["time_ratio"] is not None and r["time_ratio"] <= MIX_CLAIM
                                          for r in rows if r["preset"] == "mix-grpo"), None),
           "minutes": minutes, "samples": samples, "iterations": iterations,
           "curves": {p: c for p, c in curves.items()}}
    write_json(json_path, out)
    return out


def merge(json_paths: list[str], out_json: str | None, results: str | Path | None = None) -> dict:
    """Combine results of ``bench e2e`` runs over disjoint presets (e.g. run side by side on two
    cores) into one table, CSV, PNG and JSON. The runs must share the budget and evaluation set."""
    parts = [json.loads(Path(p).read_text()) for p in json_paths]
    if len({(d["minutes"], d["samples"], d["base_accuracy"]) for d in parts}) != 1:
        raise SystemExit("bench e2e --merge: the runs differ in minutes, evaluation samples or base accuracy")
    curves, iterations = {}, {}
    for d in parts:
        for p, c in d["curves"].items():
            curves[p] = [tuple(x) for x in c]
            iterations[p] = d.get("iterations", {}).get(p, "?")
    order = [p for p in PRESETS if p in curves] + [p for p in curves if p not in PRESETS]
    curves = {p: curves[p] for p in order}
    return summarize(curves, iterations, parts[0]["minutes"], parts[0]["samples"], results, out_json)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--minutes", type=float, default=4.0, help="training budget per preset")
    ap.add_argument("--eval-every", type=float, default=80.0, help="seconds of training between evaluations")
    ap.add_argument("--presets", nargs="*", default=list(PRESETS))
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--replot", default=None, metavar="JSON", help="only redraw e2e.png (into --out) from a saved result JSON")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine result JSONs of runs over disjoint presets (written to --json and beside it)")
    ap.add_argument("--out", "--out-dir", dest="out", default=None,
                    help="where e2e.csv / e2e.png go (default: the current directory)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value applied to every preset")
    args = ap.parse_args(argv)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        plot_e2e(data["curves"], data["target"], data.get("target_preset") or target_preset(data["curves"]),
                 data["minutes"], data.get("samples", 256), output_dir(args.out) / "e2e.png")
        return
    out_dir = args.out
    if args.merge:
        merge(args.merge, args.json, out_dir)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    run_bench_e2e(args.json, args.presets, args.minutes, args.eval_every, overrides=args.overrides, out_dir=out_dir)


if __name__ == "__main__":
    main()
