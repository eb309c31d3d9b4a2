"""GRPO-Guard (ratio normalisation, per-step reweighting) and TempFlow noise-aware weights.

The per-step weights are checked against float64 references written here from the papers' formulas
on hand-written grids and plans, and against properties that follow from those formulas:

* Guard: delta_t proportional to 1 / |Delta_t|, mean 1 over the trained steps (0 elsewhere);
* TempFlow: w_t proportional to sigma_t * sqrt(-Delta_t) (the transition std), mean 1 over
  all steps of the schedule; ODE steps of the plan are weighed like its SDE steps.
"""

import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from flowgrpo.objectives.options import GRPOOptions
from flowgrpo.objectives.terms.step_weights import (guard_step_weights, iteration_trained_steps, tempflow_step_weights,
                                                      transition_weights)
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
        raw.append(torch.log(grpo_loss_ref(*common, clip_range=1e-4, guard=False).ratio))
        guard.append(torch.log(grpo_loss_ref(*common, clip_range=1e-4, guard=True).ratio))
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


# ---------------------------------------------------------------------------- float64 references
#: a hand-written non-uniform grid (T = 8): |Delta| = .05 .10 .15 .20 .20 .15 .10 .05
GRID = [1.0, 0.95, 0.85, 0.7, 0.5, 0.3, 0.15, 0.05, 0.0]
UNIFORM = [1 - i / 8 for i in range(9)]


def plan_of(grid, specs):
    return SamplingPlan(torch.tensor(grid, dtype=torch.float32), list(specs))


def sde(kind="flow_grpo", a=0.7, **kw):
    return StepSpec(sde=True, sde_kind=kind, noise_level=a, **kw)


def ode():
    return StepSpec(sde=False)


def ref_guard(grid, steps):
    """delta_t = (1 / |Delta_t|) / mean_{trained}(1 / |Delta|) on the distinct trained steps, 0 elsewhere."""
    trained = sorted(set(steps))
    inv = {i: 1.0 / abs(grid[i + 1] - grid[i]) for i in trained}
    mean = sum(inv.values()) / len(inv)
    return [inv[i] / mean if i in inv else 0.0 for i in range(len(grid) - 1)]


def ref_sigma_t(kind, a, grid, i):
    """sigma_t of the SDE kinds: flow_grpo a * sqrt(s / (1 - s)) (at s = 1 the next grid point in the denominator);
    dance the constant eta."""
    if kind == "dance":
        return a
    s = grid[i]
    return a * math.sqrt(s / (1 - (grid[1] if s >= 1 else s)))


def ref_tempflow(grid, kinds):
    """w_t = sigma_t sqrt(-Delta_t) / mean over all T steps; ``kinds`` [(kind, a)] per step."""
    raw = [ref_sigma_t(k, a, grid, i) * math.sqrt(grid[i] - grid[i + 1]) for i, (k, a) in enumerate(kinds)]
    mean = sum(raw) / len(raw)
    return [r / mean for r in raw]


def close(actual, expected, rtol=2e-6):
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=rtol, atol=1e-7)


class _Batch:
    """The part of a TransitionBatch that weighting reads: the plan step of each row."""

    def __init__(self, step):
        self.step = torch.as_tensor(step)

    def __len__(self):
        return len(self.step)


# ---------------------------------------------------------------------------- GRPO-Guard reweighting
@pytest.mark.parametrize("steps", [list(range(8)), [1, 4, 6], [3], [6, 1, 4, 4]])
def test_guard_weights_match_the_formula(steps):
    plan = plan_of(GRID, [sde() for _ in range(8)])
    w = guard_step_weights(plan, steps)
    assert w.dtype == torch.float32 and w.shape == (8,)
    close(w, ref_guard(GRID, steps))
    trained = sorted(set(steps))
    assert float(w[trained].double().mean()) == pytest.approx(1.0, abs=1e-6)
    assert all(float(w[i]) == 0.0 for i in range(8) if i not in trained)


