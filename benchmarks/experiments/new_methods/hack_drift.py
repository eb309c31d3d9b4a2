"""CRD and NormGuard against DiffusionNFT on a reward the shapes world can hack (issue 47, item 7).

The reward is ``jpeg_incompressibility``: on the shapes world's glyphs-on-black it is a hack, learned as
8-pixel JPEG-block texture instead of the asked scene (docs/monitors.md). Each variant trains from the
shipped base for ``--minutes`` CPU-minutes (``train.clock=cpu``) at one learning rate shared by all,
so what differs is the objective. Measured at the held-out evaluations (the recipe's prompts and
seeds): the hack reward itself on held-out prompts (``monitor.rewards``), the shapes verifier's
accuracy (what the hack destroys), fidelity to the base model's images, the image statistics that
show the texture (grid_energy, high_freq) and the velocity norm against the base model's.

Variants (each a run ``RUNS/<label>-s<seed>``, resumable):

- ``diffusion-nft``: the preset;
- ``diffusion-nft+normguard``: the preset with ``loss.nft.norm_guard_beta`` (``--norm-guard-beta``);
- ``crd``: the preset (KL 0.1 to the CFG-guided base, reward-adaptive).

    python benchmarks/experiments/new_methods/hack_drift.py --seeds 0 1 --minutes 4 --lr 1e-4 \\
        --runs-dir RUNS --out OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flowgrpo.benchmarks import print_table, write_csv, write_json
from flowgrpo.benchmarks.bench_e2e import RunSpec, add_runner_arguments, collect_runs, plot_e2e, run_specs
from flowgrpo.trainer.metrics import read_metrics

HACK = "jpeg_incompressibility"
STATS = ("grid_energy", "high_freq", "velocity_norm")


def variants(norm_guard_beta: float) -> dict[str, tuple[str, ...]]:
    """label -> (--preset, preset, overrides of the variant)."""
    return {"diffusion-nft": ("--preset", "diffusion-nft"),
            "diffusion-nft+normguard": ("--preset", "diffusion-nft", f"loss.nft.norm_guard_beta={norm_guard_beta}"),
            "crd": ("--preset", "crd")}


def specs(labels, seeds, minutes: float, eval_every_min: float, lr: float, norm_guard_beta: float,
          overrides: list[str]) -> list[RunSpec]:
    """Seed-major: every variant's first seed before any second."""
    v = variants(norm_guard_beta)
    return [RunSpec(f"{label}-s{s}", (*v[label], f"reward.weights={{{HACK}: 1.0}}", f"monitor.rewards=[{HACK}]",
                                      f"train.lr={lr}", f"train.seed={s}", "train.clock=cpu",
                                      f"train.max_minutes={minutes}", f"eval.every_minutes={eval_every_min}",
                                      *overrides))
            for s in seeds for label in labels]


def _train_reward(run_dir: Path, n: int = 5) -> tuple[float, float]:
    """Mean training reward of the first and last ``n`` iterations (metrics.jsonl)."""
    r = [row["reward_mean"] for row in read_metrics(run_dir) if "reward_mean" in row]
    return sum(r[:n]) / max(1, len(r[:n])), sum(r[-n:]) / max(1, len(r[-n:]))


def rows_of(runs_dir: Path, labels, seeds) -> list[dict]:
    """One row per finished run: before/after held-out figures and the training reward."""
    out = []
    for label in labels:
        for s in seeds:
            d = runs_dir / f"{label}-s{s}"
            if not (d / "summary.json").is_file():
                continue
            summ = json.loads((d / "summary.json").read_text())
            b, a = summ["eval_before"], summ["eval_after"]
            first, last = _train_reward(d)
            row = {"variant": label, "seed": s, "iterations": summ["iterations"],
                   "train_reward_first5": first, "train_reward_last5": last,
                   f"heldout_{HACK}_before": b["monitors"][f"reward.{HACK}"],
                   f"heldout_{HACK}_after": a["monitors"][f"reward.{HACK}"],
                   "accuracy_before": b["accuracy"], "accuracy_after": a["accuracy"],
                   "fidelity_after": a.get("fidelity")}
            row.update({f"{k}_after": a["monitors"].get(k) for k in STATS})
            out.append(row)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--variants", nargs="+", default=list(variants(1.0)))
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--eval-every", type=float, default=1.0, help="CPU-minutes between held-out evaluations")
    ap.add_argument("--lr", type=float, default=1e-4, help="one learning rate for every variant")
    ap.add_argument("--norm-guard-beta", type=float, default=1.0)
    add_runner_arguments(ap)
    a = ap.parse_args(argv)
    runs_dir, out = Path(a.runs_dir).resolve(), Path(a.out)
    bad = sorted(set(a.variants) - set(variants(1.0)))
    if bad:
        raise SystemExit(f"unknown variant(s) {', '.join(bad)}; valid: {', '.join(variants(1.0))}")
    if not a.aggregate_only:
        run_specs(specs(a.variants, a.seeds, a.minutes, a.eval_every, a.lr, a.norm_guard_beta, a.overrides),
                  runs_dir, a.jobs, tag="hack")
    rows = rows_of(runs_dir, a.variants, a.seeds)
    if not rows:
        raise SystemExit(f"no finished run under {runs_dir}")
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "hack_drift.csv", rows)
    write_json(out / "hack_drift.json", {"rows": rows})
    keys = list(rows[0])
    print_table(keys, [[f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows],
                title=f"training on {HACK}: the hack, the scenes it costs and the drift", width=260)
    curves = {k: v for k, v in collect_runs(runs_dir).items() if k in a.variants}
    plot_e2e(curves, None, "", out / "hack_drift.png", clock="cpu")


if __name__ == "__main__":
    main()
