"""LoRA in diffusers' format: a tiny SD3 LoRA run writes RUN_DIR/lora, which a fresh stock pipeline loads
and then gives the trained policy's images; `flowgrpo export` (LoRA and --fuse); the memory switches."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml

from flowgrpo.cli import main
from flowgrpo.config import ModelConfig, load_config
from flowgrpo.errors import UserError
from flowgrpo.policies import build_policy
from flowgrpo.policies.diffusers.sd3 import SD3Policy
from flowgrpo.policies.tiny.sd3 import tiny_sd3_components
from flowgrpo.samplers.solvers import solve_ode
from flowgrpo.trainer.checkpoint import latest_checkpoint, load_checkpoint

from conftest import train_tiny_sd3_lora_run

SEQ, STEPS, GUIDANCE = 16, 3, 2.0
PROMPTS = ["a photo of a cat", "a mountain lake at dawn"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(base pipeline dir, run dir, config): a 2-iteration tiny SD3 LoRA run with a high lr and a fast EMA."""
    base, run_dir, _, cfg = train_tiny_sd3_lora_run(tmp_path_factory.mktemp("lora_run"), PROMPTS, seq=SEQ,
                                                    steps=STEPS, guidance=GUIDANCE)
    return base, run_dir, cfg


def policy_images(cfg, weights, noise) -> torch.Tensor:
    """flowgrpo's own sampling: Euler ODE on the policy's sigma grid, guided velocity, policy decode."""
    policy = build_policy(cfg.model)
    policy.load_trainable_state_dict(weights)
    with torch.no_grad():
        cond = policy.encode_prompts(PROMPTS)
        vel = lambda x, s: policy.velocity(x, torch.full((x.shape[0],), s), cond).float()  # noqa: E731
        return policy.decode(solve_ode(vel, noise.clone(), policy.sigma_grid(STEPS)))


def pipe_images(pipe, noise) -> torch.Tensor:
    with torch.no_grad():
        return pipe(prompt=PROMPTS, height=64, width=64, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                    latents=noise.clone(), output_type="pt", max_sequence_length=SEQ).images


