"""The strategy interface: a method's sampling plan per iteration, with typed, validated options.

A strategy turns the outer iteration number into a :class:`~flowgrpo.samplers.plan.SamplingPlan`.
Its options (``RunConfig.strategy``, set as ``strategy.<name>=...``) are a dataclass, a subclass of
:class:`StrategyOptions` with a help string on every field; keys and types are checked by the same
code as the run configuration (:func:`flowgrpo.fields.merge_into`) and ranges by
:meth:`StrategyOptions.check`, which knows the number of steps T.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from flowgrpo.errors import ConfigError
from flowgrpo.fields import help_field, merge_into

from .plan import SamplingPlan, StepSpec
from .schedule import sigma_grid


@dataclass
class StrategyOptions:
    """Base of per-strategy options (a strategy without options uses it as is)."""

    def check(self, num_steps: int) -> None:
        """Range checks that need T = ``num_steps``; raise ConfigError naming the option."""


@dataclass
class WindowOptions(StrategyOptions):
    """A sliding SDE window: ``window`` steps starting at ``start``, moved by ``stride`` every
    ``shift_every`` iterations (MixGRPO's progressive window; Dynamic-TreeRPO's tree window)."""

    window: int = help_field(4, "SDE window width w (steps)")
    start: int = help_field(0, "first window position")
    shift_every: int = help_field(25, "iterations between window moves tau")
    stride: int = help_field(1, "steps the window moves each time")

    def check(self, num_steps: int) -> None:
        check_int(self.window, "window", 1, num_steps)
        check_int(self.start, "start", 0, num_steps - self.window)
        check_int(self.stride, "stride", 1)


def check_int(value, key: str, lo: int, hi: int | None = None) -> int:
    """``value`` must be an int in lo..hi (hi None: no upper bound)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ConfigError(f"strategy option '{key}' must be an integer {rng}, got {value!r}")
    return value


def check_float(value, key: str, lo: float = 0.0, hi: float | None = None, open_lo: bool = False) -> float:
    """``value`` must be a number >= lo (> lo when ``open_lo``) and <= hi."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > lo if open_lo else value >= lo) and (hi is None or value <= hi)
    if not ok:
        raise ConfigError(f"strategy option '{key}' must be a number {'>' if open_lo else '>='} {lo}"
                          f"{'' if hi is None else f' and <= {hi}'}, got {value!r}")
    return float(value)


def check_steps(value, key: str, num_steps: int) -> list[int]:
    """A non-empty sorted list of distinct steps in 0..T-1 (a single int is a one-element list)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"strategy option '{key}' must be a list of integers, got {value!r}")
    steps = sorted(set(int(v) for v in value))
    if not steps or steps[0] < 0 or steps[-1] > num_steps - 1:
        raise ConfigError(f"strategy option '{key}' must be non-empty steps in 0..{num_steps - 1}, got {value!r}")
    return steps


def ode(**kw) -> StepSpec:
    """An Euler ODE step spec."""
    return StepSpec(sde=False, solver="euler", **kw)


def sliding_start(iteration: int, start: int, every: int, stride: int, last: int) -> int:
    """A progressive window's first step: ``start`` moved by ``stride`` every ``every`` iterations
    (0 = frozen), clamped to ``last``."""
    if every <= 0:
        return min(start, last)
    return min(start + (iteration // every) * stride, last)


def parse_options(options_cls: type[StrategyOptions], options: dict | None, num_steps: int) -> StrategyOptions:
    """``options`` (a dict of ``strategy.*`` values) as a checked ``options_cls`` instance."""
    parsed = options_cls()
    merge_into(parsed, dict(options or {}), "strategy.")
    parsed.check(num_steps)
    return parsed


@dataclass(frozen=True)
class Pruning:
    """Backward-only pruning of one iteration (:meth:`Strategy.pruning`); None means nothing is pruned.

    ``edges``: per depth, ``[N_d]`` bool masks of the edges that enter the backward pass (None at a
    depth, or for the whole list, where every edge stays). ``leaves``: ``[L]`` bool, the leaves
    whose clean samples may train: the leaf-level view of the same decision (depth pruning removes
    steps, not leaves, so only width pruning appears here)."""

    edges: list | None = None
    leaves: Tensor | None = None


class Strategy(ABC):
    """Base class: subclasses set ``Options`` (a :class:`StrategyOptions` dataclass) and :meth:`plan`.

    Args:
        sampler_cfg: the run's ``SamplerConfig`` (steps T, noise level, SDE kind, shift).
        options: the strategy's option values (a dict; missing keys keep the dataclass defaults).
        grid: ``num_steps -> sigmas [T + 1]``, a model's own sigma grid (None: the shifted uniform
            grid :func:`~flowgrpo.samplers.schedule.sigma_grid` with ``sampler.shift``).
    """

    Options: type[StrategyOptions] = StrategyOptions

    def __init__(self, sampler_cfg, options: dict | None = None, grid: Callable[[int], Tensor] | None = None):
        self.cfg = sampler_cfg
        self.options = parse_options(self.Options, options, sampler_cfg.num_steps)
        self._grid = grid

    @property
    def custom_grid(self) -> bool:
        """Whether the grid is a model's own rather than :func:`~flowgrpo.samplers.schedule.sigma_grid`."""
        return self._grid is not None

    def sigmas(self) -> Tensor:
        """The sigma grid [T + 1] of a T-step rollout, 1 -> 0."""
        if self._grid is not None:
            return self._grid(self.cfg.num_steps)
        return sigma_grid(self.cfg.num_steps, self.cfg.shift)

    def sde(self, **kw) -> StepSpec:
        """An SDE step spec with the run's noise level, SDE kind and log-prob convention."""
        kw.setdefault("noise_level", self.cfg.noise_level)
        kw.setdefault("sde_kind", self.cfg.sde_kind)
        log_prob = self.cfg.cps_log_prob if kw["sde_kind"] == "cps" else "gaussian"
        return StepSpec(sde=True, log_prob=log_prob, **kw)

    @abstractmethod
    def plan(self, iteration: int) -> SamplingPlan:
        """The sampling plan for outer iteration ``iteration`` (0-based)."""

    def pruning(self, rollout, advantages, iteration: int) -> Pruning:
        """What this strategy leaves out of iteration ``iteration``'s update, decided once: the edges
        (for the per-step losses) and the leaves (for the forward-process objectives, which train on
        clean samples instead of transitions). The default prunes nothing.

        Pruning strategies (BranchGRPO) override this; the rollout and its rewards are untouched."""
        return Pruning()

    def option_values(self) -> dict:
        """The options as a plain dict (for logs)."""
        return dataclasses.asdict(self.options)
