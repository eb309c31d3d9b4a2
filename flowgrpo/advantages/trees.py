"""Advantage estimators for tree rollouts: BranchGRPO, TempFlow-GRPO, G2RPO.

Listed in :data:`flowgrpo.advantages.ESTIMATORS` (``advantage.estimator``):

* ``branch_grpo`` -- fused node rewards and per-depth normalisation inside each tree
  (BranchGRPO, Dynamic-TreeRPO);
* ``tempflow`` -- z-score among the K SDE children of one branch point (TempFlow-GRPO);
* ``g2rpo`` -- as ``tempflow`` once per ODE granularity, summed (G2RPO).

All return an :class:`~flowgrpo.advantages.AdvantageResult` whose ``edge_advantages[d]`` [N_d] are
the advantages of the edges into depth d, and whose ``leaf_mask`` marks the leaves that carry
signal (the trainer trains only edges with such a leaf below them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .group import AdvantageResult, combine_rewards, group_zscore, masked_mean, valid_reward_mask


def _combined(rollout, rewards: dict[str, Tensor], cfg_adv, cfg_reward) -> tuple[Tensor, Tensor]:
    groups = rollout.leaf_groups
    mask = valid_reward_mask(rewards)
    combined = combine_rewards(rewards, cfg_reward.weights, groups, mask, cfg_reward.combine, cfg_adv.eps,
                               _unbiased(cfg_adv))
    return combined, mask


def _unbiased(cfg_adv) -> bool:
    return cfg_adv.std_estimator == "unbiased"


# ============================================================================ BranchGRPO


def fused_node_rewards(rollout, rewards: Tensor, valid: Tensor, depth: int, beta: float,
                       cum_log_prob: list[Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """BranchGRPO reward fusion at one depth: r(n) = sum_{leaves l under n} w_l r_l with
    w = softmax_l(beta * log p_behaviour(l | n)).

    log p(l | n) is the sum of the SDE edges' log-probs (each a Gaussian log-density averaged over
    the latent's elements; ODE edges contribute 0) on the path from n down to l. beta = 0 is the
    plain mean over the descendant leaves, beta = 1 weights them by path probability. Leaves with
    invalid rewards are left out. Returns (fused [N_depth] float32, has [N_depth] bool: nodes with at
    least one valid leaf).
    """
    anc = rollout.descendant_leaves(depth)
    n = len(rollout.levels[depth])
    m = valid & (anc >= 0)
    a = anc.clamp(min=0)
    r = torch.where(m, rewards.float(), torch.zeros_like(rewards, dtype=torch.float32))
    if beta == 0.0:
        w = m.float()
    else:
        cum = cum_log_prob if cum_log_prob is not None else rollout.cumulative_log_prob()
        leaf_cum = torch.zeros(rollout.num_leaves)
        for d in rollout.leaf_depth.unique().tolist():
            sel = rollout.leaf_depth == d
            leaf_cum[sel] = cum[d][rollout.leaf_node[sel]]
        logit = beta * (leaf_cum - cum[depth][a])
        logit = torch.where(m, logit, torch.full_like(logit, -torch.inf))
        top = torch.full((n,), -torch.inf).scatter_reduce(0, a, logit, reduce="amax")
        w = torch.where(m, torch.exp(logit - top[a]), torch.zeros_like(logit))
    tot = torch.zeros(n).index_add_(0, a, w * r)
    wsum = torch.zeros(n).index_add_(0, a, w)
    has = torch.zeros(n, dtype=torch.bool).index_put_((a[m],), torch.ones(int(m.sum()), dtype=torch.bool))
    fused = torch.where(has, tot / wsum.clamp(min=1e-30), torch.zeros(n))
    return fused, has


def branch_grpo_estimator(rollout, rewards: dict[str, Tensor], cfg_adv, cfg_reward) -> AdvantageResult:
    """BranchGRPO per-depth advantages.

    For every depth d, the fused reward r(n) of each node (:func:`fused_node_rewards`, beta =
    ``advantage.fusion_beta``) is normalised over the nodes of the same tree at that depth:
    A_d(n) = (r(n) - mu_d) / (sigma_d + eps) (``advantage.std_estimator``; a singleton depth or sigma_d < 1e-6
    gives 0). The edge into n takes A_d(n), clipped to +-``advantage.clip``. Leaves count as signal
    (``leaf_mask``) when their reward is valid and their tree's leaves do not all score the same.
    """
    combined, valid = _combined(rollout, rewards, cfg_adv, cfg_reward)
    beta = float(cfg_adv.fusion_beta)
    cum = rollout.cumulative_log_prob() if beta != 0.0 else None
    leaf_depth, leaf_node = rollout.leaf_depth, rollout.leaf_node
    leaf_adv = torch.zeros(rollout.num_leaves)
    edges: list[Tensor | None] = [None]
    depth_means: list[float] = []
    for d in range(len(rollout.levels)):
        fused, has = fused_node_rewards(rollout, combined, valid, d, beta, cum)
        tree = rollout.levels[d].tree.cpu()
        adv, keep, _ = group_zscore(fused, tree, has, "group", cfg_adv.eps, cfg_adv.clip, _unbiased(cfg_adv))
        if d > 0:
            edges.append(adv)
        if keep.any():
            depth_means.append(float(adv[keep].mean()))
        sel = leaf_depth == d
        if sel.any():
            leaf_adv[sel] = adv[leaf_node[sel]]
    # a tree carries signal when its valid leaves' rewards differ
    trees = rollout.leaf_tree
    _, tree_keep, zero_std = group_zscore(combined, trees, valid, "group", cfg_adv.eps, cfg_adv.clip,
                                          _unbiased(cfg_adv))
    return AdvantageResult(leaf_adv, edges, tree_keep, reward_mean=masked_mean(combined, valid),
                           nan_dropped=int((~valid).sum()), zero_std_ratio=zero_std,
                           diagnostics={"depth_adv_mean_absmax": max((abs(m) for m in depth_means), default=0.0)})


# ============================================================================ TempFlow-GRPO and G2RPO


def sibling_advantages(rollout, rewards: dict[str, Tensor], cfg_adv, cfg_reward, by_lane: bool) -> AdvantageResult:
    """Advantages of SDE edges z-scored among siblings (the SDE children of one parent node).

    Each SDE child's reward is the mean reward of its descendant leaves -- its ODE completion --
    taken separately per leaf lane when ``by_lane`` (G2RPO: one lane per ODE granularity lambda).
    Per lane, A^lambda = (r - mean_siblings) / (std + eps) (``advantage.std`` "group": the
    siblings' std; "global": the std over all valid children), clipped to +-clip, 0 for groups
    whose std is 0; the edge's advantage is sum_lambda A^lambda (one term without ``by_lane``).
    Each leaf takes the A^lambda of its nearest SDE ancestor for its own lane, and is signal when
    that sibling group had signal.
    """
    combined, valid = _combined(rollout, rewards, cfg_adv, cfg_reward)
    n_leaves = rollout.num_leaves
    lane_of_leaf = rollout.leaf_lane if by_lane else torch.zeros(n_leaves, dtype=torch.long)
    lanes = lane_of_leaf.unique().tolist()
    leaf_adv = torch.zeros(n_leaves)
    leaf_keep = torch.zeros(n_leaves, dtype=torch.bool)
    edges: list[Tensor | None] = [None]
    groups_seen = groups_signal = 0
    for d in range(1, len(rollout.levels)):
        lv = rollout.levels[d]
        sde = lv.sde_mask().cpu()
        total = torch.zeros(len(lv))
        if not sde.any():
            edges.append(total)
            continue
        parent = lv.parent.cpu()
        anc = rollout.descendant_leaves(d)
        for lane in lanes:
            lm = valid & (lane_of_leaf == lane)
            has = rollout.mean_over_descendants(lm.float(), d) > 0
            vals = rollout.mean_over_descendants(combined, d, lm)
            m = sde & has
            if not m.any():
                continue
            adv, keep, _ = group_zscore(vals, parent, m, cfg_adv.std, cfg_adv.eps, cfg_adv.clip, _unbiased(cfg_adv))
            total += adv
            present = torch.zeros(len(rollout.levels[d - 1]), dtype=torch.bool)
            present[parent[m]] = True
            signal = torch.zeros_like(present)
            signal[parent[keep]] = True
            groups_seen += int(present.sum())
            groups_signal += int(signal.sum())
            sel = (anc >= 0) & (lane_of_leaf == lane)
            idx = sel.nonzero(as_tuple=True)[0]
            a_idx = anc[idx]
            from_sde = sde[a_idx]  # deeper SDE ancestors overwrite shallower ones (d ascends)
            leaf_adv[idx[from_sde]] = adv[a_idx[from_sde]]
            leaf_keep[idx[from_sde]] = keep[a_idx[from_sde]] & valid[idx[from_sde]]
        edges.append(total)
    return AdvantageResult(leaf_adv, edges, leaf_keep, reward_mean=masked_mean(combined, valid),
                           nan_dropped=int((~valid).sum()),
                           zero_std_ratio=1.0 - groups_signal / groups_seen if groups_seen else 0.0,
                           diagnostics={"sibling_groups": float(groups_seen)})


def tempflow_estimator(rollout, rewards: dict[str, Tensor], cfg_adv, cfg_reward) -> AdvantageResult:
    """TempFlow-GRPO: the K SDE children of one branch point (same prompt, same initial noise, same
    parent state) form the group; each child's ODE-completion reward is credited to its SDE edge."""
    return sibling_advantages(rollout, rewards, cfg_adv, cfg_reward, by_lane=False)


def g2rpo_estimator(rollout, rewards: dict[str, Tensor], cfg_adv, cfg_reward) -> AdvantageResult:
    """G2RPO multi-granularity advantage: A_mix = sum_lambda A^lambda, A^lambda the sibling z-score of
    the rewards of the children's ODE completions at stride lambda (one leaf lane per lambda)."""
    return sibling_advantages(rollout, rewards, cfg_adv, cfg_reward, by_lane=True)
