"""Where one training iteration's wall-clock goes: the model versus flowgrpo's own overhead.

    flowgrpo bench profile [--out DIR] [--json PATH]
    python -m flowgrpo.benchmarks.bench_profile [--out DIR] [--json PATH] [--iterations 5] [key.sub=value ...]

Runs a few iterations of a preset (default: the embedded default ``shapes``) and splits each one's
wall-clock into the model's forward passes (rollout and update), the backward passes, the
optimizer step, and everything else: rollout bookkeeping, decoding, rewards, advantages, loss
arithmetic, EMA and logging. "Everything else" is flowgrpo's own overhead; the target is at most
15 % of an iteration. Writes ``profile.csv`` and ``profile.png`` into ``--out`` (default: the current
directory) and the JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import csv
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from flowgrpo.config import load_config
from flowgrpo.trainer.trainer import Trainer

from . import output_dir, write_json

PHASES = ("model forward", "model backward", "optimizer step", "flowgrpo overhead")


class _Clock:
    """Accumulates seconds per phase; ``wrap`` times every call of an instance's bound method."""

    def __init__(self) -> None:
        self.seconds = {p: 0.0 for p in PHASES}
        self._depth = 0

    @contextmanager
    def phase(self, name: str):
        # nested timed calls (a forward inside a timed backward) are counted once, by the outer one
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.seconds[name] += time.perf_counter() - t0

    def wrap(self, obj, method: str, name: str) -> None:
        fn = getattr(obj, method)

        def timed(*a, **kw):
            with self.phase(name):
                return fn(*a, **kw)

        setattr(obj, method, timed)


def profile_iterations(preset: str = "shapes", iterations: int = 5, warmup: int = 1,
                       overrides: list[str] = ()) -> dict:
    """Time ``iterations`` iterations (after ``warmup``) of ``preset``. Returns seconds per phase
    (summed over the timed iterations), the total and each phase's share."""
    cfg = load_config(preset, None, list(overrides))
    trainer = Trainer(cfg)
    clock = _Clock()
    clock.wrap(trainer.policy, "_forward", "model forward")
    clock.wrap(trainer.accelerator, "backward", "model backward")
    clock.wrap(trainer.optimizer, "step", "optimizer step")
    for _ in range(warmup):
        trainer.iteration_step()
    clock.seconds = {p: 0.0 for p in PHASES}
    t0 = time.perf_counter()
    for _ in range(iterations):
        trainer.iteration_step()
    total = time.perf_counter() - t0
    timed = sum(v for k, v in clock.seconds.items() if k != "flowgrpo overhead")
    clock.seconds["flowgrpo overhead"] = total - timed
    return {"preset": preset, "iterations": iterations, "threads": torch.get_num_threads(),
            "seconds_per_iteration": total / iterations,
            "seconds": {k: v / iterations for k, v in clock.seconds.items()},
            "share": {k: v / total for k, v in clock.seconds.items()}}


def write_outputs(res: dict, out_dir: Path, tag: str = "") -> None:
    """``profile{tag}.csv`` (phase, seconds per iteration, share) and a bar chart ``profile{tag}.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out_dir / f"profile{tag}.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["phase", "seconds_per_iteration", "share"])
        for p in PHASES:
            w.writerow([p, f"{res['seconds'][p]:.4f}", f"{res['share'][p]:.4f}"])
    fig, ax = plt.subplots(figsize=(6, 2.2))
    left = 0.0
    for p in PHASES:
        ax.barh([0], [res["seconds"][p]], left=left, label=f"{p} ({100 * res['share'][p]:.0f} %)")
        left += res["seconds"][p]
    ax.set_yticks([])
    ax.set_xlabel(f"seconds per iteration ({res['preset']}, {res['threads']} threads)")
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    fig.tight_layout()
    fig.savefig(out_dir / f"profile{tag}.png", dpi=120)
    plt.close(fig)


def run_bench_profile(json_path: str | None = None, preset: str = "shapes", iterations: int = 5,
                      overrides: list[str] = (), quiet: bool = False, out_dir: str | Path | None = None) -> dict:
    """Profile, print a table, write ``json_path`` and CSV/PNG into ``out_dir`` (default: the current directory)."""
    from rich.console import Console
    from rich.table import Table

    res = profile_iterations(preset, iterations, overrides=overrides)
    write_outputs(res, output_dir(out_dir))
    write_json(json_path, res)
    if not quiet:
        table = Table(title=f"one iteration of {preset}: {res['seconds_per_iteration']:.2f} s")
        for col in ("phase", "s / iteration", "share"):
            table.add_column(col, justify="right")
        for p in PHASES:
            table.add_row(p, f"{res['seconds'][p]:.3f}", f"{100 * res['share'][p]:.1f} %")
        Console().print(table)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", "--out-dir", dest="out", default=None,
                    help="folder of profile.csv / profile.png (default: the current directory)")
    ap.add_argument("--preset", default="shapes")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("overrides", nargs="*", help="key.sub=value")
    args = ap.parse_args(argv)
    run_bench_profile(args.json, args.preset, args.iterations, args.overrides, out_dir=args.out)


if __name__ == "__main__":
    main()
