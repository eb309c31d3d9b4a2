"""The table of sampling strategies (``sampler.strategy``): name -> class, imported on first use.

Each strategy is a :class:`~flowgrpo.samplers.strategy_base.Strategy` that turns the iteration number
into a :class:`~flowgrpo.samplers.plan.SamplingPlan` (which steps are SDE or ODE, trained,
branched, on which grid); its options are the dataclass
``<Strategy>.Options``.

* chains (:mod:`.chains`): ``flow_grpo``, ``dance_grpo``, ``mix_grpo``, ``mix_grpo_flash``,
  ``mix_grpo_flash_star``, and ``ode`` (no SDE step: rollouts of the forward-process objectives);
* trees with shared prefixes (:mod:`.trees`): ``branch_grpo``, ``branch_grpo_mix``, ``tree_rpo``;
* branch points on an ODE main chain (:mod:`.branch_points`): ``tempflow_grpo``, ``g2rpo``.

A config may also name a strategy of user code by import path (:func:`strategy_plugin`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

from torch import Tensor

from flowgrpo.registry import PluginError, Registry, describe, signature_problem

from .strategy_base import Strategy, StrategyOptions

CONTRACT = ("a strategy is a Strategy subclass (flowgrpo.samplers.Strategy) built as cls(sampler_cfg, options, grid), "
            "with its options dataclass as Options (a StrategyOptions subclass)")


def strategy_plugin(path: str, obj) -> type[Strategy]:
    """The ``STRATEGIES`` hook for ``sampler.strategy=package.module:attr``: a :class:`Strategy` subclass
    implementing ``plan``, whose ``Options`` is a :class:`StrategyOptions` dataclass."""
    if not (inspect.isclass(obj) and issubclass(obj, Strategy)):
        raise PluginError(f"{describe(obj)} is not a subclass of flowgrpo.samplers.Strategy; {CONTRACT}")
    if inspect.isabstract(obj):
        raise PluginError(f"{describe(obj)} does not implement {', '.join(sorted(obj.__abstractmethods__))}; {CONTRACT}")
    opts = getattr(obj, "Options", None)
    if not (inspect.isclass(opts) and issubclass(opts, StrategyOptions) and dataclasses.is_dataclass(opts)):
        raise PluginError(f"{describe(obj)}.Options is {describe(opts)}, not a StrategyOptions dataclass; {CONTRACT}")
    bad = signature_problem(obj, None, None, None)
    if bad:
        raise PluginError(f"{describe(obj)} {bad}; {CONTRACT}")
    return obj


STRATEGIES: Registry = Registry("sampling strategy", plugin=strategy_plugin)
for _name, _target in (
    ("flow_grpo", "chains:FlowGRPOStrategy"),
    ("dance_grpo", "chains:DanceGRPOStrategy"),
    ("mix_grpo", "chains:MixGRPOStrategy"),
    ("mix_grpo_flash", "chains:MixGRPOFlashStrategy"),
    ("mix_grpo_flash_star", "chains:MixGRPOFlashStarStrategy"),
    ("ode", "chains:ODEStrategy"),
    ("branch_grpo", "trees:BranchGRPOStrategy"),
    ("branch_grpo_mix", "trees:BranchGRPOMixStrategy"),
    ("tree_rpo", "trees:DynamicTreeRPOStrategy"),
    ("tempflow_grpo", "branch_points:TempFlowGRPOStrategy"),
    ("g2rpo", "branch_points:G2RPOStrategy"),
):
    STRATEGIES.register_lazy(_name, f"flowgrpo.samplers.{_target}")


def build_strategy(sampler_cfg, options: dict | None = None, grid: Callable[[int], Tensor] | None = None) -> Strategy:
    """The strategy named by ``sampler_cfg.strategy`` with ``options`` (unknown names list the valid ones)."""
    return STRATEGIES.build(sampler_cfg.strategy, sampler_cfg, options, grid)


def options_class(name: str) -> type[StrategyOptions]:
    """The options dataclass of strategy ``name`` (for help screens and validation)."""
    return STRATEGIES.get(name).Options


__all__ = ["STRATEGIES", "Strategy", "StrategyOptions", "build_strategy", "options_class"]
