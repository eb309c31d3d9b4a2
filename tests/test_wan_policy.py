"""The Wan 2.1 adapter on a tiny random WanPipeline saved to disk (no hub): velocities are the stock
transformer's, videos decode to [B, F, 3, H, W] and a 2-iteration run trains the LoRA and writes an mp4."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowgrpo.config import load_config

FRAMES, RES = 5, 32


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    from flowgrpo.policies.tiny.wan import save_tiny_wan

    return save_tiny_wan(tmp_path_factory.mktemp("wan") / "tiny-wan")


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("a cat walking on a beach\na red ball rolling\n")
    return f


def _overrides(wan_dir, prompt_file, *extra):
    return [f"model.name={wan_dir}", f"model.num_frames={FRAMES}", f"model.resolution={RES}",
            "model.train_mode=lora", "model.max_sequence_length=16", "model.lora_rank=4", "model.lora_alpha=8", "model.guidance_scale=3.0",
            "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompt_file}", "eval.evaluator=none",
            "data.prompts_per_iteration=1", "data.trees_per_prompt=2", "sampler.num_steps=2",
            "train.threads=1", "train.lr=1e-3", "log.progress=false", "log.trackers=[]", *extra]


def test_velocity_matches_stock_transformer(wan_dir, prompt_file):
    from diffusers import WanPipeline

    from flowgrpo.policies import build_policy

    cfg = load_config("flow-grpo", None, _overrides(wan_dir, prompt_file), recipe="shapes")
    policy = build_policy(cfg.model)
    assert type(policy).__name__ == "WanPolicy"
    assert tuple(policy.latent_shape) == (16, (FRAMES - 1) // 4 + 1, RES // 8, RES // 8)
    grid = policy.sigma_grid(4)
    assert grid.shape == (5,) and grid[0] == 1.0 and grid[-1] == 0.0 and bool((grid[1:] < grid[:-1]).all())

    # the stock pipeline, loaded independently, encodes and predicts the same velocity
    pipe = WanPipeline.from_pretrained(str(wan_dir), local_files_only=True)
    prompts = ["a cat walking on a beach", "a red ball rolling"]
    pos, neg = pipe.encode_prompt(prompts, do_classifier_free_guidance=True, max_sequence_length=16, device="cpu")
    cond = policy.encode_prompts(prompts)
    torch.testing.assert_close(cond.tensors["prompt_embeds"], pos)
    torch.testing.assert_close(cond.uncond["prompt_embeds"].expand_as(neg), neg)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, *policy.latent_shape, generator=g)
    sigma = torch.tensor([0.9, 0.3])
    with torch.no_grad():
        v = policy.velocity(x, sigma, cond)  # LoRA B = 0 at init: the policy is the base model
        c = pipe.transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=pos, return_dict=False)[0]
        u = pipe.transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=neg, return_dict=False)[0]
        ref = policy.reference_velocity(x, sigma, cond)
    torch.testing.assert_close(v, u + 3.0 * (c - u), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ref, v)

    video = policy.decode(x[:1])
    assert video.shape == (1, FRAMES, 3, RES, RES) and 0.0 <= float(video.min()) <= float(video.max()) <= 1.0
    # the VAE decode of the de-normalised latents, as WanPipeline.__call__ does it, mapped to [0, 1]
    vcfg = pipe.vae.config
    z = x[:1] * torch.tensor(vcfg.latents_std).view(1, -1, 1, 1, 1) + torch.tensor(vcfg.latents_mean).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        raw = pipe.vae.decode(z, return_dict=False)[0]  # [1, 3, F, H, W] in [-1, 1]
    torch.testing.assert_close(video, ((raw.permute(0, 2, 1, 3, 4) + 1) / 2).clamp(0, 1), rtol=1e-4, atol=1e-5)


def test_wan_trains_two_iterations_and_writes_mp4(wan_dir, prompt_file, tmp_path):
    import imageio.v3 as iio

    from flowgrpo.trainer import run as run_mod

    cfg = load_config("flow-grpo", None, _overrides(wan_dir, prompt_file, "train.iterations=2", "log.grid_every=1",
                                                     "log.checkpoint_every=1"), recipe="shapes")
    captured = {}
    real_trainer = run_mod.Trainer

    def spy(*args, **kwargs):
        trainer = real_trainer(*args, **kwargs)
        policy = trainer.policy
        ids = {id(p) for p in policy.trainable_parameters()}
        captured["policy"], captured["trainer"] = policy, trainer
        captured["lora"] = policy.trainable_state_dict()
        captured["base"] = {n: p.detach().clone() for n, p in policy.named_parameters() if id(p) not in ids}
        return trainer

    run_mod.Trainer = spy
    try:
        summary = run_mod.train(cfg, tmp_path / "run")
    finally:
        run_mod.Trainer = real_trainer
    assert summary["iterations"] == 2
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["iterations"] == 2
    assert math.isfinite(summary["final_metrics"]["loss"])

    policy = captured["policy"]
    lora_after = policy.trainable_state_dict()
    assert captured["lora"] and all("lora" in k for k in captured["lora"])
    assert any(not torch.equal(captured["lora"][k], lora_after[k]) for k in lora_after), "no LoRA weight changed"
    params = dict(policy.named_parameters())
    assert any(n.startswith("vae.") for n in captured["base"]) and any(n.startswith("text_encoder.") for n in captured["base"])
    for n, t in captured["base"].items():
        assert torch.equal(params[n].detach(), t), f"base weight {n} changed"

    for it in (0, 1):
        mp4 = tmp_path / "run" / "grids" / f"iter_{it:06d}.mp4"
        frames = iio.imread(mp4, plugin="FFMPEG")
        assert frames.shape == (FRAMES, RES, RES, 3)
        grid = iio.imread(tmp_path / "run" / "grids" / f"iter_{it:06d}.png")
        assert grid.ndim == 3 and grid.shape[1] > grid.shape[0]  # frames side by side

    # the saved adapter (the EMA weights when train.ema is on) loads into the stock WanPipeline and
    # reproduces the policy
    from diffusers import WanPipeline

    trainer = captured["trainer"]
    if trainer.ema:
        policy.load_trainable_state_dict(trainer.ema)
    lora_dir = policy.save_lora(tmp_path / "lora")
    pipe = WanPipeline.from_pretrained(str(wan_dir), local_files_only=True)
    pipe.load_lora_weights(str(lora_dir))
    x = torch.randn(1, *policy.latent_shape, generator=torch.Generator().manual_seed(1))
    enc = policy.encode_prompts(["a red ball rolling"]).tensors
    with torch.no_grad():
        ours = policy._forward(x, torch.tensor([0.5]), enc)
        stock = pipe.transformer(hidden_states=x, timestep=torch.tensor([500.0]),
                                 encoder_hidden_states=enc["prompt_embeds"], return_dict=False)[0]
        with policy.adapter_disabled():
            base_out = policy._forward(x, torch.tensor([0.5]), enc)
    assert (ours - base_out).abs().max() > 1e-4  # the trained adapter matters ...
    torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-5)  # ... and the stock pipeline has it
