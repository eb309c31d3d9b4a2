"""``loss.cfg_uncond_grad=false``: the unconditional CFG pass runs without gradient in its own call, the
gradient of Flow-GRPO's update (``noise_pred_uncond.detach()``), with the same velocities."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.policies.tiny.families import save_tiny_pipeline
from flowgrpo.trainer.trainer import Trainer


def _config(tmp_path, *extra, model="sd3-tiny"):
    f = tmp_path / "prompts.txt"
    f.write_text("a photo of a cat\na mountain lake at dawn\n")
    return load_config("flow-grpo", None, [
        f"model.name={model}", "model.train_mode=lora", "model.resolution=64", "model.max_sequence_length=16",
        "model.lora_rank=8", "model.lora_alpha=16", "model.guidance_scale=4.5",
        "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={f}", "data.prompts_per_iteration=2",
        "data.trees_per_prompt=2", "sampler.num_steps=3", "train.threads=1", "log.progress=false", *extra],
        recipe="shapes")


def _lora_grads(policy, x, sigma, cond, target):
    policy.zero_grad(set_to_none=True)
    v = policy.velocity(x, sigma, cond)
    ((v - target) ** 2).mean().backward()
    return v.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def test_detached_uncond_pass_gives_flow_grpos_gradient_and_the_same_velocity(tmp_path):
    trainer = Trainer(_config(tmp_path, "loss.cfg_uncond_grad=false"))
    policy = trainer.policy
    assert policy.uncond_grad is False
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a non-zero adapter, so that both passes depend on it
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    cond = policy.encode_prompts(["a photo of a cat", "a mountain lake at dawn"])
    x = torch.randn(2, *policy.latent_shape, generator=gen)
    sigma, target = torch.tensor([0.7, 0.4]), torch.randn(2, *policy.latent_shape, generator=gen)
    v_fast, g_fast = _lora_grads(policy, x, sigma, cond, target)

    # Flow-GRPO's form: one batched call, the unconditional half detached
    policy.zero_grad(set_to_none=True)
    b = x.shape[0]
    enc = {k: torch.cat([v, cond.uncond[k].expand(b, *v.shape[1:])]) for k, v in cond.tensors.items()}
    out = policy._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), enc)
    v_c, v_u = out[:b], out[b:].detach()
    v_ref = v_u + policy.guidance_scale * (v_c - v_u)
    ((v_ref - target) ** 2).mean().backward()
    g_ref = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    policy.uncond_grad = True  # the default: gradients through both passes
    v_both, g_both = _lora_grads(policy, x, sigma, cond, target)

    torch.testing.assert_close(v_fast, v_ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_fast, v_both, rtol=1e-5, atol=1e-5)
    assert set(g_fast) == set(g_ref) and g_fast
    worst = max((g_fast[n] - g_ref[n]).abs().max().item() / (g_ref[n].abs().max().item() + 1e-12) for n in g_ref)
    differs = max((g_both[n] - g_ref[n]).abs().max().item() / (g_ref[n].abs().max().item() + 1e-12) for n in g_ref)
    print(f"detached uncond: grad rel. diff to Flow-GRPO's form {worst:.2e}; with the uncond gradient {differs:.2e}")
    assert worst < 1e-4 and differs > 1e-2
    with torch.no_grad():  # no gradient wanted: one batched call as before
        torch.testing.assert_close(policy.velocity(x, sigma, cond), v_both, rtol=1e-5, atol=1e-5)


def test_an_adapter_that_replays_its_guidance_refuses_the_switch(tmp_path):
    folder = save_tiny_pipeline("sd35-large", tmp_path / "sd35l")
    cfg = _config(tmp_path, "loss.cfg_uncond_grad=false", "model.max_sequence_length=32", model=str(folder))
    from flowgrpo.policies import resolve_adapter

    if resolve_adapter(cfg.model) != "pipeline":  # SD3.5 folders go to the sd3 adapter, which supports it
        assert Trainer(cfg).policy.uncond_grad is False
    folder = save_tiny_pipeline("z-image", tmp_path / "zimage")
    with pytest.raises(ConfigError, match=r"loss.cfg_uncond_grad=false .*PipelinePolicy"):
        Trainer(_config(tmp_path, "loss.cfg_uncond_grad=false", "model.max_sequence_length=32", model=str(folder)))
