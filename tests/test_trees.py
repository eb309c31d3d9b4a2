"""Tree strategies and tree advantages (issue 3): BranchGRPO (+Mix), Dynamic-TreeRPO, TempFlow-GRPO, G2RPO.

Everything here runs on the cheap analytic ``TinyPolicy`` (4x4x4 latents), except one trainer-level
pruning check on the random shapes model.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TinyPolicy

from flowgrpo.advantages import ESTIMATORS, estimate_advantages
from flowgrpo.config import AdvantageConfig, RewardConfig, SamplerConfig
from flowgrpo.samplers.plan import SamplingPlan, StepSpec
from flowgrpo.samplers.rollout import ForestSampler
from flowgrpo.samplers.schedule import sigma_grid
from flowgrpo.samplers.strategies import STRATEGIES, build_strategy
from flowgrpo.advantages.trees import fused_node_rewards
from flowgrpo.objectives.terms.clip_schedule import clip_range_for
from flowgrpo.objectives.terms.sft import best_path_sft_loss, best_paths

PROMPTS = ["a red circle", "two blue squares"]
REWARD_CFG = RewardConfig(weights={"r": 1.0})


def strategy(name: str, steps: int, **options):
    return build_strategy(SamplerConfig(strategy=name, num_steps=steps), options)


def roll(plan, group_size=2, seed=0, policy=None, prompts=PROMPTS):
    policy = policy or TinyPolicy()
    return ForestSampler(policy, max_micro_batch=4096).rollout(plan, prompts, group_size,
                                                               torch.Generator().manual_seed(seed))


def leaf_rewards(ro, seed=1):
    """Continuous random rewards, one per leaf (every group has signal)."""
    return {"r": torch.rand(ro.num_leaves, generator=torch.Generator().manual_seed(seed))}


def test_registered():
    for name in ("branch_grpo", "branch_grpo_mix", "tree_rpo", "tempflow_grpo", "g2rpo"):
        assert name in STRATEGIES
    for name in ("branch_grpo", "tempflow", "g2rpo"):
        assert name in ESTIMATORS


# ============================================================================ BranchGRPO


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_branch_default_tree_has_16_leaves_and_zero_mean_advantages_at_every_depth(beta):
    st = strategy("branch_grpo", 20)  # BranchGRPO's defaults at T = 20: splits (0, 3, 6, 9), K = 2
    plan = st.plan(0)
    assert st.splits == [0, 3, 6, 9] and plan.leaves_per_tree == 16
    ro = roll(plan, group_size=2)
    trees = len(PROMPTS) * 2
    assert ro.num_leaves == 16 * trees and ro.leaves is ro.levels[-1] and len(ro.levels) == 21
    assert [len(lv) // trees for lv in ro.levels] == [1, 2, 2, 2, 4, 4, 4, 8, 8, 8] + [16] * 11
    adv = estimate_advantages("branch_grpo", ro, leaf_rewards(ro), AdvantageConfig(fusion_beta=beta), REWARD_CFG)
    assert adv.leaf_mask.all()
    rewards = leaf_rewards(ro)["r"]
    worst_rounding = 0.0
    for d in range(1, 21):
        a = adv.edge_advantages[d]
        tree = ro.levels[d].tree
        fused, _ = fused_node_rewards(ro, rewards, torch.ones(ro.num_leaves, dtype=torch.bool), d, beta)
        for t in range(trees):
            at, rt = a[tree == t], fused[tree == t]
            # zero mean over one tree's nodes at depth d, up to float32 rounding of r - mu, which
            # the division by a small sigma_d + eps magnifies (near-equal fused rewards at beta = 1)
            rounding = 4 * torch.finfo(torch.float32).eps * float(rt.abs().max()) / (float(rt.std(unbiased=False)) + 1e-4)
            assert abs(float(at.mean())) < 1e-5 + rounding, (d, t)
            worst_rounding = max(worst_rounding, rounding)
            # A_d(n) = (r(n) - mu_d) / (sigma_d + eps), population std over the tree's nodes at depth d
            expected = (rt - rt.mean()) / (rt.std(unbiased=False) + 1e-4)
            assert torch.allclose(at, expected.clamp(-5, 5), atol=1e-5)
    assert adv.diagnostics["depth_adv_mean_absmax"] < 1e-5 + worst_rounding
    # the leaves' advantages are the last depth's; the root carries nothing
    assert torch.equal(adv.leaf_advantages, adv.edge_advantages[20])


def test_branch_fusion_beta_weights_leaves_by_path_probability():
    """beta = 0 averages a node's leaves; beta = 1 weights them by exp(sum of edge log-probs below)."""
    ro = roll(strategy("branch_grpo", 6, splits=[0, 3]).plan(0), group_size=1, prompts=["x"])
    r = leaf_rewards(ro)["r"]
    valid = torch.ones(ro.num_leaves, dtype=torch.bool)
    mean0, _ = fused_node_rewards(ro, r, valid, 0, 0.0)
    assert torch.allclose(mean0, r.mean().reshape(1))
    fused, has = fused_node_rewards(ro, r, valid, 0, 1.0)
    cum = ro.cumulative_log_prob()
    lp = cum[-1]  # leaves are the last level; the root's own log-prob is 0
    w = torch.softmax(lp, 0)
    assert has.all() and torch.allclose(fused, (w * r).sum().reshape(1), atol=1e-6)
    # a node with a single chain of descendants has the same fused reward at every depth
    f4, _ = fused_node_rewards(ro, r, valid, 4, 1.0)
    f6, _ = fused_node_rewards(ro, r, valid, 6, 1.0)
    assert torch.allclose(f4, f6)


