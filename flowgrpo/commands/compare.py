"""``flowgrpo compare RUN [RUN ...]``: several runs' held-out evaluations side by side.

The question after training one recipe on several seeds: where did each run end, how far under its
own peak, how wide is the spread, and which tag lags. For every run folder, finished (its
``summary.json``) or still training (its ``eval_before.json`` and the evaluations in
``metrics.jsonl`` so far), one row: accuracy before, latest (the final evaluation of a finished run)
with its seed standard error, the peak and when it came, latest minus peak, fidelity and each
tag's accuracy, and the cores the run's iterations got (CPU-seconds per wall-second: a one-thread run
under 1 shared its core, so its CPU-minutes bought fewer iterations). Under the table: the mean,
standard deviation and range of the latest accuracy over the runs, and how many ended within
``--within`` of their peak. ``--out DIR`` also writes
``compare.csv`` and ``compare.png`` (the curves, and the tags of each run's latest evaluation).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..evaluators import per_tag_from_metrics
from ..trainer.core_share import cores_used
from ..trainer.metrics import read_metrics
from ..text_inputs import loads_json

#: how close to its peak a run's latest evaluation counts as "at the peak", by default
DEFAULT_WITHIN = 0.02


@dataclass(frozen=True)
class CurvePoint:
    """One evaluation of a run: ``minutes`` of training (evaluation time excluded), held-out
    ``accuracy`` in [0, 1] with its seed standard error ``se`` and image ``fidelity`` (None where not
    measured), ``per_tag`` accuracies (empty where not logged)."""

    minutes: float
    accuracy: float
    se: float | None = None
    fidelity: float | None = None
    per_tag: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RunRecord:
    """What ``compare`` reads of one run folder. ``curve`` starts at the evaluation before training
    and is in training-time order; ``finished``: the run wrote its ``summary.json``; ``cores_used``: its
    iterations' CPU-seconds per wall-second (:mod:`flowgrpo.trainer.core_share`; None for runs written
    before it was logged): under 1 for a one-thread run that shared its core, whose CPU-minutes then
    bought fewer iterations."""

    name: str
    seed: int | None
    finished: bool
    iterations: int
    minutes: float
    curve: tuple[CurvePoint, ...]
    cores_used: float | None = None

    @property
    def latest(self) -> CurvePoint | None:
        """The last evaluation (a finished run's final one); None before the first."""
        return self.curve[-1] if self.curve else None

    @property
    def peak(self) -> CurvePoint | None:
        """The best evaluation after training started (the base's own is not a peak of the run)."""
        trained = self.curve[1:] or self.curve
        return max(trained, key=lambda p: p.accuracy) if trained else None

    @property
    def under_peak(self) -> float | None:
        """Peak minus latest accuracy (>= 0; 0 when the latest evaluation is the peak)."""
        return None if self.latest is None else self.peak.accuracy - self.latest.accuracy


def _point(minutes: float, record: dict, per_tag: dict | None = None) -> CurvePoint:
    return CurvePoint(minutes, float(record["accuracy"]), record.get("accuracy_se"), record.get("fidelity"),
                      dict(per_tag if per_tag is not None else record.get("per_tag") or {}))


def _seed(run: Path) -> int | None:
    from ..errors import ConfigError
    from ..text_inputs import load_yaml

    try:
        cfg = load_yaml((run / "config.yaml").read_text(), "config.yaml") or {}
    except (OSError, UnicodeDecodeError, ConfigError):
        return None
    seed = (cfg.get("train") or {}).get("seed") if isinstance(cfg, dict) else None
    return seed if isinstance(seed, int) else None


def read_run(path: str | Path) -> RunRecord:
    """The :class:`RunRecord` of the run folder ``path``; a UserError when it is no run folder or its
    files cannot be read."""
    run = Path(path)
    summary_path, metrics_path = run / "summary.json", run / "metrics.jsonl"
    if not run.is_dir() or not (summary_path.exists() or metrics_path.exists()):
        raise UserError(f"{run}: not a run folder (no summary.json or metrics.jsonl)")
    try:
        lines = read_metrics(run)  # the core share of either kind of run; the curve of one still training
        if summary_path.exists():
            s = loads_json(summary_path.read_text())
            curve = [_point(c["train_seconds"] / 60, c) for c in s.get("eval_curve") or []
                     if c.get("accuracy") is not None]
            if curve and s.get("eval_after") and not curve[-1].per_tag:  # runs before the curve kept its tags
                curve[-1] = _point(curve[-1].minutes, s["eval_after"])
            if curve and s.get("eval_before") and not curve[0].per_tag:
                curve[0] = _point(0.0, s["eval_before"])
            return RunRecord(run.name, _seed(run), True, int(s.get("iterations") or 0),
                             float(s.get("train_seconds") or 0.0) / 60, tuple(curve), cores_used(lines))
        before_path = run / "eval_before.json"
        curve = [_point(0.0, loads_json(before_path.read_text()))] if before_path.exists() else []
        for ln in lines:
            if ln.get("eval_accuracy") is not None:
                record = {"accuracy": ln["eval_accuracy"], "accuracy_se": ln.get("eval_accuracy_se"),
                          "fidelity": ln.get("eval_fidelity")}
                curve.append(_point(ln["train_seconds"] / 60, record, per_tag_from_metrics(ln)))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{run}: cannot read its evaluations: {exc}") from None
    last = lines[-1] if lines else {}
    return RunRecord(run.name, _seed(run), False, int(last.get("iteration", -1)) + 1,
                     float(last.get("train_seconds") or 0.0) / 60, tuple(curve), cores_used(lines))


def spread(records: list[RunRecord], within: float = DEFAULT_WITHIN) -> dict:
    """Over the runs with an evaluation: ``n``, the ``mean``, ``sd`` (n - 1; None for one run), ``min``
    and ``max`` of the latest accuracy, and ``at_peak``: how many are within ``within`` of their peak."""
    latest = [r.latest.accuracy for r in records if r.latest is not None]
    if not latest:
        return {"n": 0}
    return {"n": len(latest), "mean": statistics.fmean(latest),
            "sd": statistics.stdev(latest) if len(latest) > 1 else None, "min": min(latest), "max": max(latest),
            "at_peak": sum(r.under_peak <= within + 1e-12 for r in records if r.latest is not None)}


def _tags(records: list[RunRecord]) -> list[str]:
    return sorted(set().union(*(r.latest.per_tag for r in records if r.latest is not None)))


def table_rows(records: list[RunRecord]) -> list[dict]:
    """One flat row per run (the CSV's and the printed table's): None where not measured."""
    rows = []
    for r in records:
        latest, peak = r.latest, r.peak
        row = {"run": r.name, "seed": r.seed, "state": "finished" if r.finished else "training",
               "iterations": r.iterations, "minutes": round(r.minutes, 2), "cores_used": r.cores_used,
               "before": r.curve[0].accuracy if r.curve else None,
               "latest": latest.accuracy if latest else None, "latest_se": latest.se if latest else None,
               "peak": peak.accuracy if peak else None, "peak_minute": round(peak.minutes, 2) if peak else None,
               "under_peak": r.under_peak, "fidelity": latest.fidelity if latest else None}
        row.update({f"tag_{t}": (latest.per_tag.get(t) if latest else None) for t in _tags(records)})
        rows.append(row)
    return rows


#: columns printed with one decimal (minutes); the other numbers with three
_MINUTE_KEYS = ("minutes", "peak_minute")


def _cell(x, key: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.1f}" if key in _MINUTE_KEYS else f"{x:.2f}" if key == "cores_used" else f"{x:.3f}"
    return str(x)


def save_compare_figure(path: Path, records: list[RunRecord]) -> None:
    """Left: each run's held-out accuracy against training minutes. Right (where the runs logged tags):
    each tag's accuracy at each run's latest evaluation, a bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    tags = _tags(records)
    fig, axes = plt.subplots(1, 2 if tags else 1, figsize=(12 if tags else 6.5, 4), squeeze=False)
    ax = axes[0][0]
    for r in records:
        if r.curve:
            ax.plot([p.minutes for p in r.curve], [p.accuracy for p in r.curve], "o-", ms=3,
                    label=r.name if r.seed is None else f"{r.name} (seed {r.seed})")
    ax.set_xlabel("training minutes (evaluation time excluded)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    if tags:
        bars = axes[0][1]
        width = 0.8 / max(1, len(records))
        for i, r in enumerate(records):
            values = [r.latest.per_tag.get(t, np.nan) if r.latest else np.nan for t in tags]
            bars.bar(np.arange(len(tags)) + i * width, values, width, label=r.name)
        bars.set_xticks(np.arange(len(tags)) + 0.4 - width / 2)
        bars.set_xticklabels(tags, rotation=20, fontsize=8)
        bars.set_ylabel("held-out accuracy of the tag (latest evaluation)")
        bars.set_ylim(0, 1)
        bars.grid(alpha=0.3, axis="y")
        bars.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_compare(args) -> int:
    """Run ``flowgrpo compare`` (see the module docstring)."""
    from ..benchmarks import check_output_paths, output_dir, print_table, write_csv, write_json

    if not (math.isfinite(args.within) and args.within >= 0):
        raise UserError(f"--within must be a finite accuracy difference >= 0, got {args.within:g}")
    check_output_paths(args.out, args.json)
    records = [read_run(p) for p in args.runs]
    rows = table_rows(records)
    tags = _tags(records)
    columns = ["run", "seed", "state", "iterations", "minutes", "cores", "before", "latest", "± s.e.", "peak",
               "at min", "under peak", "fidelity"]
    keys = ["run", "seed", "state", "iterations", "minutes", "cores_used", "before", "latest", "latest_se", "peak",
            "peak_minute", "under_peak", "fidelity"]
    tag_keys = [f"tag_{t}" for t in tags]
    s = spread(records, args.within)
    caption = "no run has an evaluation yet" if not s["n"] else (
        f"latest over {s['n']} run(s): mean {s['mean']:.3f}" + (f", sd {s['sd']:.3f}" if s["sd"] is not None else "")
        + f", range {s['min']:.3f}-{s['max']:.3f}; within {args.within:g} of their peak: {s['at_peak']} of {s['n']}")
    print_table(columns, [[_cell(row[k], k) for k in keys] for row in rows], title="held-out evaluation per run",
                caption=caption, left=("run", "state"))
    if tags:  # a table of its own: six tags beside twelve columns do not fit a terminal
        print_table(["run", *tags], [[row["run"], *(_cell(row[k]) for k in tag_keys)] for row in rows],
                    title="each tag, latest")
    if args.out:
        out = output_dir(args.out)
        write_csv(out / "compare.csv", rows, keys + tag_keys)
        save_compare_figure(out / "compare.png", records)
        print(f"wrote {out / 'compare.csv'} and {out / 'compare.png'}")
    write_json(args.json, {"runs": rows, "spread": s, "within": args.within})
    return 0


def register(sub) -> None:
    """Add ``compare`` to the CLI's subparsers ``sub``."""
    c = sub.add_parser("compare", help="runs side by side (finished or training): latest and peak held-out "
                                       "accuracy, the spread over runs, each tag")
    c.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (e.g. one recipe on several seeds)")
    c.add_argument("--within", type=float, default=DEFAULT_WITHIN,
                   help=f"count the runs whose latest evaluation is within this of their peak (default {DEFAULT_WITHIN})")
    c.add_argument("--out", default=None, metavar="DIR", help="also write compare.csv and compare.png here")
    c.add_argument("--json", default=None, metavar="PATH", help="also write the rows and the spread as JSON")
    c.set_defaults(fn=cmd_compare)
