"""DiffusionNFT, AWM and DGPO against their authors' formulas, on the full optimizer step.

Each test runs the objective through the shared update loop (:func:`run_update`) on a tiny linear
velocity model and a forest of 3 groups x 4 samples whose middle group has no reward spread, and
compares the gradient the engine receives with a float64 derivation written here, sample by sample
(the model, forest and update are tests/forward_harness.py's),
from the authors' training scripts (NVlabs/DiffusionNFT train_nft_sd3.py, scxue/advantage_weighted_matching
train_sd3_awm.py, Luo-Yihong/DGPO train_sd3_dgpo.py): every sample with a finite reward trains (a
zero-spread group has advantage 0, counts in the mean and carries the regularisers), DGPO's sigmoid
is taken per timestep, its KL always goes to the base model and its EMA reference follows
min(0.3, 0.001 n). Only the rows' data (times, noise) are taken from flowgrpo.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from forward_harness import (GROUPS, SIZE, GradEngine, LinearPolicy, each_row, grad, make_cfg, make_ctx, rel, rows_data,
                             train_step, world, assert_step)

from flowgrpo.errors import ConfigError
from flowgrpo.objectives.awm import AWMObjective
from flowgrpo.objectives.dgpo import DGPOObjective
from flowgrpo.objectives.nft import NFTObjective
from flowgrpo.objectives.options import AWMOptions, DGPOOptions, NFTOptions, check_objective_options
from flowgrpo.trainer.update_loop import run_update

# --------------------------------------------------------------------------- DiffusionNFT


def _nft_authors(d, theta, old, base, beta, a_max, kl_beta):
    """train_nft_sd3.py's loss, one (sample, timestep) row at a time, mean over every row."""
    total = 0.0
    for i, t, x0, _eps, xt, (v, v_old, v_ref) in each_row(d, theta, old, base):
        v_old = v_old.detach()
        a = min(max(float(d["adv"][i]), -a_max), a_max)
        r = min(max(a / a_max / 2 + 0.5, 0.0), 1.0)
        x0_pos = xt - t * (beta * v + (1 - beta) * v_old)
        x0_neg = xt - t * ((1 + beta) * v_old - beta * v)
        w_pos = (x0_pos - x0).abs().mean().detach().clamp(min=1e-5)
        w_neg = (x0_neg - x0).abs().mean().detach().clamp(min=1e-5)
        policy = (r * ((x0_pos - x0) ** 2 / w_pos).mean() / beta + (1 - r) * ((x0_neg - x0) ** 2 / w_neg).mean() / beta)
        total = total + policy * a_max + kl_beta * ((v - v_ref) ** 2).mean()
    return total / len(d["t"])


@pytest.mark.parametrize("rows_opt", ["all", "signal"])
def test_nft_step_equals_the_authors_on_rows_with_a_zero_spread_group(rows_opt):
    base, sets, forest = world(0)
    policy = LinearPolicy(*sets[0], *base)
    opt = NFTOptions(timesteps=3, kl_beta=0.05, rows=rows_opt)
    grads, rows = train_step(NFTObjective(make_cfg(nft=opt)), policy, forest, make_cfg(nft=opt), {"old": sets[1]})
    assert len(grads) == 1
    d = rows_data(rows, forest)
    expected = set(range(GROUPS * SIZE)) if rows_opt == "all" else set(forest["mask"].nonzero().flatten().tolist())
    assert set(d["leaf"].tolist()) == expected and len(rows) == 3 * len(expected)
    theta = tuple(p.detach().clone().requires_grad_(True) for p in sets[0])
    want = grad(_nft_authors(d, theta, sets[1], base, opt.beta, opt.adv_clip, opt.kl_beta), theta)
    assert_step(grads[0], want)
    if rows_opt == "all":  # the zero-spread group pulls v toward v_old (r = 1/2) and carries the KL
        keep = forest["mask"][d["leaf"]]
        signal_only = {k: v[keep] for k, v in d.items()}
        without = grad(_nft_authors(signal_only, theta, sets[1], base, opt.beta, opt.adv_clip, opt.kl_beta), theta)
        assert rel([w * keep.sum() / len(keep) for w in without], want) > 1e-3


