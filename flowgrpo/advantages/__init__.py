"""Advantage estimators: leaf rewards -> per-transition advantages (the credit-assignment stage).

An estimator sees the rollout (its forest structure and groups) and the rewards of its leaves, and
returns an :class:`AdvantageResult`: one advantage per edge at every depth plus a mask of the
leaves that carry signal. ``advantage.estimator`` names one of :data:`ESTIMATORS`:

* ``group_zscore`` -- chains (Flow-GRPO, DanceGRPO, MixGRPO): :mod:`.group`;
* ``branch_grpo``, ``tempflow``, ``g2rpo`` -- trees (BranchGRPO and Dynamic-TreeRPO, TempFlow-GRPO,
  G2RPO): :mod:`.trees`.
"""

from __future__ import annotations

import inspect

from ..errors import UserError
from ..registry import PluginError, Registry, describe, signature_problem
from .group import AdvantageResult, combine_rewards, group_zscore, valid_reward_mask

CONTRACT = "an estimator is a function (rollout, rewards, cfg_adv, cfg_reward) -> AdvantageResult"


def estimator_plugin(path: str, obj):
    """The ``ESTIMATORS`` hook for ``advantage.estimator=package.module:attr``: a function (or callable
    object, not a class) ``(rollout, rewards, cfg_adv, cfg_reward) -> AdvantageResult`` whose result
    type is checked on every call."""
    if inspect.isclass(obj) or not callable(obj):
        raise PluginError(f"{describe(obj)} is not a function; {CONTRACT}")
    bad = signature_problem(obj, None, None, None, None)
    if bad:
        raise PluginError(f"{describe(obj)} {bad}; {CONTRACT}")

    def estimate(rollout, rewards, cfg_adv, cfg_reward) -> AdvantageResult:
        out = obj(rollout, rewards, cfg_adv, cfg_reward)
        if not isinstance(out, AdvantageResult):
            raise UserError(f"advantage estimator {path!r} returned {describe(out)}, not an AdvantageResult")
        return out

    return estimate


#: name -> ``(rollout, rewards, cfg_adv, cfg_reward) -> AdvantageResult``; also an import path
ESTIMATORS: Registry = Registry("advantage estimator", plugin=estimator_plugin)
ESTIMATORS.register_lazy("group_zscore", "flowgrpo.advantages.group:group_zscore_estimator")
ESTIMATORS.register_lazy("branch_grpo", "flowgrpo.advantages.trees:branch_grpo_estimator")
ESTIMATORS.register_lazy("tempflow", "flowgrpo.advantages.trees:tempflow_estimator")
ESTIMATORS.register_lazy("g2rpo", "flowgrpo.advantages.trees:g2rpo_estimator")


def estimate_advantages(name: str, rollout, rewards, cfg_adv, cfg_reward) -> AdvantageResult:
    """Run the estimator ``name`` on a rollout's leaf rewards ({reward name: [L]})."""
    return ESTIMATORS.get(name)(rollout, rewards, cfg_adv, cfg_reward)


__all__ = ["ESTIMATORS", "AdvantageResult", "combine_rewards", "estimate_advantages", "group_zscore",
           "valid_reward_mask"]
