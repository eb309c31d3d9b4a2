"""Deterministic ODE solvers beyond Euler: DPM-Solver++ 2nd order for rectified flow.

Rectified-flow convention (diffusers' flow matching): x_sigma = (1 - sigma) * x0 + sigma * eps, v = eps - x0.
In DPM-Solver++ terms alpha = 1 - sigma, and the data prediction and half-log-SNR are

    x0_hat = x - sigma * v,          lambda = log((1 - sigma) / sigma).

One step i (sigma_{i-1} -> sigma_i) of the 2nd-order multistep solver with the *midpoint* update
(MixGRPO-Flash found this variant best):

    h_i = lambda_i - lambda_{i-1}
    D_i = (1 + h_i / (2 h_{i-1})) * x0_hat^{(i-1)} - (h_i / (2 h_{i-1})) * x0_hat^{(i-2)}
    x_i = (sigma_i / sigma_{i-1}) * x_{i-1} - (1 - sigma_i) * (e^{-h_i} - 1) * D_i

``x0_hat^{(i-1)}`` is the prediction at the step's start and ``x0_hat^{(i-2)}`` the one kept from
the previous step (multistep: one model evaluation per step, like Euler).

Numerics at the ends of the grid, where lambda is infinite:

* The update coefficient is evaluated in closed form, -(1 - sigma_i)(e^{-h_i} - 1) = 1 - sigma_i / sigma_{i-1},
  so ``x_i = r x_{i-1} + (1 - r) D_i`` with r = sigma_i / sigma_{i-1}. This is finite for every
  sigma_{i-1} > 0, including sigma_{i-1} = 1 (lambda = -inf) and sigma_i = 0 (lambda = +inf).
* **First order = Euler.** With D_i = x0_hat^{(i-1)} the update is *exactly* the Euler step
  x + (sigma_i - sigma_{i-1}) v (for rectified flow DDIM / first-order DPM-Solver++ coincide
  with Euler), so every fallback below is an Euler step.
* **Start (sigma = 1).** The first step has no history and is first order. A step whose previous
  step started at sigma = 1 has h_{i-1} = +inf, so the correction weight h_i / (2 h_{i-1}) is
  its limit 0 and the step is first order; no arbitrary clamp of sigma is used.
* **End (sigma = 0).** h_i = +inf there and the midpoint correction has no finite limit; the final
  step to sigma = 0 is taken first order, x_T = x0_hat^{(T-1)} (diffusers does the same with
  ``final_sigmas_type="zero"``). Both fallbacks touch O(1) steps and keep the global order 2.
* **Measured order** (tests/test_solvers.py, an exactly solvable Gaussian flow): 2.05-2.07 on
  sigma in [0.95, 0.05] (Euler 0.99). On the full grid 1 -> 0 a uniform sigma grid has lambda-steps
  that do not shrink near the ends (h ~ 1/k for the k-th step from an end), which adds a log factor,
  error ~ log(N) / N^2: the fitted slope is 1.80 over N = 80..640 and approaches 2 from below.
* **History after a stochastic step.** The multistep formula assumes x0_hat^{(i-2)} was taken on the
  same ODE trajectory; after an SDE step it was not, so the sampler drops the history and the next
  dpm2 step is first order (see :class:`~flowgrpo.samplers.forest_sampler.ForestSampler`).

All math runs in float32 (float64 inputs stay float64, for the convergence tests).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _per_sample(value: float | Tensor, like: Tensor) -> Tensor:
    """Float or [B] tensor -> [B, 1, ...] broadcastable against ``like``."""
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if t.ndim == 0:
        t = t.expand(like.shape[0])
    return t.reshape(like.shape[0], *([1] * (like.ndim - 1)))


def _sigmas64(value: float | Tensor, batch: int) -> Tensor:
    """Float or [B] tensor -> float64 [B] on the CPU (coefficients are computed in float64)."""
    if isinstance(value, Tensor):
        t = value.detach().to("cpu", torch.float64)
    else:
        t = torch.tensor(value, dtype=torch.float64)
    return t.expand(batch) if t.ndim == 0 else t


def _float(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float64 else t.float()


def log_snr(sigma: float | Tensor) -> Tensor:
    """Half-log-SNR lambda = log((1 - sigma) / sigma) of rectified flow (-inf at 1, +inf at 0), float64."""
    s = torch.as_tensor(sigma, dtype=torch.float64)
    return torch.log1p(-s) - torch.log(s)


def lambda_step(sigma: float | Tensor, sigma_next: float | Tensor) -> Tensor:
    """h = lambda(sigma_next) - lambda(sigma) (positive; +inf when sigma = 1 or sigma_next = 0), float64."""
    s = torch.as_tensor(sigma, dtype=torch.float64)
    sn = torch.as_tensor(sigma_next, dtype=torch.float64)
    with torch.no_grad():
        return log_snr(sn) - log_snr(s)


def data_prediction(sample: Tensor, velocity: Tensor, sigma: float | Tensor) -> Tensor:
    """x0_hat = x - sigma * v [B, ...]."""
    x, v = _float(sample), _float(velocity)
    return x - _per_sample(sigma, x).to(x.dtype) * v


def dpm2_step(
    sample: Tensor,
    velocity: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    prev_x0: Tensor | None = None,
    prev_h: float | Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One DPM-Solver++(2M) midpoint step sigma -> sigma_next for rectified flow.

    Args:
        sample: x_{i-1} [B, ...]; velocity: v at (x_{i-1}, sigma) [B, ...].
        sigma, sigma_next: floats or [B] tensors, sigma_next < sigma, sigma > 0.
        prev_x0: x0_hat of the previous step's start [B, ...], or None (first order).
        prev_h: h of the previous step (float or [B]); +inf / NaN / non-positive mean "no usable
            history" and give a first-order step for those rows.

    Returns: (x_i [B, ...], x0_hat at this step's start [B, ...], h_i [B] float64), the last two to
    be passed as ``prev_x0`` / ``prev_h`` to the next step.
    """
    x, v = _float(sample), _float(velocity)
    b = x.shape[0]
    s, sn = _sigmas64(sigma, b), _sigmas64(sigma_next, b)
    if (s <= 0).any():
        raise ValueError("dpm2_step needs sigma > 0 at the start of a step")
    x0 = data_prediction(x, v, s.to(x.device, x.dtype))
    h = lambda_step(s, sn)  # [B] float64 on cpu
    d = x0
    if prev_x0 is not None and prev_h is not None:
        ph = _sigmas64(prev_h, b)
        usable = torch.isfinite(ph) & (ph > 0) & torch.isfinite(h)
        # midpoint correction weight h_i / (2 h_{i-1}); its limit is 0 when h_{i-1} = +inf
        k = torch.where(usable, h / (2 * torch.where(usable, ph, torch.ones_like(ph))), torch.zeros_like(h))
        if bool((k != 0).any()):
            kk = _per_sample(k.to(x.device, x.dtype), x)
            d = (1 + kk) * x0 - kk * _float(prev_x0).to(x.dtype)
    r = _per_sample((sn / s).to(x.device, x.dtype), x)  # sigma_i / sigma_{i-1} = e^{-h}(1-sigma_i)/(1-sigma_{i-1})
    x_next = r * x + (1 - r) * d
    return x_next, x0, h


