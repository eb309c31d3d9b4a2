"""Any callable as a reward: the adapter from ``fn(images, prompts, **metadata) -> scores`` to the
reward protocol (:class:`~flowgrpo.rewards.base.Reward`), and the plug-in hook of ``REWARDS`` that
lets a config name one by import path (``reward.weights={"my_pkg.rewards:sharpness": 1.0}``).

The callable contract (docs/api.md):

* ``images``: float [B, 3, H, W] in [0, 1] (CPU). For a video model every reward scores frames
  0, s, 2s, ... (``reward.frame_stride`` = s) one call per frame and the scores are averaged per
  video, unless the callable sets ``takes_videos = True``: then ``images`` is a list of B videos,
  each [F', 3, H, W] in [0, 1] with the same frames (:func:`flowgrpo.rewards.video.score_frames`).
* ``prompts``: list of B strings.
* ``**metadata``: ``groups`` (long [B], each image's GRPO group: pairwise rewards compare within
  one) for a callable that names it or takes ``**kwargs``; ``references`` ([B, 3, H, W] in [0, 1],
  image editing: each prompt's reference image) and ``metadata`` (B dicts, each image's prompt line
  of a .jsonl prompt file; None without one) only for a callable that names them.
* returns scores [B] as a tensor, numpy array or list (higher is better), or a
  :class:`~flowgrpo.rewards.base.RewardOutput` (scores plus named components that are logged).
  NaN (or None in a list) marks an image the reward could not score: that sample is dropped from
  the advantages, not zeroed, and counted in the metric ``nan_rewards_dropped``.

A class with that ``__call__`` is instantiated with ``reward.options.<name>`` as keyword arguments
(checked against its constructor); a function takes no options.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from flowgrpo.errors import UserError
from flowgrpo.registry import PluginError, describe, signature_problem

from .base import Reward, RewardOutput

#: the metadata keywords a callable reward may declare
METADATA = ("groups", "references", "metadata")
CONTRACT = "a reward is called as (images, prompts, **metadata) -> scores [B]"


def _parameters(fn: Callable) -> tuple[set[str], bool]:
    """(the metadata keywords ``fn`` names, whether it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return set(), True
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # a ``**metadata`` catch-all is not a named keyword: it takes what is passed, it asks for nothing
    named = {k for k, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                         inspect.Parameter.KEYWORD_ONLY)}
    return {k for k in METADATA if k in named}, var_kw


def _metadata(fn: Callable) -> dict:
    """The metadata keywords ``fn`` names, as the call would pass them (for the signature check)."""
    return {k: None for k in _parameters(fn)[0]}


def as_scores(out: Any, n: int, name: str) -> RewardOutput:
    """A callable's return value (tensor, array, list with None for failures, or RewardOutput) as a
    :class:`RewardOutput` with float32 CPU scores [n]; one-line :class:`UserError` otherwise."""
    if isinstance(out, RewardOutput):
        scores, comps = out.scores, out.components
    else:
        scores, comps = out, {}
    if isinstance(scores, (list, tuple)):
        try:
            scores = [math.nan if v is None else float(v) for v in scores]
        except (TypeError, ValueError):
            raise UserError(f"reward {name!r} returned a list holding a non-number; it must return one score per "
                            f"image ([B] tensor, array or list, NaN or None where it cannot score)") from None
    if isinstance(scores, (Tensor, np.ndarray, list)):
        scores = torch.as_tensor(np.asarray(scores.detach().cpu() if isinstance(scores, Tensor) else scores,
                                            dtype=np.float32))
    else:
        raise UserError(f"reward {name!r} returned {type(scores).__name__}; it must return one score per image "
                        "([B] tensor, array or list, NaN or None where it cannot score) or a RewardOutput")
    scores = scores.reshape(-1) if scores.ndim > 1 and scores.numel() == n else scores
    if scores.ndim != 1 or scores.shape[0] != n:
        raise UserError(f"reward {name!r} returned scores of shape {tuple(scores.shape)} for {n} images; "
                        f"it must return one score per image [{n}]")
    return RewardOutput(scores, {k: torch.as_tensor(np.asarray(v.detach().cpu() if isinstance(v, Tensor) else v,
                                                               dtype=np.float32)).reshape(-1)
                                 for k, v in comps.items()})


