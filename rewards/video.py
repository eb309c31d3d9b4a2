"""Video rewards from image rewards: score every ``stride``-th frame and average per video."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Reward, RewardOutput


class FrameWise:
    """Wrap an image reward for videos [B, F, 3, H, W] (in [0, 1]).

    The inner reward scores frames 0, stride, 2 * stride, ... (one call per frame index, over the
    whole batch, with the same prompts and groups, so pairwise rewards still compare the videos of
    a group frame by frame); scores and components are the mean over those frames per video
    ([B]). A NaN frame score makes that video's score NaN (a failed sample). Images [B, 3, H, W]
    pass straight to the inner reward. Other attributes (read or set) are the inner reward's.
    """

    def __init__(self, inner: Reward, stride: int = 1):
        if int(stride) != stride or stride < 1:
            raise ValueError(f"frame stride must be an integer >= 1, got {stride!r}")
        self.inner = inner
        self.stride = int(stride)
        self.name = getattr(inner, "name", type(inner).__name__)

    _OWN = ("inner", "stride", "name")

    def __getattr__(self, attr):  # only called for attributes FrameWise itself lacks
        if attr in FrameWise._OWN:
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __setattr__(self, attr, value):  # settings such as batch_size reach the inner reward
        if attr in FrameWise._OWN:
            object.__setattr__(self, attr, value)
        else:
            setattr(self.inner, attr, value)

    def frame_indices(self, num_frames: int) -> list[int]:
        """The scored frames of a video of ``num_frames`` frames: 0, stride, 2 * stride, ..."""
        return list(range(0, num_frames, self.stride))

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        """Images [B, 3, H, W] -> the inner reward's output; videos [B, F, 3, H, W] -> frame means [B]."""
        if images.ndim == 4:
            return self.inner(images, prompts, groups=groups)
        if images.ndim != 5:
            raise ValueError(f"{self.name}: expected images [B, 3, H, W] or videos [B, F, 3, H, W], "
                             f"got {tuple(images.shape)}")
        outs = [self.inner(images[:, f], prompts, groups=groups) for f in self.frame_indices(images.shape[1])]
        scores = torch.stack([o.scores.float() for o in outs]).mean(0)
        components = {k: torch.stack([o.components[k].float() for o in outs]).mean(0)
                      for k in outs[0].components if all(k in o.components for o in outs)}
        return RewardOutput(scores, components)
