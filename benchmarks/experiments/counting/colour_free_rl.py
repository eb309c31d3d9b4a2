"""`flowgrpo train` with colour-free counting prompts ("four triangles") in the RL prompt pool.

Issue 47 item 6, one of the counting-variety options measured in docs/results/counting_generalisation.md:
a ``--share`` of the world's counting draws names no colour (:func:`flowgrpo.shapes.prompts.free_counting_specs`),
so the count is rewarded with its shape alone. Everything else is the run the overrides describe
(the default, unless they say otherwise); the held-out evaluation is the usual one (coloured prompts).

    python benchmarks/experiments/counting/colour_free_rl.py --share 0.5 train.clock=cpu train.seed=33 log.run_name=cf50-s33

The same share in pretraining is ``python -m flowgrpo.shapes.pretrain --free-counting-share S ...``.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--share", type=float, required=True, help="share of the counting draws that are colour-free")
    ap.add_argument("overrides", nargs="*", help="config overrides, key.sub=value, as `flowgrpo train` takes them")
    args = ap.parse_args(argv)

    import flowgrpo
    from flowgrpo.data import PromptSource
    from flowgrpo.shapes.prompts import TrainingPrompts
    from flowgrpo.trainer.trainer import Trainer

    cfg = flowgrpo.load_config(overrides=args.overrides)
    if cfg.data.prompts != "shapes" or cfg.data.curriculum != "none":
        raise SystemExit("colour-free counting needs the shapes world's own prompts (data.prompts=shapes) "
                         "without a curriculum")
    prompts = PromptSource("shapes", seed=cfg.train.seed)
    prompts.world = TrainingPrompts(args.share)  # the world's source with the share; draws keep the run's seed
    return flowgrpo.train(trainer=Trainer.from_config(cfg, prompts=prompts))


if __name__ == "__main__":
    main()
