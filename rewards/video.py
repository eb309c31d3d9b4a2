"""Video rewards from image rewards: score every ``stride``-th frame and average per video."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .base import Reward, RewardOutput, wants_metadata, wants_references


def frame_indices(num_frames: int, stride: int) -> list[int]:
    """The scored frames of a video of ``num_frames`` frames: 0, stride, 2 * stride, ..."""
    return list(range(0, num_frames, stride))


def score_frames(reward: Reward, images: Tensor, prompts: list[str], groups: Tensor | None = None,
                 stride: int = 1, references: Tensor | None = None, metadata: list | None = None) -> RewardOutput:
    """Score images [B, 3, H, W] with ``reward``, or videos [B, F, 3, H, W] frame by frame.

    A video is scored on frames 0, stride, 2 * stride, ... (one call of the image reward per frame
    index over the whole batch, with the same prompts and groups, so pairwise rewards still compare
    the videos of a group frame by frame); scores and components are the mean over those frames per
    video ([B]). A NaN frame score makes that video's score NaN (a failed sample).

    A reward with ``takes_videos`` (e.g. a :class:`~flowgrpo.rewards.callable.CallableReward` of a
    video-aware callable) is called once with the list of the B videos, each [F', 3, H, W] holding the
    same frames 0, stride, 2 * stride, ...

    A reward with ``wants_references`` also gets ``references=`` (images [B, 3, H, W] in [0, 1], or
    None), one with ``wants_metadata`` ``metadata=`` (B dicts, or None); any other reward is called
    without those keywords.
    """
    if int(stride) != stride or stride < 1:
        raise ValueError(f"frame stride must be an integer >= 1, got {stride!r}")
    extra = {"references": references} if wants_references(reward) else {}
    if wants_metadata(reward):
        extra["metadata"] = metadata
    call = functools.partial(reward, **extra) if extra else reward
    if images.ndim == 4:
        return call(images, prompts, groups=groups)
    if images.ndim != 5:
        raise ValueError(f"{getattr(reward, 'name', type(reward).__name__)}: expected images [B, 3, H, W] "
                         f"or videos [B, F, 3, H, W], got {tuple(images.shape)}")
    frames = frame_indices(images.shape[1], int(stride))
    if getattr(reward, "takes_videos", False):
        return call(list(images[:, frames]), prompts, groups=groups)
    outs = [call(images[:, f], prompts, groups=groups) for f in frames]
    scores = torch.stack([o.scores.float() for o in outs]).mean(0)
    components = {k: torch.stack([o.components[k].float() for o in outs]).mean(0)
                  for k in outs[0].components if all(k in o.components for o in outs)}
    return RewardOutput(scores, components)
