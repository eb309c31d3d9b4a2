"""KL terms: the trained policy's divergence from a reference model.

* :class:`VelocityKL`, the forward-process objectives' (nft, awm, dgpo) KL in velocity space:
  for a row at time t with the trained velocity v and the reference's v_ref,

      KL = mean_D((v - v_ref)^2)    [optionally / (2 sigma_t^2), sigma_t = a sqrt(t / (1 - t))],

  the KL of the Flow-GRPO SDE's one-step Gaussians up to the factor 1 / (2 sigma_t^2) dt, which
  AWM's ELBO option keeps (``kl_sigma_weighting``, noise level a = ``kl_noise_level``). The reference
  is the frozen base model, or (``reference="ema"``) a lagging copy of the trained weights (AWM's
  second KL).

The KL itself is :func:`flowgrpo.ops.kl.mean_kl`, the one KL of the non-fused paths: here without a
std (the velocity KL), in Flow-DPPO's trust region and reference KL with the transition std, and in
GRPO's reference op (``loss.grpo.kl_beta``) with sigma_t or the transition std; the fused op
computes the same in its kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...fields import help_field as _f
from ...ops.kl import mean_kl
from .base import LossTerm


@dataclass
class KLOptions:
    kl_beta: float = _f(1e-3, "weight of the KL term mean((v - v_ref)^2) against the frozen base model (0: no reference pass)", ge=0.0)
    kl_sigma_weighting: bool = _f(False, "divide the KL term by 2 sigma_t^2, sigma_t = kl_noise_level sqrt(t / (1 - min(t, 0.99))) (AWM's ELBO option)")
    kl_noise_level: float = _f(0.7, "a of sigma_t in the KL's optional 1 / (2 sigma_t^2) (the Flow-GRPO SDE's noise level; the authors of AWM: 0.7)", gt=0.0)


def kl_sigma_factor(t: Tensor, noise_level: float) -> Tensor:
    """1 / (2 sigma_t^2) [R] with sigma_t = a sqrt(t / (1 - min(t, 0.99))), t [R] floored at 1e-4."""
    t = t.clamp(min=1e-4)
    return 1.0 / (2 * noise_level**2 * t / (1 - t.clamp(max=0.99)))


def velocity_kl(v: Tensor, v_ref: Tensor, t: Tensor | None = None, noise_level: float | None = None) -> Tensor:
    """mean_D((v - v_ref)^2) per row [R] of velocities [R, ...]; divided by 2 sigma_t^2 when
    ``noise_level`` is given (t [R] then the rows' times)."""
    kl = mean_kl(v, v_ref)
    return kl if noise_level is None else kl * kl_sigma_factor(t.to(kl.device), noise_level)


class VelocityKL(LossTerm):
    """``kl_beta * KL`` per row to the base model (or to the EMA, ``reference="ema"``)."""

    name = "kl"
    Options = KLOptions

    def __init__(self, opt: KLOptions, reference: str = "base"):
        super().__init__(opt)
        self.reference = reference

    @property
    def active(self) -> bool:
        return self.opt.kl_beta > 0

    @property
    def references(self) -> frozenset[str]:
        return frozenset({self.reference}) if self.active else frozenset()

    def value(self, v: Tensor, v_ref: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """(kl_beta * KL, KL), both [R], for the trained velocities v [R, ...] (with gradient), the
        reference's v_ref [R, ...] and the rows' times t [R]."""
        level = self.opt.kl_noise_level if self.opt.kl_sigma_weighting else None
        kl = velocity_kl(v, v_ref.detach(), t, level)
        return self.opt.kl_beta * kl, kl