def test_branch_nan_leaves_are_left_out_of_the_fusion():
    ro = roll(strategy("branch_grpo", 4, splits=[0, 2]).plan(0), group_size=1)
    r = leaf_rewards(ro)["r"].clone()
    r[0] = float("nan")
    adv = estimate_advantages("branch_grpo", ro, {"r": r}, AdvantageConfig(), REWARD_CFG)
    assert not adv.leaf_mask[0] and adv.leaf_mask[1:].all()
    assert adv.nan_dropped == 1
    assert all(torch.isfinite(a).all() for a in adv.edge_advantages[1:])


# ---------------------------------------------------------------------------- branching noise


def _split_rollout(mode: str, trees: int = 3000, c: float = 4.0):
    plan = SamplingPlan(sigma_grid(2), [StepSpec(branch=2, branch_noise=mode, branch_noise_scale=c), StepSpec()])
    return roll(plan, group_size=trees, prompts=["p"])


def test_branching_noise_keeps_unit_variance_and_reference_variant_does_not():
    """z = (x' - mu) / s of the split children: N(0, 1) marginals for "shared" (and "iid"), sibling
    correlation 1 / (1 + c^2); the reference code's "scaled" variant has variance c^2 = 16.

    3000 parents x 2 children x 64 dims = 384k samples: the standard error of the variance is
    sqrt(2 / 384k) = 0.0023 and of the correlation sqrt(1 / 192k) = 0.0023 (dims of one node are
    independent draws); the tolerances (0.02 and 0.015) are > 6 standard errors.
    """
    for mode in ("shared", "iid"):
        ro = _split_rollout(mode)
        lv = ro.levels[1]
        z = (lv.x - lv.mean) / lv.std.view(-1, 1, 1, 1)
        assert abs(float(z.var()) - 1.0) < 0.02, mode
        assert abs(float(z.mean())) < 0.01, mode
        pairs = z.view(-1, 2, 64)
        corr = float((pairs[:, 0] * pairs[:, 1]).mean())
        expected = 1 / 17 if mode == "shared" else 0.0
        assert abs(corr - expected) < 0.015, (mode, corr)
        # the stored log-prob is the density the child was drawn from: E[-(z^2)/2] = -1/2
        const = lv.log_prob + torch.log(lv.std) + 0.5 * math.log(2 * math.pi)
        assert abs(float(const.mean()) + 0.5) < 0.01, mode
    ro = _split_rollout("scaled")
    lv = ro.levels[1]
    z = (lv.x - lv.mean) / lv.std.view(-1, 1, 1, 1)
    assert abs(float(z.var()) - 16.0) < 0.5  # marginal N(0, c^2): not unit variance
    pairs = z.view(-1, 2, 64)
    assert abs(float((pairs[:, 0] * pairs[:, 1]).mean()) / 16.0) < 0.015  # independent siblings
    const = lv.log_prob + torch.log(lv.std) + 0.5 * math.log(2 * math.pi)
    assert float(const.mean()) < -7.0  # log-probs scored as N(0, 1): -c^2 / 2 = -8 on average


