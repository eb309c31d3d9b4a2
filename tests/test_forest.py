"""The rollout forest (samplers/forest.py) and the ForestSampler (samplers/forest_sampler.py): level
shapes, NFE, shared noise, branching, determinism."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyPolicy

from flowgrpo.samplers import sde_step, sigma_grid
from flowgrpo.samplers.plan import SamplingPlan, StepSpec
from flowgrpo.samplers.forest_sampler import ForestSampler

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def branching_plan(num_steps=4, branch_at=1, k=2, ode_at=(3,)):
    steps = []
    for i in range(num_steps):
        sde = i not in ode_at
        steps.append(StepSpec(sde=sde, branch=k if i == branch_at else 1))
    return SamplingPlan(sigma_grid(num_steps), steps)


def rollout(policy, plan, group_size=2, seed=0, shared=False, prompts=PROMPTS, **kw):
    sampler = ForestSampler(policy, **kw)
    return sampler.rollout(plan, prompts, group_size, torch.Generator().manual_seed(seed), shared_group_noise=shared)


def test_the_old_module_path_still_imports_the_sampler():
    from flowgrpo.samplers import rollout as old

    assert old.ForestSampler is ForestSampler


def test_level_shapes_parents_and_trees(tiny_policy):
    plan = branching_plan(num_steps=4, branch_at=1, k=3, ode_at=(3,))
    ro = rollout(tiny_policy, plan, group_size=2)
    trees = len(PROMPTS) * 2
    expected = [trees, trees, trees * 3, trees * 3, trees * 3]
    assert plan.nodes_per_depth(trees) == expected
    assert [len(lv) for lv in ro.levels] == expected
    for d, lv in enumerate(ro.levels):
        assert lv.x.shape == (expected[d], *tiny_policy.latent_shape)
        assert lv.x.dtype == torch.float32
        assert lv.parent.shape == lv.tree.shape == (expected[d],)
        if d == 0:
            assert torch.all(lv.parent == -1)
            assert torch.equal(lv.tree, torch.arange(trees))
            continue
        # a node belongs to its parent's tree
        assert torch.equal(lv.tree, ro.levels[d - 1].tree[lv.parent])
        step = plan.steps[d - 1]
        if step.sde:
            assert lv.mean.shape == lv.x.shape and lv.std.shape == (expected[d],) and lv.log_prob.shape == (expected[d],)
            assert torch.isfinite(lv.log_prob).all()
        else:
            assert lv.mean is None and lv.std is None and lv.log_prob is None
    # depth-2 nodes: each depth-1 node has exactly 3 children, consecutive
    assert torch.equal(ro.levels[2].parent, torch.arange(trees).repeat_interleave(3))
    assert ro.num_leaves == trees * 3 == trees * plan.leaves_per_tree
    assert ro.leaf_prompts == [PROMPTS[i // 6] for i in range(trees * 3)]
    assert torch.equal(ro.leaf_groups, torch.arange(len(PROMPTS)).repeat_interleave(6))
    assert torch.equal(ro.tree_prompt, ro.tree_group)


def test_nfe_is_nodes_of_the_non_final_depths_and_parents_are_evaluated_once():
    plan = SamplingPlan(sigma_grid(5), [StepSpec(), StepSpec(branch=2), StepSpec(), StepSpec(branch=3),
                                        StepSpec(sde=False)])
    policy = TinyPolicy()
    ro = rollout(policy, plan, group_size=2)
    trees = len(PROMPTS) * 2
    nodes = plan.nodes_per_depth(trees)
    assert nodes == [6, 6, 12, 12, 36, 36]
    assert ro.nfe == plan.nfe(trees) == sum(nodes[:-1]) == 72
    # one model call per depth (no chunking at this size), each with that depth's nodes: the
    # velocity of a branching node is computed once and shared by its children
    assert policy.calls == plan.num_steps
    assert policy.rows == nodes[:-1]
    assert sum(policy.rows) == ro.nfe


def test_chunking_changes_neither_results_nor_nfe():
    plan = branching_plan(num_steps=3, branch_at=0, k=2, ode_at=())
    p1, p2 = TinyPolicy(), TinyPolicy()
    a = rollout(p1, plan, group_size=2, seed=3)
    b = rollout(p2, plan, group_size=2, seed=3, max_micro_batch=5)
    assert a.nfe == b.nfe
    assert max(p2.rows) <= 5 and sum(p2.rows) == sum(p1.rows)
    for la, lb in zip(a.levels, b.levels):
        torch.testing.assert_close(la.x, lb.x, rtol=1e-6, atol=1e-6)


def test_branch_children_share_the_parent_velocity():
    k = 4
    plan = branching_plan(num_steps=3, branch_at=1, k=k, ode_at=())
    policy = TinyPolicy()
    ro = rollout(policy, plan, group_size=2)
    parents, children = ro.levels[1], ro.levels[2]
    assert len(children) == k * len(parents)
    for p in range(len(parents)):
        kids = (children.parent == p).nonzero(as_tuple=True)[0]
        assert len(kids) == k
        # same parent state and velocity -> identical Gaussian mean and std for all K children ...
        for j in kids[1:]:
            assert torch.equal(children.mean[kids[0]], children.mean[j])
            assert children.std[kids[0]] == children.std[j]
        # ... but independent noise: the children differ
        assert len({tuple(children.x[j].flatten()[:4].tolist()) for j in kids}) == k
        # the stored mean is exactly that of the parent's velocity
        s, sn = plan.sigmas[1], plan.sigmas[2]
        v = policy.velocity(parents.x[p:p + 1], s.expand(1), policy.encode_prompts([ro.prompts[ro.tree_prompt[parents.tree[p]]]]))
        out = sde_step(parents.x[p:p + 1], v, s, sn, noise_level=0.7, prev_sample=children.x[kids[0]:kids[0] + 1],
                       sigma_max=plan.sigmas[1])
        torch.testing.assert_close(out.mean[0], children.mean[kids[0]], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.log_prob[0], children.log_prob[kids[0]], rtol=1e-5, atol=1e-5)


def test_shared_group_noise_gives_identical_initial_noise_within_a_group(tiny_policy):
    plan = branching_plan(num_steps=2, branch_at=-1, ode_at=())
    g = 3
    shared = rollout(tiny_policy, plan, group_size=g, shared=True)
    x0 = shared.levels[0].x
    for p in range(len(PROMPTS)):
        grp = x0[p * g:(p + 1) * g]
        assert all(torch.equal(grp[0], grp[j]) for j in range(1, g))
    assert not torch.equal(x0[0], x0[g])  # groups differ
    # the SDE noise still differs within a group, so the samples do
    assert not torch.equal(shared.leaves.x[0], shared.leaves.x[1])
    private = rollout(tiny_policy, plan, group_size=g, shared=False)
    y0 = private.levels[0].x
    assert not torch.equal(y0[0], y0[1])


def test_rollouts_are_deterministic_for_a_fixed_generator(tiny_policy):
    plan = branching_plan(num_steps=4, branch_at=2, k=2, ode_at=(0,))
    a = rollout(tiny_policy, plan, seed=42)
    b = rollout(tiny_policy, plan, seed=42)
    c = rollout(tiny_policy, plan, seed=43)
    for la, lb in zip(a.levels, b.levels):
        assert torch.equal(la.x, lb.x)
        assert torch.equal(la.parent, lb.parent)
        if la.log_prob is not None:
            assert torch.equal(la.log_prob, lb.log_prob) and torch.equal(la.mean, lb.mean)
    assert not torch.equal(a.leaves.x, c.leaves.x)


def test_logprob_of_every_edge_rescores_consistently(tiny_policy):
    plan = branching_plan(num_steps=3, branch_at=1, k=2, ode_at=())
    ro = rollout(tiny_policy, plan)
    cond = tiny_policy.encode_prompts(ro.prompts)
    for i, step in enumerate(plan.steps):
        parent, child = ro.levels[i], ro.levels[i + 1]
        xs = parent.x[child.parent]
        v = tiny_policy.velocity(xs, plan.sigmas[i].expand(len(child)), cond.index(ro.tree_prompt[child.tree]))
        out = sde_step(xs, v, plan.sigmas[i], plan.sigmas[i + 1], noise_level=step.noise_level, kind=step.sde_kind,
                       prev_sample=child.x, sigma_max=plan.sigmas[1])
        torch.testing.assert_close(out.log_prob, child.log_prob, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.mean, child.mean, rtol=1e-5, atol=1e-6)


def test_transitions_flatten_the_trained_sde_edges(tiny_policy):
    plan = SamplingPlan(sigma_grid(4), [StepSpec(), StepSpec(branch=2), StepSpec(sde=False), StepSpec(train=False)])
    ro = rollout(tiny_policy, plan, group_size=2)
    nodes = plan.nodes_per_depth(len(PROMPTS) * 2)
    assert plan.trained_steps() == [0, 1]
    adv = [None] + [torch.arange(n, dtype=torch.float32) for n in nodes[1:]]
    batch = ro.transitions(adv)
    assert len(batch) == nodes[1] + nodes[2]
    assert batch.sample.shape == (len(batch), *tiny_policy.latent_shape)
    assert torch.equal(batch.step, torch.tensor([0] * nodes[1] + [1] * nodes[2]))
    assert torch.equal(batch.sample[:nodes[1]], ro.levels[0].x)
    assert torch.equal(batch.sample[nodes[1]:], ro.levels[1].x[ro.levels[2].parent])
    assert torch.equal(batch.prev_sample[nodes[1]:], ro.levels[2].x)
    assert torch.equal(batch.log_prob_old[:nodes[1]], ro.levels[1].log_prob)
    assert torch.all(batch.sigma[:nodes[1]] == plan.sigmas[0]) and torch.all(batch.sigma_next[nodes[1]:] == plan.sigmas[2])
    assert torch.equal(batch.advantages, torch.cat([adv[1], adv[2]]))
    assert torch.equal(batch.prompt, ro.tree_prompt[batch.tree])
    # masks keep a subset; an ODE-only selection is refused
    masks = [None, torch.arange(nodes[1]) % 2 == 0, None, None, None]
    assert len(ro.transitions(adv, edge_masks=masks)) == nodes[1] // 2 + nodes[2]
    with pytest.raises(ValueError):
        ro.transitions(adv, steps=[2])


def test_mean_over_descendants(tiny_policy):
    plan = branching_plan(num_steps=3, branch_at=0, k=2, ode_at=())
    ro = rollout(tiny_policy, plan, group_size=1, prompts=PROMPTS[:2])
    leaf_vals = torch.arange(ro.num_leaves, dtype=torch.float32)  # 4 leaves, trees of 2
    torch.testing.assert_close(ro.mean_over_descendants(leaf_vals, 0), torch.tensor([0.5, 2.5]))
    torch.testing.assert_close(ro.mean_over_descendants(leaf_vals, 3), leaf_vals)
    mask = torch.tensor([True, False, False, False])
    torch.testing.assert_close(ro.mean_over_descendants(leaf_vals, 1, mask), torch.tensor([0.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(ro.mean_over_descendants(leaf_vals + 1, 0, mask), torch.tensor([1.0, 0.0]))


def test_plan_validation():
    with pytest.raises(ValueError):
        StepSpec(branch=0)
    with pytest.raises(ValueError, match="euler"):
        StepSpec(solver="heun")
    with pytest.raises(ValueError):
        SamplingPlan(sigma_grid(3), [StepSpec()] * 2)
