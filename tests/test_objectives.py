"""Forward-process objectives (DiffusionNFT, AWM, DGPO) against float64 re-derivations of their
authors' formulas, and their behaviour in the trainer (rows, weighting rule, resume, on-policy ratio).

The re-derivations are written in the algebra of the papers, not the code's: with x_t - x0 = t u
(u = eps - x0), DiffusionNFT's x0-space errors are t (u - v+-), and AWM's surrogate is the negative
flow-matching error.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.objectives.awm import fm_log_likelihood, ppo_clip_loss
from flowgrpo.objectives.nft import nft_optimality, nft_policy_loss
from flowgrpo.objectives.old_policy import DecaySchedule
from flowgrpo.trainer.trainer import Trainer
from conftest import BRIGHTNESS

D = (3, 4, 4)


def _inputs(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, *D, generator=g, dtype=torch.float64)
    eps = torch.randn(n, *D, generator=g, dtype=torch.float64)
    t = torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05
    v = (eps - x0) + 0.3 * torch.randn(n, *D, generator=g, dtype=torch.float64)
    v_old = v + 0.05 * torch.randn(n, *D, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64) * 3
    return x0, eps, t, v, v_old, adv


def _nft_reference(v, v_old, x0, eps, t, adv, beta, a_max):
    """DiffusionNFT in float64, written from the paper's quantities (u = eps - x0)."""
    u = eps - x0
    tt = t.view(-1, 1, 1, 1)
    r = ((adv.clamp(-a_max, a_max) / a_max) / 2 + 0.5).clamp(0, 1)
    e_pos = tt * (u - (beta * v + (1 - beta) * v_old))  # x0+ - x0
    e_neg = tt * (u - ((1 + beta) * v_old - beta * v))  # x0- - x0
    w_pos = e_pos.abs().mean((1, 2, 3)).detach().clamp(min=1e-5)
    w_neg = e_neg.abs().mean((1, 2, 3)).detach().clamp(min=1e-5)
    per = r * (e_pos**2).mean((1, 2, 3)) / w_pos + (1 - r) * (e_neg**2).mean((1, 2, 3)) / w_neg
    return a_max * per / beta


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_loss_and_gradient_match_float64_derivation(beta):
    x0, eps, t, v, v_old, adv = _inputs()
    v64 = v.clone().requires_grad_(True)
    ref = _nft_reference(v64, v_old, x0, eps, t, adv, beta, 5.0)
    ref.sum().backward()
    # the objective's function, in float32 as it runs
    v32 = v.float().clone().requires_grad_(True)
    x_t = ((1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps).float()
    r = nft_optimality(adv.float(), 5.0)
    loss, _ = nft_policy_loss(v32, v_old.float(), x_t, x0.float(), t.float(), r, beta, 5.0)
    loss.sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(v32.grad.double(), v64.grad, rtol=2e-4, atol=1e-6)


def test_nft_at_old_policy_is_advantage_weighted_flow_matching():
    """At v = v_old (beta = 1) the gradient is A_max 2 t (1 - 2r) (u - v) / (D mean|u - v|): good samples
    (r > 1/2) pull v toward u, bad ones push it away, zero-advantage samples (r = 1/2) not at all."""
    x0, eps, t, v, _, adv = _inputs(seed=1)
    adv[0] = 0.0
    v32 = v.float().clone().requires_grad_(True)
    x_t = ((1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps).float()
    r = nft_optimality(adv.float(), 5.0)
    loss, _ = nft_policy_loss(v32, v.float(), x_t, x0.float(), t.float(), r, 1.0, 5.0)
    loss.sum().backward()
    u = (eps - x0).float()
    n = u[0].numel()
    expected = 5.0 * 2 * t.float().view(-1, 1, 1, 1) * (1 - 2 * r).view(-1, 1, 1, 1) * (u - v.float()) / (
        n * (u - v.float()).abs().mean((1, 2, 3)).view(-1, 1, 1, 1))
    torch.testing.assert_close(v32.grad, expected, rtol=1e-4, atol=1e-7)
    assert v32.grad[0].abs().max() < 1e-7


def test_nft_optimality_modes():
    a = torch.tensor([-7.0, -2.5, 0.0, 2.5, 7.0])
    assert nft_optimality(a, 5.0).tolist() == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert nft_optimality(a, 5.0, "positive_only").tolist() == pytest.approx([0.5, 0.5, 0.5, 0.75, 1.0])
    assert nft_optimality(a, 5.0, "negative_only").tolist() == pytest.approx([0.0, 0.25, 0.5, 0.5, 0.5])
    # the authors' binary mode: A -> sign(A), then the usual map (0.4 / 0.6 at A_max = 5)
    assert nft_optimality(a, 5.0, "binary").tolist() == pytest.approx([0.4, 0.4, 0.5, 0.6, 0.6])
    with pytest.raises(ValueError, match="valid: all"):
        nft_optimality(a, 5.0, "sometimes")


def test_decay_schedules_of_the_authors():
    assert [DecaySchedule(0, 0, 0)(s) for s in (0, 10, 1000)] == [0, 0, 0]
    assert [DecaySchedule(0, 0.001, 0.5)(s) for s in (0, 100, 500, 900)] == pytest.approx([0, 0.1, 0.5, 0.5])
    assert [DecaySchedule(75, 0.0075, 0.999)(s) for s in (0, 75, 175, 400)] == pytest.approx([0, 0, 0.75, 0.999])


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "ghuber"])
def test_awm_ppo_loss_matches_float64_derivation(weighting):
    x0, eps, t, v, v_old, adv = _inputs(seed=2)
    u = eps - x0

    def surrogate(vel):
        err = ((vel - u) ** 2).mean((1, 2, 3))
        w = {"uniform": 1.0, "t": t, "t2": t * t}.get(weighting)
        if w is None:  # the generalised Huber: -t ((err + delta)^p - delta^p) / p, p = 1/4
            return -t * 4 * ((err + 1e-10) ** 0.25 - 1e-10**0.25)
        return -w * err

    v64 = v.clone().requires_grad_(True)
    rho = torch.exp(surrogate(v64) - surrogate(v_old))
    eps_clip = 0.02
    ref = torch.maximum(-adv * rho, -adv * rho.clamp(1 - eps_clip, 1 + eps_clip))
    ref.sum().backward()
    v32 = v.float().clone().requires_grad_(True)
    ll = fm_log_likelihood(v32, u.float(), t.float(), weighting)
    ll_old = fm_log_likelihood(v_old.float(), u.float(), t.float(), weighting)
    loss, clipped = ppo_clip_loss(ll - ll_old, adv.float(), eps_clip)
    loss.sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v32.grad.double(), v64.grad, rtol=1e-4, atol=1e-6)
    # the clipped rows carry no gradient
    assert (v32.grad[clipped].abs().amax((1, 2, 3)) == 0).all() if clipped.any() else True