def test_branch_noise_option_reaches_the_split_steps_only():
    plan = strategy("branch_grpo", 8, splits=[0, 4], branch_noise="scaled", branch_noise_scale=2.0).plan(0)
    assert [s.branch_noise for s in plan.steps if s.branch > 1] == ["scaled", "scaled"]
    assert all(s.branch == 1 for i, s in enumerate(plan.steps) if i not in (0, 4))


# ---------------------------------------------------------------------------- pruning


def test_pruning_masks_touch_only_the_backward_pass():
    opts = dict(splits=[0, 2, 4], branch=2)
    plain = strategy("branch_grpo", 8, **opts)
    pruned = strategy("branch_grpo", 8, **opts, width_prune="top", width_keep=0.5, depth_prune=2,
                      depth_prune_every=30)
    p0, p1 = plain.plan(0), pruned.plan(0)
    assert p0.steps == p1.steps and torch.equal(p0.sigmas, p1.sigmas)
    a, b = roll(p0, seed=3), roll(p1, seed=3)
    for la, lb in zip(a.levels[1:], b.levels[1:]):  # the rollout is identical
        assert torch.equal(la.x, lb.x) and torch.equal(la.log_prob, lb.log_prob)
    rewards = leaf_rewards(a)
    adv = estimate_advantages("branch_grpo", b, rewards, AdvantageConfig(), REWARD_CFG)
    assert plain.pruning(a, adv, 0).edges is None and plain.pruning(a, adv, 0).leaves is None
    masks = pruned.pruning(b, adv, 0).edges
    # depth pruning: the last 2 steps (6, 7) -> edges into depths 7 and 8 are all out
    assert pruned.depth_pruned_steps(0) == [6, 7]
    assert not masks[7].any() and not masks[8].any()
    # split edges and everything before the last split's children train in full
    for d in range(1, 6):
        assert masks[d] is None
    # width pruning: of each last-split parent's 2 children, the better one (by advantage) keeps
    # its subtree (depth 6 = edges at step 5)
    d0 = 5
    kids = b.levels[d0]
    keep6 = masks[6]
    kept_child = kids.parent.unique()
    for p in kept_child.tolist():
        c = (kids.parent == p).nonzero(as_tuple=True)[0]
        best = c[adv.edge_advantages[d0][c].argmax()]
        below = b.levels[6].parent  # chains below the children
        assert keep6[below == best].all() and not keep6[(below != best) & torch.isin(below, c)].any()
    batch_full = b.transitions(adv.edge_advantages)
    batch_pruned = b.transitions(adv.edge_advantages, edge_masks=masks)
    n_trees = 4
    full_edges = n_trees * (2 + 2 + 4 + 4 + 8 + 8 + 8 + 8)
    assert len(batch_full) == full_edges
    assert len(batch_pruned) == full_edges - n_trees * (8 + 8) - n_trees * 4  # depth window, then width
    # the window moves one step earlier every 30 iterations and stops after the last split
    assert pruned.depth_pruned_steps(30) == [5, 6]
    assert pruned.depth_pruned_steps(10_000) == [5, 6]


def test_width_pruning_top_bottom_keeps_best_and_worst_quarter():
    st = strategy("branch_grpo", 6, splits=[0, 1, 2, 3], width_prune="top_bottom", width_keep=0.5)
    ro = roll(st.plan(0), group_size=1, prompts=["x"])
    adv = estimate_advantages("branch_grpo", ro, leaf_rewards(ro), AdvantageConfig(), REWARD_CFG)
    masks = st.pruning(ro, adv, 0).edges
    a4 = adv.edge_advantages[4]  # the 16 children of the last split (step 3)
    keep5 = masks[5]
    order = torch.argsort(a4, descending=True)
    kept = set(ro.levels[5].parent[keep5].tolist())
    assert kept == set(order[:4].tolist()) | set(order[-4:].tolist())