class CallableReward:
    """A callable ``fn(images, prompts, **metadata) -> scores`` as a :class:`Reward` (module docstring).

    It passes ``groups=``, ``references=`` and ``metadata=`` only where ``fn`` takes them, declares
    ``wants_references`` / ``wants_metadata`` when ``fn`` names ``references`` / ``metadata`` (or sets
    the attribute), forwards
    ``takes_videos`` and ``images_of`` from ``fn``, and turns the return value into a
    :class:`RewardOutput` (:func:`as_scores`). It is thread-safe as far as ``fn`` is (``reward.waves``
    scores on a worker thread), and the reward server (``flowgrpo serve-reward``) serves it as any reward.
    """

    def __init__(self, fn: Callable, name: str | None = None):
        if not callable(fn):
            raise TypeError(f"a reward must be callable, got {describe(fn)}")
        self.fn = fn
        self.name = name or getattr(fn, "name", None) or getattr(fn, "__qualname__", type(fn).__name__)
        named, self._var_kw = _parameters(fn)
        # the call __call__ makes (the keywords it names); was accepted here and failed at the first scoring
        problem = signature_problem(fn, None, [], **{k: None for k in ("groups", "references", "metadata")
                                                      if k in named})
        if problem:
            raise TypeError(f"{describe(fn)} {problem}; a reward is called as (images, prompts, **metadata)")
        self._named = named
        self.wants_references = bool(getattr(fn, "wants_references", False)) or "references" in named
        self.wants_metadata = bool(getattr(fn, "wants_metadata", False)) or "metadata" in named
        self.takes_videos = bool(getattr(fn, "takes_videos", False))
        self.images_of = getattr(fn, "images_of", None)

    def __call__(self, images, prompts: list[str], groups: Tensor | None = None,
                 references: Tensor | None = None, metadata: list | None = None) -> RewardOutput:
        meta = {}
        if "groups" in self._named or self._var_kw:
            meta["groups"] = groups
        if self.wants_references and ("references" in self._named or self._var_kw):
            meta["references"] = references
        if self.wants_metadata and ("metadata" in self._named or self._var_kw):
            meta["metadata"] = metadata
        return as_scores(self.fn(images, prompts, **meta), len(prompts), self.name)

    def __repr__(self) -> str:
        return f"CallableReward({self.name!r})"


def as_reward(obj: Any, name: str) -> Reward:
    """A reward part (:class:`~flowgrpo.trainer.trainer.Trainer`'s ``rewards=``): ``obj`` adapted by
    :class:`CallableReward` (a protocol reward returning a RewardOutput passes through unchanged)."""
    return obj if isinstance(obj, CallableReward) else CallableReward(obj, name)


def reward_plugin(path: str, obj: Any) -> Callable[..., Reward]:
    """The ``REWARDS`` hook for an import path: a function (or callable object) becomes a factory
    without options; a class one whose options are its constructor's arguments. Raises
    :class:`~flowgrpo.registry.PluginError` for anything else or a signature that does not fit."""
    if inspect.isclass(obj):
        call = getattr(obj, "__call__", None)
        if not (inspect.isfunction(call) or inspect.ismethod(call)):
            raise PluginError(f"{describe(obj)} has no __call__; {CONTRACT}")
        bad = signature_problem(call, None, None, None, **_metadata(call))  # (self, images, prompts, ...)
        if bad:
            raise PluginError(f"{describe(obj)}.__call__ {bad}; {CONTRACT}")

        def factory(**options) -> Reward:
            return CallableReward(obj(**options), path)

        factory.__signature__ = inspect.signature(obj)  # check_options reads the constructor's arguments
        return factory
    if not callable(obj):
        raise PluginError(f"{describe(obj)} is not callable; {CONTRACT}")
    bad = signature_problem(obj, None, None, **_metadata(obj))
    if bad:
        raise PluginError(f"{describe(obj)} {bad}; {CONTRACT}")

    def build() -> Reward:
        return CallableReward(obj, path)

    return build