def test_nft_binary_mode_is_the_authors_sign():
    from flowgrpo.objectives.nft import nft_optimality

    r = nft_optimality(torch.tensor([-9.0, -0.1, 0.0, 0.1, 9.0]), 5.0, "binary")
    assert r.tolist() == pytest.approx([0.4, 0.4, 0.5, 0.6, 0.6])


# --------------------------------------------------------------------------- AWM


def _awm_authors(d, theta, ema, base, kl_beta, ema_kl_beta, adv_clip=5.0, clip=1.0, p=0.25):
    """train_sd3_awm.py's first (on-policy) step: ghuber surrogate, PPO clip, KL to the base and to the EMA."""
    total = 0.0
    for i, t, x0, eps, _xt, (v, v_ref, v_ema) in each_row(d, theta, base, ema):
        err = ((v - (eps - x0)) ** 2).mean()
        ll = -t * ((err + 1e-10) ** p - 1e-10**p) / p
        ratio = torch.exp(ll - ll.detach())
        a = min(max(float(d["adv"][i]), -adv_clip), adv_clip) / adv_clip
        policy = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip))
        total = total + policy + kl_beta * ((v - v_ref) ** 2).mean() + ema_kl_beta * ((v - v_ema.detach()) ** 2).mean()
    return total / len(d["t"])


def test_awm_step_equals_the_authors_on_rows_with_a_zero_spread_group():
    base, sets, forest = world(1)
    policy = LinearPolicy(*sets[0], *base)
    opt = AWMOptions(timesteps=3, kl_beta=0.05, ema_kl_beta=1.0)
    assert opt.rows == "all"
    grads, rows = train_step(AWMObjective(make_cfg(awm=opt)), policy, forest, make_cfg(awm=opt), {"ema": sets[2]})
    d = rows_data(rows, forest)
    assert set(d["leaf"].tolist()) == set(range(GROUPS * SIZE))
    theta = tuple(p.detach().clone().requires_grad_(True) for p in sets[0])
    assert_step(grads[0], grad(_awm_authors(d, theta, sets[2], base, opt.kl_beta, opt.ema_kl_beta), theta))


def _awm_off_policy_step(micro, opt, split_samples=False):
    """One AWM step after an earlier one (the old policy is another weight set), micro-batches of ``micro``;
    returns (gradient, the leaf ids of each micro-batch)."""
    base, sets, forest = world(2)
    policy = LinearPolicy(*sets[0], *base)
    cfg = make_cfg(micro=micro, awm=opt)
    objective = AWMObjective(cfg)
    ctx = make_ctx(policy, forest, cfg)
    objective.setup(policy)
    rows = objective.rows(ctx)
    objective.old.weights = {"W": sets[1][0].clone(), "b": sets[1][1].clone()}
    objective._steps = 1  # as after a first optimizer step: l_old comes from the old weights
    objective.rows = lambda _ctx, _r=rows: _r
    if split_samples:  # the loop before issue 47: rows ordered by step, split at train.micro_batch
        objective.micro_batch_key = lambda: None
    seen, micro_loss = [], objective.micro_loss
    objective.micro_loss = lambda c, r: (seen.append(r.leaf.tolist()), micro_loss(c, r))[1]
    engine = GradEngine(policy.trainable_parameters())
    run_update(ctx, objective, engine)
    return engine.grads[0], seen