def test_guard_weights_properties():
    all_steps = list(range(8))
    plan = plan_of(GRID, [sde() for _ in range(8)])
    w = guard_step_weights(plan, all_steps).double()
    dt = [GRID[i] - GRID[i + 1] for i in all_steps]
    # larger at small |Delta|, equal at equal |Delta| (steps 0/7, 1/6, 2/5, 3/4 of GRID pair up)
    for i in all_steps:
        for j in all_steps:
            if dt[i] < dt[j] - 1e-9:
                assert w[i] > w[j], (i, j)
    for i, j in [(0, 7), (1, 6), (2, 5), (3, 4)]:
        assert float(w[i]) == pytest.approx(float(w[j]), rel=1e-6)
    # the equalisation: delta_t |Delta_t| (the weighted scale of the Euler part x + Delta v of the SDE
    # mean, whose gradient in v is Delta_t) is one constant over the trained steps, 1 / mean(1 / |Delta|)
    scaled = w * torch.tensor(dt, dtype=torch.float64)
    const = 1.0 / (sum(1.0 / d for d in dt) / len(dt))
    torch.testing.assert_close(scaled, torch.full((8,), const, dtype=torch.float64), rtol=2e-6, atol=0)
    # a global rescale of the grid (every Delta times c) is removed by the normalisation
    scaled_plan = plan_of([0.6 * s for s in GRID], [sde() for _ in range(8)])
    torch.testing.assert_close(guard_step_weights(scaled_plan, all_steps), w.float(), rtol=1e-5, atol=0)
    # only |Delta| matters: not the SDE kind nor the noise level
    dance = plan_of(GRID, [sde("dance", 0.3) for _ in range(8)])
    torch.testing.assert_close(guard_step_weights(dance, [1, 4, 6]), guard_step_weights(plan, [1, 4, 6]))
    # uniform grid: every trained step weighs 1
    uni = plan_of(UNIFORM, [sde() for _ in range(8)])
    close(guard_step_weights(uni, [0, 2, 5]), [1.0, 0, 1.0, 0, 0, 1.0, 0, 0])


# ---------------------------------------------------------------------------- TempFlow weighting
def test_tempflow_weights_match_the_formula():
    # every step SDE, Flow-GRPO kind
    flow = plan_of(GRID, [sde() for _ in range(8)])
    w = tempflow_step_weights(flow)
    assert w.dtype == torch.float32 and w.shape == (8,)
    close(w, ref_tempflow(GRID, [("flow_grpo", 0.7)] * 8))
    assert float(w.double().mean()) == pytest.approx(1.0, abs=1e-6)
    # per-step noise levels: each SDE step with its own a
    levels = [0.7 if i % 2 else 0.35 for i in range(8)]
    mixed = plan_of(GRID, [sde(a=a) for a in levels])
    close(tempflow_step_weights(mixed), ref_tempflow(GRID, [("flow_grpo", a) for a in levels]))
    # TempFlow-style plan: an ODE main chain with SDE branch steps at 2 and 5; the ODE steps are weighed
    # with the SDE steps' kind and level, so the weights are those of the all-SDE plan
    branchy = plan_of(GRID, [sde() if i in (2, 5) else ode() for i in range(8)])
    close(tempflow_step_weights(branchy), ref_tempflow(GRID, [("flow_grpo", 0.7)] * 8))
    # a dance SDE step among ODE steps: sigma_t = eta everywhere -> w proportional to sqrt(-Delta)
    dancy = plan_of(GRID, [sde("dance", 0.3) if i == 3 else ode() for i in range(8)])
    close(tempflow_step_weights(dancy), ref_tempflow(GRID, [("dance", 0.3)] * 8))
    # CPS: the transition std is sigma' sin(a pi / 2), so w_t = sigma_{t+1} / mean(sigma_{1..T});
    # its last step (into sigma' = 0) is deterministic and weighs 0
    cps = plan_of(GRID, [sde("cps", 0.5) for _ in range(8)])
    nxt = GRID[1:]
    close(tempflow_step_weights(cps), [s / (sum(nxt) / len(nxt)) for s in nxt])


def test_tempflow_weights_properties():
    # uniform grid, dance kind: sigma_t sqrt(-Delta) is the same at every step -> exactly 1
    uni_dance = plan_of(UNIFORM, [sde("dance", 0.3) for _ in range(8)])
    torch.testing.assert_close(tempflow_step_weights(uni_dance), torch.ones(8), rtol=0, atol=1e-6)
    # the noise level multiplies every sigma_t, and the normalisation removes it
    for kind, (a1, a2) in (("flow_grpo", (0.3, 0.9)), ("dance", (0.1, 0.5))):
        w1 = tempflow_step_weights(plan_of(GRID, [sde(kind, a1) for _ in range(8)]))
        w2 = tempflow_step_weights(plan_of(GRID, [sde(kind, a2) for _ in range(8)]))
        torch.testing.assert_close(w1, w2, rtol=1e-6, atol=0)
    # uniform grid, flow_grpo: sigma_t grows with sigma, so the weights fall along the chain; steps 0 and 1
    # share the denominator 1 - sigma_1 (the sigma = 1 rule) and Delta, so w_0 / w_1 = sqrt(1 / sigma_1)
    w = tempflow_step_weights(plan_of(UNIFORM, [sde() for _ in range(8)])).double()
    assert bool((w[1:] < w[:-1]).all())
    assert float(w[0] / w[1]) == pytest.approx(math.sqrt(1 / UNIFORM[1]), rel=1e-6)
    # normalised over the whole schedule: which steps are trained does not change the weights
    some = plan_of(GRID, [sde(train=i in (1, 2)) for i in range(8)])
    torch.testing.assert_close(tempflow_step_weights(some), tempflow_step_weights(plan_of(GRID, [sde()] * 8)))