def test_trainer_pruning_leaves_rollout_and_rewards_alone(shapes_model_dir):
    from flowgrpo.config import load_config
    from flowgrpo.trainer.trainer import Trainer

    common = [f"model.path={shapes_model_dir}", "sampler.strategy=branch_grpo", "sampler.num_steps=4",
              "strategy.splits=[0, 2]", "advantage.estimator=branch_grpo", "data.prompts_per_iteration=2",
              "data.trees_per_prompt=1", "reward.weights={shapes: 1.0, jpeg_compressibility: 0.01}",
              "loss.grpo.backend=reference", "train.threads=1"]
    runs = {}
    for name, extra in (("plain", []), ("pruned", ["strategy.width_prune=top", "strategy.depth_prune=1"])):
        tr = Trainer(load_config("shapes", None, common + extra))
        runs[name] = tr.iteration_step()
    a, b = runs["plain"], runs["pruned"]
    assert torch.equal(a.images, b.images)
    assert a.metrics["reward_mean"] == b.metrics["reward_mean"]
    assert a.metrics["nfe_rollout"] == b.metrics["nfe_rollout"]
    # 2 trees: 2 + 2 + 4 + 4 = 12 edges each; depth window {3}: -4; width (top half at step 3 only): already out
    assert a.metrics["transitions"] == 24 and b.metrics["transitions"] == 16
    assert b.metrics["onpolicy_ratio_maxdev"] < 1e-6


# ---------------------------------------------------------------------------- BranchGRPO-Mix, Dynamic-TreeRPO


def test_branch_mix_sde_only_at_splits_and_window():
    st = strategy("branch_grpo_mix", 10, splits=[0, 3, 6], window=2, window_every=5)
    p = st.plan(0)
    assert [i for i, s in enumerate(p.steps) if s.sde] == [0, 1, 3, 6]
    assert p.trained_steps() == [0, 1, 3, 6]
    assert [i for i, s in enumerate(st.plan(12).steps) if s.sde] == [0, 2, 3, 6]  # window at 2 after 2 shifts
    assert [i for i, s in enumerate(st.plan(10_000).steps) if s.sde] == [0, 3, 6, 8, 9]
    ro = roll(p)
    assert ro.levels[3].mean is None and ro.levels[4].mean is not None  # step 2 ODE, step 3 SDE


def test_tree_rpo_window_tree_noise_growth_clip_and_sft():
    st = strategy("tree_rpo", 8, window=3, start=1, shift_every=4, noise_growth=0.5)
    p = st.plan(0)
    assert [i for i, s in enumerate(p.steps) if s.sde] == [1, 2, 3]
    assert [s.noise_level for s in p.steps if s.sde] == pytest.approx([0.7, 1.05, 1.4])
    assert all(s.branch == 2 for s in p.steps if s.sde) and p.leaves_per_tree == 8
    assert [i for i, s in enumerate(st.plan(4).steps) if s.sde] == [2, 3, 4]
    # reward-adaptive clip (loss.grpo.clip_adapt = 1): eps0 * (1 + (1 - q)), q the mean reward clamped to [0, 1]
    assert clip_range_for(1e-4, 1.0, {"r": torch.zeros(4)}) == pytest.approx(2e-4)
    assert clip_range_for(1e-4, 1.0, {"r": torch.ones(4)}) == pytest.approx(1e-4)
    assert clip_range_for(1e-4, 1.0, {"r": torch.tensor([0.5, float("nan")])}) == pytest.approx(1.5e-4)
    assert clip_range_for(1e-4, 1.0, {"r": torch.tensor([3.0]), "s": torch.tensor([-2.0])}) == pytest.approx(1.5e-4)
    assert clip_range_for(1e-4, 0.0, {"r": torch.zeros(4)}) == 1e-4
    ro = roll(p)
    rewards = leaf_rewards(ro)
    adv = estimate_advantages("branch_grpo", ro, rewards, AdvantageConfig(), REWARD_CFG)
    assert st.pruning(ro, adv, 0).edges is None
    best = best_paths(ro, adv.leaf_advantages, adv.leaf_mask)
    trees = ro.leaf_tree
    for t in range(4):
        leaf = int(torch.where(trees == t, rewards["r"], torch.tensor(-1.0)).argmax())
        assert best[-1][leaf]
        assert int(best[-1][trees == t].sum()) == 1
    assert all(int(b.sum()) == 4 for b in best)  # one node per depth per tree
    # SFT term: only best-path rows contribute; positive; zero weight -> no term
    batch = ro.transitions(adv.edge_advantages)
    mean = batch.mean_old.clone().requires_grad_(True)
    aux = best_path_sft_loss(batch, mean, best, 0.5)
    on = torch.stack([best[d][n] for d, n in zip(batch.depth.tolist(), batch.node.tolist())])
    assert int(on.sum()) == 4 * 3  # 3 window edges on each tree's best path
    aux.backward()
    assert (mean.grad.flatten(1).abs().sum(1) > 0).eq(on).all()
    nll = (((batch.prev_sample - batch.mean_old) ** 2) / (2 * batch.std.view(-1, 1, 1, 1) ** 2)).flatten(1).mean(1)
    assert float(aux.detach()) == pytest.approx(0.5 * float(nll[on].sum()) / len(batch), rel=1e-5)
    assert best_path_sft_loss(batch, mean, best, 0.0) is None


