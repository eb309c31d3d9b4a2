"""Trainer on the random-init shapes model: on-policy ratio, determinism, in-process resume, edge cases."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import BRIGHTNESS, CONSTANT, NAN_EVERY_THIRD

from flowgrpo.ops.reference import grpo_loss_ref
from flowgrpo.samplers import sde_step
from flowgrpo.seeds import ROLLOUT, derive_seed
from flowgrpo.trainer.trainer import Trainer

TIMING = ("rollout_s", "collect_s", "train_s", "iter_s", "train_seconds")


def numeric(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k not in TIMING}


def brightness_cfg(tiny_config, **extra):
    return tiny_config(**{"reward.weights": f"{{{BRIGHTNESS}: 1.0}}", **extra})


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_importance_ratio_is_one_on_the_first_on_policy_update(tiny_config, backend):
    cfg = brightness_cfg(tiny_config, **{"loss.grpo.backend": backend})
    trainer = Trainer(cfg)
    policy = trainer.policy

    # 1. independently: rebuild iteration 0's rollout, recompute every SDE mean with the same
    #    (not yet updated) policy in one batch, and score the stored samples with grpo_loss_ref
    plan = trainer.strategy.plan(0)
    prompts = trainer.prompts.batch(0, cfg.data.prompts_per_iteration)
    gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, 0, ROLLOUT))
    policy.eval()
    ro = trainer.sampler.rollout(plan, prompts, cfg.data.trees_per_prompt, gen, cfg.sampler.shared_group_noise)
    batch = ro.transitions([None] + [torch.ones(len(lv)) for lv in ro.levels[1:]])
    assert len(batch) == ro.num_leaves * plan.num_steps
    cond = policy.encode_prompts(ro.prompts)
    with torch.no_grad():
        v = policy.velocity(batch.sample, batch.sigma, cond.index(batch.prompt)).float()
    mean = torch.empty_like(batch.sample)
    for s in range(plan.num_steps):
        rows = batch.step == s
        spec = plan.steps[s]
        mean[rows] = sde_step(batch.sample[rows], v[rows], batch.sigma[rows], batch.sigma_next[rows],
                              noise_level=spec.noise_level, kind=spec.sde_kind, prev_sample=batch.prev_sample[rows],
                              sigma_max=plan.sigmas[1]).mean
    st = grpo_loss_ref(batch.prev_sample, mean, batch.mean_old, batch.std, batch.log_prob_old,
                       torch.ones(len(batch)), torch.ones(len(batch)), clip_range=cfg.loss.grpo.clip_range)
    independent = (st.ratio - 1).abs().max().item()
    print(f"independent on-policy |r - 1| max = {independent:.3e}")
    assert independent < 1e-6
    assert not st.clipped_high.any() and not st.clipped_low.any()

    # 2. the trainer's own first update reports the same invariant, on the same rollout
    before = {k: t.clone() for k, t in policy.trainable_state_dict().items()}
    out = trainer.iteration_step()
    m = out.metrics
    print(f"trainer onpolicy_ratio_maxdev = {m['onpolicy_ratio_maxdev']:.3e} ({backend})")
    assert m["onpolicy_ratio_maxdev"] < 1e-6
    assert torch.equal(out.rollout.leaves.x, ro.leaves.x)
    assert m["transitions"] == len(batch) and m["zero_std_ratio"] == 0.0
    # inner_epochs = minibatches = 1: every row is on-policy, so no ratio is clipped
    assert m["clipfrac_high"] == 0.0 and m["clipfrac_low"] == 0.0
    assert abs(m["ratio_mean"] - 1) < 1e-6
    # per-timestep diagnostics: every trained step reports its ratio and clip fraction
    for s in plan.trained_steps():
        assert abs(m[f"ratio_mean/step_{s:02d}"] - 1) < 1e-6 and m[f"clipfrac/step_{s:02d}"] == 0.0
    # and the update really moved the adapter
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_two_runs_with_the_same_seed_are_identical(tiny_config):
    cfg = brightness_cfg(tiny_config, **{"loss.grpo.backend": "reference"})
    a, b = Trainer(cfg), Trainer(cfg)
    for _ in range(2):
        ma, mb = a.iteration_step().metrics, b.iteration_step().metrics
        assert numeric(ma) == numeric(mb)
    sa, sb = a.policy.trainable_state_dict(), b.policy.trainable_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_state_dict_resume_reproduces_the_uninterrupted_run(tiny_config):
    cfg = brightness_cfg(tiny_config, **{"loss.grpo.backend": "reference", "train.lr": 1e-3})
    full = Trainer(cfg)
    ref = [numeric(full.iteration_step().metrics) for _ in range(3)]

    first = Trainer(cfg)
    first.iteration_step()
    state = first.state_dict()
    state = {k: (v.copy() if isinstance(v, dict) else v) for k, v in state.items()}
    resumed = Trainer(cfg)
    resumed.load_state_dict(state)
    assert resumed.iteration == 1
    got = [numeric(resumed.iteration_step().metrics) for _ in range(2)]
    assert got == ref[1:]
    ema_full, ema_res = full.ema, resumed.ema
    assert all(torch.equal(ema_full[k], ema_res[k]) for k in ema_full)


def test_zero_std_everywhere_means_no_update(tiny_config):
    cfg = tiny_config(**{"reward.weights": f"{{{CONSTANT}: 1.0}}"})
    trainer = Trainer(cfg)
    before = trainer.policy.trainable_state_dict()
    m = trainer.iteration_step().metrics
    assert m["zero_std_ratio"] == 1.0
    assert "loss" not in m  # nothing carried signal: no transitions were trained
    after = trainer.policy.trainable_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.iteration == 1


def test_run_with_nan_rewards_finishes_and_counts_them(tiny_config, tmp_path):
    from flowgrpo.trainer.run import train

    cfg = tiny_config(**{"reward.weights": f"{{{NAN_EVERY_THIRD}: 1.0}}", "train.iterations": 2,
                         "log.trackers": "[]"})
    summary = train(cfg, tmp_path / "run")
    leaves = cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt
    per_iter = len(range(0, leaves, 3))
    assert summary["iterations"] == 2
    assert summary["nan_rewards_dropped"] == 2 * per_iter
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["nan_rewards_dropped"] for r in rows] == [per_iter, per_iter]
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_timestep_fraction_selects_a_subset(tiny_config):
    cfg = brightness_cfg(tiny_config, **{"train.timestep_fraction": 0.5, "train.timestep_order": "random",
                                         "loss.grpo.backend": "reference"})
    trainer = Trainer(cfg)
    m = trainer.iteration_step().metrics
    assert m["trained_steps"] == 2
    assert m["transitions"] == 2 * cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt
    steps = trainer.select_steps(trainer.strategy.plan(0), 0)
    assert steps == trainer.select_steps(trainer.strategy.plan(0), 0) and len(steps) == 2


def test_cps_kind_is_on_policy_too(tiny_config):
    """CPS rollouts store the Gaussian log-prob the loss recomputes; the std-0 last step runs as ODE."""
    cfg = brightness_cfg(tiny_config, **{"sampler.sde_kind": "cps", "loss.grpo.backend": "reference"})
    m = Trainer(cfg).iteration_step().metrics
    assert m["onpolicy_ratio_maxdev"] < 1e-6
    assert np.isfinite(m["loss"])


def test_time_budget_is_never_exceeded(tiny_config, tmp_path):
    """The run stops before an iteration that would end past train.max_minutes, so train_seconds
    (evaluation excluded) stays within the budget while still using most of it."""
    from flowgrpo.trainer.run import train

    budget_s = 4.0
    # the process's CPU clock: on a loaded machine a wall-clock iteration can take the whole budget (one
    # iteration in 4 s under a concurrent suite and a busy loop); the stopping rule is the same for both clocks
    cfg = brightness_cfg(tiny_config, **{"train.iterations": 10000, "train.max_minutes": budget_s / 60,
                                         "train.clock": "cpu", "log.trackers": "[]", "log.checkpoint_every": 1000})
    summary = train(cfg, tmp_path / "run")
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["iterations"] == len(rows) >= 2
    assert summary["train_seconds"] <= budget_s
    longest = max(r["iter_s"] for r in rows)
    assert summary["train_seconds"] > budget_s - 3 * longest  # it did not stop early either
