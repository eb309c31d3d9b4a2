"""The loss-term interface: what every regulariser, weight and schedule an objective composes offers.

A term is one concept of the loss that several objectives may share (a KL to a reference, an anchor
to the base model, an SFT pull, per-step weights, a clip schedule). It has

* an options dataclass (:attr:`LossTerm.Options`) with a help string on every field: the field
  names are the config keys, so an objective's options (or ``LossConfig`` for GRPO's flat keys)
  declare them with :func:`term_field`, which copies the term's help, range and default;
* :attr:`LossTerm.active`: whether its options switch it on (an inactive term costs nothing);
* :attr:`LossTerm.references`: the models it evaluates besides the trained one (``"base"``, the
  frozen base model; ``"ema"``, a lagging copy of the trained weights), so an objective knows
  whether it needs the reference pass;
* ``value(...)``: the term itself, with the operands its own docstring names (they differ by term:
  a KL reads two velocities, a clip schedule reads the iteration's rewards).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

from ...fields import help_field

#: a model a term evaluates besides the trained weights
Reference = Literal["base", "ema"]


class LossTerm(ABC):
    """One loss term with its options (``self.opt``, an instance of :attr:`Options`)."""

    #: short name, used in metric names and errors
    name: ClassVar[str]
    #: the options dataclass; its field names are the config keys that set the term
    Options: ClassVar[type]

    def __init__(self, opt: Any):
        self.opt = opt

    @classmethod
    def from_config(cls, cfg: Any, **kwargs: Any) -> "LossTerm":
        """The term set by ``cfg``'s fields of the same names as :attr:`Options`' (``cfg``: an objective's
        options or ``LossConfig``); a field ``cfg`` does not have keeps the term's default (the host
        does not expose that option). ``kwargs`` go to the constructor."""
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls.Options) if hasattr(cfg, f.name)}
        return cls(cls.Options(**values), **kwargs)

    @property
    @abstractmethod
    def active(self) -> bool:
        """Whether the options switch the term on."""

    @property
    def references(self) -> frozenset[str]:
        """The models (:data:`Reference`) the active term evaluates besides the trained weights."""
        return frozenset()

    @abstractmethod
    def value(self, *args: Any, **kwargs: Any) -> Any:
        """The term (operands and result as the subclass documents)."""


def term_field(options: type, name: str, default: Any = dataclasses.MISSING, note: str = "") -> Any:
    """A dataclass field declaring the term option ``name`` of ``options`` in a host dataclass:
    the term's help (with ``note`` appended, e.g. the authors' value for this objective), its range,
    and its default unless ``default`` is given."""
    src = {f.name: f for f in dataclasses.fields(options)}[name]
    value = src.default if default is dataclasses.MISSING else default
    text = src.metadata["help"] + (f" ({note})" if note else "")
    return help_field(value, text, **src.metadata.get("range", {}))