def test_best_paths_skip_trees_without_signal():
    ro = roll(strategy("branch_grpo", 3, splits=[0]).plan(0), group_size=1)
    vals = torch.arange(ro.num_leaves, dtype=torch.float32)
    mask = torch.tensor([True, True, False, False])
    best = best_paths(ro, vals, mask)
    assert best[-1].tolist() == [False, True, False, False]
    assert best[0].tolist() == [True, False]


# ============================================================================ TempFlow-GRPO


def test_tempflow_sibling_groups_and_mixed_depths():
    t, k, steps = 6, 3, [0, 2, 4]
    st = strategy("tempflow_grpo", t, branch=k, branch_steps=steps)
    plan = st.plan(0)
    assert plan.trained_steps() == steps
    ro = roll(plan)
    trees = 4
    assert ro.num_leaves == trees * k * len(steps)
    assert (ro.leaves.pos == t).all()
    for d in range(1, len(ro.levels)):
        lv, sde = ro.levels[d], ro.levels[d].sde_mask()
        if d - 1 in steps:  # the branch step: K SDE children + (main chain continues by ODE)
            assert int(sde.sum()) == trees * k
            main = (ro.node_lane(d) == 0).sum()
            assert int(main) == (trees if d - 1 < steps[-1] else 0)
            assert not sde[ro.node_lane(d) == 0].any()
        else:
            assert not sde.any()
    rewards = leaf_rewards(ro)
    adv = estimate_advantages("tempflow", ro, rewards, AdvantageConfig(), REWARD_CFG)
    assert adv.diagnostics["sibling_groups"] == trees * len(steps) and adv.leaf_mask.all()
    for s in steps:
        d = s + 1
        lv, sde = ro.levels[d], ro.levels[d].sde_mask()
        anc = ro.descendant_leaves(d)
        for p in lv.parent[sde].unique().tolist():
            kids = ((lv.parent == p) & sde).nonzero(as_tuple=True)[0]
            assert len(kids) == k
            # each SDE child has exactly one leaf: its ODE completion, whose reward is credited to the edge
            r = torch.stack([rewards["r"][anc == c].squeeze() for c in kids.tolist()])
            assert all(int((anc == c).sum()) == 1 for c in kids.tolist())
            expected = (r - r.mean()) / (r.std(unbiased=False) + 1e-4)
            assert torch.allclose(adv.edge_advantages[d][kids], expected, atol=1e-5)
        assert (adv.edge_advantages[d][~sde] == 0).all()
    batch = ro.transitions(adv.edge_advantages)
    assert len(batch) == trees * k * len(steps)
    assert sorted(batch.step.unique().tolist()) == steps
    assert torch.equal(batch.depth, batch.step + 1)


def test_tempflow_completion_is_the_ode_of_the_sde_child():
    """Each SDE child's leaf is exactly its Euler ODE completion on the remaining grid."""
    policy = TinyPolicy()
    plan = strategy("tempflow_grpo", 5, branch=2, branch_steps=[1]).plan(0)
    ro = roll(plan, group_size=1, policy=policy)
    cond = policy.encode_prompts(PROMPTS)
    d = 2
    lv = ro.levels[d]
    sde = lv.sde_mask().nonzero(as_tuple=True)[0]
    x = lv.x[sde]
    rows = ro.tree_prompt[lv.tree[sde]]
    for i in range(2, 5):
        s = plan.sigmas[i].expand(len(x))
        x = x + (plan.sigmas[i + 1] - plan.sigmas[i]) * policy.velocity(x, s, cond.index(rows))
    anc = ro.descendant_leaves(d)
    leaf_x = torch.stack([ro.leaves.x[(anc == c).nonzero()[0, 0]] for c in sde.tolist()])
    assert torch.allclose(leaf_x, x, atol=1e-6)


