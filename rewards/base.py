"""The reward protocol and registry (rewards score the leaves of a rollout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from flowgrpo.registry import Registry


@dataclass
class RewardOutput:
    """Per-sample scores [B] (float32, higher is better; NaN marks a failed score) and named components [B]."""

    scores: Tensor
    components: dict[str, Tensor] = field(default_factory=dict)


class Reward(Protocol):
    """A reward model: ``reward(images [B, 3, H, W] in [0, 1], prompts [B], groups [B]) -> RewardOutput``.

    ``groups`` (long [B], optional) is the GRPO group of each image: pairwise rewards (Pref-GRPO
    win rates) compare images within a group; pointwise rewards ignore it.
    """

    name: str

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput: ...


REWARDS: Registry = Registry("reward")