# --------------------------------------------------------------------------- in the trainer

OBJECTIVE_OVERRIDES = {
    "nft": {"loss.objective": "nft", "sampler.strategy": "ode", "loss.nft.timesteps": 2},
    "awm": {"loss.objective": "awm", "sampler.strategy": "ode", "loss.awm.timesteps": 2, "loss.awm.kl_beta": 0.01},
    "dgpo": {"loss.objective": "dgpo", "sampler.strategy": "ode", "loss.dgpo.timesteps": 2},
    "flow_dppo": {"loss.objective": "flow_dppo", "sampler.strategy": "flow_grpo"},
    "diffusion_dpo": {"loss.objective": "diffusion_dpo", "sampler.strategy": "ode", "loss.diffusion_dpo.timesteps": 2},
}


@pytest.fixture
def objective_trainer(tiny_config):
    def make(name, **extra):
        return Trainer(tiny_config(**{**OBJECTIVE_OVERRIDES[name], "train.lr": 1e-3,
                                      "reward.weights": f"{{{BRIGHTNESS}: 1.0}}", **extra}))

    return make


@pytest.mark.parametrize("name", ["nft", "awm", "dgpo"])
def test_objective_trains_every_leaf_at_its_times(objective_trainer, name):
    trainer = objective_trainer(name)
    before = trainer.policy.trainable_state_dict()
    res = trainer.iteration_step()
    m = res.metrics
    assert m["trained_steps"] == 0  # an ODE rollout has no SDE transition
    n_leaves = res.advantages.leaf_mask.numel()
    assert m["rows"] == 2 * n_leaves > 0  # K = 2 times per leaf: every leaf trains (rows=all, the authors')
    assert torch.isfinite(torch.tensor(m["loss"]))
    after = trainer.policy.trainable_state_dict()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 0


def test_awm_first_update_is_on_policy(objective_trainer):
    m = objective_trainer("awm").iteration_step().metrics
    assert m["ratio"] == 1.0 and m["clipfrac"] == 0.0