def test_awm_mean_ratio_does_not_depend_on_the_micro_batch():
    """ratio_mode=mean clips the ratio of a sample's mean surrogate over its K times: micro-batches hold whole
    samples (K = 6 rows, more than a micro-batch of 5), so off-policy the step is the same at micro-batch 5,
    64 and 1000 (float64); split by step, as before, it was not."""
    opt = AWMOptions(timesteps=6, time_sampler="uniform", ratio_mode="mean", clip_range=0.05, kl_beta=0.0,
                     ema_kl_beta=0.0)
    g5, seen5 = _awm_off_policy_step(5, opt)
    g64, seen64 = _awm_off_policy_step(64, opt)
    g1000, _ = _awm_off_policy_step(1000, opt)
    assert all(len(m) == 6 and len(set(m)) == 1 for m in seen5)  # one whole sample per micro-batch of 5
    assert [len(m) for m in seen64] == [60, 12]  # 10 whole samples fit in 64 rows
    leaves = [leaf for m in seen64 for leaf in m]
    assert all(leaves.count(leaf) == 6 for leaf in set(leaves))
    assert rel(g5, g64) < 1e-10 and rel(g1000, g64) < 1e-10, (rel(g5, g64), rel(g1000, g64))
    split5, _ = _awm_off_policy_step(5, opt, split_samples=True)
    assert rel(split5, g64) > 1e-3  # what the whole-sample micro-batches remove


# --------------------------------------------------------------------------- DGPO


def _dgpo_authors(d, theta, ref, base, beta, kl_beta, group_size=SIZE, sigma_per_timestep=True):
    """train_sd3_dgpo.py: per timestep, group sums S_g = sum_i A_i beta (dsm_i - ref_dsm_i) / G, row loss
    sigmoid(S_g) A_i dsm_i (sigmoid detached) + kl_beta mean((v - v_base)^2), mean over every row.
    ``sigma_per_timestep=False``: the sigmoid of the margin averaged over the timesteps (the old flowgrpo)."""
    n = len(d["t"])
    xt = (1 - d["t"].view(-1, 1)) * d["x0"] + d["t"].view(-1, 1) * d["eps"]
    tt = d["t"].view(-1, 1)
    v = (xt @ theta[0]) * (1 + tt) + theta[1] + d["cond"]
    v_ref = ((xt @ ref[0]) * (1 + tt) + ref[1] + d["cond"]).detach()
    v_base = ((xt @ base[0]) * (1 + tt) + base[1] + d["cond"]).detach()
    u = d["eps"] - d["x0"]
    dsm = ((v - u) ** 2).mean(1)
    delta = (dsm - ((v_ref - u) ** 2).mean(1)).detach()
    weight = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        if sigma_per_timestep:
            same = (d["group"] == d["group"][i]) & (d["slot"] == d["slot"][i])
            s = (d["adv"][same] * beta * delta[same] / group_size).sum()
        else:
            same = d["group"] == d["group"][i]
            k = int((d["slot"][same]).max()) + 1
            s = (d["adv"][same] * beta * delta[same] / group_size).sum() / k
        weight[i] = torch.sigmoid(s)
    loss = weight * d["adv"] * dsm + kl_beta * ((v - v_base) ** 2).mean(1)
    return loss.mean()


@pytest.mark.parametrize("beta", [100.0, 2000.0])
def test_dgpo_step_equals_the_authors_per_timestep_sigmoid(beta):
    base, sets, forest = world(2)
    policy = LinearPolicy(*sets[0], *base)
    opt = DGPOOptions(beta_dpo=beta, kl_beta=0.05, timesteps=3)
    grads, rows = train_step(DGPOObjective(make_cfg(dgpo=opt)), policy, forest, make_cfg(dgpo=opt))
    d = rows_data(rows, forest)
    assert set(d["leaf"].tolist()) == set(range(GROUPS * SIZE)) and int(d["slot"].max()) == 2
    theta = tuple(p.detach().clone().requires_grad_(True) for p in sets[0])
    want = grad(_dgpo_authors(d, theta, base, base, beta, opt.kl_beta), theta)
    assert_step(grads[0], want)
    averaged = grad(_dgpo_authors(d, theta, base, base, beta, opt.kl_beta, sigma_per_timestep=False), theta)
    assert rel(averaged, want) > 1e-2  # the test tells the two apart


