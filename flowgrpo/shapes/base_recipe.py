"""The shipped shapes base model's pretraining: two runs of :mod:`flowgrpo.shapes.pretrain`, as data.

    python -m flowgrpo.shapes.base_recipe --out /tmp/shapes_base      # resumable: run it again to go on
    cp /tmp/shapes_base/stage2/snapshots/final/{model.safetensors,config.json} flowgrpo/shapes/weights/

Why two stages (docs/shapes_world.md, "A base pretrained in two stages"): a model pretrained once on
every tag places each object of a position prompt from its own marginal distribution of cells and
coordinates nothing, so the relation holds at (or below) its independence null, and RL only sharpens
the marginals: 0.84-0.86 after the default's 60 minutes from such a base, with a seed per sample. The
coupling takes many clean position samples, far more than a mixed, mis-captioned run gives on two
cores in an hour:

1. **stage 1** trains on position captions only, without caption noise, 2,000 steps of 512
   (about a million position scenes), and couples: the relation holds 0.906 against a null of
   0.883;
2. **stage 2** starts every weight from stage 1 and runs the default recipe (all tags, the default
   caption noise, position three shares) for 3,000 steps of 128 at half the learning rate, which
   makes the base misaligned again (held-out accuracy about 0.47). The default's 60 minutes from
   it hold the relation 0.93-0.94 (docs/results/scene_world_interpolating_split.md, "The two-stage
   base, shipped").

Both stages use the learned cell-offset attention bias (``--cell-offset-bias``). Each stage is an
ordinary pretraining folder under ``OUT`` (``stage1/``, ``stage2/``) with its log, arguments and
resumable state; a stage that has finished is skipped on a rerun.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Stage:
    """One pretraining run of the recipe: its folder name under OUT and the arguments of
    :func:`flowgrpo.shapes.pretrain.main` besides ``--out``, ``--threads``, ``--device`` and (stage 2)
    ``--init-model``."""

    name: str
    steps: int
    args: tuple[str, ...]


STAGES: tuple[Stage, ...] = (
    Stage("stage1", 2000, ("--batch", "512", "--eval-every", "500", "--eval-prompts", "12", "--cell-offset-bias",
                           "--caption-noise", "position=0",
                           "--tag-weights", "single_object=0,two_object=0,counting=0,colors=0,color_attr=0,position=1")),
    Stage("stage2", 3000, ("--batch", "128", "--lr", "5e-4", "--warmup", "300", "--eval-every", "1000",
                           "--cell-offset-bias")),
)


def stage_argv(stage: Stage, out: Path, previous: Path | None, threads: int, device: str, seed: int = 0) -> list[str]:
    """The full argument list of ``stage`` written into ``out / stage.name``; ``previous`` is the
    folder of the stage before it (its final EMA snapshot initialises every weight), None for the first."""
    argv = ["--out", str(out / stage.name), "--steps", str(stage.steps), *stage.args,
            "--threads", str(threads), "--device", device, "--seed", str(seed)]
    if previous is not None:
        argv += ["--init-model", str(previous / "snapshots" / "final")]
    return argv


def finished(folder: Path, steps: int) -> bool:
    """Whether the pretraining in ``folder`` reached ``steps`` (its last log line) and wrote its final snapshot."""
    log = folder / "pretrain_log.jsonl"
    if not (folder / "snapshots" / "final" / "model.safetensors").is_file() or not log.is_file():
        return False
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    return bool(lines) and json.loads(lines[-1]).get("step") == steps


def main(argv: list[str] | None = None) -> Path:
    """Run the stages in order into ``--out`` and return the folder of the base's weights
    (``OUT/stage2/snapshots/final``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder; one pretraining folder per stage inside it")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each stage (0 = torch's default)")
    ap.add_argument("--device", default="auto", help="as pretrain's --device: auto, cpu, cuda or cuda:N")
    ap.add_argument("--seed", type=int, default=0, help="seed of both stages (the shipped weights: 0)")
    args = ap.parse_args(argv)

    from . import pretrain  # late import: argument errors above cost nothing

    out = Path(args.out)
    previous = None
    for i, stage in enumerate(STAGES, 1):
        folder = out / stage.name
        if finished(folder, stage.steps):
            print(f"stage {i} of {len(STAGES)} ({stage.name}) already finished in {folder}", flush=True)
        else:
            print(f"stage {i} of {len(STAGES)}: {stage.name} -> {folder}", flush=True)
            pretrain.main(stage_argv(stage, out, previous, args.threads, args.device, args.seed))
        previous = folder
    final = previous / "snapshots" / "final"
    print(f"base model: {final} (flowgrpo train model.path={final})", flush=True)
    return final


if __name__ == "__main__":
    main()