def test_nft_old_policy_lags_and_rollouts_use_it(objective_trainer):
    trainer = objective_trainer("nft", **{"loss.nft.decay_rate": 0.25, "loss.nft.decay_cap": 0.5})
    m0 = trainer.iteration_step().metrics
    assert m0["v_old_dev"] == 0.0  # the old policy starts as the trained weights
    assert m0["nft_old_decay"] == pytest.approx(0.25)  # d(1 optimizer step)
    live = trainer.policy.trainable_state_dict()
    old = trainer.objective.old.weights
    gap = max(float((live[k] - old[k]).abs().max()) for k in live)
    assert gap > 0  # old = 0.25 old + 0.75 theta, not theta
    m1 = trainer.iteration_step().metrics
    assert m1["v_old_dev"] > 0


def test_update_does_not_depend_on_the_micro_batch(tiny_config):
    """The weighting rule: a minibatch's step is the mean over its rows however they are batched."""
    weights = []
    for micro in (64, 3):
        cfg = tiny_config(**{**OBJECTIVE_OVERRIDES["nft"], "train.micro_batch": micro, "train.lr": 1e-3,
                             "train.adam_eps": 1e-2, "reward.weights": f"{{{BRIGHTNESS}: 1.0}}"})
        trainer = Trainer(cfg)
        trainer.iteration_step()
        weights.append(trainer.policy.trainable_state_dict())
    diff = max(float((weights[0][k] - weights[1][k]).abs().max()) for k in weights[0])
    assert diff < 1e-6


@pytest.mark.parametrize("name", ["nft", "awm", "dgpo", "flow_dppo", "diffusion_dpo"])
def test_objective_state_resumes_exactly(objective_trainer, name):
    # dgpo: an EMA reference whose rollouts take over after the first step, so the resumed run must
    # restore both the EMA and the step count
    extra = {"awm": {"loss.awm.ema_kl_beta": 0.1},
             "dgpo": {"loss.dgpo.reference": "ema", "loss.dgpo.ema_rollouts_after": 1}}.get(name, {})
    full = objective_trainer(name, **extra)
    for _ in range(3):
        full.iteration_step()
    first = objective_trainer(name, **extra)
    for _ in range(2):
        first.iteration_step()
    state = first.state_dict()
    # the old policy / EMA travels with the checkpoint (flow_dppo and diffusion_dpo keep no state of their own)
    assert bool(state["objective"]) == (name in ("nft", "awm", "dgpo"))
    resumed = objective_trainer(name, **extra)
    resumed.load_state_dict(state)
    resumed.iteration_step()
    a, b = full.policy.trainable_state_dict(), resumed.policy.trainable_state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) == 0.0


def _dgpo_reference(d, adv, group, beta):
    """DGPO's mean group loss in float64, written group by group from the paper's quantities."""
    total = 0.0
    gs = sorted(set(group.tolist()))
    for g in gs:
        m = group == g
        a, dd = adv[m], d[m]
        pos, neg = a > 0, a < 0
        k = int(m.sum())  # the group's size
        r_pos = (a[pos].abs() / k * (-beta * dd[pos])).sum()
        r_neg = (a[neg].abs() / k * (-beta * dd[neg])).sum()
        total = total - torch.log(torch.sigmoid(r_pos - r_neg))
    return total / len(gs)


def test_dgpo_two_pass_gradient_equals_the_group_loss_gradient():
    from flowgrpo.objectives.dgpo import dgpo_coefficients, dgpo_group_loss

    g = torch.Generator().manual_seed(3)
    n = 12
    group = torch.tensor([0] * 4 + [1] * 5 + [2] * 3)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[[0, 4, 9]] = torch.tensor([2.0, 1.5, -1.0], dtype=torch.float64)  # both sets in every group
    adv[[1, 5, 10]] = torch.tensor([-2.0, -1.5, 1.0], dtype=torch.float64)
    d = (torch.randn(n, generator=g, dtype=torch.float64) * 0.01).requires_grad_(True)
    for beta in (10.0, 100.0):
        ref = _dgpo_reference(d, adv, group, beta)
        (grad_ref,) = torch.autograd.grad(ref, d)
        losses, _ = dgpo_group_loss(d.detach(), adv, group, beta)
        assert float(losses.mean()) == pytest.approx(float(ref.detach()), rel=1e-12)
        coef = dgpo_coefficients(d.detach(), adv, group, beta)
        torch.testing.assert_close(coef, grad_ref, rtol=1e-10, atol=1e-14)