def stock(path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_run_lora_reproduces_policy_images_and_export(run, tmp_path, capsys):
    base, run_dir, cfg = run
    state = load_checkpoint(latest_checkpoint(run_dir))["trainer"]
    ema, raw = state["ema"], state["trainable"]
    assert max((ema[k] - raw[k]).abs().max().item() for k in ema) > 1e-4  # the EMA is not the raw adapter
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()
    noise = torch.randn(len(PROMPTS), 16, 8, 8, generator=torch.Generator().manual_seed(7))

    ours = policy_images(cfg, ema, noise)
    pipe = stock(base)
    before = pipe_images(pipe, noise)
    pipe.load_lora_weights(str(run_dir / "lora"))
    theirs = pipe_images(pipe, noise)
    assert ours.shape == theirs.shape == (2, 3, 64, 64)
    assert (theirs - before).abs().max() > 1e-3  # the trained LoRA changes the images
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)

    # export (default: the latest checkpoint's EMA) = RUN_DIR/lora; --raw gives the raw policy's images
    assert main(["export", str(run_dir), "--to", str(tmp_path / "ema")]) == 0
    from safetensors.torch import load_file

    a, b = load_file(run_dir / "lora" / "pytorch_lora_weights.safetensors"), load_file(tmp_path / "ema" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["export", str(run_dir), "--to", str(tmp_path / "raw"), "--raw", "--checkpoint", "2"]) == 0
    raw_pipe = stock(base)
    raw_pipe.load_lora_weights(str(tmp_path / "raw"))
    torch.testing.assert_close(pipe_images(raw_pipe, noise), policy_images(cfg, raw, noise), rtol=0, atol=1e-4)

    # --fuse: a plain pipeline (no LoRA layers) with the same images as the LoRA-loaded one
    assert main(["export", str(run_dir), "--to", str(tmp_path / "fused"), "--fuse"]) == 0
    fused = stock(tmp_path / "fused")
    assert not any("lora" in n for n, _ in fused.transformer.named_parameters())
    torch.testing.assert_close(pipe_images(fused, noise), theirs, rtol=0, atol=1e-4)

    # errors: one line, exit 2
    bad = tmp_path / "full"
    bad.mkdir()
    data = yaml.safe_load((run_dir / "config.yaml").read_text())
    data["model"]["train_mode"] = "full"
    (bad / "config.yaml").write_text(yaml.safe_dump(data))
    nockpt = tmp_path / "nockpt"
    nockpt.mkdir()
    shutil.copy(run_dir / "config.yaml", nockpt / "config.yaml")
    capsys.readouterr()
    for argv, needle in [([str(tmp_path / "nowhere")], "not a run directory"), ([str(bad)], "has no checkpoint yet"),  # a full run exports its weights
                         ([str(nockpt)], "no checkpoint"), ([str(run_dir), "--checkpoint", "7"], "available: 1, 2")]:
        assert main(["export", *argv, "--to", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


def test_models_without_diffusers_lora_format(shapes_model_dir, tmp_path, capsys):
    cfg = load_config("shapes", None, [f"model.path={shapes_model_dir}", "model.train_mode=lora"], recipe="shapes")
    policy = build_policy(cfg.model)
    with pytest.raises(UserError, match="has no diffusers LoRA format"):
        policy.save_lora(tmp_path / "x")
    from flowgrpo.config import to_dict
    from flowgrpo.trainer.checkpoint import save_checkpoint

    run_dir = tmp_path / "shapes_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    save_checkpoint(run_dir, 1, {"trainer": {"trainable": policy.trainable_state_dict(), "ema": None}})
    assert main(["export", str(run_dir), "--to", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no diffusers LoRA format" in err and "\n" not in err


# ---------------------------------------------------------------------------- memory / speed switches
def make(**kw) -> SD3Policy:
    return SD3Policy.from_components(tiny_sd3_components(seed=0), resolution=64, max_sequence_length=SEQ,
                                     lora_rank=4, lora_alpha=8.0, **kw)


def test_gradient_checkpointing_same_velocity_and_grads():
    plain, ckpt = make(), make(gradient_checkpointing=True)
    assert ckpt.transformer.gradient_checkpointing and not plain.transformer.gradient_checkpointing
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        lora = {k: torch.randn_like(v) * 0.1 for k, v in plain.trainable_state_dict().items()}
    x = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    s = torch.tensor([0.7, 0.3])
    out = []
    for p in (plain, ckpt):
        p.load_trainable_state_dict(lora)
        p.train()
        v = p.velocity(x, s, p.encode_prompts(PROMPTS))
        v.square().mean().backward()
        out.append((v.detach(), {n: q.grad.clone() for n, q in p.named_trainable_parameters()}))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=0, atol=1e-5)
    for n, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][n], g, rtol=0, atol=1e-5)


def test_vae_slicing_tiling_offload_cache_attention_compile():
    plain, sliced = make(), make(vae_slicing=True, vae_tiling=True)
    assert sliced.vae.use_slicing and sliced.vae.use_tiling and not plain.vae.use_slicing
    z = torch.randn(3, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(make(vae_slicing=True).decode(z), plain.decode(z), rtol=0, atol=1e-5)  # batch-size numerics only

    off = make(offload_text_encoders=True)
    calls = []
    off.text_encoder.register_forward_hook(lambda *a: calls.append(1))
    first = off.encode_prompts(PROMPTS)
    n = len(calls)
    second = off.encode_prompts(list(reversed(PROMPTS)) + PROMPTS)
    assert n > 0 and len(calls) == n  # every prompt (and the empty one) came from the cache
    assert all(next(m.parameters()).device.type == "cpu" for m in (off.text_encoder, off.text_encoder_2, off.text_encoder_3))
    ref = plain.encode_prompts(PROMPTS)
    for k, v in first.tensors.items():
        assert torch.equal(second.tensors[k][2:], v) and torch.equal(second.tensors[k][0], v[1])
        torch.testing.assert_close(v, ref.tensors[k], rtol=0, atol=1e-6)

    with pytest.raises(UserError, match="xformers"):
        make(attention_backend="xformers") if not torch.cuda.is_available() else make(attention_backend="bogus")
    assert make(compile_transformer=True).transformer._compiled_call_impl is not None


def test_config_switches_reach_the_sd3_adapter(run):
    base, _, _ = run
    policy = build_policy(ModelConfig(name="sd3", path=str(base), resolution=64, max_sequence_length=SEQ,
                                      gradient_checkpointing=True, vae_slicing=True, offload_text_encoders=True))
    assert policy.transformer.gradient_checkpointing and policy.vae.use_slicing and policy.offload_text_encoders
