"""Recompute what the loss needs for stored transitions, with the sampler's own math.

The update re-runs the model on a rollout's stored states x_sigma and needs, per transition, the
SDE mean mu_theta of the same step kind and noise level the rollout used, sigma_t (the KL
denominator) and the std its log-prob is scored with. These functions read each transition's plan
step (``batch.step`` indexes ``plan.steps``) and ask its :class:`~flowgrpo.samplers.sde.SDEKind`, so
the trainer never re-implements a step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .forest import TransitionBatch
from .plan import SamplingPlan
from .sde import sde_kind


def _rows_by_step(batch: TransitionBatch):
    """(plan step, rows [m] long) for each step present in ``batch``."""
    for s in batch.step.unique().tolist():
        yield s, (batch.step == s).nonzero(as_tuple=True)[0]


def transition_means(batch: TransitionBatch, velocity: Tensor, plan: SamplingPlan) -> Tensor:
    """mu [M, ...] float32 of each transition from the velocity [M, ...] at its stored x_sigma."""
    x = batch.sample.to(velocity.device).float()
    out = torch.empty_like(x)
    smax = plan.sigmas[1].to(x.device).float()
    for s, rows in _rows_by_step(batch):
        spec = plan.steps[s]
        r = rows.to(x.device)
        mean, _ = sde_kind(spec.sde_kind).mean_std(x[r], velocity[r].float(), batch.sigma[rows].to(x.device).float(),
                                                   batch.sigma_next[rows].to(x.device).float(), spec.noise_level,
                                                   smax.expand(len(rows)))
        out[r] = mean
    return out


def transition_sigma_t(batch: TransitionBatch, plan: SamplingPlan) -> Tensor:
    """sigma_t [M] float32 of each transition (its SDE kind's diffusion coefficient), on the batch's device.

    The per-step coefficients are computed on the CPU (a handful of scalars per step) and the result is
    moved to where the transitions live: the loss combines it with the CUDA means of a GPU run."""
    out = torch.empty(len(batch))
    for s, rows in _rows_by_step(batch):
        spec = plan.steps[s]
        out[rows] = sde_kind(spec.sde_kind).sigma_t(batch.sigma[rows].cpu().float(), batch.sigma_next[rows].cpu().float(),
                                                    spec.noise_level, plan.sigmas[1].float().expand(len(rows)))
    return out.to(batch.std.device)


def transition_log_prob_std(batch: TransitionBatch, plan: SamplingPlan) -> Tensor:
    """The std [M] each transition's log-prob is scored with (its std, or 1/sqrt(2) under "mse")."""
    out = batch.std.clone().float()
    for s, rows in _rows_by_step(batch):
        spec = plan.steps[s]
        out[rows] = sde_kind(spec.sde_kind).log_prob_std(out[rows], spec.log_prob)
    return out
