"""The reward protocol (rewards score the leaves of a rollout); the registry is ``flowgrpo.rewards.REWARDS``."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from flowgrpo.errors import ConfigError


@dataclass
class RewardOutput:
    """Per-sample scores [B] (float32, higher is better; NaN marks a failed score) and named components [B]."""

    scores: Tensor
    components: dict[str, Tensor] = field(default_factory=dict)


class Reward(Protocol):
    """A reward model: ``reward(images [B, 3, H, W] in [0, 1], prompts [B], groups [B]) -> RewardOutput``.

    ``groups`` (long [B], optional) is the GRPO group of each image: pairwise rewards (Pref-GRPO
    win rates) compare images within a group; pointwise rewards ignore it.

    Image editing: a reward whose class sets ``wants_references = True`` is also called with
    ``references=`` [B, 3, H, W] in [0, 1], the reference image of each image's prompt at the images'
    size (None when the prompts have none); other rewards never see the keyword
    (:func:`wants_references`).
    """

    name: str

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput: ...


def check_options(name: str, factory, options: dict) -> None:
    """Refuse options that ``factory`` (a reward class or function) does not take, naming the valid ones."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no introspectable signature: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and k != "self"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)} for reward {name!r}; "
                          f"valid options: {', '.join(valid) or '(none)'}")
    missing = [k for k, p in params.items() if k in valid and p.default is inspect.Parameter.empty and k not in options]
    if missing:
        raise ConfigError(f"reward {name!r} needs option(s) {', '.join(missing)} "
                          f"(set reward.options.{name}.{missing[0]}=...)")


def wants_references(reward) -> bool:
    """Whether ``reward`` asks for the prompts' reference images (its ``wants_references`` attribute)."""
    return bool(getattr(reward, "wants_references", False))
