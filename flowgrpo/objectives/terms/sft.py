"""The best-path SFT term of Dynamic-TreeRPO (LayerTuning-RL): ``loss.grpo.sft_beta``.

For each tree, the path from its root to its best leaf (highest advantage among the leaves that
carry signal) is a target: every SDE edge on it adds ``sft_beta`` (lambda) times its negative
log-likelihood under the current policy, mean_dims((x' - mu_theta)^2) / (2 s^2), which pulls each
step's prediction toward the best path's next state. The term is summed over the on-path rows of a
micro-batch and divided by the micro-batch's size, so it averages over transitions like the policy
loss it is added to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...fields import help_field as _f
from ...samplers.steps import gaussian_exponent
from .base import LossTerm


@dataclass
class SFTOptions:
    sft_beta: float = _f(0.0, "weight of the best-path SFT term (Dynamic-TreeRPO / LayerTuning-RL, flowgrpo.objectives.terms.sft); 0 = off", ge=0.0)


def best_paths(rollout, leaf_values: Tensor, leaf_mask: Tensor) -> list[Tensor]:
    """Per depth, [N_d] bool: the nodes on the path from each tree's root to its best leaf.

    Args: leaf_values [L] (e.g. leaf advantages), leaf_mask [L] bool (leaves that may be chosen).
    Trees without a masked-in leaf have no best path; ties go to the first leaf in leaf order.
    """
    vals = torch.where(leaf_mask.bool().cpu(), leaf_values.float().cpu(), torch.full((rollout.num_leaves,), -math.inf))
    trees = rollout.leaf_tree
    n_trees = len(rollout.tree_prompt)
    best = torch.full((n_trees,), -math.inf).scatter_reduce(0, trees, vals, reduce="amax")
    is_best = (vals == best[trees]) & torch.isfinite(vals)
    chosen = torch.zeros(n_trees, dtype=torch.bool)
    on = [torch.zeros(len(lv), dtype=torch.bool) for lv in rollout.levels]
    depth, node = rollout.leaf_depth, rollout.leaf_node
    for j in is_best.nonzero(as_tuple=True)[0].tolist():
        t = int(trees[j])
        if chosen[t]:
            continue
        chosen[t] = True
        d, n = int(depth[j]), int(node[j])
        while d >= 0:
            on[d][n] = True
            n = int(rollout.levels[d].parent[n]) if d > 0 else -1
            d -= 1
    return on


def best_path_sft_loss(batch, mean: Tensor, best: list[Tensor], weight: float) -> Tensor | None:
    """lambda * (sum over ``batch``'s on-path rows of their NLL) / len(batch) (None: no row on a path).

    Args:
        batch: a micro-batch :class:`~flowgrpo.samplers.forest.TransitionBatch` (``depth``, ``node``
            locate each transition's child in the rollout).
        mean: mu_theta [m, ...] recomputed with gradients for the batch's rows.
        best: :func:`best_paths` of the rollout.
        weight: lambda (``loss.grpo.sft_beta``).
    """
    if weight <= 0 or batch.depth is None:
        return None
    on = torch.zeros(len(batch), dtype=torch.bool)
    for d in batch.depth.unique().tolist():
        rows = (batch.depth == d).nonzero(as_tuple=True)[0]
        on[rows] = best[d][batch.node[rows]]
    if not on.any():
        return None
    rows = on.nonzero(as_tuple=True)[0]
    x_next = batch.prev_sample[rows].to(mean.device)
    nll = gaussian_exponent(x_next, mean[rows.to(mean.device)], batch.std[rows].to(mean.device))
    return weight * nll.sum() / len(batch)


class BestPathSFT(LossTerm):
    """The SFT pull toward each tree's best path (:func:`best_path_sft_loss`); needs no reference."""

    name = "sft"
    Options = SFTOptions

    @property
    def active(self) -> bool:
        return self.opt.sft_beta > 0

    def value(self, batch, mean: Tensor, best: list[Tensor]) -> Tensor | None:
        """:func:`best_path_sft_loss` of a micro-batch with this term's weight (None: no row on a path)."""
        return best_path_sft_loss(batch, mean, best, self.opt.sft_beta)
