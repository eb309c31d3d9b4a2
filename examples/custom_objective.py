"""Train the shapes world with an objective from your own module (``my_objective.py`` beside this
file), named by import path, for a few iterations; its statistics appear in the metrics.

    pip install -e .                          # once, from the repository root
    python examples/custom_objective.py       # seconds on a CPU; key.sub=value overrides may follow

Forward-process objectives train on the final samples, so the rollouts are deterministic ODE chains
(``sampler.strategy=ode``). The same objective can also be handed to a trainer as an instance:
``flowgrpo.Trainer.from_config(cfg, objective=AdvantageWeightedMatching(cfg, temperature=0.5))``.
"""

from __future__ import annotations

import sys

import flowgrpo

TINY = ["model.name=shapes", "data.prompts=shapes", "reward.weights={shapes: 1.0}", "train.iterations=3",
        "data.prompts_per_iteration=2", "data.trees_per_prompt=4", "sampler.num_steps=4", "eval.evaluator=none",
        "train.max_minutes=0", "log.progress=false", "log.trackers=[]", "log.grid_every=0",
        "log.out_dir=runs/examples"]


def show(trainer, m: dict) -> None:
    print(f"iteration {m['iteration']}: objective={trainer.objective.name} reward.shapes={m['reward.shapes']:.4f} "
          f"loss={m['loss']:.5f} fm_error={m.get('fm_error', float('nan')):.5f} rows={m['rows']}")


def main(argv: list[str]) -> dict:
    cfg = flowgrpo.load_config(overrides=[*TINY, "sampler.strategy=ode",
                                          "loss.objective=my_objective:AdvantageWeightedMatching", *argv])
    return flowgrpo.train(cfg, callbacks=[show])


if __name__ == "__main__":
    main(sys.argv[1:])
