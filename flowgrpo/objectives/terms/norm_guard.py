"""NormGuard: a hinge on the trained velocity's norm where it grows past the base model's.

Why: RL fine-tuning of a flow model tends to inflate the per-step velocity norm ||v_theta|| over the
base model's (the NormGuard paper, arXiv 2606.27771, reports 5-15 % after NFT, AWM and DPO, with a
loss of perceptual quality the reward does not see). The term penalises only that excess and is
zero while the trained norm stays at or below the reference's, so it adds to any objective whose
loss is local in the velocity (nft, awm, dgpo, crd). For a row with the trained velocity v [D] and
the frozen base model's v_ref [D] at the same input, time and guidance,

    L_row = norm_guard_beta * max(0, ||v||_2 / ||sg(v_ref)||_2 - 1 - norm_guard_margin),

the norms taken over every latent element of the sample. Its gradient, where active, is
beta v / (||v|| ||v_ref||): a radial shrink of v that leaves its direction alone.

What could not be checked: only the paper's abstract was reachable (no code is published that we
could find). The abstract says "a hinge penalty that activates only when ||v_theta|| exceeds
||v_ref||, and composes additively with any velocity-local base loss"; the exact form (relative or
absolute excess, linear or squared, a margin) and the paper's default weight are this module's
choices, not the paper's: a linear hinge on the relative excess (dimension-free, so one weight serves
every latent size), off by default (weight 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...fields import help_field as _f
from .base import LossTerm


@dataclass
class NormGuardOptions:
    norm_guard_beta: float = _f(0.0, "weight of the NormGuard hinge beta * max(0, ||v|| / ||v_ref|| - 1 - margin) per row, v_ref the frozen base model's velocity (flowgrpo.objectives.terms.norm_guard; arXiv 2606.27771, whose exact form and default could not be checked: 0 = off)", ge=0.0)
    norm_guard_margin: float = _f(0.0, "relative excess of ||v|| over ||v_ref|| the NormGuard hinge allows before it acts (0: any excess)", ge=0.0)


def velocity_norm_ratio(v: Tensor, v_ref: Tensor) -> Tensor:
    """||v|| / ||v_ref|| per row [R] of velocities [R, ...] (norms over every non-batch element; the
    reference norm floored at 1e-12 so a zero reference gives a finite ratio)."""
    norm = v.flatten(1).norm(dim=1)
    ref = v_ref.detach().flatten(1).norm(dim=1).clamp(min=1e-12)
    return norm / ref


class NormGuard(LossTerm):
    """``norm_guard_beta * max(0, ||v|| / ||v_ref|| - 1 - margin)`` per row (module docstring)."""

    name = "norm_guard"
    Options = NormGuardOptions

    @property
    def active(self) -> bool:
        return self.opt.norm_guard_beta > 0

    @property
    def references(self) -> frozenset[str]:
        return frozenset({"base"}) if self.active else frozenset()

    def value(self, v: Tensor, v_ref: Tensor) -> tuple[Tensor, Tensor]:
        """(the weighted hinge [R], the norm ratio ||v|| / ||v_ref|| [R], detached) for the trained
        velocities v [R, ...] (with gradient) and the base model's v_ref [R, ...] at the same inputs."""
        ratio = velocity_norm_ratio(v, v_ref)
        hinge = torch.relu(ratio - 1.0 - self.opt.norm_guard_margin)
        return self.opt.norm_guard_beta * hinge, ratio.detach()
