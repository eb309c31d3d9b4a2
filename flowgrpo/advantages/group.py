"""Advantage estimators: leaf rewards -> per-transition advantages (DESIGN §4).

An estimator sees the rollout (its forest structure and groups) and the rewards of its leaves,
and returns one advantage per edge at every depth plus a mask of leaves that carry signal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .registry import Registry

ESTIMATORS: Registry = Registry("advantage estimator")


@dataclass
class AdvantageResult:
    """leaf_advantages [L]; edge_advantages[d] [N_d] for edges into depth d (None at d = 0);
    leaf_mask [L] bool: leaves whose reward is valid and whose group has signal; stats for logging."""

    leaf_advantages: Tensor
    edge_advantages: list[Tensor | None]
    leaf_mask: Tensor
    stats: dict = field(default_factory=dict)


def valid_reward_mask(rewards: dict[str, Tensor]) -> Tensor:
    """[B] bool: samples whose every reward is finite (NaN/inf rewards are dropped, not zeroed)."""
    mask = None
    for r in rewards.values():
        m = torch.isfinite(r)
        mask = m if mask is None else mask & m
    return mask


def group_zscore(values: Tensor, groups: Tensor, mask: Tensor, std_mode: str = "group", eps: float = 1e-4,
                 clip: float = 5.0) -> tuple[Tensor, Tensor, dict]:
    """GRPO advantage (r - mean_group) / (std + eps), clipped to +-clip.

    Args: values [B], groups [B] long, mask [B] bool (samples to use). ``std_mode`` "group" uses
    each group's std, "global" the std over all valid samples (Flow-GRPO's default for SD3).
    Returns (advantages [B] with 0 outside the mask or in zero-std groups, keep [B] bool: valid and
    in a group with signal, stats {zero_std_ratio, reward_std}).
    """
    v = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    ng = int(groups.max().item()) + 1 if len(groups) else 0
    m = mask.float()
    cnt = torch.zeros(ng).index_add_(0, groups, m)
    mean = torch.zeros(ng).index_add_(0, groups, v) / cnt.clamp(min=1)
    dev = (v - mean[groups]) * m
    # population std within each group (torch.std(unbiased=False)), as the GRPO references do
    var = torch.zeros(ng).index_add_(0, groups, dev**2) / cnt.clamp(min=1)
    gstd = var.sqrt()
    if std_mode == "global":
        denom = torch.std(values[mask].float(), unbiased=False) if mask.any() else torch.tensor(0.0)
        denom = denom.expand(len(values))
    else:
        denom = gstd[groups]
    adv = (dev / (denom + eps)).clamp(-clip, clip)
    has_signal = (gstd > 1e-6) & (cnt > 1)
    keep = mask & has_signal[groups]
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    present = cnt > 0
    stats = {"zero_std_ratio": float((~has_signal[present]).float().mean()) if present.any() else 0.0}
    return adv, keep, stats


def combine_rewards(rewards: dict[str, Tensor], weights: dict[str, float], groups: Tensor, mask: Tensor,
                    mode: str, eps: float = 1e-4) -> Tensor:
    """Several rewards -> one scalar per sample (DESIGN §4).

    ``sum_then_normalize``: weighted sum of raw rewards (Flow-GRPO); ``normalize_then_sum``: z-score
    each reward within its group first, then the weighted sum (MixGRPO, Pref-GRPO).
    """
    total = torch.zeros(len(groups))
    for name, w in weights.items():
        r = torch.where(mask, rewards[name].float(), torch.zeros_like(rewards[name], dtype=torch.float32))
        if mode == "normalize_then_sum" and len(weights) > 1:
            r, _, _ = group_zscore(r, groups, mask, "group", eps, clip=float("inf"))
        total = total + w * r
    return total


@ESTIMATORS.register("group_zscore")
def group_zscore_estimator(rollout, rewards: dict[str, Tensor], cfg_adv, cfg_reward) -> AdvantageResult:
    """Group z-score on leaves; each edge takes the mean advantage of its descendant leaves
    (for a chain: its own leaf's advantage)."""
    groups = rollout.leaf_groups
    mask = valid_reward_mask(rewards)
    combined = combine_rewards(rewards, cfg_reward.weights, groups, mask, cfg_reward.combine, cfg_adv.eps)
    if cfg_reward.combine == "normalize_then_sum" and len(cfg_reward.weights) > 1 and not cfg_reward.renormalize:
        # MixGRPO / Pref-GRPO: the advantage *is* sum_k w_k z_k; z-scoring that sum again would rescale
        # each group by its own factor (the references stop here)
        _, keep, stats = group_zscore(combined, groups, mask, "group", cfg_adv.eps, cfg_adv.clip)
        adv = torch.where(keep, combined.clamp(-cfg_adv.clip, cfg_adv.clip), torch.zeros_like(combined))
    else:
        adv, keep, stats = group_zscore(combined, groups, mask, cfg_adv.std, cfg_adv.eps, cfg_adv.clip)
    edges: list[Tensor | None] = [None]
    for d in range(1, len(rollout.levels)):
        edges.append(rollout.mean_over_descendants(adv, d, keep))
    stats["nan_dropped"] = int((~mask).sum())
    stats["combined_reward_mean"] = float(combined[mask].mean()) if mask.any() else float("nan")
    return AdvantageResult(adv, edges, keep, stats)


def estimate_advantages(name: str, rollout, rewards, cfg_adv, cfg_reward) -> AdvantageResult:
    return ESTIMATORS.get(name)(rollout, rewards, cfg_adv, cfg_reward)


# Estimators defined in other modules register themselves on import.
from . import tree_advantages  # noqa: E402,F401  (branch_grpo, tempflow, g2rpo)
