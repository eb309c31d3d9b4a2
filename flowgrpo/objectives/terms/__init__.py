"""Loss terms the objectives compose (:mod:`.base` defines the interface).

* :mod:`.kl` -- :class:`~.kl.VelocityKL` (nft, awm, dgpo; to the base model or an EMA) and the exact
  transition-Gaussian KL (flow_dppo);
* :mod:`.anchor` -- :class:`~.anchor.ODEAnchor` (grpo's ``loss.grpo.anchor_beta``) and
  :class:`~.anchor.LowNoiseAnchor` (nft's ``policy_min_t``);
* :mod:`.norm_guard` -- :class:`~.norm_guard.NormGuard`, the velocity-norm hinge to the base model
  (nft, awm, dgpo, crd: ``norm_guard_beta``);
* :mod:`.sft` -- :class:`~.sft.BestPathSFT` (grpo's ``loss.grpo.sft_beta``);
* :mod:`.step_weights` -- :class:`~.step_weights.StepWeights` (GRPO-Guard and TempFlow per-step weights);
* :mod:`.clip_schedule` -- :class:`~.clip_schedule.ClipSchedule` (fixed or reward-adaptive clip).

Each term's options dataclass holds the help of its keys; an objective's options declare them with
:func:`~.base.term_field`, so a key reads the same wherever it appears.
"""

from .base import LossTerm, Reference, term_field

__all__ = ["LossTerm", "Reference", "term_field"]
