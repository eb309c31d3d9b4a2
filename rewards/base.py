"""The reward protocol (rewards score the leaves of a rollout); the registry is ``flowgrpo.rewards.REWARDS``."""

from __future__ import annotations

import inspect
import os
import typing
from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from flowgrpo.errors import ConfigError
from flowgrpo.fields import as_number, check_range, coerce


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

    Prompt metadata: a reward whose class sets ``wants_metadata = True`` is also called with
    ``metadata=``, a list of B dicts: each image's prompt line of a .jsonl prompt file, every field
    (e.g. GenEval's ``tag`` / ``include`` / ``exclude``); None for prompts without (a .txt file, the
    shapes world). Other rewards never see the keyword (:func:`wants_metadata`).
    """

    name: str

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput: ...


def check_options(name: str, factory, options: dict) -> None:
    """Refuse options that ``factory`` (a reward class or function) does not take, naming the valid
    ones, and values of the wrong type or out of range (:func:`check_option_values`). The config's
    ``reward.options.<name>`` and ``flowgrpo serve-reward --option`` both come here."""
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
    check_option_values(name, factory, options)


def check_option_values(name: str, factory, options: dict) -> None:
    """Each option's value against the factory's annotation (:func:`flowgrpo.fields.coerce`, as a config
    key's: ``quality: int`` refuses ``"abc"``) and the bounds it declares in ``option_ranges``
    (``{"quality": {"ge": 1, "le": 100}}``, :func:`flowgrpo.fields.check_range`). A ConfigError names
    the option as ``reward.options.<name>.<option>``; options without an annotation pass."""
    try:
        hints = typing.get_type_hints(factory.__init__ if isinstance(factory, type) else factory)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: let the factory decide
        hints = {}
    ranges = getattr(factory, "option_ranges", {})
    for option, value in options.items():
        key = f"reward.options.{name}.{option}"
        number = as_number(value)
        if option in ranges and number is not None:  # first: 1e9 for an int option names the range
            check_range(key, value if isinstance(value, (int, float)) else number, ranges[option])
        if option in hints and not isinstance(value, os.PathLike):  # a Path from Python code where a str is declared
            coerce(value, hints[option], key)


def wants_references(reward) -> bool:
    """Whether ``reward`` asks for the prompts' reference images (its ``wants_references`` attribute)."""
    return bool(getattr(reward, "wants_references", False))


def wants_metadata(reward) -> bool:
    """Whether ``reward`` asks for each prompt's .jsonl line (its ``wants_metadata`` attribute)."""
    return bool(getattr(reward, "wants_metadata", False))


def check_metadata(rewards: dict, spec: str, has_metadata: bool) -> None:
    """Refuse, in one line before the first rollout, a reward that reads prompt metadata when the
    prompt source ``spec`` (``data.prompts``) has none."""
    wanting = [name for name, fn in rewards.items() if wants_metadata(fn)]
    if wanting and not has_metadata:
        from flowgrpo.errors import UserError

        raise UserError(f"reward {wanting[0]!r} reads each prompt's metadata, and data.prompts={spec!r} gives none: "
                        "use a .jsonl prompt file whose lines carry it (for geneval: GenEval's evaluation_metadata.jsonl)")
