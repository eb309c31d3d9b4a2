"""The 2026 presets' rows of the method race (issue 47, item 7): ``crd`` and ``flow-opd`` in the protocol of
docs/results/method_race.md, beside reference rows (``--references``: flow-grpo, whose final accuracy is
the race's target, and the default ``shapes-nft``) re-run on the same base model and evaluation. The
committed race ran on an earlier shipped base (held-out 0.449 on its evaluation; the current one reads
0.469), so its curves are not mixed in.

The race's protocol: each run trains ``--minutes`` CPU-minutes (``train.clock=cpu``) from the shipped
base with the preset's own settings and the shapes recipe's per-method lr, and evaluates on held-out
prompts every ``--eval-every`` seconds with the race's evaluation (64 prompts x 4 seeds, the clock
paused). Resumable: finished runs are reused, interrupted ones resumed.

- ``crd`` gets its lr the way the race's paper presets got theirs: ``--screen-minutes`` at 1e-5 on
  training seed ``--screen-seed`` (never a race seed); 1e-5 if the fidelity stays >= 0.98 throughout,
  3e-6 otherwise.
- ``flow-opd`` needs a teacher, and the teacher's CPU time counts: per race seed, a ``shapes-nft``
  teacher trains ``--teacher-minutes`` (every tag routed to it through ``default_teacher``), then the
  student trains the rest of ``--minutes`` from the base (``cold_start=none``: with one teacher the
  preset's merge would be the teacher itself, and the row would measure nothing of the distillation)
  at the teacher's lr (the shapes recipe's for shapes-nft). The row's curve is the teacher's up to its
  minutes, then the student's, offset by them: the model one would ship at each moment of the pipeline.

The rows are tabulated by the race's own summary (``bench_e2e.summarize``): ``e2e.csv``, ``e2e.png``,
``e2e.json`` and ``lr_screen.csv`` in ``--out``.

    python benchmarks/experiments/new_methods/race_rows.py --seeds 0 1 --jobs 1 --runs-dir RUNS \\
        --out benchmarks/results/new_methods/race
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowgrpo.benchmarks import write_csv
from flowgrpo.benchmarks.bench_e2e import (CurvePoint, RunSpec, add_runner_arguments, race_spec, run_curve,
                                           run_specs, summarize)

# the race's settings (docs/results/method_race.md): its evaluation, not the recipe's larger one, and
# CPU time as the clock; eval.seen=false: the curve never uses the seen pools
RACE_SETTINGS = ("eval.num_prompts=64", "eval.seeds_per_prompt=4", "eval.seen=false", "train.clock=cpu")
SCREEN_LR, FALLBACK_LR, SCREEN_MIN_FIDELITY = 1e-5, 3e-6, 0.98


def screen_spec(seed: int, minutes: float) -> RunSpec:
    return race_spec("crd", seed, minutes, 60.0, [f"train.lr={SCREEN_LR}", *RACE_SETTINGS])


def screened_lr(runs_dir: Path, seed: int) -> tuple[float, list[CurvePoint]]:
    """The race's rule on crd's screen run: 1e-5 if every evaluation kept fidelity >= 0.98, else 3e-6."""
    curve = run_curve(runs_dir / f"crd-s{seed}")
    ok = all(p.fidelity is None or p.fidelity >= SCREEN_MIN_FIDELITY for p in curve)
    return (SCREEN_LR if ok else FALLBACK_LR), curve


def opd_specs(seed: int, runs_dir: Path, minutes: float, teacher_minutes: float, eval_every_s: float,
              overrides: list[str] = ()) -> list[RunSpec]:
    """The teacher (shapes-nft) and the student (flow-opd from the base) of one race seed."""
    from flowgrpo.config.schema import load_config

    teacher, teacher_lr = f"opd-teacher-s{seed}", load_config("shapes-nft").train.lr
    every = f"eval.every_minutes={eval_every_s / 60}"
    return [RunSpec(teacher, ("--preset", "shapes-nft", f"train.seed={seed}", f"train.max_minutes={teacher_minutes}",
                              every, *RACE_SETTINGS, *overrides)),
            RunSpec(f"flow-opd-s{seed}", ("--preset", "flow-opd", f"train.seed={seed}",
                                          f"train.max_minutes={minutes - teacher_minutes}", every,
                                          f"loss.flow_opd.default_teacher={runs_dir / teacher}",
                                          "loss.flow_opd.cold_start=none", f"train.lr={teacher_lr}", *RACE_SETTINGS,
                                          *overrides))]


def opd_curve(runs_dir: Path, seed: int) -> list[CurvePoint]:
    """The pipeline's curve: the teacher's evaluations, then the student's (its own evaluation before
    training included) shifted by the teacher's training seconds."""
    teacher = run_curve(runs_dir / f"opd-teacher-s{seed}")
    offset = json.loads((runs_dir / f"opd-teacher-s{seed}" / "summary.json").read_text())["train_seconds"]
    offset = max(offset, teacher[-1].seconds)
    student = run_curve(runs_dir / f"flow-opd-s{seed}")
    # the student's before point sits just after the teacher's last one: the curve steps back to the base
    return teacher + [CurvePoint(offset + p.seconds + (1e-3 if i == 0 else 0.0), p.accuracy, p.fidelity)
                      for i, p in enumerate(student)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="race training seeds")
    ap.add_argument("--minutes", type=float, default=10.0, help="CPU-minutes of each row (flow-opd: teacher + student)")
    ap.add_argument("--eval-every", type=float, default=60.0, help="seconds of training between evaluations")
    ap.add_argument("--teacher-minutes", type=float, default=5.0, help="flow-opd's teacher's share of --minutes")
    ap.add_argument("--screen-seed", type=int, default=9, help="training seed of crd's lr screen (not a race seed)")
    ap.add_argument("--screen-minutes", type=float, default=3.0)
    ap.add_argument("--references", nargs="*", default=["flow-grpo", "shapes-nft"],
                    help="race presets re-run beside the new rows (flow-grpo's final accuracy is the target, as in the race)")
    add_runner_arguments(ap, jobs=1)
    a = ap.parse_args(argv)
    if a.screen_seed in a.seeds:
        raise SystemExit(f"--screen-seed {a.screen_seed} is a race seed: the screen must not see the race's seeds")
    if not 0 < a.teacher_minutes < a.minutes:
        raise SystemExit(f"--teacher-minutes must lie in (0, --minutes = {a.minutes}), got {a.teacher_minutes}")
    runs_dir, out = Path(a.runs_dir).resolve(), Path(a.out)
    screen_dir = runs_dir / "screen"
    if not a.aggregate_only:
        run_specs([screen_spec(a.screen_seed, a.screen_minutes)], screen_dir, 1, tag="screen")
    lr, screen = screened_lr(screen_dir, a.screen_seed)
    print(f"[race] crd lr {lr:g} (screen at {SCREEN_LR:g}: fidelity "
          f"{', '.join(f'{p.fidelity:.3f}' for p in screen if p.fidelity is not None)})", flush=True)
    if not a.aggregate_only:
        specs = []
        for s in a.seeds:  # seed-major, as the race: an interrupted run has every row on its first seed
            race = lambda p, *extra: race_spec(p, s, a.minutes, a.eval_every, [*extra, *RACE_SETTINGS, *a.overrides])  # noqa: E731
            specs += [race(p) for p in a.references[:1]] + [race("crd", f"train.lr={lr}")]
            specs += opd_specs(s, runs_dir, a.minutes, a.teacher_minutes, a.eval_every, a.overrides)
            specs += [race(p) for p in a.references[1:]]
        run_specs(specs, runs_dir, a.jobs, tag="race")
    # label -> (the run whose summary marks a seed finished, the seed's curve)
    rows = {p: (p, lambda s, p=p: run_curve(runs_dir / f"{p}-s{s}")) for p in [*a.references, "crd"]}
    rows["flow-opd (teacher counted)"] = ("flow-opd", lambda s: opd_curve(runs_dir, s))
    curves = {}
    for label, (run, curve_of) in rows.items():
        done = {s: curve_of(s) for s in a.seeds if (runs_dir / f"{run}-s{s}" / "summary.json").is_file()}
        if done:
            curves[label] = done
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "lr_screen.csv", [{"run": f"crd-s{a.screen_seed}", "lr": SCREEN_LR, "train_seconds": p.seconds,
                                       "accuracy": p.accuracy, "fidelity": p.fidelity} for p in screen],
              ["run", "lr", "train_seconds", "accuracy", "fidelity"])
    summarize(curves, a.minutes, out, str(out / "e2e.json"), clock="cpu")


if __name__ == "__main__":
    main()