# ============================================================================ G2RPO


def test_g2rpo_granularities_leaves_and_mixed_advantage():
    t, g, m, lams = 8, 3, 2, [1, 2, 3]
    st = strategy("g2rpo", t, branch=g, first_steps=m, granularities=lams)
    plan = st.plan(0)
    lane_of = plan.meta.lane_granularity
    assert sorted(lane_of.values()) == lams
    assert plan.leaves_per_tree == m * g * len(lams)
    ro = roll(plan)
    trees = 4
    assert ro.num_leaves == trees * m * g * len(lams)
    assert (ro.leaves.pos == t).all()
    # a completion at stride lambda from the child at grid k + 1 reaches sigma = 0 in ceil((T-k-1)/lambda) edges
    for lane, lam in lane_of.items():
        sel = ro.leaf_lane == lane
        depths = sorted(set(ro.leaf_depth[sel].tolist()))
        assert depths == sorted({k + 1 + math.ceil((t - k - 1) / lam) for k in range(m)})
    # all granularities of one child share that child (and its one model call)
    for k in range(m):
        d = k + 1
        anc = ro.descendant_leaves(d)
        sde = ro.levels[d].sde_mask()
        for c in sde.nonzero(as_tuple=True)[0].tolist():
            assert sorted(ro.leaf_lane[anc == c].tolist()) == sorted(lane_of)
    rewards = leaf_rewards(ro)
    adv = estimate_advantages("g2rpo", ro, rewards, AdvantageConfig(), REWARD_CFG)
    for k in range(m):
        d = k + 1
        lv, sde = ro.levels[d], ro.levels[d].sde_mask()
        anc = ro.descendant_leaves(d)
        for p in lv.parent[sde].unique().tolist():
            kids = ((lv.parent == p) & sde).nonzero(as_tuple=True)[0].tolist()
            total = torch.zeros(len(kids))
            for lane in lane_of:
                r = torch.stack([rewards["r"][(anc == c) & (ro.leaf_lane == lane)].squeeze() for c in kids])
                total += (r - r.mean()) / (r.std(unbiased=False) + 1e-4)
            assert torch.allclose(adv.edge_advantages[d][kids], total, atol=1e-4)  # A_mix = sum_l A^l
    # tempflow on the same rollout uses one group of all leaves per child (their mean)
    adv_tf = estimate_advantages("tempflow", ro, rewards, AdvantageConfig(), REWARD_CFG)
    assert not torch.allclose(adv_tf.edge_advantages[1], adv.edge_advantages[1])
    assert len(ro.transitions(adv.edge_advantages)) == trees * m * g


# ============================================================================ forward cost


def _branch_nfe(t, splits, k):
    return sum(k ** sum(1 for s in splits if s < i) for i in range(t))


def _window_tree_nfe(t, l0, w, k):
    return sum(k ** min(max(i - l0, 0), w) for i in range(t))


def _tempflow_nfe(t, steps, k):
    return steps[-1] + 1 + k * sum(t - 1 - s for s in steps)


def _g2rpo_nfe(t, m, g, lams):
    return m + g * sum(1 + sum(math.ceil((t - 1 - k) / lam) - 1 for lam in lams) for k in range(m) if t - 1 - k > 0)


