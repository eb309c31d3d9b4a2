"""The one result type of the GRPO loss, shared by the reference and the fused op."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class GRPOLossOutput:
    """What :func:`~flowgrpo.ops.grpo_loss` and :func:`~flowgrpo.ops.grpo_loss_ref` return.

    Attributes:
        loss: scalar, the weighted clipped surrogate plus ``beta`` times the mean KL (differentiable
            with respect to ``mean``); float32 (float64 for float64 inputs).
        logp: [N] log-probability of each ``prev_sample`` under the recomputed mean (detached).
        ratio: [N] importance ratio r (GRPO-Guard's normalised ratio when ``guard``; detached).
        kl: [N] KL term per row before ``beta`` (zeros when the KL is off; detached).
        clipped_high: [N] bool, r > 1 + eps.
        clipped_low: [N] bool, r < 1 - eps.
    """

    loss: Tensor
    logp: Tensor
    ratio: Tensor
    kl: Tensor
    clipped_high: Tensor
    clipped_low: Tensor