def test_a_new_objective_plugs_in_without_touching_the_trainer(tiny_config):
    """An objective written outside the package (plain advantage-weighted flow matching) runs through
    the shared loop: it only implements rows and micro_loss."""
    from flowgrpo.objectives import MicroLoss, Objective
    from flowgrpo.objectives.forward_rows import build_sample_rows, per_row_mean, uniform_times

    class WeightedFlowMatching(Objective):
        name = "weighted_fm"

        def rows(self, ctx):
            return build_sample_rows(ctx.collected, ctx.credit, 0, uniform_times(), 1)

        def micro_loss(self, ctx, rows):
            v = ctx.policy.velocity(rows.noised().to(ctx.dtype), rows.t, ctx.collected.cond.index(rows.prompt)).float()
            return MicroLoss(loss=(rows.advantage * per_row_mean((v - rows.target()) ** 2)).mean())

    cfg = tiny_config(**{"sampler.strategy": "ode", "reward.weights": f"{{{BRIGHTNESS}: 1.0}}"})
    trainer = Trainer(cfg, objective=WeightedFlowMatching())
    before = trainer.policy.trainable_state_dict()
    m = trainer.iteration_step().metrics
    assert m["rows"] > 0 and m["loss"] == m["loss"]
    after = trainer.policy.trainable_state_dict()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 0


def test_nft_low_noise_rows_train_only_the_anchor(objective_trainer):
    """policy_min_t: rows below it carry anchor_beta * mean((v - v_ref)^2) instead of the NFT loss;
    on a 4-step grid (t = 1, .75, .5, .25) and policy_min_t = 0.6, half the rows are anchors, and at
    the base weights the anchor is 0 (up to float32 round-off: the policy's and the reference's
    forwards agree to ~5e-7, not bit for bit)."""
    trainer = objective_trainer("nft", **{"loss.nft.timesteps": 0, "loss.nft.policy_min_t": 0.6,
                                          "loss.nft.anchor_beta": 2.0, "loss.nft.kl_beta": 0.0})
    assert trainer.objective.needs_reference
    m0 = trainer.iteration_step().metrics
    assert m0["anchor_rows"] == pytest.approx(0.5) and m0["kl"] < 1e-10  # 0 up to float32 round-off
    m1 = trainer.iteration_step().metrics
    assert m1["kl"] > 0  # the weights moved away from the base; the anchor now pulls back


def test_nft_self_guidance_adds_its_term_from_the_old_policys_unconditional_pass(objective_trainer):
    """loss.nft.self_guidance_beta > 0: the empty prompt is encoded once and the old policy's
    unconditional velocity enters the loss (the gap is logged and the update differs); at 0 nothing
    of it runs."""
    plain = objective_trainer("nft", **{"loss.nft.kl_beta": 1.0})
    guided = objective_trainer("nft", **{"loss.nft.kl_beta": 1.0, "loss.nft.self_guidance_beta": 0.5})
    assert plain.objective._uncond is None and guided.objective._uncond is not None
    before = guided.policy.trainable_state_dict()
    m_plain, m_guided = plain.iteration_step().metrics, guided.iteration_step().metrics
    assert "self_guidance_gap" not in m_plain
    assert m_guided["self_guidance_gap"] > 0 and torch.isfinite(torch.tensor(m_guided["loss"]))
    a, b = plain.policy.trainable_state_dict(), guided.policy.trainable_state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 0  # same rollout and rows, another update
    assert max(float((b[k] - before[k]).abs().max()) for k in b) > 0


def test_nft_self_guidance_from_the_frozen_base_uncond_moves_apart_once_the_old_policy_does(objective_trainer):
    """self_guidance_uncond = base takes the empty prompt's velocity from the frozen base: on the first
    update the old policy is the base, so the gap equals the old-policy variant's to round-off; once
    the weights have moved, the two targets (and gaps) differ."""
    opts = {"loss.nft.kl_beta": 1.0, "loss.nft.self_guidance_beta": 0.5, "loss.nft.decay_cap": 0.0,
            "loss.nft.decay_rate": 0.0}
    old = objective_trainer("nft", **opts)
    base = objective_trainer("nft", **opts, **{"loss.nft.self_guidance_uncond": "base"})
    assert base.objective.self_guidance.references == {"base"} and not old.objective.self_guidance.references
    g_old, g_base = (t.iteration_step().metrics["self_guidance_gap"] for t in (old, base))
    assert g_base == pytest.approx(g_old, rel=1e-4)
    g_old, g_base = (t.iteration_step().metrics["self_guidance_gap"] for t in (old, base))
    assert abs(g_base - g_old) > 1e-3 * g_old
