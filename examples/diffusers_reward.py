"""A reward that is a plain Python function, on a diffusers pipeline folder, with a Trainer assembled
in code: the function is handed to the trainer as a part (no registry, no import path).

    pip install -e .                                        # once, from the repository root
    python examples/diffusers_reward.py PIPELINE_DIR [key.sub=value ...]

PIPELINE_DIR is any flow-matching diffusers pipeline folder (``model_index.json`` picks the adapter:
SD3 / SD3.5, FLUX.1, Wan 2.1, ...). Without real weights, make a tiny random SD3 folder first::

    python -c "from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline; tiny_sd3_pipeline(seed=0).save_pretrained('tiny_sd3')"
    python examples/diffusers_reward.py tiny_sd3 model.resolution=64 model.max_sequence_length=16
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

import flowgrpo

PROMPTS = ["a red apple on a wooden table", "a blue car in the rain", "a lighthouse at dusk", "a bowl of soup"]
TINY = ["model.train_mode=lora", "model.lora_rank=4", "model.lora_alpha=8", "sampler.strategy=flow_grpo",
        "loss.objective=grpo", "advantage.estimator=group_zscore", "train.iterations=2",
        "data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=3", "eval.evaluator=none",
        "train.max_minutes=0", "log.progress=false", "log.trackers=[]", "log.grid_every=0",
        "log.out_dir=runs/examples"]


def warmth(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """Red minus blue, averaged over the image: [B] in [-1, 1] (images [B, 3, H, W] in [0, 1])."""
    return (images[:, 0] - images[:, 2]).flatten(1).mean(1)


def main(argv: list[str]) -> dict:
    if not argv or "=" in argv[0]:
        raise SystemExit(__doc__)
    pipeline, overrides = argv[0], argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        cfg = flowgrpo.load_config(overrides=[f"model.name={pipeline}", f"data.prompts={prompts}", *TINY, *overrides])
        trainer = flowgrpo.Trainer.from_config(cfg, rewards={"warmth": warmth})  # the part replaces reward.weights
        print(f"policy {type(trainer.policy).__name__}, rewards {list(trainer.rewards)}")
        return flowgrpo.train(trainer=trainer, callbacks=[
            lambda tr, m: print(f"iteration {m['iteration']}: reward.warmth={m['reward.warmth']:.5f} "
                                f"loss={m['loss']:.3g}")])


if __name__ == "__main__":
    main(sys.argv[1:])
