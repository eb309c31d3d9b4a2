"""``loss.objective=flow_dppo``: Flow-DPPO (Ping et al., arXiv 2606.11025), a divergence trust region
on the rollout's SDE transitions instead of ratio clipping.

Rows, rollouts and advantages are Flow-GRPO's (:mod:`.grpo`): the trained SDE transitions of the
credit stage, each with the log-probability logp_old and the Gaussian mean mu_old stored at rollout
time. Both the rollout and the trained policy's step are Gaussians with the same std s (s depends on
the step's noise levels, not on the weights), so the divergence between them is exact in closed form:

    KL(pi_old || pi_theta) = ||mu_theta - mu_old||^2 / (2 s^2)        (a sum over the D latent elements).

As the authors' code, the trust region reads the **per-element mean** of it, kl = mean_D((mu_theta -
mu_old)^2) / (2 s^2) = KL / D, so the threshold tau (default 1e-5) is in those units. A row is dropped
from the surrogate when it has left the trust region *in the direction its advantage pushes*:

    drop = (kl >= tau) and ((r > 1 and A > 0) or (r < 1 and A < 0)),      r = exp(logp_theta - logp_old),
    L = mean_rows( w * (-A r) * [not drop] ) + kl_beta * mean_rows( mean_D((mu_theta - mu_ref)^2) / (2 s^2) ).

A row that moved far but back toward the old policy (A > 0 with r < 1, or A < 0 with r > 1) keeps its
gradient; rows inside the region keep the unclipped -A r whatever r is. The mean runs over every row,
dropped ones included (they contribute 0). The old means and log-probs are the rollout's, fixed for
every inner epoch and minibatch of the iteration. ``kl_coefficient=false`` divides by 1 instead of
s^2 (the authors' ``add_kl_coefficient``).

``kl_norm`` picks the s the trust region divides by. ``authors`` (default) is the authors' normaliser
(UniRL ``FlowDPPO._compute_sigma_t``): s_A = a sqrt(sigma / (1 - min(sigma, 0.99))) sqrt(sigma - sigma'),
on Flow-GRPO steps (other step kinds keep their own std). It equals the transition's std wherever
sigma <= 0.99, but not at sigma = 1, where their SDE (and flowgrpo's, ``samplers/sde.py``) evaluates
sigma / (1 - sigma) at the grid's second point sigma_1 while the normaliser clamps at 0.99: there the
exact KL is 100 (1 - sigma_1) times the authors' (10x at shift 1, sigma_1 = 0.9; 3.57x at shift 3 on 10
steps, sigma_1 = 27/28), and on (0.99, 1) it is (1 - sigma) / 0.01 times it. ``exact`` divides by the
transition's own s^2, the KL of the two Gaussians the step draws from. Per-row weights w are GRPO's terms under this objective's
own keys (``loss.flow_dppo.tempflow_weight``, ``loss.flow_dppo.guard_reweight``; 1 otherwise). GRPO's
clip, KL (``loss.grpo.kl_beta``), SFT and anchor terms are not part of this objective. Its own
reference KL (``kl_beta``, 0 by default: none) is flowgrpo's addition, not the authors' (their
Flow-DPPO has no reference model); it is the exact Gaussian KL with the transition std, whatever
``kl_norm``.

Works with every SDE kind (``flow_grpo``, ``dance``, ``cps``): the means come from the step kind's own
math (:func:`~flowgrpo.samplers.recompute.transition_means`) and s is the transition's std.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..fields import help_field as _f
from ..ops import GRPOLossOutput
from ..ops.kl import mean_kl
from ..samplers.recompute import transition_means
from ..samplers.steps import gaussian_log_prob
from .base import MicroLoss, UpdateContext
from .grpo import GRPOObjective
from .grpo_stats import UpdateStatsCollector
from .lora_fold import lora_folded
from .terms.base import term_field
from .terms.step_weights import StepWeightOptions


@dataclass
class FlowDPPOOptions:
    """``loss.flow_dppo.*`` (defaults: the authors' SD3.5 recipe)."""

    kl_threshold: float = _f(1e-5, "tau: a row whose divergence from the rollout policy, mean_D((mu - mu_old)^2) / (2 s^2) (the exact Gaussian KL over the D latent elements, divided by D), reaches tau is dropped from the surrogate when it moved in its advantage's direction (r > 1 with A > 0, r < 1 with A < 0) (the authors: 1e-5)", gt=0.0)
    kl_coefficient: bool = _f(True, "divide the squared mean shift by the transition variance s^2 (the exact KL; the authors' add_kl_coefficient); false: by 1 (mean_D((mu - mu_old)^2) / 2)")
    kl_norm: Literal["authors", "exact"] = _f("authors", "the std s the trust region's KL divides by: authors (UniRL's a sqrt(sigma / (1 - min(sigma, 0.99))) sqrt(sigma - sigma') on Flow-GRPO steps: the transition's std except at sigma = 1, where the exact KL is 100 (1 - sigma_1) times it, and on (0.99, 1)) | exact (the transition's own std: the exact Gaussian KL)")
    kl_beta: float = _f(0.0, "weight of a KL term to the frozen base model, mean_D((mu - mu_ref)^2) / (2 s^2) with the transition std s; flowgrpo's addition: the authors' Flow-DPPO has no reference-model KL, and the default 0 means none (note loss.grpo.kl_beta's KL divides by sigma_t^2 instead, about T times weaker)", ge=0.0)
    guard_reweight: bool = term_field(StepWeightOptions, "guard_reweight")
    tempflow_weight: bool = term_field(StepWeightOptions, "tempflow_weight")


@dataclass(frozen=True)
class FlowDPPOLossOutput(GRPOLossOutput):
    """:class:`~flowgrpo.ops.GRPOLossOutput` of a Flow-DPPO micro-batch: ``clipped_high`` / ``clipped_low``
    are the rows dropped with A > 0 / A < 0, ``kl`` the reference KL per row (zeros without it), and

    Attributes:
        kl_old: [N] mean_D((mu - mu_old)^2) / (2 s^2), the divergence the trust region reads (detached).
        outside: [N] bool, kl_old >= tau.
    """

    kl_old: Tensor = None
    outside: Tensor = None


#: sigma's clamp in the authors' KL normaliser (UniRL ``FlowDPPO._compute_sigma_t``)
AUTHORS_SIGMA_CLAMP = 0.99


def authors_kl_std(sigma: Tensor, sigma_next: Tensor, noise_level: float) -> Tensor:
    """The authors' trust-region normaliser a sqrt(sigma / (1 - min(sigma, 0.99))) sqrt(sigma - sigma') [N],
    in ``sigma``'s dtype: Flow-GRPO's transition std, but with sigma clamped at 0.99 where the SDE step
    itself uses the grid's second point at sigma = 1."""
    return noise_level * torch.sqrt(sigma / (1 - sigma.clamp(max=AUTHORS_SIGMA_CLAMP))) * torch.sqrt(sigma - sigma_next)


def region_std(batch, plan, kl_norm: str) -> Tensor:
    """The std [M] the trust region divides by for a :class:`~flowgrpo.samplers.forest.TransitionBatch`:
    ``exact``: the transitions' own; ``authors``: :func:`authors_kl_std` on Flow-GRPO steps (the step's
    noise level), the own std on other step kinds."""
    out = batch.std.clone()
    if kl_norm == "exact":
        return out
    for s in batch.step.unique().tolist():
        spec = plan.steps[s]
        if spec.sde_kind != "flow_grpo":
            continue
        rows = (batch.step == s).nonzero(as_tuple=True)[0]
        std = authors_kl_std(batch.sigma[rows].double(), batch.sigma_next[rows].double(), float(spec.noise_level))
        out[rows.to(out.device)] = std.to(out.device, out.dtype)
    return out


def flow_dppo_loss(prev_sample: Tensor, mean: Tensor, mean_old: Tensor, std: Tensor, logp_std: Tensor,
                   logp_old: Tensor, advantages: Tensor, weights: Tensor, *, kl_threshold: float,
                   kl_coefficient: bool = True, mean_ref: Tensor | None = None,
                   kl_beta: float = 0.0, region_std: Tensor | None = None) -> FlowDPPOLossOutput:
    """Flow-DPPO's loss over N SDE transitions (see the module docstring).

    Args:
        prev_sample: x' [N, ...] drawn at rollout time.
        mean: mu_theta [N, ...] recomputed (with gradient); mean_old: mu_old [N, ...] of the rollout.
        std: the transition std s [N] (the KL's); logp_std: the std the log-prob is scored with [N]
            (s, or CPS's 1/sqrt(2) under ``sampler.cps_log_prob=mse``).
        logp_old: [N] rollout log-probs (per-element means, :func:`~flowgrpo.samplers.steps.gaussian_log_prob`).
        advantages: A [N]; weights: w [N].
        kl_threshold: tau; kl_coefficient: divide by s^2 (else by 1).
        mean_ref: mu_ref [N, ...] of the base model for the ``kl_beta`` term (None: no term).
        region_std: [N] the std the trust region's KL divides by (None: ``std``; ``kl_norm=authors``
            passes :func:`region_std`'s); the reference term always divides by ``std``.
    Returns: :class:`FlowDPPOLossOutput`, computed in float64 for float64 ``mean``, else float32.
    """
    acc = torch.float64 if mean.dtype == torch.float64 else torch.float32
    n = mean.shape[0]
    mu = mean.to(acc)
    s = std.to(acc).reshape(n)
    logp = gaussian_log_prob(prev_sample.to(acc), mu, logp_std.to(acc).reshape(n), dtype=acc)
    ratio = torch.exp(logp - logp_old.to(acc))
    adv = advantages.to(acc)
    with torch.no_grad():
        s_region = s if region_std is None else region_std.to(acc).reshape(n)
        kl_old = mean_kl(mu, mean_old, s_region if kl_coefficient else torch.ones_like(s))
        outside = kl_old >= kl_threshold
        drop_high = outside & (ratio > 1) & (adv > 0)
        drop_low = outside & (ratio < 1) & (adv < 0)
        keep = ~(drop_high | drop_low)
    # torch.where, not a product with the mask: an overflowing ratio on a dropped row must give 0, not nan
    surrogate = torch.where(keep, -adv * ratio, torch.zeros((), dtype=acc, device=mu.device))
    loss = (weights.to(acc) * surrogate).mean()
    kl_ref = torch.zeros_like(logp)
    if mean_ref is not None and kl_beta > 0:
        kl_ref = mean_kl(mu, mean_ref, s)
        loss = loss + kl_beta * kl_ref.mean()
    return FlowDPPOLossOutput(loss=loss, logp=logp.detach(), ratio=ratio.detach(), kl=kl_ref.detach(),
                              clipped_high=drop_high, clipped_low=drop_low, kl_old=kl_old, outside=outside)


class FlowDPPOStatsCollector(UpdateStatsCollector):
    """GRPO's diagnostics (``clipfrac_high`` / ``clipfrac_low`` are the dropped fractions) plus the
    trust region's: ``dppo_kl_old`` (mean divergence from the rollout policy), ``dppo_kl_old_max`` and
    ``dppo_outside`` (fraction of rows at or beyond tau, dropped or not)."""

    def __init__(self, transitions: int):
        super().__init__(transitions)
        self.kl_old: list[Tensor] = []
        self.outside: list[Tensor] = []

    def add(self, micro: MicroLoss, rows) -> None:
        super().add(micro, rows)
        self.kl_old.append(micro.record.kl_old.detach().float().cpu())
        self.outside.append(micro.record.outside.float().cpu())

    def finish(self, dp=None) -> dict[str, float]:
        out = super().finish(dp)
        kl = torch.cat(self.kl_old) if self.kl_old else torch.zeros(0)
        outside = torch.cat(self.outside) if self.outside else torch.zeros(0)
        if dp is not None:
            kl, outside = dp.cat(kl), dp.cat(outside)
        out["dppo_kl_old"] = float(kl.mean()) if len(kl) else 0.0
        out["dppo_kl_old_max"] = float(kl.max()) if len(kl) else 0.0
        out["dppo_outside"] = float(outside.mean()) if len(outside) else 0.0
        return out


class FlowDPPOObjective(GRPOObjective):
    """Flow-DPPO with ``loss.flow_dppo`` options (:class:`FlowDPPOOptions`) on GRPO's rows."""

    name = "flow_dppo"

    def __init__(self, cfg, device=None):
        # GRPO's rows and per-row weights (this objective's own keys); its loss op, clip, SFT and anchor are not used
        self.opt: FlowDPPOOptions = cfg.loss.flow_dppo
        self.cfg = self.opt
        self._compose_terms(self.opt)
        self.needs_reference = self.opt.kl_beta > 0

    def new_collector(self, rows):
        return FlowDPPOStatsCollector(len(rows) if rows is not None else 0)

    def micro_loss(self, ctx: UpdateContext, mb) -> MicroLoss:
        it, plan = self._it, ctx.collected.plan
        cond = ctx.collected.cond.index(mb.prompt)
        with ctx.autocast(), lora_folded(self._denoiser(ctx.policy), ctx.cfg.train.fold_lora):
            v = ctx.policy.velocity(mb.sample.to(ctx.device).to(ctx.dtype), mb.sigma, cond).float()
        mean = transition_means(mb, v, plan)
        mean_ref = self._reference_means(ctx, mb) if self.opt.kl_beta > 0 else None
        dev = mean.device
        out = flow_dppo_loss(mb.prev_sample.to(dev), mean, mb.mean_old.to(dev), mb.std.to(dev),
                             it["logp_std"][mb.row].to(dev), mb.log_prob_old.to(dev), mb.advantages.to(dev),
                             it["weights"][mb.row].to(dev), kl_threshold=self.opt.kl_threshold,
                             kl_coefficient=self.opt.kl_coefficient, mean_ref=mean_ref, kl_beta=self.opt.kl_beta,
                             region_std=region_std(mb, plan, self.opt.kl_norm).to(dev))
        return MicroLoss(loss=out.loss, record=out)

    def begin_minibatch(self, ctx: UpdateContext, rows, passes: int) -> int:
        return 0  # GRPO's batched reference serves loss.grpo.kl_beta, which this objective does not read

    def minibatch_terms(self, ctx: UpdateContext) -> dict:
        return {}  # no anchor term

    def after_update(self, ctx: UpdateContext) -> dict[str, float]:
        return {"dppo_kl_threshold": self.opt.kl_threshold}


def build_flow_dppo(cfg, device=None) -> FlowDPPOObjective:
    """Factory of ``loss.objective=flow_dppo`` from a :class:`~flowgrpo.config.RunConfig`."""
    return FlowDPPOObjective(cfg, device)