def solve_ode(velocity_fn, x: Tensor, sigmas: Tensor, solver: str = "euler") -> Tensor:
    """Integrate dx/dsigma = v(x, sigma) over the grid ``sigmas`` [T + 1] (1 -> 0) with ``solver``.

    ``velocity_fn(x [B, ...], sigma float) -> v [B, ...]``. A helper for tests and evaluation; the
    rollout sampler runs the same step functions per depth.
    """
    prev_x0, prev_h = None, None
    for i in range(len(sigmas) - 1):
        s, sn = sigmas[i], sigmas[i + 1]
        v = velocity_fn(x, float(s))
        if solver == "euler":
            x = x + (float(sn) - float(s)) * v
        elif solver == "dpm2":
            x, prev_x0, prev_h = dpm2_step(x, v, s, sn, prev_x0, prev_h)
        else:
            raise ValueError(f"unknown ODE solver {solver!r}")
    return x


def compressed_grid(t_start: float, num_steps: int, shift: float = 1.0) -> Tensor:
    """``num_steps`` + 1 sigmas from the grid position ``t_start`` down to 0, float32.

    ``t_start`` is the *unshifted* time of the first point (1 - e / T for grid index e of a T-step
    uniform grid); the points are uniform in unshifted time and then shifted like
    :func:`~flowgrpo.samplers.schedule.sigma_grid`, so the compressed grid keeps the schedule's shape
    and, with ``num_steps = T - e``, reproduces the original grid's tail exactly. Used by
    MixGRPO-Flash for the steps after the SDE window.
    """
    from .schedule import shift_sigmas

    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    base = torch.linspace(float(t_start), 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(base, shift).to(torch.float32)


__all__ = ["compressed_grid", "data_prediction", "dpm2_step", "lambda_step", "log_snr", "solve_ode"]
