"""The SDE kinds: one object per discretisation owns its sigma_t, mean, std and log-prob convention.

Convention (diffusers' FlowMatchEulerDiscreteScheduler): x_sigma = (1 - sigma) x0 + sigma eps, the
model predicts v = eps - x0, and a step goes from sigma to sigma' < sigma (Delta = sigma' - sigma).
Every kind draws x' ~ N(mu, s^2 I); they differ in mu and s:

* ``flow_grpo`` (Flow-GRPO): Euler-Maruyama of the marginal-preserving reverse SDE with
  sigma_t = a sqrt(sigma / (1 - sigma)),
  mu = x (1 + sigma_t^2 Delta / (2 sigma)) + v (1 + sigma_t^2 (1 - sigma) / (2 sigma)) Delta,
  s = sigma_t sqrt(-Delta). At sigma = 1 the ratio uses ``sigma_max`` (the grid's second point).
* ``dance`` (DanceGRPO): the same drift with the constant sigma_t = eta.
* ``cps`` (coefficient-preserving sampling): s = sigma' sin(a pi / 2),
  mu = x0_hat (1 - sigma') + x1_hat sqrt(sigma'^2 - s^2), x0_hat = x - sigma v, x1_hat = x + (1 - sigma) v;
  its sigma_t is s itself. A CPS step into sigma' = 0 has s = 0: it is deterministic, so plans run
  it as an ODE step (:meth:`SDEKind.deterministic_at`).

The log-probability of a transition is the Gaussian log-density of x' under N(mu, s^2 I), averaged
(not summed) over the non-batch dims, constants included; the loss recomputes it with the std
:meth:`SDEKind.log_prob_std` returns. ``log_prob="mse"`` (CPS only) is Flow-GRPO-Fast's
constant-free -mean((x' - mu)^2), obtained as the Gaussian with std 1/sqrt(2): the two differ by a
constant, which cancels in every ratio.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Literal, get_args

import torch
from torch import Tensor

#: The default SDE noise level a (eta for the "dance" kind): Flow-GRPO's and MixGRPO's 0.7.
DEFAULT_NOISE_LEVEL = 0.7
#: Log-prob conventions: "gaussian" (the transition's own Gaussian density, every kind) or "mse"
#: (CPS only, Flow-GRPO-Fast's -mean((x' - mu)^2)). The one list of them (``sampler.cps_log_prob``'s type).
LogProbConvention = Literal["gaussian", "mse"]
LOG_PROB_CONVENTIONS: tuple[str, ...] = get_args(LogProbConvention)
_MSE_STD = 1.0 / math.sqrt(2.0)


def bcast(t: Tensor, like: Tensor) -> Tensor:
    """[B] -> [B, 1, 1, ...] matching ``like``'s rank."""
    return t.view(t.shape[0], *([1] * (like.ndim - 1)))


class SDEKind(ABC):
    """One SDE discretisation. All tensors float32; sigma, sigma_next, sigma_max are [B]."""

    name: str = ""

    @abstractmethod
    def sigma_t(self, sigma: Tensor, sigma_next: Tensor, a: float, sigma_max: Tensor | None = None) -> Tensor:
        """The diffusion coefficient sigma_t [B] (what ``loss.grpo.kl_sigma=sigma_t`` divides by)."""

    @abstractmethod
    def mean_std(self, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, a: float,
                 sigma_max: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The transition's mean mu [B, ...] and std s [B] from x_sigma and the velocity v [B, ...]."""

    def std(self, sigma: Tensor, sigma_next: Tensor, a: float, sigma_max: Tensor | None = None) -> Tensor:
        """The transition std s [B] (needs no sample)."""
        return self.sigma_t(sigma, sigma_next, a, sigma_max) * torch.sqrt((sigma - sigma_next).clamp(min=0))

    def deterministic_at(self, sigma_next: float, a: float) -> bool:
        """Whether a step into ``sigma_next`` has std 0 whatever sigma (then it is run as an ODE step)."""
        return a == 0.0

    def log_prob_std(self, std: Tensor, convention: str = "gaussian") -> Tensor:
        """The std [B] the log-prob is scored with: ``std`` itself, or 1/sqrt(2) for "mse"."""
        if convention == "gaussian":
            return std
        raise ValueError(f"the {self.name} SDE kind supports only the gaussian log-prob, got {convention!r}")


class _EulerMaruyama(SDEKind):
    """The drift shared by ``flow_grpo`` and ``dance``; subclasses set sigma_t."""

    def mean_std(self, x, v, sigma, sigma_next, a, sigma_max=None):
        st = self.sigma_t(sigma, sigma_next, a, sigma_max)
        s_, d_ = bcast(sigma, x), bcast(sigma_next - sigma, x)
        st2 = bcast(st, x) ** 2
        mean = x * (1 + st2 / (2 * s_) * d_) + v * (1 + st2 * (1 - s_) / (2 * s_)) * d_
        return mean, st * torch.sqrt(-(sigma_next - sigma))


class FlowGRPOSDE(_EulerMaruyama):
    name = "flow_grpo"

    def sigma_t(self, sigma, sigma_next, a, sigma_max=None):
        # at sigma = 1 the reference code evaluates sigma / (1 - sigma) with the grid's second point
        denom = torch.where(sigma >= 1.0, sigma_max if sigma_max is not None else sigma_next, sigma)
        return a * torch.sqrt(sigma / (1.0 - denom))


class DanceSDE(_EulerMaruyama):
    name = "dance"

    def sigma_t(self, sigma, sigma_next, a, sigma_max=None):
        return torch.full_like(sigma, float(a))


class CPSSDE(SDEKind):
    name = "cps"

    def sigma_t(self, sigma, sigma_next, a, sigma_max=None):
        return sigma_next * math.sin(a * math.pi / 2)

    def std(self, sigma, sigma_next, a, sigma_max=None):
        return self.sigma_t(sigma, sigma_next, a, sigma_max)

    def mean_std(self, x, v, sigma, sigma_next, a, sigma_max=None):
        std = self.std(sigma, sigma_next, a)
        s_, sn_ = bcast(sigma, x), bcast(sigma_next, x)
        x0_hat = x - s_ * v
        x1_hat = x + (1 - s_) * v
        mean = x0_hat * (1 - sn_) + x1_hat * torch.sqrt(torch.clamp(sn_**2 - bcast(std, x) ** 2, min=0.0))
        return mean, std

    def deterministic_at(self, sigma_next, a):
        return a == 0.0 or float(sigma_next) == 0.0

    def log_prob_std(self, std, convention="gaussian"):
        if convention == "mse":
            return torch.full_like(std, _MSE_STD)
        return super().log_prob_std(std, convention)


SDE_KINDS: dict[str, SDEKind] = {k.name: k for k in (FlowGRPOSDE(), DanceSDE(), CPSSDE())}
#: The names of :data:`SDE_KINDS` as a type (``sampler.sde_kind``'s): the choices are the kinds above.
SDEKindName = Literal[tuple(SDE_KINDS)]  # type: ignore[valid-type]


def sde_kind(name: str) -> SDEKind:
    """The :class:`SDEKind` called ``name`` (a ValueError lists the valid names)."""
    try:
        return SDE_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown SDE kind {name!r}; valid kinds: {', '.join(SDE_KINDS)}") from None
