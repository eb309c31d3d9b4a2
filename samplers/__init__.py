"""Samplers: step math, sampling plans and the rollout forest (installed as ``flowgrpo.samplers``).

Samplers produce rollouts: a forest of transitions that the reward, advantage and loss stages
consume downstream.
"""

from .schedule import shift_sigmas, sigma_grid
from .steps import SDE_KINDS, SDEStepOutput, euler_step, gaussian_log_prob, sde_step

__all__ = [
    "SDE_KINDS",
    "SDEStepOutput",
    "euler_step",
    "gaussian_log_prob",
    "sde_step",
    "shift_sigmas",
    "sigma_grid",
]
