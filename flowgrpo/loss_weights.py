"""Per-transition loss weights w_j (DESIGN §5): GRPO-Guard reweighting and TempFlow weighting."""

from __future__ import annotations

import torch
from torch import Tensor


def transition_weights(batch, plan, loss_cfg) -> Tensor:
    """Weights [M] for the transitions of ``batch`` (ones unless a weighting option is on)."""
    w = torch.ones(len(batch))
    return w
