"""Group-relative advantages of chains: z-scores of leaf rewards within their prompt's group.

Also the building blocks every estimator shares: the NaN-reward mask, the group z-score and the
combination of several rewards into one scalar.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import UserError


@dataclass
class AdvantageResult:
    """What an advantage estimator returns.

    Attributes:
        leaf_advantages: [L] advantage of each leaf.
        edge_advantages: per depth d, [N_d] advantages of the edges into depth d (None at d = 0).
        leaf_mask: [L] bool, leaves whose reward is valid and whose group has signal (the trainer
            trains only edges with such a leaf below them).
        reward_mean: mean combined reward over the valid leaves (NaN when none is valid).
        nan_dropped: leaves dropped because a reward was NaN/inf.
        zero_std_ratio: fraction of groups whose rewards are all equal (no signal).
        diagnostics: estimator-specific scalars, logged as ``advantage.<name>``.
    """

    leaf_advantages: Tensor
    edge_advantages: list[Tensor | None]
    leaf_mask: Tensor
    reward_mean: float = float("nan")
    nan_dropped: int = 0
    zero_std_ratio: float = 0.0
    diagnostics: dict[str, float] = field(default_factory=dict)


def valid_reward_mask(rewards: dict[str, Tensor]) -> Tensor:
    """[B] bool: samples whose every reward is finite (NaN/inf rewards are dropped, not zeroed)."""
    mask = None
    for r in rewards.values():
        m = torch.isfinite(r)
        mask = m if mask is None else mask & m
    return mask


def group_zscore(values: Tensor, groups: Tensor, mask: Tensor, std_mode: str = "group", eps: float = 1e-4,
                 clip: float = 5.0, unbiased: bool = False) -> tuple[Tensor, Tensor, float]:
    """GRPO advantage (r - mean_group) / (std + eps), clipped to +-clip.

    Args: values [B], groups [B] long, mask [B] bool (samples to use). ``std_mode`` "group" uses
    each group's std, "global" the std over all valid samples (Flow-GRPO's default for SD3).
    ``unbiased``: the std divides by n - 1 (DanceGRPO, MixGRPO, BranchGRPO: ``torch.std``) instead
    of n (Flow-GRPO: ``np.std``).
    Returns (advantages [B] with 0 outside the mask or in zero-std groups, keep [B] bool: valid and
    in a group with signal, the fraction of groups without signal).
    """
    v = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    ng = int(groups.max().item()) + 1 if len(groups) else 0
    m = mask.float()
    cnt = torch.zeros(ng).index_add_(0, groups, m)
    mean = torch.zeros(ng).index_add_(0, groups, v) / cnt.clamp(min=1)
    dev = (v - mean[groups]) * m
    dof = (cnt - 1).clamp(min=1) if unbiased else cnt.clamp(min=1)
    var = torch.zeros(ng).index_add_(0, groups, dev**2) / dof
    gstd = var.sqrt()
    if std_mode == "global":
        denom = torch.std(values[mask].float(), unbiased=unbiased) if mask.any() else torch.tensor(0.0)
        denom = denom.expand(len(values))
    else:
        denom = gstd[groups]
    adv = (dev / (denom + eps)).clamp(-clip, clip)
    has_signal = (gstd > 1e-6) & (cnt > 1)
    keep = mask & has_signal[groups]
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    present = cnt > 0
    zero_std_ratio = float((~has_signal[present]).float().mean()) if present.any() else 0.0
    return adv, keep, zero_std_ratio


def combine_rewards(rewards: dict[str, Tensor], weights: dict[str, float], groups: Tensor, mask: Tensor,
                    mode: str, eps: float = 1e-4, unbiased: bool = False) -> Tensor:
    """Several rewards -> one scalar per sample, before the group z-score.

    ``sum_then_normalize``: weighted sum of raw rewards (Flow-GRPO); ``normalize_then_sum``: z-score
    each reward within its group first, then the weighted sum (MixGRPO, Pref-GRPO).
    """
    total = torch.zeros(len(groups))
    for name, w in weights.items():
        r = torch.where(mask, rewards[name].float(), torch.zeros_like(rewards[name], dtype=torch.float32))
        if mode == "normalize_then_sum" and len(weights) > 1:
            r, _, _ = group_zscore(r, groups, mask, "group", eps, clip=float("inf"), unbiased=unbiased)
        total = total + w * r
    overflow = mask & ~torch.isfinite(total)
    if overflow.any():  # every reward finite, their weighted sum not: float32 overflowed (a weight of 1e308)
        raise UserError(f"the weighted sum of the rewards is not a finite float32 for {int(overflow.sum())} samples "
                        f"whose every reward is finite (reward.weights={dict(weights)}): scale the weights or the "
                        "rewards down")
    return total


def group_zscore_estimator(rollout, rewards: dict[str, Tensor], cfg_adv, cfg_reward) -> AdvantageResult:
    """Group z-score on leaves; each edge takes the mean advantage of its descendant leaves
    (for a chain: its own leaf's advantage)."""
    groups = rollout.leaf_groups
    mask = valid_reward_mask(rewards)
    unbiased = cfg_adv.std_estimator == "unbiased"
    combined = combine_rewards(rewards, cfg_reward.weights, groups, mask, cfg_reward.combine, cfg_adv.eps, unbiased)
    if cfg_reward.combine == "normalize_then_sum" and len(cfg_reward.weights) > 1 and not cfg_reward.renormalize:
        # MixGRPO / Pref-GRPO: the advantage *is* sum_k w_k z_k; z-scoring that sum again would rescale
        # each group by its own factor (the references stop here)
        _, keep, zero_std = group_zscore(combined, groups, mask, "group", cfg_adv.eps, cfg_adv.clip, unbiased)
        adv = torch.where(keep, combined.clamp(-cfg_adv.clip, cfg_adv.clip), torch.zeros_like(combined))
    else:
        adv, keep, zero_std = group_zscore(combined, groups, mask, cfg_adv.std, cfg_adv.eps, cfg_adv.clip, unbiased)
    edges: list[Tensor | None] = [None]
    for d in range(1, len(rollout.levels)):
        edges.append(rollout.mean_over_descendants(adv, d, keep))
    return AdvantageResult(adv, edges, keep, reward_mean=masked_mean(combined, mask), nan_dropped=int((~mask).sum()),
                           zero_std_ratio=zero_std)


def masked_mean(values: Tensor, mask: Tensor) -> float:
    """Mean of ``values`` [B] over ``mask`` [B] (NaN when the mask is empty)."""
    return float(values[mask].mean()) if mask.any() else float("nan")
