"""Advantages: group z-score, clipping, zero-std groups, NaN rewards, reward combination."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import NAN_EVERY_THIRD, TinyPolicy

from flowgrpo.advantages import combine_rewards, estimate_advantages, group_zscore, valid_reward_mask
from flowgrpo.config import AdvantageConfig, RewardConfig
from flowgrpo.samplers import sigma_grid
from flowgrpo.samplers.plan import SamplingPlan, StepSpec
from flowgrpo.samplers.rollout import ForestSampler

EPS = 1e-4


def np_zscore(values, groups, std_mode="group", eps=EPS, clip=5.0):
    """Independent float64 reference: (r - mean_g) / (pop. std + eps), clipped; zero-std groups -> 0."""
    values, groups = np.asarray(values, np.float64), np.asarray(groups)
    out = np.zeros_like(values)
    gstd = np.std(values)
    for g in np.unique(groups):
        idx = groups == g
        r = values[idx]
        if r.std() <= 1e-6 or idx.sum() < 2:
            continue
        denom = (r.std() if std_mode == "group" else gstd) + eps
        out[idx] = np.clip((r - r.mean()) / denom, -clip, clip)
    return out


def make_groups(num_groups=6, size=8):
    return torch.arange(num_groups).repeat_interleave(size)


@pytest.mark.parametrize("std_mode", ["group", "global"])
def test_zero_mean_within_each_group(std_mode):
    g = torch.Generator().manual_seed(0)
    groups = make_groups()
    # groups of very different scales and offsets
    values = torch.randn(len(groups), generator=g) * (groups.float() + 1) + 3 * groups.float()
    adv, keep, stats = group_zscore(values, groups, torch.ones(len(groups), dtype=torch.bool), std_mode, EPS, clip=1e9)
    assert keep.all() and stats == 0.0
    for k in range(6):
        a = adv[groups == k].double()
        assert abs(a.mean().item()) < 1e-5
        if std_mode == "group":
            assert abs(a.std(unbiased=False).item() - 1) < 1e-3  # unit std per group
    np.testing.assert_allclose(adv.numpy(), np_zscore(values.numpy(), groups.numpy(), std_mode, clip=1e9), rtol=1e-4,
                               atol=1e-5)


def test_global_std_uses_one_denominator_for_the_batch():
    groups = make_groups(2, 4)
    values = torch.tensor([0.0, 1, 2, 3, 10, 20, 30, 40])
    adv, _, _ = group_zscore(values, groups, torch.ones(8, dtype=torch.bool), "global", EPS)
    denom = values.double().std(unbiased=False).item() + EPS
    np.testing.assert_allclose(adv.numpy(), (values.numpy() - np.repeat([1.5, 25.0], 4)) / denom, rtol=1e-5)


def test_advantages_are_clipped_to_plus_minus_5():
    groups = make_groups(2, 100)
    values = torch.zeros(200)
    values[0] = 1.0  # one outlier: z = 0.99 / 0.0995 = 9.95 -> clipped to +5
    values[100:] = 1.0
    values[100] = 0.0  # the opposite outlier -> clipped to -5
    adv, _, _ = group_zscore(values, groups, torch.ones(200, dtype=torch.bool), "group", EPS, clip=5.0)
    assert adv[0].item() == pytest.approx(5.0)
    assert adv[100].item() == pytest.approx(-5.0)
    assert adv.abs().max().item() <= 5.0
    np.testing.assert_allclose(adv.numpy(), np_zscore(values.numpy(), groups.numpy()), rtol=1e-4, atol=1e-6)


def test_zero_std_groups_are_dropped_and_counted():
    groups = make_groups(4, 4)
    values = torch.tensor([1.0, 1, 1, 1,  0, 1, 0, 1,  5, 5, 5, 5,  0, 0, 0, 3])
    adv, keep, stats = group_zscore(values, groups, torch.ones(16, dtype=torch.bool), "group", EPS)
    assert stats == pytest.approx(0.5)
    assert keep.tolist() == [False] * 4 + [True] * 4 + [False] * 4 + [True] * 4
    assert torch.all(adv[~keep] == 0)
    # in global mode the zero-std groups carry no signal either
    adv_g, keep_g, stats_g = group_zscore(values, groups, torch.ones(16, dtype=torch.bool), "global", EPS)
    assert torch.equal(keep_g, keep) and stats_g == pytest.approx(0.5)
    assert torch.all(adv_g[~keep] == 0)


def test_nan_rewards_are_masked_out_of_the_statistics():
    rewards = {"a": torch.tensor([1.0, float("nan"), 3.0, 5.0, 2.0, 2.0, float("inf"), 4.0])}
    mask = valid_reward_mask(rewards)
    assert mask.tolist() == [True, False, True, True, True, True, False, True]
    groups = make_groups(2, 4)
    adv, keep, _ = group_zscore(rewards["a"], groups, mask, "group", EPS)
    assert torch.isfinite(adv).all()
    assert not keep[1] and not keep[6] and adv[1] == 0 and adv[6] == 0
    # statistics over the valid members only: group 0 = {1, 3, 5}, group 1 = {2, 2, 4}
    np.testing.assert_allclose(adv[[0, 2, 3]].numpy(), np_zscore([1, 3, 5], [0, 0, 0]), rtol=1e-4)
    np.testing.assert_allclose(adv[[4, 5, 7]].numpy(), np_zscore([2, 2, 4], [0, 0, 0]), rtol=1e-4)
    # a group left with one valid sample has no signal
    only_one = torch.tensor([1.0, float("nan"), float("nan"), float("nan")])
    adv1, keep1, st = group_zscore(only_one, make_groups(1, 4), valid_reward_mask({"x": only_one}), "group", EPS)
    assert not keep1.any() and st == 1.0


def test_two_reward_combination_modes():
    groups = make_groups(3, 4)
    g = torch.Generator().manual_seed(1)
    ra = torch.rand(12, generator=g)
    rb = torch.rand(12, generator=g) * 1000.0  # a reward on a much larger scale
    weights = {"a": 1.0, "b": 0.5}
    mask = torch.ones(12, dtype=torch.bool)
    summed = combine_rewards({"a": ra, "b": rb}, weights, groups, mask, "sum_then_normalize", EPS)
    torch.testing.assert_close(summed, ra + 0.5 * rb)
    normed = combine_rewards({"a": ra, "b": rb}, weights, groups, mask, "normalize_then_sum", EPS)
    expected = np_zscore(ra.numpy(), groups.numpy(), clip=np.inf) + 0.5 * np_zscore(rb.numpy(), groups.numpy(), clip=np.inf)
    np.testing.assert_allclose(normed.numpy(), expected, rtol=1e-4, atol=1e-5)
    # sum-then-normalize: the large-scale reward dominates the ranking; normalize-then-sum: it does not
    adv_sum, _, _ = group_zscore(summed, groups, mask, "group", EPS)
    adv_b, _, _ = group_zscore(rb, groups, mask, "group", EPS)
    np.testing.assert_allclose(adv_sum.numpy(), adv_b.numpy(), atol=2e-2)
    adv_norm, _, _ = group_zscore(normed, groups, mask, "group", EPS)
    assert np.abs(adv_norm.numpy() - adv_b.numpy()).max() > 0.1
    # one reward: both modes agree
    one = combine_rewards({"a": ra}, {"a": 2.0}, groups, mask, "normalize_then_sum", EPS)
    torch.testing.assert_close(one, 2.0 * ra)


# --------------------------------------------------------------------------- the estimator on a rollout


def small_rollout(num_prompts=3, group_size=4, num_steps=3):
    policy = TinyPolicy()
    plan = SamplingPlan(sigma_grid(num_steps), [StepSpec() for _ in range(num_steps)])
    prompts = [f"prompt {i}" for i in range(num_prompts)]
    return ForestSampler(policy).rollout(plan, prompts, group_size, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("combine", ["sum_then_normalize", "normalize_then_sum"])
def test_estimator_on_a_chain_rollout(combine):
    ro = small_rollout()
    g = torch.Generator().manual_seed(2)
    r = {"x": torch.rand(ro.num_leaves, generator=g), "y": torch.rand(ro.num_leaves, generator=g)}
    r["x"][5] = float("nan")
    r["y"][0:4] = 0.25
    r["x"][0:4] = 0.5  # group 0 has zero std in both rewards
    cfg_adv, cfg_rew = AdvantageConfig(), RewardConfig(weights={"x": 1.0, "y": 1.0}, combine=combine)
    res = estimate_advantages("group_zscore", ro, r, cfg_adv, cfg_rew)
    assert res.nan_dropped == 1
    assert res.zero_std_ratio == pytest.approx(1 / 3)
    assert not res.leaf_mask[5] and not res.leaf_mask[:4].any() and res.leaf_mask[6:].all()
    # a chain: every edge carries its own leaf's advantage
    assert res.edge_advantages[0] is None
    for d in range(1, len(ro.levels)):
        torch.testing.assert_close(res.edge_advantages[d], torch.where(res.leaf_mask, res.leaf_advantages, 0.0))
    for grp in (1, 2):
        kept = res.leaf_mask & (ro.leaf_groups == grp)
        assert abs(res.leaf_advantages[kept].mean().item()) < 1e-5


def test_nan_reward_registered_in_tests_drops_and_counts(tiny_config):
    """The trainer keeps going when a reward fails on some samples: those are dropped and counted."""
    from flowgrpo.trainer.trainer import Trainer

    cfg = tiny_config(**{"reward.weights": f"{{{NAN_EVERY_THIRD}: 1.0}}", "loss.grpo.backend": "reference"})
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.policy.trainable_state_dict().items()}
    out = trainer.iteration_step()
    m = out.metrics
    leaves = cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt
    nan = len(range(0, leaves, 3))
    assert m["nan_rewards_dropped"] == nan
    assert m["transitions"] == (leaves - nan) * cfg.sampler.num_steps
    assert np.isfinite(m["loss"]) and np.isfinite(m[f"reward.{NAN_EVERY_THIRD}"]) and np.isfinite(m["reward_mean"])
    after = trainer.policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())
    m2 = trainer.iteration_step().metrics  # training continues
    assert m2["iteration"] == 1 and m2["nan_rewards_dropped"] == nan and np.isfinite(m2["loss"])


def test_normalize_then_sum_stops_at_the_weighted_sum_of_z_scores():
    """MixGRPO / Pref-GRPO: A = sum_k w_k z_k (clipped); a second per-group z-score only on request."""
    from types import SimpleNamespace

    rollout = small_rollout(num_prompts=3, group_size=4)
    groups = rollout.leaf_groups
    g = torch.Generator().manual_seed(2)
    rewards = {"a": torch.rand(12, generator=g), "b": torch.rand(12, generator=g) * 10}
    weights = {"a": 1.0, "b": 0.5}
    cfg_adv = AdvantageConfig(eps=EPS)
    expected = np_zscore(rewards["a"].numpy(), groups.numpy(), clip=np.inf) + 0.5 * np_zscore(
        rewards["b"].numpy(), groups.numpy(), clip=np.inf)
    res = estimate_advantages("group_zscore", rollout, rewards, cfg_adv,
                              SimpleNamespace(weights=weights, combine="normalize_then_sum", renormalize=False))
    np.testing.assert_allclose(res.leaf_advantages.numpy(), expected, rtol=1e-4, atol=1e-5)
    again = estimate_advantages("group_zscore", rollout, rewards, cfg_adv,
                                SimpleNamespace(weights=weights, combine="normalize_then_sum", renormalize=True))
    np.testing.assert_allclose(again.leaf_advantages.numpy(), np_zscore(expected, groups.numpy()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("std_mode", ["group", "global"])
def test_unbiased_std_estimator_matches_numpy_ddof1(std_mode):
    """DanceGRPO / MixGRPO / BranchGRPO: (r - mean) / (torch.std(r) + 1e-8), torch.std being unbiased."""
    g = torch.Generator().manual_seed(5)
    groups = make_groups(3, 5)
    values = torch.randn(len(groups), generator=g).double()
    adv, keep, _ = group_zscore(values, groups, torch.ones(len(groups), dtype=torch.bool), std_mode, 1e-8,
                                clip=1e9, unbiased=True)
    v = values.numpy()
    for grp in range(3):
        sel = (groups == grp).numpy()
        std = v.std(ddof=1) if std_mode == "global" else v[sel].std(ddof=1)
        np.testing.assert_allclose(adv[sel].numpy(), (v[sel] - v[sel].mean()) / (std + 1e-8), rtol=1e-5)
    pop, _, _ = group_zscore(values, groups, torch.ones(len(groups), dtype=torch.bool), std_mode, 1e-8, clip=1e9)
    # population and unbiased differ by sqrt(n / (n - 1)) exactly (n = 5 per group, 15 overall)
    n = 15 if std_mode == "global" else 5
    np.testing.assert_allclose(pop.numpy() / adv.numpy(), np.sqrt(n / (n - 1)), rtol=1e-5)


def test_method_presets_use_their_references_std_convention():
    from flowgrpo.config import load_config

    for preset in ("dance-grpo", "mix-grpo", "mix-grpo-flash", "branch-grpo", "branch-grpo-mix"):
        cfg = load_config(preset)
        assert (cfg.advantage.std_estimator, cfg.advantage.eps) == ("unbiased", 1e-8), preset
    for preset in ("flow-grpo", "shapes"):
        cfg = load_config(preset)
        assert (cfg.advantage.std_estimator, cfg.advantage.eps) == ("population", 1e-4), preset
