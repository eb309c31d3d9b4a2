"""GRPO-Guard (ratio normalisation, per-step reweighting) and TempFlow noise-aware weights."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from flowgrpo.config import LossConfig
from flowgrpo.loss_weights import guard_step_weights, step_sigma_t, tempflow_step_weights, transition_weights
from flowgrpo.ops import grpo_loss_ref
from flowgrpo.samplers.plan import SamplingPlan, StepSpec
from flowgrpo.samplers.schedule import sigma_grid
from flowgrpo.samplers.steps import sde_step

torch.set_num_threads(1)

T, N, SHAPE = 10, 2048, (3, 8, 8)


def synthetic_rollout(shift=1.0, a=0.7, dv_scale=0.05, seed=0):
    """One SDE transition per sample at every step of a T-step grid, then a policy update that
    perturbs the velocity by dv (same rms at every step). Returns per-step lists of
    (raw log-ratio, Guard log-ratio) [N] and the plan."""
    g = torch.Generator().manual_seed(seed)
    sig = sigma_grid(T, shift).double()
    plan = SamplingPlan(sig.float(), [StepSpec(sde=True, noise_level=a) for _ in range(T)])
    raw, guard, mse = [], [], []
    for i in range(T):
        x = torch.randn(N, *SHAPE, generator=g, dtype=torch.float64)
        v = torch.randn(N, *SHAPE, generator=g, dtype=torch.float64)
        old = sde_step(x, v, sig[i], sig[i + 1], noise_level=a, generator=g, sigma_max=sig[1])
        dv = dv_scale * torch.randn(N, *SHAPE, generator=g, dtype=torch.float64)
        new = sde_step(x, v + dv, sig[i], sig[i + 1], noise_level=a, prev_sample=old.prev_sample, sigma_max=sig[1])
        ones = torch.ones(N, dtype=torch.float64)
        common = (old.prev_sample.double(), new.mean.double(), old.mean.double(), old.std.double(),
                  old.log_prob.double(), ones, ones)
        _, st_raw = grpo_loss_ref(*common, clip_range=1e-4, guard=False)
        _, st_guard = grpo_loss_ref(*common, clip_range=1e-4, guard=True)
        raw.append(torch.log(st_raw["ratio"]))
        guard.append(torch.log(st_guard["ratio"]))
        mse.append(((new.mean - old.mean) ** 2).flatten(1).mean(1).double())
    return raw, guard, mse, plan


def test_guard_log_ratio_zero_mean_equal_spread():
    raw, guard, mse, plan = synthetic_rollout(shift=1.0)
    g_mean = torch.stack([r.mean() for r in guard])
    g_std = torch.stack([r.std() for r in guard])
    r_mean = torch.stack([r.mean() for r in raw])
    r_std = torch.stack([r.std() for r in raw])
    print("per step  sigma   raw mean    raw std     guard mean   guard std")
    for i in range(T):
        print(f"  {i:2d}     {float(plan.sigmas[i]):.2f}  {r_mean[i]:+.3e}  {r_std[i]:.3e}  {g_mean[i]:+.3e}  {g_std[i]:.3e}")
    # zero mean: within 4 standard errors at every step
    assert (g_mean.abs() < 4 * g_std / N**0.5).all()
    # equal spread: the flow_grpo mean moves by (1 + a^2/2) * dt * dv off sigma = 1 (by dt * dv at sigma = 1),
    # so on a uniform grid the Guard spread is the same at every step after the first
    spread = g_std[1:]
    assert float(spread.max() / spread.min()) < 1.15
    assert float(g_std[0] / spread.mean()) == pytest.approx(1 / (1 + 0.7**2 / 2), rel=0.1)
    # the raw log-ratio is biased (-mse / 2s^2) and its spread differs by orders of magnitude across steps
    assert float(r_std.max() / r_std.min()) > 5
    assert (r_mean < 0).sum() >= T - 1
    # the closed form: log r_hat = -mean_D((mu_old - mu) * eps), spread sqrt(mse / D)
    d = SHAPE[0] * SHAPE[1] * SHAPE[2]
    expected = torch.stack([m.mean().sqrt() for m in mse]) / d**0.5
    torch.testing.assert_close(g_std, expected, rtol=0.15, atol=0)


def test_guard_spread_scales_with_dt_and_reweighting_equalises_it():
    """On a shifted (non-uniform) grid the Guard spread follows |dt|; the 1/|dt| weights flatten it."""
    _, guard, _, plan = synthetic_rollout(shift=3.0)
    g_std = torch.stack([r.std() for r in guard])[1:]
    dt = (plan.sigmas[:-1] - plan.sigmas[1:]).double()[1:]
    assert float(dt.max() / dt.min()) > 2
    delta = guard_step_weights(plan, list(range(T))).double()[1:]
    flat = g_std * delta
    print("guard std per step (shift 3):", [f"{float(s):.2e}" for s in g_std])
    print("times delta_t               :", [f"{float(s):.2e}" for s in flat])
    assert float(g_std.max() / g_std.min()) > 2
    assert float(flat.max() / flat.min()) < 1.15


def test_guard_weights():
    plan = SamplingPlan(sigma_grid(T, 3.0), [StepSpec() for _ in range(T)])
    steps = [1, 4, 7]
    w = guard_step_weights(plan, steps)
    dt = (plan.sigmas[:-1] - plan.sigmas[1:]).double()
    assert float(w[steps].mean()) == pytest.approx(1.0)
    torch.testing.assert_close(w[steps].double(), (1 / dt[steps]) / (1 / dt[steps]).mean(), rtol=1e-6, atol=0)
    assert float(w[[0, 2, 3, 5, 6, 8, 9]].abs().sum()) == 0.0
    # per transition: rows take their step's weight, mean 1 over the distinct trained steps
    batch = _Batch(torch.tensor([1, 1, 1, 4, 7, 7]))
    rows = transition_weights(batch, plan, LossConfig(guard_reweight=True))
    torch.testing.assert_close(rows, w[batch.step])
    assert float(rows.unique().mean()) == pytest.approx(1.0)


class _Batch:
    def __init__(self, step):
        self.step = step

    def __len__(self):
        return len(self.step)


def test_tempflow_weights():
    a = 0.7
    sig = sigma_grid(T, 3.0)
    # TempFlow-style plan: ODE main chain with SDE branch steps at 2 and 5
    steps = [StepSpec(sde=i in (2, 5), noise_level=a) if i in (2, 5) else StepSpec(sde=False) for i in range(T)]
    plan = SamplingPlan(sig, steps)
    w = tempflow_step_weights(plan)
    assert float(w.mean()) == pytest.approx(1.0, abs=1e-6)  # over all steps of the schedule
    # proportional to the SDE transition std sigma_t * sqrt(-dt)
    std = torch.stack([sde_step(torch.zeros(1, 2), torch.zeros(1, 2), sig[i], sig[i + 1], noise_level=a,
                                sigma_max=sig[1]).std[0] for i in range(T)]).double()
    torch.testing.assert_close(w.double(), std / std.mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(step_sigma_t(plan)[3], torch.tensor(a * (float(sig[3]) / (1 - float(sig[3]))) ** 0.5,
                                                                    dtype=torch.float64), rtol=1e-5, atol=0)
    rows = transition_weights(_Batch(torch.tensor([2, 2, 5])), plan, LossConfig(tempflow_weight=True))
    torch.testing.assert_close(rows, w[[2, 2, 5]])
    # dance kind: sigma_t = eta constant -> w proportional to sqrt(-dt)
    dplan = SamplingPlan(sig, [StepSpec(sde=True, noise_level=0.3, sde_kind="dance") for _ in range(T)])
    dt = (sig[:-1] - sig[1:]).double()
    torch.testing.assert_close(tempflow_step_weights(dplan).double(), dt.sqrt() / dt.sqrt().mean(), rtol=1e-5, atol=0)


def test_weights_default_and_combined():
    plan = SamplingPlan(sigma_grid(T, 3.0), [StepSpec() for _ in range(T)])
    b = _Batch(torch.tensor([0, 3, 3, 9]))
    assert torch.equal(transition_weights(b, plan, LossConfig()), torch.ones(4))
    both = transition_weights(b, plan, LossConfig(guard_reweight=True, tempflow_weight=True))
    g = transition_weights(b, plan, LossConfig(guard_reweight=True))
    t = transition_weights(b, plan, LossConfig(tempflow_weight=True))
    torch.testing.assert_close(both, g * t)
