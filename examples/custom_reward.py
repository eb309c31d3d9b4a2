"""Train the shapes world with rewards from your own module (``my_rewards.py`` beside this file),
named by import path, for a few iterations; print each iteration's rewards.

    pip install -e .                      # once, from the repository root
    python examples/custom_reward.py      # seconds on a CPU; extra key.sub=value overrides may follow

Running this script puts ``examples/`` on ``sys.path``, so ``my_rewards`` imports; from the command
line the same run is::

    PYTHONPATH=examples flowgrpo train "reward.weights={shapes: 1.0, 'my_rewards:colourfulness': 0.2}" ...
"""

from __future__ import annotations

import sys

import flowgrpo

REWARDS = {"shapes": 1.0, "my_rewards:colourfulness": 0.2, "my_rewards:Contrast": 0.1}
TINY = ["model.name=shapes", "data.prompts=shapes", "train.iterations=3", "data.prompts_per_iteration=2",
        "data.trees_per_prompt=4", "sampler.num_steps=4", "eval.evaluator=none", "train.max_minutes=0",
        "log.progress=false", "log.trackers=[]", "log.grid_every=0", "log.out_dir=runs/examples"]


def show(trainer, metrics: dict) -> None:
    """A callback: one line per iteration with every reward's mean (the metrics.jsonl line's keys)."""
    rewards = "  ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k.startswith("reward."))
    print(f"iteration {metrics['iteration']}: {rewards}  nan_rewards_dropped={metrics['nan_rewards_dropped']}")


def main(argv: list[str]) -> dict:
    cfg = flowgrpo.load_config(overrides=[*TINY, f"reward.weights={REWARDS}",
                                          "reward.options={'my_rewards:Contrast': {cap: 0.4}}", *argv])
    summary = flowgrpo.train(cfg, callbacks=[show])
    print("final metrics:", {k: v for k, v in summary["final_metrics"].items() if k.startswith("reward")})
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
