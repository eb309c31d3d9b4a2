"""The diffusers plug-in (flowgrpo.diffusers): FlowGRPOScheduler, StepRecorder and rollout() on
tiny random stock SD3, FLUX and Wan 2.1 pipelines (built offline; SD3 and Wan with
classifier-free guidance, batched [uncond; cond] in SD3, two transformer calls per step in Wan).

* noise_level 0 reproduces the stock scheduler's output exactly (latents and decoded images);
* with noise, the recorded log-probs equal sde_step's on the recorded tensors, and a fresh
  transformer call on the recorded latents + conditioning gives the recorded means, so the first
  on-policy importance ratio is 1;
* the config round-trips through save_pretrained / from_pretrained and a MixGRPO window makes
  exactly its steps SDE;
* rollout() returns a chain Rollout the trainer's transitions() accepts.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowgrpo.diffusers import FlowGRPOScheduler, ensure_flowgrpo_scheduler, rollout
from flowgrpo.policies.tiny.flux import tiny_flux_pipeline
from flowgrpo.ops import grpo_loss_ref
from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline
from flowgrpo.policies.tiny.wan import tiny_wan_pipeline
from flowgrpo.samplers.steps import sde_step

KW = {"sd3": dict(height=32, width=32, max_sequence_length=32, guidance_scale=4.5),
      "flux": dict(height=32, width=32, max_sequence_length=32),
      "wan": dict(height=32, width=32, num_frames=5, max_sequence_length=32, guidance_scale=4.0)}
BUILD = {"sd3": tiny_sd3_pipeline, "flux": tiny_flux_pipeline, "wan": tiny_wan_pipeline}
PROMPTS = ["a red cube", "two blue spheres"]


@pytest.fixture(scope="module")
def pipes():
    out = {}
    for name, build in BUILD.items():
        pipe = build(seed=0)
        pipe.set_progress_bar_config(disable=True)
        out[name] = pipe
    return out


def _call(pipe, kw, output_type, steps=4):
    out = pipe(PROMPTS, num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
               output_type=output_type, **kw)
    return out.frames if hasattr(out, "frames") else out.images


@pytest.mark.parametrize("name", ["sd3", "flux", "wan"])
def test_noise_level_zero_equals_stock_scheduler(pipes, name):
    pipe = pipes[name]
    stock = pipe.scheduler
    try:
        if name == "wan":  # Wan ships UniPC on flow sigmas: compare with stock flow-matching Euler there
            assert type(stock).__name__ == "UniPCMultistepScheduler"
            pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=stock.config.flow_shift)
        assert type(pipe.scheduler) is FlowMatchEulerDiscreteScheduler
        ref = {t: _call(pipe, KW[name], t) for t in ("latent", "pt")}
        pipe.scheduler = stock
        sched = ensure_flowgrpo_scheduler(pipe, noise_level=0.0)
        assert sched.config.shift == 3.0 and pipe.scheduler is sched
        got = {t: _call(pipe, KW[name], t) for t in ("latent", "pt")}
        records = pipe.scheduler.records
    finally:
        pipe.scheduler = stock
    for t in ref:
        diff = (ref[t].float() - got[t].float()).abs().max().item()
        print(f"{name} {t}: max |stock - flowgrpo(noise 0)| = {diff:.3g}")
        assert diff <= 1e-5
    assert len(records) == 4 and not any(r.sde for r in records)


@pytest.mark.parametrize("name", ["sd3", "flux", "wan"])
def test_log_probs_and_first_ratio(pipes, name):
    pipe = pipes[name]
    stock = pipe.scheduler
    try:
        pr = rollout(pipe, PROMPTS, trees_per_prompt=2, num_inference_steps=4, generator=torch.Generator().manual_seed(1),
                     scheduler_options=dict(noise_level=0.7), **KW[name])
    finally:
        pipe.scheduler = stock
    r, rec = pr.rollout, pr.recorder
    smax = float(r.plan.sigmas[1])
    assert all(x.sde for x in pr.records)
    means, lp_diff, mean_diff = [], 0.0, 0.0
    for i, step in enumerate(pr.records):
        x, x_next = r.levels[i].x, r.levels[i + 1].x
        # log-prob of the recorded transition, rescored from the recorded tensors
        v_no_grad = None
        with torch.no_grad():
            v_no_grad = rec.velocity(i, x)
        again = sde_step(x, v_no_grad, step.sigma, step.sigma_next, noise_level=0.7, prev_sample=x_next,
                         sigma_max=smax)
        lp_diff = max(lp_diff, (again.log_prob - r.levels[i + 1].log_prob).abs().max().item())
        # a fresh forward with gradients (what the policy update does)
        v = rec.velocity(i, x)
        assert v.requires_grad
        mean = sde_step(x, v, step.sigma, step.sigma_next, noise_level=0.7, sigma_max=smax).mean
        mean_diff = max(mean_diff, (mean.detach() - r.levels[i + 1].mean).abs().max().item())
        means.append(mean)
    tb = r.transitions([None] + [torch.ones(len(lv)) for lv in r.levels[1:]])
    out = grpo_loss_ref(tb.prev_sample, torch.cat(means), tb.mean_old, tb.std, tb.log_prob_old, tb.advantages,
                        torch.ones(len(tb)), clip_range=1e-4)
    ratio_diff = (out.ratio - 1).abs().max().item()
    print(f"{name}: log-prob diff {lp_diff:.3g}, mean diff {mean_diff:.3g}, max |r - 1| {ratio_diff:.3g}")
    assert lp_diff <= 1e-5 and mean_diff <= 1e-5 and ratio_diff < 1e-5
    out.loss.backward()
    grads = [p.grad for p in pipe.transformer.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    pipe.transformer.zero_grad(set_to_none=True)


def test_config_round_trip_and_window(pipes, tmp_path):
    pipe = pipes["sd3"]
    sched = FlowGRPOScheduler.from_config(pipe.scheduler.config, noise_level=0.5, sde_kind="dance",
                                          window_start=1, window_size=2)
    sched.save_pretrained(tmp_path)
    again = FlowGRPOScheduler.from_pretrained(tmp_path)
    for key in ("noise_level", "sde_kind", "window_start", "window_size", "shift", "log_prob"):
        assert again.config[key] == sched.config[key], key
    assert (again.config.noise_level, again.config.sde_kind, again.config.window_start) == (0.5, "dance", 1)
    again.set_timesteps(5)
    assert again.sde_mask() == [False, True, True, False, False]
    explicit = FlowGRPOScheduler.from_config(pipe.scheduler.config, sde_steps=[0, 3])
    explicit.set_timesteps(5)
    assert explicit.sde_mask() == [True, False, False, True, False]
    with pytest.raises(ValueError):
        FlowGRPOScheduler(sde_steps=[0], window_start=0, window_size=1)
    with pytest.raises(ValueError):
        FlowGRPOScheduler(sde_kind="nope")

    stock = pipe.scheduler
    try:
        pipe.scheduler = again
        pr = rollout(pipe, PROMPTS[:1], trees_per_prompt=2, num_inference_steps=5,
                     generator=torch.Generator().manual_seed(2), **KW["sd3"])
    finally:
        pipe.scheduler = stock
    r = pr.rollout
    assert [s.sde for s in r.plan.steps] == [False, True, True, False, False]
    assert r.plan.trained_steps() == [1, 2] and r.plan.meta.window_start == 1 and r.plan.meta.window == 2
    assert [lv.mean is not None for lv in r.levels[1:]] == [False, True, True, False, False]
    tb = r.transitions([None] + [torch.ones(len(lv)) for lv in r.levels[1:]])
    assert tb.step.tolist() == [1, 1, 2, 2]
    # the ODE steps outside the window are the stock Euler steps
    for step in pr.records:
        if not step.sde:
            with torch.no_grad():
                v = pr.recorder.velocity(step.step_index, step.sample)
            euler = step.sample + (step.sigma_next - step.sigma) * v
            assert (euler - step.prev_sample).abs().max().item() <= 1e-5


def test_rollout_structure(pipes):
    pipe = pipes["flux"]
    stock = pipe.scheduler
    try:
        pr = rollout(pipe, PROMPTS, trees_per_prompt=3, num_inference_steps=3, generator=torch.Generator().manual_seed(3),
                     output_type="pt", scheduler_options=dict(noise_level=0.7, sde_kind="cps"), **KW["flux"])
    finally:
        pipe.scheduler = stock
    r = pr.rollout
    n = len(PROMPTS) * 3
    # FLUX's packed latents: (H / (8 * 2)) * (W / (8 * 2)) tokens of 4 * C channels
    packed = ((KW["flux"]["height"] // (pipe.vae_scale_factor * 2)) ** 2, pipe.transformer.config.in_channels)
    assert len(r.levels) == 4 and all(tuple(lv.x.shape) == (n, *packed) for lv in r.levels)
    assert r.tree_prompt.tolist() == [0, 0, 0, 1, 1, 1] and r.tree_group.tolist() == r.tree_prompt.tolist()
    assert torch.equal(r.levels[1].parent, torch.arange(n)) and r.levels[0].mean is None
    # cps into sigma' = 0 is deterministic: the last step runs as an Euler step
    assert [s.sde for s in r.plan.steps] == [True, True, False]
    assert r.plan.sigmas.shape == (4,) and float(r.plan.sigmas[-1]) == 0.0
    assert r.num_leaves == n and r.leaf_prompts == [p for p in PROMPTS for _ in range(3)]
    tb = r.transitions([None] + [torch.arange(len(lv)).float() for lv in r.levels[1:]])
    assert len(tb) == 2 * n and tb.step.tolist() == [0] * n + [1] * n
    assert tuple(tb.mean_old.shape) == (2 * n, *packed) and tuple(tb.std.shape) == (2 * n,)
    assert tb.prompt.tolist() == r.tree_prompt.tolist() * 2
    assert tuple(pr.output.shape) == (n, 3, 32, 32)
    assert pr.conditioning["prompt_embeds"].shape[0] == n
    assert r.nfe == 3


def test_group_size_is_a_deprecated_name_of_trees_per_prompt(pipes):
    """rollout(group_size=G) still works (a DeprecationWarning) and is trees_per_prompt=G exactly."""
    pipe = pipes["sd3"]
    stock = pipe.scheduler
    kw = dict(num_inference_steps=2, output_type="latent", scheduler_options=dict(noise_level=0.7), **KW["sd3"])
    try:
        new = rollout(pipe, PROMPTS[:1], trees_per_prompt=2, generator=torch.Generator().manual_seed(4), **kw)
        with pytest.warns(DeprecationWarning, match="trees_per_prompt"):
            old = rollout(pipe, PROMPTS[:1], group_size=2, generator=torch.Generator().manual_seed(4), **kw)
        with pytest.raises(ValueError, match="trees_per_prompt only"):
            rollout(pipe, PROMPTS[:1], group_size=2, trees_per_prompt=2, **kw)
    finally:
        pipe.scheduler = stock
    assert old.rollout.tree_prompt.tolist() == new.rollout.tree_prompt.tolist() == [0, 0]
    assert all(torch.equal(a.x, b.x) for a, b in zip(old.rollout.levels, new.rollout.levels))


def test_step_dtype_and_reproducibility():
    """An SDE step returns the model's dtype (math and records in float32) and is reproducible."""
    sched = FlowGRPOScheduler(shift=3.0, noise_level=0.7)
    outs = []
    for _ in range(2):
        sched.set_timesteps(4)
        x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
        v = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
        prev = sched.step(v, sched.timesteps[0], x, generator=torch.Generator().manual_seed(5)).prev_sample
        assert prev.dtype == torch.bfloat16 and len(sched.records) == 1
        rec = sched.records[0]
        assert rec.sde and rec.prev_sample.dtype == torch.float32 and rec.log_prob.shape == (2,)
        assert (rec.prev_sample.bfloat16() == prev).all()
        outs.append(prev)
    assert torch.equal(outs[0], outs[1])
    euler = x.float() + (rec.sigma_next - rec.sigma) * v.float()
    assert (euler - outs[0].float()).abs().max() > 1e-2  # noise was added
