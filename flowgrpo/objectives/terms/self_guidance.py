"""Self-guidance distillation: pull the conditional velocity toward the old policy's guided one.

Why: on the shapes world an RL-trained policy sampled with classifier-free guidance keeps its
accuracy and ties (A and B on one line) far less (seed 6 after 15 minutes: relation holds 0.82 at
guidance 1, 0.90 at 2): RL trains the conditional prediction and never the empty prompt. The world
samples at guidance 1. This term moves that gain into the
guidance-1 policy, as guidance distillation does for a fixed teacher, with the old policy (the
objective's lagging copy) as the teacher: for a row at time t with the trained conditional velocity
v, the old policy's conditional and unconditional velocities v_o, v_o^u and scale g,

    T = v_o^u + g (v_o - v_o^u) = v_o + (g - 1)(v_o - v_o^u),
    L = self_guidance_beta * mean_D((v - sg[T])^2)        on rows with t >= policy_min_t.

At theta = old its gradient pushes v along the guidance direction v_o - v_o^u by (g - 1) of it.
Since the old policy follows the trained weights, the push compounds; the KL to the base model
(weight kl_beta) is what stops it. Near the fixed point, with the trained and old velocities equal,
b (g - 1)(v - v^u) = kl_beta (v - v_ref), so v - v_ref = a / (1 - a) (v_ref - v^u) with
a = b (g - 1) / kl_beta: the policy settles at about guidance 1 / (1 - a) of the base's direction
when a < 1 and runs away when a >= 1 (refused by the options' validation). The analysis takes the
unconditional velocity as fixed; under full fine-tuning it moves with the shared weights (measured on
the shapes world: the gap grew sixfold in 40 minutes and fidelity fell, docs/shapes_world.md). With
``self_guidance_uncond = "base"`` the unconditional velocity comes from the frozen base model instead
(v_o^u -> v_ref^u, one more reference pass per row), which is the fixed unconditional the analysis
assumes: T = v_o + (g - 1)(v_o - v_ref^u) is then what the old policy draws at guidance g beside the
base's empty-prompt prediction. Low-noise rows (t < policy_min_t) keep their anchor only: guidance
there changes fine detail, not the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from ...fields import help_field as _f
from ..forward_rows import per_row_mean
from .base import LossTerm


@dataclass
class SelfGuidanceOptions:
    self_guidance_beta: float = _f(0.0, "weight b of the self-guidance term b * mean((v - sg[v_old_u + g (v_old - v_old_u)])^2) on policy rows (t >= policy_min_t): distils the old policy's classifier-free guidance at scale g into the guidance-1 policy (flowgrpo.objectives.terms.self_guidance); needs b (g - 1) < kl_beta, else the policy runs away (0: off)", ge=0.0)
    self_guidance_scale: float = _f(2.0, "g of the self-guidance target (> 1)", gt=1.0)
    self_guidance_uncond: Literal["old", "base"] = _f("old", "whose empty-prompt velocity v_u the self-guidance target uses: old (the old policy's, which full fine-tuning moves with the shared weights) | base (the frozen base model's: a fixed guidance origin, one more reference pass per row)")


def self_guidance_target(v_old: Tensor, v_old_uncond: Tensor, scale: float) -> Tensor:
    """T = v_u + g (v - v_u) [R, ...] from the old policy's conditional and unconditional velocities [R, ...]."""
    return v_old_uncond + scale * (v_old - v_old_uncond)


class SelfGuidance(LossTerm):
    """``self_guidance_beta * mean((v - sg[T])^2)`` per row on rows at t >= ``min_t`` (module docstring)."""

    name = "self_guidance"
    Options = SelfGuidanceOptions

    def __init__(self, opt: SelfGuidanceOptions, min_t: float = 0.0):
        super().__init__(opt)
        self.min_t = min_t

    @property
    def active(self) -> bool:
        return self.opt.self_guidance_beta > 0

    @property
    def references(self) -> frozenset[str]:
        return frozenset({"base"}) if self.active and self.opt.self_guidance_uncond == "base" else frozenset()

    def value(self, v: Tensor, v_old: Tensor, v_old_uncond: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """(b * gap on the rows at t >= min_t, 0 elsewhere; gap = mean_D((v - T)^2)), both [R], for the
        trained conditional velocities v [R, ...] (with gradient), the old policy's conditional ones
        [R, ...], the unconditional ones [R, ...] (the old policy's or the base's, by
        ``self_guidance_uncond``) and the rows' times t [R]."""
        target = self_guidance_target(v_old.detach(), v_old_uncond.detach(), self.opt.self_guidance_scale)
        gap = per_row_mean((v - target) ** 2)
        rows = (t.to(gap.device) >= self.min_t).to(gap.dtype)
        return self.opt.self_guidance_beta * gap * rows, gap.detach()
