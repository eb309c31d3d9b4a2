"""Samplers: step math, sampling plans and the rollout forest (installed as ``flowgrpo.samplers``).

Samplers produce rollouts: a forest of transitions that the reward, advantage and loss stages
consume downstream.
"""

from .schedule import shift_sigmas, sigma_grid
from .sde import DEFAULT_NOISE_LEVEL, SDE_KINDS, SDEKind, sde_kind
from .steps import SDEStepOutput, euler_step, gaussian_log_prob, sde_step

__all__ = [
    "DEFAULT_NOISE_LEVEL",
    "SDEKind",
    "SDE_KINDS",
    "sde_kind",
    "SDEStepOutput",
    "euler_step",
    "gaussian_log_prob",
    "sde_step",
    "shift_sigmas",
    "sigma_grid",
]
