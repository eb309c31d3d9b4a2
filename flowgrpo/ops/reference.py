"""Pure-PyTorch GRPO loss (the clipped ratio surrogate over SDE transitions, with the optional
GRPO-Guard normalisation and KL term): the source of truth for the fused op in csrc/."""

from __future__ import annotations

import torch
from torch import Tensor

from ..samplers.steps import gaussian_log_prob
from .kl import mean_kl
from .output import GRPOLossOutput


def grpo_loss_ref(
    prev_sample: Tensor,
    mean: Tensor,
    mean_old: Tensor,
    std: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    weights: Tensor,
    *,
    clip_range: float,
    guard: bool = False,
    mean_ref: Tensor | None = None,
    kl_sigma: Tensor | None = None,
    beta: float = 0.0,
) -> GRPOLossOutput:
    """Clipped GRPO surrogate over N SDE transitions, each with D latent elements.

    Args:
        prev_sample: x' [N, ...] drawn at rollout time.
        mean: mu_theta [N, ...] recomputed with grad (the only input that needs a gradient).
        mean_old: mu_old [N, ...] stored at rollout (used by the GRPO-Guard normalisation).
        std: transition std s [N]. logp_old: [N] rollout log-probs (Gaussian log-density averaged
            over the D elements, :func:`flowgrpo.samplers.steps.gaussian_log_prob`).
        advantages: A [N]. weights: per-row weight w [N] (TempFlow / Guard reweighting; ones otherwise).
        clip_range: epsilon of the ratio clip. guard: use GRPO-Guard's normalised log-ratio
            log r^ = s * (logp - logp_old) + mse / (2 s), mse = mean_D((mu - mu_old)^2).
        mean_ref: mu_ref [N, ...] of the reference model, kl_sigma [N]: the KL term
            mean_D((mu - mu_ref)^2) / (2 kl_sigma^2), weighted by ``beta``.

    Returns: :class:`~flowgrpo.ops.output.GRPOLossOutput` (scalar loss; per-row ``logp``, ``ratio``,
    ``kl`` and bool ``clipped_high`` (r > 1 + eps), ``clipped_low`` (r < 1 - eps), all [N]).
    Accumulation is float32 for float32/bfloat16/float16 inputs; float64 inputs are computed (and
    returned) in float64, which makes this the float64 ground truth for the fused op's tests.
    """
    n = prev_sample.shape[0]
    acc = torch.float64 if mean.dtype == torch.float64 else torch.float32
    x = prev_sample.to(acc).reshape(n, -1)
    mu = mean.to(acc).reshape(n, -1)
    s = std.to(acc).reshape(n)
    logp = gaussian_log_prob(x, mu, s, dtype=acc)
    log_ratio = logp - logp_old.to(acc)
    if guard:
        mse = ((mu - mean_old.to(acc).reshape(n, -1)) ** 2).mean(1)
        log_ratio = s * log_ratio + mse / (2 * s)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(acc)
    unclipped = -adv * ratio
    # torch.clamp's forward, with the gradient passed strictly inside (lo, hi) and none at a bound,
    # written out: torch.clamp's own backward at r exactly on a bound differs between devices (the CPU
    # passes none, CUDA passes it, seen with torch 2.11 on an H100), and this function is the contract
    # the fused op's CPU and CUDA kernels both follow (only the on-policy tie r = 1 at clip_range = 0 hits it)
    lo, hi = 1.0 - clip_range, 1.0 + clip_range
    inside = (ratio > lo) & (ratio < hi)
    clipped = -adv * torch.where(inside, ratio, torch.clamp(ratio, lo, hi).detach())
    policy_loss = (weights.to(acc) * torch.maximum(unclipped, clipped)).mean()
    if mean_ref is not None and beta != 0.0:
        if kl_sigma is None:
            raise ValueError("mean_ref given without kl_sigma")
        kl = mean_kl(mu, mean_ref, kl_sigma)
        loss = policy_loss + beta * kl.mean()
    else:
        kl = torch.zeros_like(logp)
        loss = policy_loss
    ratio = ratio.detach()
    return GRPOLossOutput(loss=loss, logp=logp.detach(), ratio=ratio, kl=kl.detach(),
                          clipped_high=ratio > 1.0 + clip_range, clipped_low=ratio < 1.0 - clip_range)
