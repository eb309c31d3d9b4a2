"""User code: rewards written outside flowgrpo, named in a config by import path.

A reward is any callable ``(images, prompts, **metadata) -> scores``:

* ``images``: float tensor [B, 3, H, W] in [0, 1] (a video model: see ``takes_videos`` in docs/api.md);
* ``prompts``: list of B strings;
* ``metadata``: ``groups`` (long [B], the GRPO group of each image) where the callable takes it;
* returns B scores (tensor, numpy array or list; higher is better). NaN, or None in a list, marks an
  image the reward cannot score: the sample is dropped from that iteration's advantages and counted
  in the metric ``nan_rewards_dropped``.

A class with such a ``__call__`` is built with ``reward.options.<module:Class>`` as its keyword arguments.
"""

from __future__ import annotations

import torch


def colourfulness(images: torch.Tensor, prompts: list[str], **metadata) -> torch.Tensor:
    """Mean saturation (max - min over RGB) of the image's drawn pixels, [B] in [0, 1]; NaN for an
    image with nothing drawn on it (no pixel away from the background), which it cannot judge."""
    sat = images.amax(1) - images.amin(1)                         # [B, H, W]
    drawn = (images - images.mean((2, 3), keepdim=True)).abs().amax(1) > 0.1
    total = (sat * drawn).flatten(1).sum(1)
    count = drawn.flatten(1).sum(1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))


class Contrast:
    """Standard deviation of the grey image, capped at ``cap`` (option: reward.options)."""

    def __init__(self, cap: float = 0.5):
        self.cap = float(cap)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> list[float]:
        grey = images.mean(1).flatten(1)
        return [min(float(g.std()), self.cap) for g in grey]
