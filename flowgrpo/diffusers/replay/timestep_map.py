"""The map from a step's sigma to the timestep a pipeline hands its transformer, fitted in any dtype.

Flow-matching pipelines feed their transformer ``t = a * sigma + b`` with small integer ``a`` and
``b``: SD3 and Wan ``1000 sigma``, FLUX and Qwen-Image ``sigma``, Z-Image ``1 - sigma``. The
recorded ``t`` is the tensor the transformer received, in whatever dtype the pipeline cast it to:
Qwen-Image hands over ``t.to(latents.dtype) / 1000``, which in bfloat16 is ``sigma`` to within
2^-8 of its magnitude, so a least-squares fit of two bf16 steps reads 0.98 instead of 1.

:func:`fit_timestep_map` therefore fits ``(a, b)`` as the *simplest* integer pair that reproduces
every recorded value to within the recorded dtype's rounding (two roundings of each term, the
pipeline's cast and its arithmetic in that dtype): of the integer pairs inside the fit's error
interval it takes the one with the most trailing zeros (1000 before 1004; 0 roundest of all), and
the smallest distance to the fit among those. In float32 the interval holds one integer, which is
then the plain rounding of the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: relative precision assumed for timesteps recorded in float32 or wider: the pipeline may have
#: computed them in a narrower type before the cast (kept from the float32-only fit this replaces)
MIN_RELATIVE_PRECISION = 1e-4


@dataclass(frozen=True)
class TimestepMap:
    """``timestep = scale * sigma + offset`` (both integers, as floats), as a tensor of ``dtype``, the
    dtype the pipeline handed the transformer, computed the way the pipeline computes it.

    With ``train_timesteps`` (the scheduler's ``num_train_timesteps`` N) the value is derived from the
    scheduler's own float32 timestep ``t = sigma * N`` as ``(scale * t + offset * N) / N``, after
    casting ``t`` to ``dtype`` first when ``cast_first``: Z-Image hands over ``(1000 - t) / 1000`` in
    float32, FLUX and Qwen-Image ``t.to(latents.dtype) / 1000``. Those roundings differ from ``sigma``
    mapped directly by up to one ulp of the timestep (of 1000 for bf16's cast), enough to move a
    bfloat16 transformer's output by several percent; replayed this way the timestep is bit for bit
    the pipeline's.
    """

    scale: float
    offset: float
    dtype: torch.dtype = torch.float32
    train_timesteps: int | None = None
    cast_first: bool = False

    def __call__(self, sigma: torch.Tensor) -> torch.Tensor:
        """Timesteps [B] in :attr:`dtype` for sigmas [B] (float32)."""
        sigma = sigma.float()
        if self.train_timesteps is None:
            return (sigma * self.scale + self.offset).to(self.dtype)
        n = self.train_timesteps
        t = sigma * n
        if self.cast_first:
            t = t.to(self.dtype)
        return ((t * self.scale + self.offset * n) / n).to(self.dtype)


def _precision(dtype: torch.dtype) -> tuple[float, float]:
    """(relative, absolute) rounding of one operation in ``dtype``: a float type's machine epsilon (at
    least :data:`MIN_RELATIVE_PRECISION`), an integer type's truncation to whole units."""
    if dtype.is_floating_point:
        return max(float(torch.finfo(dtype).eps), MIN_RELATIVE_PRECISION), 1e-12
    return 0.0, 1.0


def _roundness(n: int) -> int:
    """Trailing decimal zeros of ``n`` (0 counts as the roundest of all)."""
    if n == 0:
        return 99
    zeros = 0
    while n % 10 == 0:
        n //= 10
        zeros += 1
    return zeros


def _integers(lo: float, hi: float, limit: int = 100_000) -> range:
    lo_i, hi_i = math.ceil(lo), math.floor(hi)
    if hi_i - lo_i > limit:  # a fit this loose has no answer worth guessing
        return range(0)
    return range(lo_i, hi_i + 1)


def fit_timestep_map(sigmas: list[float], values: list[float], dtype: torch.dtype,
                     train_timesteps: int | None = None) -> TimestepMap:
    """The simplest integer ``(scale, offset)`` with ``values[i] = scale * sigmas[i] + offset`` to within
    the rounding of ``dtype`` (see the module docstring).

    Args:
        sigmas: the steps' sigmas (float32 from the scheduler), at least two distinct ones.
        values: the timestep the transformer received at each step (one element of its tensor).
        dtype: that tensor's dtype.
        train_timesteps: the scheduler's ``num_train_timesteps``: when the recorded values are exactly
            what a computation from the scheduler's timestep gives (:class:`TimestepMap`), the map
            replays that computation; else the values are mapped from sigma directly.

    Raises:
        ValueError naming the fitted scale and offset when no integer pair fits.
    """
    if len(sigmas) != len(values) or len(set(sigmas)) < 2:
        raise ValueError("the timestep map needs two steps with different sigmas")
    rel, absolute = _precision(dtype)
    s = torch.tensor(sigmas, dtype=torch.float64)
    t = torch.tensor(values, dtype=torch.float64)
    s_mean, t_mean = s.mean(), t.mean()
    a_hat = float(((s - s_mean) * (t - t_mean)).sum()) / float(((s - s_mean) ** 2).sum())
    b_hat = float(t_mean) - a_hat * float(s_mean)
    # each value is off by at most two roundings of the terms it was computed from (the pipeline's
    # arithmetic, then its cast); the slope is off by at most twice that over the sigmas' span
    value_err = 2.0 * rel * (float(t.abs().max()) + abs(a_hat) * float(s.abs().max()) + abs(b_hat)) + absolute
    a_err = 2.0 * value_err / float(s.max() - s.min())
    best = None
    for a in _integers(a_hat - a_err, a_hat + a_err):
        if a == 0:
            continue  # a constant timestep is no map of sigma
        residual = t - a * s
        for b in _integers(float(residual.max()) - value_err, float(residual.min()) + value_err):
            tol = 2.0 * rel * ((a * s).abs() + abs(b) + t.abs()) + absolute
            if not bool(((residual - b).abs() <= tol).all()):
                continue
            key = (-(_roundness(a) + _roundness(b)), abs(a - a_hat) + abs(b - b_hat))
            if best is None or key < best[0]:
                best = (key, a, b)
    if best is None:
        raise ValueError(f"the transformer's timestep is not an integer affine map of sigma (scale = {a_hat:.6g}, "
                         f"offset = {b_hat:.6g}, recorded in {str(dtype).replace('torch.', '')})")
    plain = TimestepMap(float(best[1]), float(best[2]), dtype)
    recorded = torch.tensor(values, dtype=torch.float32).to(dtype)
    sig = torch.tensor(sigmas, dtype=torch.float32)
    recipes = [plain] + ([TimestepMap(plain.scale, plain.offset, dtype, int(train_timesteps), cast)
                          for cast in (False, True)] if train_timesteps else [])
    return next((m for m in recipes if torch.equal(m(sig), recorded)), plain)
