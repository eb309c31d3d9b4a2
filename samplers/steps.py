"""One denoising step x_sigma -> x_sigma' in the rectified-flow convention, and the Gaussian
log-density its stochastic steps are scored with.

Convention (diffusers' FlowMatchEulerDiscreteScheduler): x_sigma = (1 - sigma) * x0 + sigma * eps,
sigma runs from 1 (noise) to 0 (data), the model predicts v = eps - x0. Delta = sigma' - sigma < 0.

All step math runs in float32 whatever the model dtype: bf16 step math overflows in the
sigma_t^2 / sigma terms near sigma = 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .sde import DEFAULT_NOISE_LEVEL, bcast, sde_kind

#: log(sqrt(2 pi)), the constant of a standard normal's log-density
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class SDEStepOutput:
    """Result of :func:`sde_step`.

    Attributes:
        prev_sample: x_sigma' [B, ...] float32 (drawn, or the given ``prev_sample``).
        mean: mu [B, ...] float32, the Gaussian mean of the transition.
        std: s [B] float32, the transition's standard deviation (per element).
        log_prob: [B] float32 log-density of ``prev_sample`` (mean over non-batch dims; see
            :func:`gaussian_log_prob`), scored with ``SDEKind.log_prob_std(std, log_prob)``.
        sigma_t: [B] float32, the SDE's diffusion coefficient sigma_t (used by the KL term).
    """

    prev_sample: Tensor
    mean: Tensor
    std: Tensor
    log_prob: Tensor
    sigma_t: Tensor


def _per_sample(value: float | Tensor, batch: int, device) -> Tensor:
    """Float or [B] tensor -> float32 [B] on ``device``."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"sigma must be a float or a [B]={batch} tensor, got shape {tuple(t.shape)}")
    return t


def _row_std(std, x: Tensor, dtype: torch.dtype) -> Tensor:
    """std (a number, or one per row of x [B, ...]) -> [B] in ``dtype`` on x's device."""
    std = torch.as_tensor(std, dtype=dtype, device=x.device)
    return std.expand(x.shape[0]) if std.ndim == 0 else std.reshape(x.shape[0])


def gaussian_exponent(x: Tensor, mean: Tensor, std, dtype: torch.dtype = torch.float32) -> Tensor:
    """The sample-dependent part of -log N(x; mean, std^2): mean over the non-batch dims of
    (x - mean)^2 / (2 std^2). x, mean [B, ...]; std a number or [B]. Returns [B] in ``dtype``."""
    b = x.shape[0]
    x, mean = x.to(dtype).reshape(b, -1), mean.to(dtype).reshape(b, -1)
    return ((x - mean) ** 2 / (2 * _row_std(std, x, dtype)[:, None] ** 2)).mean(1)


def gaussian_log_prob(x: Tensor, mean: Tensor, std, dtype: torch.dtype = torch.float32) -> Tensor:
    """Log N(x; mean, std^2) **averaged** over the non-batch dims, constants included:
    ``-gaussian_exponent - log(std) - log(sqrt(2 pi))``. The one Gaussian log-density of the project:
    rollouts, the plug-in's scheduler and the reference GRPO loss score with it, the best-path SFT
    term (:mod:`flowgrpo.objectives.terms.sft`) takes its :func:`gaussian_exponent`.

    Args: x, mean [B, ...]; std a number or [B] (per-sample std). ``dtype``: what it is computed
    and returned in (float32; the reference loss passes float64 for its float64 ground truth).
    Returns [B]. The mean (not the sum) over dims sets the scale of the importance ratio and
    therefore the meaning of the clip range (1e-4 .. 1e-3 in Flow-GRPO).
    """
    std = _row_std(std, x, dtype)
    return -gaussian_exponent(x, mean, std, dtype) - torch.log(std) - LOG_SQRT_2PI


def euler_step(sample: Tensor, velocity: Tensor, sigma: float | Tensor, sigma_next: float | Tensor) -> Tensor:
    """Deterministic Euler ODE step x' = x + (sigma' - sigma) * v, in float32. Shapes [B, ...]."""
    x, v = sample.float(), velocity.float()
    s = bcast(_per_sample(sigma, x.shape[0], x.device), x)
    sn = bcast(_per_sample(sigma_next, x.shape[0], x.device), x)
    return x + (sn - s) * v


def sde_sigma_t(
    sigma: Tensor, sigma_next: Tensor, noise_level: float, kind: str, sigma_max: Tensor | None = None
) -> Tensor:
    """Diffusion coefficient sigma_t [B] of the SDE ``kind`` (see :mod:`flowgrpo.samplers.sde`)."""
    return sde_kind(kind).sigma_t(sigma.float(), sigma_next.float(), noise_level,
                                  None if sigma_max is None else torch.as_tensor(sigma_max).float())


def sde_step(
    sample: Tensor,
    velocity: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float = DEFAULT_NOISE_LEVEL,
    kind: str = "flow_grpo",
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    sigma_max: float | Tensor | None = None,
    log_prob: str = "gaussian",
) -> SDEStepOutput:
    """One stochastic reverse step x' ~ N(mu, s^2 I) with its Gaussian log-probability
    (:func:`gaussian_log_prob`; mu and s from the SDE kind, :mod:`flowgrpo.samplers.sde`).

    Args:
        sample: x_sigma [B, ...] (any float dtype; math runs in float32).
        velocity: model output v = eps - x0 at (x_sigma, sigma) [B, ...].
        sigma, sigma_next: current and next noise level, floats or [B] tensors, sigma_next < sigma.
        noise_level: a for "flow_grpo" and "cps", eta for "dance".
        kind: "flow_grpo" (Euler-Maruyama of the marginal-preserving SDE), "dance" (same drift,
            constant sigma_t = eta) or "cps" (coefficient-preserving sampling).
        prev_sample: if given, score this x_sigma' [B, ...] instead of drawing one.
        generator: RNG for the drawn noise.
        noise: standard-normal noise [B, ...] to use instead of drawing (branching noise).
        sigma_max: sigma of the grid's second point, for the flow_grpo sigma = 1 rule.
        log_prob: the log-prob convention, "gaussian" or (CPS) "mse" (:mod:`flowgrpo.samplers.sde`).

    Returns: :class:`SDEStepOutput`. With noise_level = 0, "flow_grpo" and "dance" reduce exactly
    to :func:`euler_step` (std = 0, so only ``mean``/``prev_sample`` are meaningful).
    """
    sde = sde_kind(kind)
    x, v = sample.float(), velocity.float()
    b = x.shape[0]
    s = _per_sample(sigma, b, x.device)
    sn = _per_sample(sigma_next, b, x.device)
    smax = _per_sample(sigma_max, b, x.device) if sigma_max is not None else None
    mean, std = sde.mean_std(x, v, s, sn, noise_level, smax)
    sigma_t = sde.sigma_t(s, sn, noise_level, smax)

    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        prev = mean + bcast(std, x) * noise.float()
    else:
        prev = prev_sample.float()

    logp = gaussian_log_prob(prev, mean, sde.log_prob_std(std, log_prob))
    return SDEStepOutput(prev_sample=prev, mean=mean, std=std, log_prob=logp, sigma_t=sigma_t)
