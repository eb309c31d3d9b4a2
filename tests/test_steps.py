"""Step math (Euler steps, the SDE kinds' mean and std, the Gaussian log-density) against an
independent float64 implementation written with numpy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowgrpo.samplers import SDE_KINDS, euler_step, gaussian_log_prob, sde_step, sigma_grid
from flowgrpo.samplers.steps import sde_sigma_t

# --------------------------------------------------------------------------- float64 reference


def ref_log_density(x: np.ndarray, mu: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Per-element Gaussian log-density log N(x; mu, s^2), then the mean over non-batch dims ([B])."""
    b = x.shape[0]
    out = np.empty(b)
    for i in range(b):
        xi, mi, si = x[i].ravel(), mu[i].ravel(), float(s[i])
        per_elem = [-((a - m) ** 2) / (2 * si * si) - math.log(si) - 0.5 * math.log(2 * math.pi) for a, m in zip(xi, mi)]
        out[i] = sum(per_elem) / len(per_elem)
    return out


def ref_step(x, v, sigma, sigma_next, a, kind, sigma_max=None):
    """(mean, std [B]) of one reverse step, float64, following the SDE kinds' formulas literally."""
    x, v = np.asarray(x, np.float64), np.asarray(v, np.float64)
    b = x.shape[0]
    sig = np.broadcast_to(np.asarray(sigma, np.float64), (b,))
    nxt = np.broadcast_to(np.asarray(sigma_next, np.float64), (b,))
    smax = None if sigma_max is None else np.broadcast_to(np.asarray(sigma_max, np.float64), (b,))
    means, stds = np.empty_like(x), np.empty(b)
    for i in range(b):
        s, sn = float(sig[i]), float(nxt[i])
        d = sn - s
        if kind == "cps":
            std = sn * math.sin(a * math.pi / 2)
            x0 = x[i] - s * v[i]
            x1 = x[i] + (1 - s) * v[i]
            means[i] = x0 * (1 - sn) + x1 * math.sqrt(max(sn * sn - std * std, 0.0))
            stds[i] = std
            continue
        if kind == "dance":
            st = a
        else:  # flow_grpo; at sigma = 1 the denominator uses the next grid point
            denom = (float(smax[i]) if smax is not None else sn) if s >= 1.0 else s
            st = a * math.sqrt(s / (1 - denom))
        means[i] = x[i] * (1 + st * st / (2 * s) * d) + v[i] * (1 + st * st * (1 - s) / (2 * s)) * d
        stds[i] = st * math.sqrt(-d)
    return means, stds


