"""Flow-DPPO (``loss.objective=flow_dppo``) against independent float64 derivations: the closed-form
KL against torch.distributions and a Monte Carlo estimate, the asymmetric mask and the loss written
row by row from the paper's rule, the limit tau -> inf against GRPO's unclipped surrogate, and in the
trainer the on-policy invariant (r = 1, KL = 0) with Flow-SDE and CPS steps."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from flowgrpo.objectives.flow_dppo import flow_dppo_loss
from flowgrpo.ops.kl import mean_kl
from flowgrpo.ops import grpo_loss_ref
from flowgrpo.trainer.trainer import Trainer
from conftest import BRIGHTNESS

D = (2, 3, 3)
N_EL = 18


def _rows(n=8, seed=0, shift=0.05):
    g = torch.Generator().manual_seed(seed)
    mu_old = torch.randn(n, *D, generator=g, dtype=torch.float64)
    std = 0.2 + torch.rand(n, generator=g, dtype=torch.float64)
    x = mu_old + std.view(-1, 1, 1, 1) * torch.randn(n, *D, generator=g, dtype=torch.float64)
    mu = mu_old + shift * torch.randn(n, *D, generator=g, dtype=torch.float64)
    logp_old = Normal(mu_old, std.view(-1, 1, 1, 1)).log_prob(x).flatten(1).mean(1)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return x, mu, mu_old, std, logp_old, adv


def test_closed_form_kl_is_the_gaussian_kl_per_element():
    _, mu, mu_old, std, _, _ = _rows(seed=1, shift=0.3)
    s = std.view(-1, 1, 1, 1).expand_as(mu)
    exact = kl_divergence(Normal(mu_old, s), Normal(mu, s)).flatten(1).sum(1)  # KL(pi_old || pi_theta)
    torch.testing.assert_close(mean_kl(mu, mu_old, std) * N_EL, exact, rtol=1e-12, atol=1e-14)
    # and the same KL as the expected log-density difference under the old policy (Monte Carlo)
    g = torch.Generator().manual_seed(2)
    xs = mu_old[0] + std[0] * torch.randn(200_000, *D, generator=g, dtype=torch.float64)
    diff = (Normal(mu_old[0], std[0]).log_prob(xs) - Normal(mu[0], std[0]).log_prob(xs)).flatten(1).sum(1)
    se = float(diff.std()) / math.sqrt(len(diff))
    assert abs(float(diff.mean()) - float(exact[0])) < 4 * se
    # equal means: no divergence
    assert float(mean_kl(mu_old, mu_old, std).abs().max()) == 0.0


def _reference_loss(x, mu, mu_old, std, logp_old, adv, tau):
    """The paper's rule row by row: drop a row whose KL / D reaches tau and whose ratio moved with
    its advantage; the mean over all rows of -A r on the kept ones."""
    total = 0
    dropped = []
    for i in range(len(adv)):
        logp = Normal(mu[i], std[i]).log_prob(x[i]).mean()
        r = torch.exp(logp - logp_old[i])
        kl = kl_divergence(Normal(mu_old[i], std[i]), Normal(mu[i].detach(), std[i])).sum() / N_EL
        drop = bool(kl >= tau) and ((bool(r > 1) and adv[i] > 0) or (bool(r < 1) and adv[i] < 0))
        dropped.append(drop)
        if not drop:
            total = total - adv[i] * r
    return total / len(adv), dropped


@pytest.mark.parametrize("tau", [1e-4, 2e-3, 1e-1])
def test_mask_loss_and_gradient_match_the_row_by_row_rule(tau):
    x, mu, mu_old, std, logp_old, adv = _rows(n=12, seed=3)
    m_ref = mu.clone().requires_grad_(True)
    ref, dropped = _reference_loss(x, m_ref, mu_old, std, logp_old, adv, tau)
    (g_ref,) = torch.autograd.grad(ref, m_ref)
    m = mu.clone().requires_grad_(True)
    out = flow_dppo_loss(x, m, mu_old, std, std, logp_old, adv, torch.ones(12, dtype=torch.float64), kl_threshold=tau)
    (g,) = torch.autograd.grad(out.loss, m)
    assert float(out.loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-15)
    got = (out.clipped_high | out.clipped_low).tolist()
    assert got == dropped
    if tau == 2e-3:  # the middle threshold splits the rows: the case under test is not vacuous
        assert 0 < sum(dropped) < len(dropped) and 0 < int(out.outside.sum()) < 12
    # a dropped row carries no gradient, a kept one does
    for i, d in enumerate(dropped):
        assert (float(g[i].abs().max()) == 0.0) == d


def test_the_mask_is_asymmetric():
    """Beyond tau: A > 0 with r > 1 and A < 0 with r < 1 are dropped; the corrective moves (A > 0
    with r < 1, A < 0 with r > 1) keep their gradient; inside tau everything trains."""
    n = 5
    mu_old = torch.zeros(n, *D, dtype=torch.float64)
    std = torch.full((n,), 0.5, dtype=torch.float64)
    x = torch.full((n, *D), 0.3, dtype=torch.float64)  # the rollout drew x' above mu_old
    step = torch.tensor([0.1, -0.1, 0.1, -0.1, 1e-4], dtype=torch.float64)  # toward x' (r > 1) or away
    mu = mu_old + step.view(-1, 1, 1, 1)
    logp_old = Normal(mu_old, 0.5).log_prob(x).flatten(1).mean(1)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    m = mu.clone().requires_grad_(True)
    out = flow_dppo_loss(x, m, mu_old, std, std, logp_old, adv, torch.ones(n, dtype=torch.float64), kl_threshold=1e-3)
    assert (out.ratio[[0, 2, 4]] > 1).all() and (out.ratio[[1, 3]] < 1).all()
    assert out.outside.tolist() == [True, True, True, True, False]
    assert out.clipped_high.tolist() == [True, False, False, False, False]
    assert out.clipped_low.tolist() == [False, False, False, True, False]
    (g,) = torch.autograd.grad(out.loss, m)
    assert [float(g[i].abs().max()) > 0 for i in range(n)] == [False, True, True, False, True]


def test_without_a_trust_region_it_is_grpos_unclipped_surrogate():
    x, mu, mu_old, std, logp_old, adv = _rows(n=10, seed=4, shift=0.2)
    w = torch.rand(10, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.5
    a = mu.clone().requires_grad_(True)
    out = flow_dppo_loss(x, a, mu_old, std, std, logp_old, adv, w, kl_threshold=float("inf"))
    b = mu.clone().requires_grad_(True)
    ref = grpo_loss_ref(x, b, mu_old, std, logp_old, adv, w, clip_range=1e9)
    (ga,), (gb,) = torch.autograd.grad(out.loss, a), torch.autograd.grad(ref.loss, b)
    assert out.loss.detach().item() == pytest.approx(ref.loss.detach().item(), rel=1e-12)
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-15)
    assert not (out.clipped_high | out.clipped_low).any()


def test_kl_coefficient_off_divides_by_one_and_the_reference_term_uses_the_transition_std():
    x, mu, mu_old, std, logp_old, adv = _rows(seed=6)
    ones = torch.ones(8, dtype=torch.float64)
    off = flow_dppo_loss(x, mu, mu_old, std, std, logp_old, adv, ones, kl_threshold=1.0, kl_coefficient=False)
    torch.testing.assert_close(off.kl_old, ((mu - mu_old) ** 2).flatten(1).mean(1) / 2)
    mu_ref = mu_old + 0.1
    base = flow_dppo_loss(x, mu, mu_old, std, std, logp_old, adv, ones, kl_threshold=1.0)
    with_ref = flow_dppo_loss(x, mu, mu_old, std, std, logp_old, adv, ones, kl_threshold=1.0, mean_ref=mu_ref,
                              kl_beta=0.5)
    s = std.view(-1, 1, 1, 1).expand_as(mu)
    kl_ref = kl_divergence(Normal(mu, s), Normal(mu_ref, s)).flatten(1).sum(1) / N_EL
    torch.testing.assert_close(with_ref.kl, kl_ref, rtol=1e-12, atol=1e-15)
    assert float(with_ref.loss - base.loss) == pytest.approx(0.5 * float(kl_ref.mean()), rel=1e-12)


@pytest.mark.parametrize("shift, factor", [(1.0, 10.0), (3.0, 100 / 28)])
def test_the_authors_normaliser_differs_from_the_exact_kl_only_at_sigma_1(shift, factor):
    """The authors' trust region divides by a sqrt(sigma / (1 - min(sigma, 0.99))) sqrt(sigma - sigma'), the
    exact KL by the transition's own std, whose sigma / (1 - sigma) takes the grid's second point sigma_1 at
    sigma = 1 (samplers/sde.py, as the authors' SDE). So on sigma = 1 rows the exact KL is
    s_A^2 / s^2 = (1 / 0.01) / (1 / (1 - sigma_1)) = 100 (1 - sigma_1) times the authors': 10 at shift 1
    (sigma_1 = 0.9), 100 / 28 = 3.57 at shift 3 (sigma_1 = 2.7 / 2.8); on every other grid row (sigma <= 0.99)
    the two are equal; on (0.99, 1) the clamp makes the exact KL (1 - sigma) / 0.01 times the authors'."""
    from flowgrpo.objectives.flow_dppo import authors_kl_std
    from flowgrpo.samplers.sde import sde_kind

    t = torch.linspace(1, 0, 11, dtype=torch.float64)
    grid = shift * t / (1 + (shift - 1) * t)
    sigma, sigma_next, a = grid[:-1], grid[1:], 0.7
    assert float(grid[1]) == pytest.approx(1 - factor / 100, rel=1e-14)
    exact_std = sde_kind("flow_grpo").std(sigma, sigma_next, a, grid[1].expand(10))
    authors_std = authors_kl_std(sigma, sigma_next, a)
    x, mu, mu_old, _, logp_old, adv = _rows(n=10, seed=7)
    ones = torch.ones(10, dtype=torch.float64)
    exact = flow_dppo_loss(x, mu, mu_old, exact_std, exact_std, logp_old, adv, ones, kl_threshold=1.0)
    authors = flow_dppo_loss(x, mu, mu_old, exact_std, exact_std, logp_old, adv, ones, kl_threshold=1.0,
                             region_std=authors_std)
    ratio = exact.kl_old / authors.kl_old
    assert float(ratio[0]) == pytest.approx(factor, rel=1e-12)
    torch.testing.assert_close(ratio[1:], torch.ones(9, dtype=torch.float64), rtol=1e-13, atol=0)
    torch.testing.assert_close(exact.loss, authors.loss, rtol=0, atol=0)  # tau = 1: nothing dropped in either
    # inside (0.99, 1) the clamp acts, the other way round
    s, sn = torch.tensor([0.995], dtype=torch.float64), torch.tensor([0.9], dtype=torch.float64)
    r = (authors_kl_std(s, sn, a) / sde_kind("flow_grpo").std(s, sn, a, torch.tensor([0.9], dtype=torch.float64))) ** 2
    assert float(r) == pytest.approx((1 - 0.995) / 0.01, rel=1e-12)


def test_region_std_is_the_authors_on_flow_grpo_steps_and_the_own_std_otherwise():
    from types import SimpleNamespace

    from flowgrpo.objectives.flow_dppo import authors_kl_std, region_std

    plan = SimpleNamespace(steps=[SimpleNamespace(sde_kind="flow_grpo", noise_level=0.7),
                                  SimpleNamespace(sde_kind="cps", noise_level=0.5)])
    batch = SimpleNamespace(step=torch.tensor([0, 1, 0]), sigma=torch.tensor([1.0, 0.8, 0.5]),
                            sigma_next=torch.tensor([0.9, 0.6, 0.4]), std=torch.tensor([0.5, 0.25, 0.125]))
    torch.testing.assert_close(region_std(batch, plan, "exact"), batch.std, rtol=0, atol=0)
    got = region_std(batch, plan, "authors")
    want = authors_kl_std(batch.sigma.double(), batch.sigma_next.double(), 0.7).float()
    torch.testing.assert_close(got[[0, 2]], want[[0, 2]], rtol=0, atol=0)
    assert float(got[1]) == 0.25


# --------------------------------------------------------------------------- in the trainer

@pytest.mark.parametrize("sde_kind", ["flow_grpo", "cps"])
def test_first_update_is_on_policy_and_later_epochs_leave_it(tiny_config, sde_kind):
    """One optimizer step per epoch: in epoch 1 every row is at the rollout policy (r = 1 and KL = 0 up
    to float32 rounding, nothing dropped); epoch 2 sees the moved weights."""
    cfg = tiny_config(**{"loss.objective": "flow_dppo", "sampler.sde_kind": sde_kind, "train.lr": 1e-3,
                         "reward.weights": f"{{{BRIGHTNESS}: 1.0}}"})
    trainer = Trainer(cfg)
    before = trainer.policy.trainable_state_dict()
    m = trainer.iteration_step().metrics
    assert m["transitions"] > 0 and m["grad_norm"] > 0
    assert m["onpolicy_ratio_maxdev"] < 1e-5 and abs(m["ratio_mean"] - 1) < 1e-6
    assert m["dppo_kl_old_max"] < 1e-10 and m["dppo_outside"] == 0.0
    assert m["clipfrac_high"] == m["clipfrac_low"] == 0.0
    after = trainer.policy.trainable_state_dict()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 0
    cfg2 = tiny_config(**{"loss.objective": "flow_dppo", "sampler.sde_kind": sde_kind, "train.lr": 1e-3,
                          "train.inner_epochs": 2, "reward.weights": f"{{{BRIGHTNESS}: 1.0}}"})
    m2 = Trainer(cfg2).iteration_step().metrics
    assert m2["dppo_kl_old"] > 0 and m2["dppo_kl_old_max"] > 1e-10


def test_the_reference_term_runs_the_base_model(tiny_config):
    cfg = tiny_config(**{"loss.objective": "flow_dppo", "loss.flow_dppo.kl_beta": 0.1, "train.lr": 1e-3,
                         "train.inner_epochs": 2, "reward.weights": f"{{{BRIGHTNESS}: 1.0}}"})
    trainer = Trainer(cfg)
    assert trainer.objective.needs_reference
    m = trainer.iteration_step().metrics
    assert m["kl"] > 0  # the second epoch's weights differ from the base model


def test_bad_threshold_is_a_config_error(tiny_config):
    from flowgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="loss.flow_dppo.kl_threshold"):
        tiny_config(**{"loss.objective": "flow_dppo", "loss.flow_dppo.kl_threshold": 0})
