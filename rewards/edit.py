"""An example reward for image editing: how much of the reference image an edit keeps.

``edit_consistency`` is an example of a reward that reads the reference image, not a quality
model: it scores how close the edited image stays to its reference (a pixel term and a structure
term), optionally combined with any registered prompt-based reward (``prompt_reward=clipscore``,
...) that checks the instruction was followed. A real edit reward would be a judge given both images
(e.g. ``judge`` with a VLM); this one shows the protocol:

* the class sets ``wants_references = True``;
* its ``__call__`` takes ``references=`` [B, 3, H, W] in [0, 1], the reference of each image's
  prompt at the images' size (the trainer passes it only to rewards that declare they want it, so
  every other reward keeps the plain ``reward(images, prompts, groups)`` call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flowgrpo.errors import UserError

from .base import RewardOutput

#: luma weights (ITU-R BT.601) for the structure term
_LUMA = (0.299, 0.587, 0.114)


def pixel_similarity(images: Tensor, references: Tensor) -> Tensor:
    """1 - mean absolute difference per image, [B] in [0, 1] (1: identical), of [B, 3, H, W] in [0, 1]."""
    return 1.0 - (images.float() - references.float()).abs().mean(dim=(1, 2, 3))


def structure_similarity(images: Tensor, references: Tensor, window: int = 7) -> Tensor:
    """Mean SSIM of the luma of [B, 3, H, W] in [0, 1] over ``window`` x ``window`` box windows
    (clipped to the image side), [B] in [-1, 1] (1: identical structure)."""
    luma = torch.tensor(_LUMA, dtype=torch.float32).reshape(1, 3, 1, 1)
    x, y = (images.float() * luma).sum(1, keepdim=True), (references.float() * luma).sum(1, keepdim=True)
    k = max(1, min(window, x.shape[-1], x.shape[-2]))
    mean = lambda t: F.avg_pool2d(t, k, stride=1)  # noqa: E731
    mx, my = mean(x), mean(y)
    vx, vy, cxy = mean(x * x) - mx * mx, mean(y * y) - my * my, mean(x * y) - mx * my
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    ssim = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return ssim.mean(dim=(1, 2, 3))


class EditConsistencyReward:
    """``keep_weight * (pixel + structure) / 2 + prompt_weight * <prompt_reward>`` (see the module docstring).

    Options: ``keep_weight`` (1.0), ``prompt_reward`` (a registered reward's name, or None: no prompt
    check), ``prompt_weight`` (1.0), ``window`` (SSIM window side, 7). Components: ``pixel``,
    ``structure`` and, with a prompt reward, ``prompt``.
    """

    name = "edit_consistency"
    wants_references = True

    def __init__(self, keep_weight: float = 1.0, prompt_reward: str | None = None, prompt_weight: float = 1.0,
                 window: int = 7):
        from . import build_reward

        self.keep_weight, self.prompt_weight, self.window = float(keep_weight), float(prompt_weight), int(window)
        self.prompt_reward = None if prompt_reward is None else build_reward(prompt_reward)
        if getattr(self.prompt_reward, "wants_references", False):
            raise UserError(f"edit_consistency: prompt_reward={prompt_reward!r} wants references itself; name a "
                            "prompt-based reward")

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None, *,
                 references: Tensor | None = None) -> RewardOutput:
        """Scores [B] of images [B, 3, H, W] against ``references`` [B, 3, H, W] (both in [0, 1])."""
        if references is None:
            raise UserError("reward 'edit_consistency' needs the prompts' reference images: train an image-editing "
                            "model on a .jsonl prompt file with an \"image\" column")
        if references.shape != images.shape:
            raise ValueError(f"edit_consistency: references {tuple(references.shape)} do not match images "
                             f"{tuple(images.shape)}")
        pixel = pixel_similarity(images, references)
        structure = structure_similarity(images, references, self.window)
        scores = self.keep_weight * 0.5 * (pixel + structure)
        components = {"pixel": pixel, "structure": structure}
        if self.prompt_reward is not None:
            prompt = self.prompt_reward(images, prompts, groups).scores.float()
            scores = scores + self.prompt_weight * prompt
            components["prompt"] = prompt
        return RewardOutput(scores, components)
