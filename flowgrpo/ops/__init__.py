"""GRPO loss operators (clipped importance-ratio surrogate per SDE transition, optional GRPO-Guard
normalisation and KL term): the pure-PyTorch reference and the fused csrc/ kernel.

* :func:`grpo_loss_ref` - plain PyTorch, the source of truth.
* :func:`grpo_loss` - same signature and results; runs the fused C++/CUDA op where it is built
  (JIT on first use, cached), else the reference with one warning.
* :func:`active_backend` - "compiled" or "reference" for a device.

Both return a :class:`GRPOLossOutput`.
"""

from __future__ import annotations

from .output import GRPOLossOutput
from .fused import active_backend, fused_available, grpo_loss
from .reference import grpo_loss_ref

__all__ = ["GRPOLossOutput", "active_backend", "fused_available", "grpo_loss", "grpo_loss_ref"]