def data(b=5, shape=(3, 4, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)


def close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_noise_level_zero_is_the_euler_step(kind):
    x, v = data()
    for s, sn in [(0.8, 0.6), (0.5, 0.3), (0.2, 0.0)]:
        euler = euler_step(x, v, s, sn)
        out = sde_step(x, v, s, sn, noise_level=0.0, kind=kind, generator=torch.Generator().manual_seed(1))
        assert torch.all(out.std == 0)
        torch.testing.assert_close(out.mean, euler, rtol=0, atol=2e-6)
        torch.testing.assert_close(out.prev_sample, euler, rtol=0, atol=2e-6)
        # and Euler itself is x + (sigma' - sigma) v in float64
        close(euler.numpy(), x.double().numpy() + (sn - s) * v.double().numpy(), 1e-6)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance"])
@pytest.mark.parametrize("a", [0.3, 0.7, 1.0])
def test_mean_std_and_log_prob_match_float64_reference(kind, a):
    x, v = data()
    s, sn = 0.7, 0.55
    out = sde_step(x, v, s, sn, noise_level=a, kind=kind, generator=torch.Generator().manual_seed(3))
    mu, std = ref_step(x.numpy(), v.numpy(), s, sn, a, kind)
    close(out.mean.numpy(), mu)
    close(out.std.numpy(), std)
    close(out.log_prob.numpy(), ref_log_density(out.prev_sample.double().numpy(), mu, std), 5e-5)
    assert out.mean.dtype == out.std.dtype == out.log_prob.dtype == torch.float32
    assert out.log_prob.shape == (x.shape[0],) and out.std.shape == (x.shape[0],)
    expected_st = a if kind == "dance" else a * math.sqrt(s / (1 - s))
    close(out.sigma_t.numpy(), np.full(x.shape[0], expected_st))


def test_gaussian_log_prob_is_mean_not_sum_over_dims():
    x, mu = data(b=3, shape=(2, 8, 8))
    std = torch.tensor([0.3, 0.05, 1.7])
    lp = gaussian_log_prob(x, mu, std)
    close(lp.numpy(), ref_log_density(x.double().numpy(), mu.double().numpy(), std.double().numpy()), 1e-5)
    # scalar std broadcasts the same way
    lp1 = gaussian_log_prob(x, mu, torch.tensor(0.3))
    close(lp1[0].item(), lp[0].item(), 1e-6)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_sigma_as_per_sample_tensor_equals_per_row_floats(kind):
    x, v = data(b=4)
    sig = torch.tensor([1.0, 0.9, 0.5, 0.25])
    # (CPS into sigma' = 0 has std 0, no density: plans run it as an ODE step, test_plan covers that)
    nxt = torch.tensor([0.9, 0.7, 0.4, 0.0 if kind != "cps" else 0.05])
    prev = x + 0.1 * v  # score a fixed x'
    batched = sde_step(x, v, sig, nxt, noise_level=0.6, kind=kind, prev_sample=prev, sigma_max=0.9)
    for i in range(4):
        row = sde_step(x[i:i + 1], v[i:i + 1], float(sig[i]), float(nxt[i]), noise_level=0.6, kind=kind,
                       prev_sample=prev[i:i + 1], sigma_max=0.9)
        torch.testing.assert_close(batched.mean[i:i + 1], row.mean)
        torch.testing.assert_close(batched.std[i:i + 1], row.std)
        torch.testing.assert_close(batched.log_prob[i:i + 1], row.log_prob)
    mu, std = ref_step(x.numpy(), v.numpy(), sig.numpy(), nxt.numpy(), 0.6, kind, sigma_max=0.9)
    close(batched.mean.numpy(), mu)
    close(batched.std.numpy(), std)
    # a [B] sigma of the wrong length is refused
    with pytest.raises(ValueError):
        sde_step(x, v, sig[:3], nxt[:3], kind=kind)


@pytest.mark.parametrize("kind", ["flow_grpo", "dance"])
def test_prev_sample_given_is_scored_not_drawn(kind):
    x, v = data()
    target = data(seed=7)[0]
    out = sde_step(x, v, 0.6, 0.45, noise_level=0.7, kind=kind, prev_sample=target)
    assert torch.equal(out.prev_sample, target)
    mu, std = ref_step(x.numpy(), v.numpy(), 0.6, 0.45, 0.7, kind)
    close(out.log_prob.numpy(), ref_log_density(target.double().numpy(), mu, std), 5e-5)
    # scoring the sample a draw produced gives back that draw's log-prob
    drawn = sde_step(x, v, 0.6, 0.45, noise_level=0.7, kind=kind, generator=torch.Generator().manual_seed(5))
    rescored = sde_step(x, v, 0.6, 0.45, noise_level=0.7, kind=kind, prev_sample=drawn.prev_sample)
    torch.testing.assert_close(rescored.log_prob, drawn.log_prob, rtol=0, atol=1e-6)


def test_cps_log_prob_conventions():
    x, v = data()
    s, sn, a = 0.6, 0.4, 0.7
    gen = lambda: torch.Generator().manual_seed(2)  # noqa: E731
    out = sde_step(x, v, s, sn, noise_level=a, kind="cps", generator=gen())
    mu, std = ref_step(x.numpy(), v.numpy(), s, sn, a, "cps")
    close(out.mean.numpy(), mu)
    close(out.std.numpy(), np.full(x.shape[0], sn * math.sin(a * math.pi / 2)))
    prev = out.prev_sample.double().numpy()
    # default: the transition's Gaussian density (mean over elements), like every other kind
    close(out.log_prob.numpy(), ref_log_density(prev, mu, out.std.double().numpy()), 5e-5)
    # "mse" (Flow-GRPO-Fast): -mean((x' - mu)^2) up to the constant log(sqrt 2) - log(sqrt(2 pi)) = -log(pi) / 2,
    # which cancels in every ratio
    mse = sde_step(x, v, s, sn, noise_level=a, kind="cps", generator=gen(), log_prob="mse")
    torch.testing.assert_close(mse.prev_sample, out.prev_sample)
    expected = -((prev - mu) ** 2).reshape(x.shape[0], -1).mean(1) - 0.5 * math.log(math.pi)
    close(mse.log_prob.numpy(), expected, 5e-5)
    with pytest.raises(ValueError, match="gaussian"):
        sde_step(x, v, s, sn, kind="flow_grpo", log_prob="mse")
    # the draw is x' = mu + std * eps: the residual over std is standard normal-ish
    z = (prev - mu) / out.std[0].item()
    assert abs(z.mean()) < 0.3 and abs(z.std() - 1) < 0.3


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_noise_argument_and_generator_determinism(kind):
    x, v = data()
    eps = data(seed=11)[0]
    out = sde_step(x, v, 0.5, 0.3, noise_level=0.7, kind=kind, noise=eps)
    torch.testing.assert_close(out.prev_sample, out.mean + out.std.view(-1, 1, 1, 1) * eps)
    a = sde_step(x, v, 0.5, 0.3, kind=kind, generator=torch.Generator().manual_seed(4))
    b = sde_step(x, v, 0.5, 0.3, kind=kind, generator=torch.Generator().manual_seed(4))
    c = sde_step(x, v, 0.5, 0.3, kind=kind, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.prev_sample, b.prev_sample)
    assert not torch.equal(a.prev_sample, c.prev_sample)


def test_sigma_one_rule_uses_sigma_max_in_the_denominator():
    x, v = data(b=3)
    a = 0.7
    # the first grid point sigma = 1 would divide by zero; the next grid point stands in
    out = sde_step(x, v, 1.0, 0.9, noise_level=a, kind="flow_grpo", sigma_max=0.9,
                   generator=torch.Generator().manual_seed(0))
    expected_st = a * math.sqrt(1.0 / (1 - 0.9))
    close(out.sigma_t.numpy(), np.full(3, expected_st), 1e-5)
    close(out.std.numpy(), np.full(3, expected_st * math.sqrt(0.1)), 1e-5)
    mu, std = ref_step(x.numpy(), v.numpy(), 1.0, 0.9, a, "flow_grpo", sigma_max=0.9)
    close(out.mean.numpy(), mu)
    assert torch.isfinite(out.log_prob).all() and torch.isfinite(out.prev_sample).all()
    # sigma_max differing from sigma_next: sigma_max is what counts (a shifted grid's second point)
    out2 = sde_step(x, v, 1.0, 0.95, noise_level=a, kind="flow_grpo", sigma_max=0.8)
    close(out2.sigma_t.numpy(), np.full(3, a * math.sqrt(1.0 / (1 - 0.8))), 1e-5)
    # without sigma_max the next sigma is used
    out3 = sde_step(x, v, 1.0, 0.95, noise_level=a, kind="flow_grpo")
    close(out3.sigma_t.numpy(), np.full(3, a * math.sqrt(1.0 / (1 - 0.95))), 1e-5)
    # below sigma = 1 sigma_max plays no role
    st = sde_sigma_t(torch.tensor([0.5]), torch.tensor([0.4]), a, "flow_grpo", torch.tensor([0.9]))
    close(st.numpy(), [a * math.sqrt(0.5 / 0.5)], 1e-6)
    # the sampler's grid: sigma_grid starts at exactly 1
    grid = sigma_grid(10)
    assert grid[0].item() == 1.0 and grid[-1].item() == 0.0


def test_bad_kind_lists_valid_kinds():
    x, v = data(b=2)
    with pytest.raises(ValueError) as exc:
        sde_step(x, v, 0.5, 0.4, kind="ddim")
    msg = str(exc.value)
    assert "ddim" in msg
    for k in SDE_KINDS:
        assert k in msg


def test_step_math_runs_in_float32_for_half_inputs():
    x, v = data()
    out = sde_step(x.bfloat16(), v.bfloat16(), 1.0, 0.9, sigma_max=0.9, generator=torch.Generator().manual_seed(0))
    assert out.mean.dtype == torch.float32 and out.log_prob.dtype == torch.float32
    ref = sde_step(x.bfloat16().float(), v.bfloat16().float(), 1.0, 0.9, sigma_max=0.9,
                   generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.mean, ref.mean)
    assert torch.isfinite(out.log_prob).all()


# --------------------------------------------------------------------------- marginals (statistical)


def _gaussian_velocity(x, sigma, m, c):
    """Exact v = E[eps - x0 | x_sigma] when x0 ~ N(m, c^2) and x_sigma = (1 - sigma) x0 + sigma eps."""
    var = (1 - sigma) ** 2 * c * c + sigma * sigma
    centred = x - (1 - sigma) * m
    e_x0 = m + (1 - sigma) * c * c / var * centred
    e_eps = sigma / var * centred
    return e_eps - e_x0


@pytest.mark.parametrize("kind,a", [("flow_grpo", 0.7), ("dance", 0.3)])
def test_sde_preserves_the_ode_marginals(kind, a):
    """With the exact velocity of 1-D Gaussian data, the SDE's samples at every sigma of the grid
    have (approximately) the marginal N((1 - sigma) m, (1 - sigma)^2 c^2 + sigma^2) of the flow.

    Tolerances (N = 100k particles, T = 100 steps; sampling error ~ 0.003):
    * at the end (sigma = 0): |mean error| < 0.02 and |std error| < 0.02;
    * at every grid point: |mean error| < 0.03 and |std error| < 0.07. The largest deviation
      (~0.05 in std for flow_grpo, a = 0.7) sits at the first steps, where sigma_t =
      a sqrt(sigma / (1 - sigma)) diverges and the sigma = 1 rule substitutes the next grid point:
      Euler-Maruyama is coarse there whatever T, and it heals as sigma decreases.
    A drift with a wrong scale (1/sigma or 1/(4 sigma) for 1/(2 sigma), or 1/(2.5 sigma)) gives a
    std error above 0.1, so the bounds still catch it.
    """
    n, steps, m, c = 100_000, 100, 1.5, 0.5
    g = torch.Generator().manual_seed(0)
    sig = sigma_grid(steps)
    x = torch.randn(n, 1, generator=g)
    worst_mean, worst_std = 0.0, 0.0
    for i in range(steps):
        s = float(sig[i])
        v = _gaussian_velocity(x, s, m, c)
        x = sde_step(x, v, s, float(sig[i + 1]), noise_level=a, kind=kind, generator=g, sigma_max=float(sig[1])).prev_sample
        sn = float(sig[i + 1])
        exp_mean, exp_std = (1 - sn) * m, math.sqrt((1 - sn) ** 2 * c * c + sn * sn)
        worst_mean = max(worst_mean, abs(x.mean().item() - exp_mean))
        worst_std = max(worst_std, abs(x.std().item() - exp_std))
    assert worst_mean < 0.03, worst_mean
    assert worst_std < 0.07, worst_std
    assert abs(x.mean().item() - m) < 0.02 and abs(x.std().item() - c) < 0.02