@pytest.mark.parametrize("case", [
    ("flow_grpo", 10, {}, lambda: 10),
    ("branch_grpo", 20, {}, lambda: 203),
    ("branch_grpo", 10, {"splits": [0, 3, 6]}, lambda: _branch_nfe(10, [0, 3, 6], 2)),
    ("branch_grpo_mix", 10, {"splits": [0, 3, 6], "window": 2}, lambda: _branch_nfe(10, [0, 3, 6], 2)),
    ("tree_rpo", 10, {"window": 3, "start": 2}, lambda: _window_tree_nfe(10, 2, 3, 2)),
    ("tempflow_grpo", 10, {"branch": 4}, lambda: 10 + 4 * sum(10 - 1 - k for k in range(10))),
    ("tempflow_grpo", 10, {"branch": 4, "branch_steps": [0, 3, 6]}, lambda: _tempflow_nfe(10, [0, 3, 6], 4)),
    ("g2rpo", 10, {"branch": 4, "first_steps": 3, "granularities": [1, 2]}, lambda: _g2rpo_nfe(10, 3, 4, [1, 2])),
    ("g2rpo", 16, {}, lambda: _g2rpo_nfe(16, 8, 12, [1, 2])),
], ids=lambda c: f"{c[0]}-T{c[1]}-{'-'.join(f'{k}{v}' for k, v in c[2].items())}")
def test_nfe_matches_the_formula(case):
    name, t, opts, formula = case
    st = strategy(name, t, **opts)
    plan = st.plan(0)
    assert plan.nfe(1) == formula()
    if plan.nfe(1) > 1000:
        return  # the formula is the point; skip the big rollout
    policy = TinyPolicy()
    ro = roll(plan, group_size=2, policy=policy)
    assert ro.nfe == plan.nfe(4) == sum(policy.rows)
    assert policy.calls == len(ro.levels) - 1  # one model call per depth, every node of the depth in it
    assert ro.num_leaves == 4 * plan.leaves_per_tree


def test_nfe_at_equal_t_and_group():
    """Model calls per prompt at T = 10 and 16 samples (leaves) per prompt."""
    t = 10
    tempflow = strategy("tempflow_grpo", t, branch=4, branch_steps=[0, 3, 6, 9]).plan(0)
    costs = {
        "flow_grpo (16 chains)": 16 * t,
        "branch_grpo (K=2 at 0,3,6,9)": strategy("branch_grpo", t).plan(0).nfe(1),
        "tree_rpo (window 4 at l=0)": strategy("tree_rpo", t, window=4).plan(0).nfe(1),
        "tempflow (K=4, steps 0,3,6,9)": tempflow.nfe(1),
        "g2rpo (G=4, M=2, Lambda=1,2)": strategy("g2rpo", t, branch=4, first_steps=2).plan(0).nfe(1),
    }
    leaves = {
        "branch_grpo (K=2 at 0,3,6,9)": strategy("branch_grpo", t).plan(0).leaves_per_tree,
        "tree_rpo (window 4 at l=0)": strategy("tree_rpo", t, window=4).plan(0).leaves_per_tree,
        "tempflow (K=4, steps 0,3,6,9)": tempflow.leaves_per_tree,
        "g2rpo (G=4, M=2, Lambda=1,2)": strategy("g2rpo", t, branch=4, first_steps=2).plan(0).leaves_per_tree,
    }
    assert all(n == 16 for n in leaves.values())
    assert costs == {"flow_grpo (16 chains)": 160, "branch_grpo (K=2 at 0,3,6,9)": 43,
                     "tree_rpo (window 4 at l=0)": 1 + 2 + 4 + 8 + 16 * 6,
                     "tempflow (K=4, steps 0,3,6,9)": 10 + 4 * (9 + 6 + 3 + 0),
                     "g2rpo (G=4, M=2, Lambda=1,2)": 2 + 4 * ((1 + 8 + 4) + (1 + 7 + 3))}


# ============================================================================ validation


def test_option_validation():
    from flowgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="splits"):
        strategy("branch_grpo", 4, splits=[0, 4])
    with pytest.raises(ConfigError, match="branch_noise"):
        strategy("branch_grpo", 10, branch_noise="gauss")
    with pytest.raises(ConfigError, match="width_prune"):
        strategy("branch_grpo", 10, width_prune="all")
    with pytest.raises(ConfigError, match="window"):
        strategy("tree_rpo", 4, window=5)
    with pytest.raises(ConfigError, match="branch_steps"):
        strategy("tempflow_grpo", 4, branch_steps=[4])
    with pytest.raises(ConfigError, match="granularities"):
        strategy("g2rpo", 10, granularities=[0])
    with pytest.raises(ConfigError, match="unknown config key 'strategy.windw'; valid keys under 'strategy': branch"):
        strategy("g2rpo", 10, windw=2)
    with pytest.raises(ValueError, match="stride"):
        StepSpec(sde=True, stride=2)
    with pytest.raises(ValueError, match="must match steps"):
        SamplingPlan(sigma_grid(2), [StepSpec(sde=False), StepSpec(sde=False)],
                     rules={0: [(StepSpec(sde=True),), (StepSpec(sde=False),)]})
