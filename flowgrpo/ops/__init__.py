"""GRPO loss operators: the pure-PyTorch reference and (where built) the fused csrc/ kernel."""

from __future__ import annotations

import torch

from .reference import grpo_loss_ref


def active_backend(device: torch.device | str = "cpu") -> str:
    """"compiled" when a fused kernel serves ``device``, else "reference"."""
    return "reference"


def grpo_loss(*args, **kwargs):
    """Same signature and results as :func:`grpo_loss_ref`; dispatches to the fused op when available."""
    return grpo_loss_ref(*args, **kwargs)


__all__ = ["active_backend", "grpo_loss", "grpo_loss_ref"]