def test_dgpo_ema_reference_keeps_the_kl_on_the_base_model():
    base, sets, forest = world(3)
    policy = LinearPolicy(*sets[0], *base)
    opt = DGPOOptions(beta_dpo=100.0, kl_beta=0.05, timesteps=2, reference="ema")
    objective = DGPOObjective(make_cfg(dgpo=opt))
    assert objective.needs_reference  # the KL needs the base model even with an EMA reference
    grads, rows = train_step(objective, policy, forest, make_cfg(dgpo=opt), {"ema": sets[2]})
    d = rows_data(rows, forest)
    theta = tuple(p.detach().clone().requires_grad_(True) for p in sets[0])
    assert_step(grads[0], grad(_dgpo_authors(d, theta, sets[2], base, 100.0, opt.kl_beta), theta))
    kl_to_ema = grad(_dgpo_authors(d, theta, sets[2], sets[2], 100.0, opt.kl_beta), theta)
    assert rel(kl_to_ema, grads[0]) > 1e-3


def test_dgpo_ema_decay_schedule_and_rollout_switch():
    base, sets, _ = world(4)
    policy = LinearPolicy(*sets[0], *base)
    opt = DGPOOptions(reference="ema", ema_decay=0.3, ema_decay_rate=0.1, ema_rollouts_after=2)
    objective = DGPOObjective(make_cfg(dgpo=opt))
    objective.setup(policy)
    ema = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    g = torch.Generator().manual_seed(9)
    for n in range(6):
        with objective.rollout_weights(policy):  # the live weights until more than 2 steps are taken
            rolled = policy.trainable_state_dict()
        target = ema if n > 2 else policy.trainable_state_dict()
        assert all(torch.allclose(rolled[k], target[k], rtol=1e-12, atol=1e-12) for k in rolled)
        assert n <= 2 or not torch.allclose(rolled["W"], policy.W.detach())
        policy.load_trainable_state_dict({k: v + torch.randn(v.shape, generator=g, dtype=v.dtype)
                                          for k, v in policy.trainable_state_dict().items()})
        objective.after_step(SimpleNamespace(policy=policy))
        decay = min(0.3, 0.1 * n)  # the authors' min(0.3, 0.001 n) at rate 0.1: 0, .1, .2, .3, .3, .3
        live = policy.trainable_state_dict()
        ema = {k: decay * ema[k] + (1 - decay) * live[k] for k in ema}
        for k in ema:
            torch.testing.assert_close(objective.ema.weights[k], ema[k], rtol=1e-12, atol=1e-12)
    frozen = DGPOObjective(make_cfg(dgpo=DGPOOptions(ema_rollouts_after=-1)))
    frozen.setup(policy)
    assert frozen.ema is None  # no EMA kept when neither the reference nor the rollouts use it


def test_dgpo_minibatches_keep_groups_whole():
    base, sets, forest = world(5)
    policy = LinearPolicy(*sets[0], *base)
    opt = DGPOOptions(beta_dpo=100.0, kl_beta=0.0, timesteps=2)
    objective = DGPOObjective(make_cfg(dgpo=opt))
    seen = []
    begin = objective.begin_minibatch
    objective.begin_minibatch = lambda ctx, rows, passes: (seen.append(rows.leaf.clone()), begin(ctx, rows, passes))[1]
    grads, _ = train_step(objective, policy, forest, make_cfg(minibatches=3, dgpo=opt))
    assert len(grads) == len(seen) == 3
    groups = [set(forest["group"][leaf].tolist()) for leaf in seen]
    assert all(len(gs) == 1 for gs in groups) and len(set().union(*groups)) == 3
    for leaf in seen:  # every sample of the group, at both of its times
        assert len(leaf) == 2 * SIZE


# --------------------------------------------------------------------------- option checks


def test_policy_min_t_without_any_anchor_weight_is_one_line():
    loss = SimpleNamespace(nft=NFTOptions(policy_min_t=0.4, anchor_beta=0.0, kl_beta=0.0), awm=AWMOptions(),
                           dgpo=DGPOOptions())
    with pytest.raises(ConfigError, match=r"'loss.nft.policy_min_t'.*anchor_beta") as err:
        check_objective_options(loss)
    assert "\n" not in str(err.value)
    loss.nft.kl_beta = 1.0
    check_objective_options(loss)  # the low rows then carry the KL term alone
