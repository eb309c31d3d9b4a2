"""Training objectives (``loss.objective``): the update stage's loss, one module each.

* ``grpo`` -- clipped likelihood ratios on SDE transitions (:mod:`.grpo`, every GRPO variant);
* ``nft`` -- DiffusionNFT, negative-aware fine-tuning on the forward process (:mod:`.nft`);
* ``awm`` -- Advantage Weighted Matching, a PPO clip on the flow-matching loss (:mod:`.awm`);
* ``dgpo`` -- Direct Group Preference Optimization, a group-level DPO (:mod:`.dgpo`);
* ``flow_dppo`` -- Flow-DPPO, GRPO's rows with an exact-KL trust region instead of the clip (:mod:`.flow_dppo`);
* ``diffusion_dpo`` -- Diffusion-DPO on preference pairs, online from the rollout or from a file (:mod:`.diffusion_dpo`).

:mod:`.base` defines the protocol every objective implements; :mod:`flowgrpo.trainer.update_loop`
runs it. A config may name an objective of user code by import path,
``loss.objective=my_pkg.obj:MyObjective`` (:func:`objective_plugin`). Options of the forward-process objectives are typed dataclasses in :mod:`.options`
(``loss.nft.*``, ``loss.awm.*``, ``loss.dgpo.*``).
"""

from __future__ import annotations

import inspect

from ..errors import UserError
from ..registry import PluginError, Registry, describe, signature_problem
from .base import Collected, Credit, MicroLoss, Objective, UpdateContext

CONTRACT = ("an objective is an Objective subclass (flowgrpo.objectives.Objective) built as cls(cfg, device), "
            "cls(cfg) or cls(), or a function (cfg, device) -> Objective")


def objective_plugin(path: str, obj):
    """The ``OBJECTIVES`` hook for ``loss.objective=package.module:attr``: an :class:`Objective`
    subclass implementing :meth:`~Objective.rows` and :meth:`~Objective.micro_loss`, constructed as
    ``cls(cfg, device)`` (or ``cls(cfg)``, or ``cls()`` where it takes no arguments), or a factory function
    ``(cfg, device) -> Objective`` whose result is checked when it is built."""
    if inspect.isclass(obj):
        if not issubclass(obj, Objective):
            raise PluginError(f"{describe(obj)} is not a subclass of flowgrpo.objectives.Objective; {CONTRACT}")
        if inspect.isabstract(obj):
            missing = ", ".join(sorted(obj.__abstractmethods__))
            raise PluginError(f"{describe(obj)} does not implement {missing}; {CONTRACT}")
        if signature_problem(obj, None, None) is None:
            return obj
        if signature_problem(obj, None) is None:
            return lambda cfg, device=None: obj(cfg)
        bad = signature_problem(obj)
        if bad:
            raise PluginError(f"{describe(obj)} {bad}; {CONTRACT}")
        return lambda cfg, device=None: obj()
    bad = signature_problem(obj, None, None) if callable(obj) else "is not callable"
    if bad:
        raise PluginError(f"{describe(obj)} {bad}; {CONTRACT}")

    def build(cfg, device=None) -> Objective:
        made = obj(cfg, device)
        if not isinstance(made, Objective):
            raise UserError(f"objective {path!r} returned {describe(made)}, not a flowgrpo.objectives.Objective")
        return made

    return build


#: name -> factory ``(run_cfg, device) -> Objective``; ``loss.objective`` may also be an import path
OBJECTIVES: Registry = Registry("objective", plugin=objective_plugin)
OBJECTIVES.register_lazy("grpo", "flowgrpo.objectives.grpo:build_grpo")
OBJECTIVES.register_lazy("nft", "flowgrpo.objectives.nft:build_nft")
OBJECTIVES.register_lazy("awm", "flowgrpo.objectives.awm:build_awm")
OBJECTIVES.register_lazy("dgpo", "flowgrpo.objectives.dgpo:build_dgpo")
OBJECTIVES.register_lazy("flow_dppo", "flowgrpo.objectives.flow_dppo:build_flow_dppo")
OBJECTIVES.register_lazy("diffusion_dpo", "flowgrpo.objectives.diffusion_dpo:build_diffusion_dpo")


def build_objective(cfg, device=None) -> Objective:
    """The objective ``cfg.loss.objective`` of a :class:`~flowgrpo.config.RunConfig`."""
    return OBJECTIVES.build(cfg.loss.objective, cfg, device)


__all__ = ["OBJECTIVES", "Collected", "Credit", "MicroLoss", "Objective", "UpdateContext", "build_objective"]
