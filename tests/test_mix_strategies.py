"""Chain strategies with partial SDE: DanceGRPO, MixGRPO window schedules, Flash's compressed grid,
Flash*'s NFE."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from flowgrpo.config import SamplerConfig, load_config
from flowgrpo.errors import ConfigError
from flowgrpo.policies.base import Conditioning
from flowgrpo.samplers.chains import compressed_steps, round_half_up
from flowgrpo.samplers.rollout import ForestSampler
from flowgrpo.samplers.schedule import sigma_grid
from flowgrpo.samplers.solvers import compressed_grid
from flowgrpo.samplers.strategies import STRATEGIES, build_strategy
from flowgrpo.trainer.trainer import Trainer

torch.set_num_threads(1)


def make(name, num_steps=10, shift=1.0, noise_level=0.7, **options):
    return build_strategy(SamplerConfig(strategy=name, num_steps=num_steps, shift=shift, noise_level=noise_level),
                          options)


class _Policy(nn.Module):
    """Prompt-independent linear velocity field: enough to run plans and count model calls."""

    latent_shape = (4,)

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.5))
        self.calls = 0

    @property
    def device(self):
        return torch.device("cpu")

    def encode_prompts(self, prompts):
        return Conditioning({"ids": torch.arange(len(prompts))})

    def velocity(self, x, sigma, cond):
        self.calls += x.shape[0]
        return self.w * x - 1.0


def rollout(plan, prompts=2, group=3, shared=False, seed=0):
    policy = _Policy()
    ro = ForestSampler(policy).rollout(plan, [f"p{i}" for i in range(prompts)], group,
                                       torch.Generator().manual_seed(seed), shared)
    return ro, policy.calls


def test_registered():
    for name in ("dance_grpo", "mix_grpo", "mix_grpo_flash", "mix_grpo_flash_star"):
        assert name in STRATEGIES.names()


# --------------------------------------------------------------------------- DanceGRPO


def test_dance_plan_and_options():
    s = make("dance_grpo", noise_level=0.3)
    plan = s.plan(0)
    assert plan.num_steps == 10 and all(st.sde and st.sde_kind == "dance" and st.noise_level == 0.3 for st in plan.steps)
    assert plan.trained_steps() == list(range(10))
    assert all(st.noise_level == 0.25 for st in make("dance_grpo", eta=0.25).plan(3).steps)
    ro, _ = rollout(plan)
    # constant eta: every transition's std is eta * sqrt(-dt)
    for d in range(1, 11):
        dt = float(plan.sigmas[d - 1] - plan.sigmas[d])
        torch.testing.assert_close(ro.levels[d].std, torch.full_like(ro.levels[d].std, 0.3 * dt**0.5))


def test_dance_preset_settings():
    cfg = load_config("dance-grpo")
    assert cfg.sampler.strategy == "dance_grpo" and cfg.sampler.sde_kind == "dance"
    assert cfg.sampler.noise_level == pytest.approx(0.3)
    assert cfg.sampler.shared_group_noise is True
    assert cfg.train.timestep_order == "random" and cfg.train.timestep_fraction == pytest.approx(0.6)
    assert cfg.loss.grpo.kl_beta == 0.0
    # shared group noise: every member of a group starts from the same noise
    ro, _ = rollout(build_strategy(cfg.sampler, cfg.strategy).plan(0), prompts=2, group=4, shared=True)
    x0 = ro.levels[0].x
    assert torch.equal(x0[0], x0[3]) and not torch.equal(x0[0], x0[4])
    assert not torch.equal(ro.leaves.x[0], ro.leaves.x[1])  # the SDE noise differs
    # a fresh random 60 % of the timesteps each iteration
    fake = SimpleNamespace(cfg=cfg)
    plan = build_strategy(cfg.sampler, cfg.strategy).plan(0)
    chosen = [Trainer.select_steps(fake, plan, it) for it in range(6)]
    assert all(len(c) == 6 and c == sorted(set(c)) for c in chosen)  # round(0.6 * 10)
    assert len({tuple(c) for c in chosen}) > 1


# --------------------------------------------------------------------------- MixGRPO window


def test_window_progressive():
    s = make("mix_grpo", window=4, shift_every=3, stride=2)
    got = [s.window_start(n) for n in range(15)]
    assert got == [0, 0, 0, 2, 2, 2, 4, 4, 4, 6, 6, 6, 6, 6, 6]  # l <- min(l + 2, T - w = 6) every 3 its
    s = make("mix_grpo", window=4, shift_every=1, stride=1, start=2)
    assert [s.window_start(n) for n in range(7)] == [2, 3, 4, 5, 6, 6, 6]


def test_window_rollback():
    s = make("mix_grpo", window=4, shift_every=2, stride=2, rollback=True)
    got = [s.window_start(n) for n in range(18)]
    # 0, 2, 4, 6 (= T - w), then back to 0
    assert got == [0, 0, 2, 2, 4, 4, 6, 6, 0, 0, 2, 2, 4, 4, 6, 6, 0, 0]
    s = make("mix_grpo", window=4, shift_every=1, stride=4, rollback=True)
    assert [s.window_start(n) for n in range(7)] == [0, 4, 6, 0, 4, 6, 0]  # last position clamped to T - w


def test_window_random_and_frozen():
    s = make("mix_grpo", window=4, shift_every=5, mode="random", seed=3)
    got = [s.window_start(n) for n in range(200)]
    assert all(0 <= l <= 6 for l in got)
    assert all(len(set(got[k:k + 5])) == 1 for k in range(0, 200, 5))  # redrawn every tau iterations
    assert len(set(got)) >= 5
    assert got == [make("mix_grpo", window=4, shift_every=5, mode="random", seed=3).window_start(n) for n in range(200)]
    assert got != [make("mix_grpo", window=4, shift_every=5, mode="random", seed=4).window_start(n) for n in range(200)]
    f = make("mix_grpo", window=3, mode="frozen", start=5)
    assert {f.window_start(n) for n in range(100)} == {5}


def test_mix_plan():
    s = make("mix_grpo", window=3, shift_every=1)
    for n in range(9):
        plan = s.plan(n)
        l0 = min(n, 7)
        assert plan.meta.window_start == l0
        assert plan.trained_steps() == [l0, l0 + 1, l0 + 2]
        assert all(not st.sde and st.solver == "euler" for i, st in enumerate(plan.steps) if i not in range(l0, l0 + 3))
        assert torch.equal(plan.sigmas, sigma_grid(10, 1.0))
    ro, calls = rollout(s.plan(2))
    assert [lv.mean is not None for lv in ro.levels[1:]] == [False, False, True, True, True] + [False] * 5
    assert calls == ro.nfe == 10 * 6


def test_bad_options():
    with pytest.raises(ConfigError, match="window"):
        make("mix_grpo", window=11)
    with pytest.raises(ConfigError, match="mode"):
        make("mix_grpo", mode="sideways")
    with pytest.raises(ConfigError, match="unknown config key 'strategy.windw'; valid keys under 'strategy': window"):
        make("mix_grpo", windw=2)
    with pytest.raises(ConfigError, match="compress"):
        make("mix_grpo_flash", compress=0.0)
    with pytest.raises(ConfigError, match="unknown config key 'strategy.shift_every'"):
        make("mix_grpo_flash_star", shift_every=3)  # Flash*'s window is fixed at 0


# --------------------------------------------------------------------------- Flash


def test_rounding():
    assert round_half_up(2.5) == 3 and round_half_up(8.4) == 8 and round_half_up(0.4) == 0
    assert compressed_steps(21, 0.4) == 8 and compressed_steps(1, 0.4) == 1 and compressed_steps(0, 0.4) == 0


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_flash_compressed_grid(shift):
    t, w = 25, 4
    s = make("mix_grpo_flash", num_steps=t, shift=shift, window=w, shift_every=1, stride=1)
    full = sigma_grid(t, shift)
    for n, (l0, tail) in {0: (0, 8), 5: (5, 6), 20: (20, 1), 21: (21, 0), 40: (21, 0)}.items():
        plan = s.plan(n)
        end = l0 + w
        assert plan.meta.window_start == l0 and plan.meta.compressed_steps == tail
        assert tail == compressed_steps(t - l0 - w, 0.4)  # round((T - l - w) * 0.4)
        assert plan.num_steps == l0 + w + tail
        # Euler on the original grid before the window, SDE in it, DPM-Solver++2 after it
        assert all(not st.sde and st.solver == "euler" for st in plan.steps[:l0])
        assert all(st.sde for st in plan.steps[l0:end]) and plan.trained_steps() == list(range(l0, end))
        assert all(not st.sde and st.solver == "dpm2" for st in plan.steps[end:])
        torch.testing.assert_close(plan.sigmas[:end + 1], full[:end + 1])
        if tail:
            torch.testing.assert_close(plan.sigmas[end:], compressed_grid(1 - end / t, tail, shift))
            if shift == 1.0:  # uniform: tail steps of (T - l - w) / tail original steps each
                gaps = plan.sigmas[end:-1] - plan.sigmas[end + 1:]
                torch.testing.assert_close(gaps, torch.full_like(gaps, (t - end) / t / tail))
        assert float(plan.sigmas[-1]) == 0.0 and (plan.sigmas[1:] < plan.sigmas[:-1]).all()
    # the rollout runs the compressed plan: one model call per node per step
    plan = make("mix_grpo_flash", num_steps=10, window=3, compress=0.4).plan(0)
    ro, calls = rollout(plan)
    assert plan.num_steps == 3 + 3  # round(7 * 0.4) = 3
    assert calls == ro.nfe == 6 * 6 and torch.isfinite(ro.leaves.x).all()


def test_flash_star_nfe():
    t, w, r = 25, 4, 0.2
    s = make("mix_grpo_flash_star", num_steps=t, window=w)
    assert s.options.compress == r
    speedup = t / (w + (t - w) * r)  # S = T / (w + (T - w) r~) = 3.05
    assert s.speedup() == pytest.approx(speedup)
    for n in (0, 1, 50, 1000):
        plan = s.plan(n)
        assert plan.meta.window_start == 0 and plan.trained_steps() == [0, 1, 2, 3]
    plan = s.plan(7)
    ro, calls = rollout(plan, prompts=2, group=3)
    nfe_chain = calls / 6
    print(f"Flash*: T={t} w={w} r={r}: NFE per chain {nfe_chain:g}, T/S = {t / speedup:.2f}, S = {speedup:.3f}, "
          f"realised speed-up {t / nfe_chain:.3f}")
    assert nfe_chain == w + round_half_up((t - w) * r) == 8
    assert abs(nfe_chain - t / speedup) <= 0.5
    assert ro.nfe == plan.nfe(6) == calls
    # the shapes preset: T = 10, w = 4 -> 4 + round(1.2) = 5 model calls per chain
    cfg = load_config("mix-grpo-flash-star")
    p = build_strategy(cfg.sampler, cfg.strategy).plan(0)
    assert p.num_steps == 5 and p.nfe(1) == 5
