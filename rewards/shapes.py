"""The shapes world's verifiable reward: parse the image, check the prompt's spec."""

from __future__ import annotations

import torch
from torch import Tensor

from flowgrpo.images import to_uint8
from flowgrpo.shapes.prompts import parse_prompt
from flowgrpo.shapes.verify import verify

from .base import RewardOutput


class ShapesReward:
    """GenEval-style reward for shapes prompts.

    ``scores`` is the partial credit in [0, 1] (the mean of the per-object count checks, the
    no-extra-objects check and the relation check); component ``correct`` is the strict 0/1
    GenEval rule. A prompt that is not a shapes-world prompt scores NaN (dropped by the trainer).

    Args:
        reversed_credit: the relation check's credit when A and B stand on different lines the wrong
            way round (``reward.options.shapes.reversed_credit``; default 0: a reversal scores as a tie,
            A and B on one line). Above 0 a tie ranks below a reversal within a group, so the update
            pushes hardest on ties, the misses that RL otherwise leaves (docs/shapes_world.md). The
            strict ``correct`` component is unchanged.
    """

    name = "shapes"
    #: the only policy adapter whose images this reward can read (the trainer refuses other models up front)
    images_of = "shapes"

    def __init__(self, reversed_credit: float = 0.0):
        if not 0.0 <= float(reversed_credit) < 1.0:
            from flowgrpo.errors import ConfigError

            raise ConfigError(f"reward.options.shapes.reversed_credit must be in [0, 1) (1 would score a reversal as "
                              f"right), got {reversed_credit!r}")
        self.reversed_credit = float(reversed_credit)

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        scores, correct = [], []
        for prompt, img in zip(prompts, to_uint8(images)):
            try:
                r = verify(parse_prompt(prompt), img, self.reversed_credit)
            except ValueError:
                r = {"score": float("nan"), "correct": float("nan")}
            scores.append(r["score"])
            correct.append(r["correct"])
        return RewardOutput(torch.tensor(scores, dtype=torch.float32),
                            {"correct": torch.tensor(correct, dtype=torch.float32)})


class ShapesCorrectReward(ShapesReward):
    """The strict 0/1 GenEval rule of :class:`ShapesReward` as the score (what held-out accuracy
    measures); the partial credit is kept as component ``partial``. Sparse: a group whose samples
    all fail (or all succeed) has zero spread and carries no advantage."""

    name = "shapes_correct"

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        out = super().__call__(images, prompts)
        return RewardOutput(out.components["correct"], {"partial": out.scores})
