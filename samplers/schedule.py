"""Noise-level grids for flow-matching samplers: T + 1 sigmas from 1 (noise) down to 0 (data)."""

from __future__ import annotations

import torch
from torch import Tensor


def shift_sigmas(sigmas: Tensor, shift: float) -> Tensor:
    """Timestep shift sigma~ = s * sigma / (1 + (s - 1) * sigma); shift = 1 is the identity."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_grid(num_steps: int, shift: float = 1.0, device=None) -> Tensor:
    """float32 [num_steps + 1] grid from 1 to 0 (both included), uniform before the shift."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    base = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift_sigmas(base, shift).to(torch.float32).to(device)
