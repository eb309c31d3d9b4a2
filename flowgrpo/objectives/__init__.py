"""Training objectives (``loss.objective``): the update stage's loss, one module each.

* ``grpo`` -- clipped likelihood ratios on SDE transitions (:mod:`.grpo`, every GRPO variant);
* ``nft`` -- DiffusionNFT, negative-aware fine-tuning on the forward process (:mod:`.nft`);
* ``awm`` -- Advantage Weighted Matching, a PPO clip on the flow-matching loss (:mod:`.awm`);
* ``dgpo`` -- Direct Group Preference Optimization, a group-level DPO (:mod:`.dgpo`).

:mod:`.base` defines the protocol every objective implements; :mod:`flowgrpo.trainer.update_loop`
runs it. Options of the forward-process objectives are typed dataclasses in :mod:`.options`
(``loss.nft.*``, ``loss.awm.*``, ``loss.dgpo.*``).
"""

from __future__ import annotations

from ..registry import Registry
from .base import Collected, Credit, MicroLoss, Objective, UpdateContext

#: name -> factory ``(run_cfg, device) -> Objective``
OBJECTIVES: Registry = Registry("objective")
OBJECTIVES.register_lazy("grpo", "flowgrpo.objectives.grpo:build_grpo")
OBJECTIVES.register_lazy("nft", "flowgrpo.objectives.nft:build_nft")
OBJECTIVES.register_lazy("awm", "flowgrpo.objectives.awm:build_awm")
OBJECTIVES.register_lazy("dgpo", "flowgrpo.objectives.dgpo:build_dgpo")


def build_objective(cfg, device=None) -> Objective:
    """The objective ``cfg.loss.objective`` of a :class:`~flowgrpo.config.RunConfig`."""
    return OBJECTIVES.build(cfg.loss.objective, cfg, device)


__all__ = ["OBJECTIVES", "Collected", "Credit", "MicroLoss", "Objective", "UpdateContext", "build_objective"]
