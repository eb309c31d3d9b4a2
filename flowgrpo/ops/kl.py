"""The KL between two Gaussians of one std, per latent element: the one KL of every non-fused path.

Used by the GRPO reference op (:func:`~flowgrpo.ops.reference.grpo_loss_ref`, ``loss.grpo.kl_beta``),
Flow-DPPO's trust region and reference KL, and the velocity-space KL of the forward-process
objectives (:mod:`flowgrpo.objectives.terms.kl`). The fused op computes the same quantity in its own
kernel, against :func:`~flowgrpo.ops.reference.grpo_loss_ref` as its contract.
"""

from __future__ import annotations

from torch import Tensor


def mean_kl(mean: Tensor, other: Tensor, std: Tensor | None = None) -> Tensor:
    """KL(N(other, s^2 I) || N(mean, s^2 I)) / D = mean_D((mean - other)^2) / (2 s^2) per row, [N].

    Args:
        mean, other: [N, ...] (``other`` is cast to ``mean``'s dtype, in which everything is computed).
        std: the shared std s [N]; None: the squared distance mean_D((mean - other)^2) alone (the
            velocity-space KL, whose 1 / (2 sigma_t^2) the caller applies or leaves out).
    """
    n = mean.shape[0]
    kl = ((mean.reshape(n, -1) - other.to(mean.dtype).reshape(n, -1)) ** 2).mean(1)
    return kl if std is None else kl / (2 * std.to(mean.dtype).reshape(n) ** 2)
