"""Branching into a deterministic step (CPS into sigma' = 0, any kind at noise level 0).

Such a step has std 0: it runs as an ODE step, and its K children would be K identical copies (K
leaves decoded and scored for one image, groups padded with duplicates). The plan gives the step
one child instead; steps with noise keep their K children.
"""

from __future__ import annotations

import torch
from conftest import TinyPolicy

from flowgrpo.advantages.trees import tempflow_estimator
from flowgrpo.config import AdvantageConfig, RewardConfig, SamplerConfig
from flowgrpo.samplers.rollout import ForestSampler
from flowgrpo.samplers.strategies import build_strategy

PROMPTS = ["a red circle", "two blue squares"]
TREES_PER_PROMPT = 2


def plan_of(name: str, kind: str = "cps", noise_level: float = 0.7, **options):
    cfg = SamplerConfig(strategy=name, num_steps=4, sde_kind=kind, noise_level=noise_level)
    return build_strategy(cfg, options).plan(0)


def roll(plan):
    return ForestSampler(TinyPolicy(), max_micro_batch=4096).rollout(
        plan, PROMPTS, TREES_PER_PROMPT, torch.Generator().manual_seed(0))


def distinct_leaves(ro) -> int:
    """Leaves [L, ...] that differ from every other leaf of their tree."""
    x, tree = ro.leaves.x.flatten(1), ro.leaf_tree
    same = (torch.cdist(x, x) == 0) & (tree[:, None] == tree[None, :])
    return int((same.sum(1) == 1).sum())


def test_branch_grpo_split_into_sigma_zero_makes_one_child_under_cps():
    plan = plan_of("branch_grpo", splits=[0, 3], branch=2)  # step 3 goes into sigma' = 0
    last = plan.steps[3]
    assert not last.sde and last.branch == 1 and plan.steps[0].sde and plan.steps[0].branch == 2
    assert plan.trained_steps() == [0, 1, 2] and plan.leaves_per_tree == 2
    ro = roll(plan)
    trees = len(PROMPTS) * TREES_PER_PROMPT
    assert ro.num_leaves == trees * 2 == distinct_leaves(ro)  # before: 4 leaves a tree, two of each image
    assert ro.nfe == plan.nfe(trees) == trees * (1 + 2 + 2 + 2)  # the last step's velocity is still computed once
    # with noise into sigma' = 0 (the Flow-GRPO kind) the split keeps its K distinct children
    flow = plan_of("branch_grpo", kind="flow_grpo", splits=[0, 3], branch=2)
    assert flow.steps[3].sde and flow.steps[3].branch == 2 and flow.leaves_per_tree == 4
    ro = roll(flow)
    assert ro.num_leaves == distinct_leaves(ro) == trees * 4


def test_tempflow_branch_point_at_the_last_step_makes_one_leaf_under_cps():
    plan = plan_of("tempflow_grpo", branch=3, branch_steps=[0, 3])
    assert plan.leaves_per_tree == 3 + 1  # before: 3 + 3, the last three identical
    ro = roll(plan)
    assert ro.num_leaves == distinct_leaves(ro) == len(PROMPTS) * TREES_PER_PROMPT * 4
    rewards = {"r": ro.leaves.x.flatten(1).mean(1).cpu()}  # a continuous reward: distinct leaves differ
    adv = tempflow_estimator(ro, rewards, AdvantageConfig(), RewardConfig(weights={"r": 1.0}))
    # the sibling groups are those of step 0 (one per tree), all with spread; the last branch point's
    # single ODE child is a leaf without signal
    assert adv.diagnostics["sibling_groups"] == len(PROMPTS) * TREES_PER_PROMPT
    assert adv.zero_std_ratio == 0.0 and int(adv.leaf_mask.sum()) == len(PROMPTS) * TREES_PER_PROMPT * 3


def test_noise_level_zero_makes_every_split_one_child():
    """At noise level 0 every SDE step is deterministic: a BranchGRPO plan is one ODE chain."""
    plan = plan_of("branch_grpo", kind="flow_grpo", noise_level=0.0, splits=[0, 2], branch=3)
    assert all(not s.sde and s.branch == 1 for s in plan.steps) and plan.leaves_per_tree == 1