# ---------------------------------------------------------------------------- per transition
def test_transition_weights_gather_step_weights():
    plan = plan_of(GRID, [sde() for _ in range(8)])
    step = [1, 1, 1, 4, 6, 6]
    batch = _Batch(step)
    assert torch.equal(transition_weights(batch, plan, GRPOOptions()), torch.ones(6))
    guard = ref_guard(GRID, step)  # normalised over the distinct steps present in this update: 1, 4, 6
    temp = ref_tempflow(GRID, [("flow_grpo", 0.7)] * 8)
    g = transition_weights(batch, plan, GRPOOptions(guard_reweight=True))
    t = transition_weights(batch, plan, GRPOOptions(tempflow_weight=True))
    both = transition_weights(batch, plan, GRPOOptions(guard_reweight=True, tempflow_weight=True))
    assert g.shape == t.shape == both.shape == (6,)
    close(g, [guard[i] for i in step])
    close(t, [temp[i] for i in step])
    close(both, [guard[i] * temp[i] for i in step], rtol=5e-6)
    # the mean is 1 over the distinct trained steps (rows 0, 3, 4), not over the rows (step 1 is thrice)
    assert float(g[[0, 3, 4]].double().mean()) == pytest.approx(1.0, abs=1e-6)
    assert abs(float(g.double().mean()) - 1.0) > 0.05


def test_guard_weights_of_a_row_do_not_depend_on_the_rows_beside_it():
    """Under several processes each rank weighs its own rows: normalised over the whole update's
    steps, a rank holding only some of them gives its rows the weights of the 1-process batch."""
    plan = plan_of(GRID, [sde() for _ in range(8)])
    cfg = GRPOOptions(guard_reweight=True)
    whole = transition_weights(_Batch([1, 1, 4, 6, 6]), plan, cfg)
    rank0 = transition_weights(_Batch([1, 1, 4]), plan, cfg, trained_steps=[1, 4, 6])
    rank1 = transition_weights(_Batch([6, 6]), plan, cfg, trained_steps=[1, 4, 6])
    torch.testing.assert_close(torch.cat([rank0, rank1]), whole, rtol=0, atol=0)
    # without the update's steps a rank normalises over its own: rank 1 alone would weigh its rows 1
    torch.testing.assert_close(transition_weights(_Batch([6, 6]), plan, cfg), torch.ones(2))
    assert abs(float(rank1[0]) - 1.0) > 0.1
    with pytest.raises(ValueError, match=r"plan steps \[6\] outside trained_steps"):
        transition_weights(_Batch([1, 6]), plan, cfg, trained_steps=[1, 4])


def test_iteration_trained_steps_are_the_steps_with_a_trainable_row(tiny_policy):
    """The whole forest's steps among the selected ones that keep at least one edge after masking,
    i.e. the distinct steps of the batch the update trains on one process."""
    from flowgrpo.samplers.rollout import ForestSampler

    plan = plan_of(UNIFORM[:5] + [0.0], [sde(), sde(), ode(), sde(), sde()])
    ro = ForestSampler(tiny_policy).rollout(plan, ["a", "b"], 2, torch.Generator().manual_seed(0))
    adv = [None] + [torch.zeros(len(lv)) for lv in ro.levels[1:]]
    assert iteration_trained_steps(ro, adv, [0, 1, 3, 4], [None] * len(ro.levels)) == [0, 1, 3, 4]
    assert iteration_trained_steps(ro, adv, [1, 4], None) == [1, 4]
    # every edge out of step 3 (into depth 4) masked, and the edges out of step 0 of tree 0 only
    masks = [None] * len(ro.levels)
    masks[4] = torch.zeros(len(ro.levels[4]), dtype=torch.bool)
    masks[1] = ro.levels[1].tree != 0
    steps = iteration_trained_steps(ro, adv, [0, 1, 3, 4], masks)
    assert steps == [0, 1, 4]
    assert steps == sorted(set(ro.transitions(adv, [0, 1, 3, 4], masks).step.tolist()))
