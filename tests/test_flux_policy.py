"""FLUX policy adapter over a tiny random FLUX.1 pipeline saved to disk (no hub, no GPU)."""

import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from flowgrpo.config import ModelConfig, load_config
from flowgrpo.policies import build_policy
from flowgrpo.policies.diffusers.flux import FluxPolicy
from flowgrpo.policies.tiny.flux import save_tiny_flux_pipeline

RES, SEQ, GUIDANCE = 32, 16, 3.5
PROMPTS = ["a photo of a cat", "a red circle on a white table"]


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    return save_tiny_flux_pipeline(tmp_path_factory.mktemp("tiny-flux"), seed=0, guidance_embeds=True)


def load_pipe(directory):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(str(directory), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_policy(directory, **kw) -> FluxPolicy:
    kw = {"resolution": RES, "max_sequence_length": SEQ, "guidance_scale": GUIDANCE, "lora_rank": 4, "lora_alpha": 8, **kw}
    return FluxPolicy.from_components(load_pipe(directory).components, **kw)


def pack(x):  # [B, C, h, w] -> [B, (h/2)(w/2), 4C], FLUX's 2x2 patch tokens, written out here
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack(t, h, w):
    b, _, c4 = t.shape
    return t.reshape(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, h, w)


def stock_velocity(pipe, x, sigma, prompts, guidance):
    """The transformer call of FluxPipeline.__call__, assembled here from the stock components."""
    b, _, h, w = x.shape
    prompt_embeds, pooled, text_ids = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=SEQ)
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    out = pipe.transformer(hidden_states=pack(x), timestep=sigma, guidance=torch.full((b,), guidance),
                           pooled_projections=pooled, encoder_hidden_states=prompt_embeds, txt_ids=text_ids,
                           img_ids=img_ids, return_dict=False)[0]
    return unpack(out, h, w)


def test_velocity_matches_stock_transformer_and_lora_moves_it(flux_dir):
    policy, pipe = make_policy(flux_dir), load_pipe(flux_dir)
    assert policy.latent_shape == (16, RES // 8, RES // 8)
    g = torch.Generator().manual_seed(0)
    x, sigma = torch.randn(2, *policy.latent_shape, generator=g), torch.tensor([0.3, 0.9])
    cond = policy.encode_prompts(PROMPTS)
    assert cond.uncond is None  # distilled guidance: no unconditional pass
    with torch.no_grad():
        ref = stock_velocity(pipe, x, sigma, PROMPTS, GUIDANCE)
        v = policy.velocity(x, sigma, cond)
        assert torch.allclose(v, ref, atol=1e-5), (v - ref).abs().max()
        # the guidance value is a transformer input: another value changes the velocity
        assert not torch.allclose(policy.velocity(x, sigma, cond, guidance_scale=1.0), v, atol=1e-4)
        gen = torch.Generator().manual_seed(1)
        for p in policy.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        assert not torch.allclose(policy.velocity(x, sigma, cond), ref, atol=1e-4)
        assert torch.allclose(policy.reference_velocity(x, sigma, cond), ref, atol=1e-5)


def test_euler_on_sigma_grid_reproduces_stock_pipeline(flux_dir):
    policy, pipe = make_policy(flux_dir, train_mode="frozen"), load_pipe(flux_dir)
    steps = 4
    packed = pipe(PROMPTS[0], height=RES, width=RES, num_inference_steps=steps, guidance_scale=GUIDANCE,
                  max_sequence_length=SEQ, generator=torch.Generator().manual_seed(0), output_type="latent").images
    grid = policy.sigma_grid(steps)
    assert torch.allclose(grid, pipe.scheduler.sigmas.float(), atol=0, rtol=0)
    assert not torch.allclose(grid[1:-1], torch.linspace(1, 0, steps + 1)[1:-1])  # dynamic shift applied
    x = torch.randn(1, *policy.latent_shape, generator=torch.Generator().manual_seed(0))  # the pipeline's draw
    cond = policy.encode_prompts(PROMPTS[:1])
    with torch.no_grad():
        for s, s_next in zip(grid[:-1], grid[1:]):
            x = x + (s_next - s) * policy.velocity(x, s.reshape(1), cond).float()
    ref = unpack(packed, *policy.latent_shape[1:])
    assert (x - ref).abs().max() <= 1e-4
    # decode is the pipeline's VAE tail (before its [0, 1] post-processing)
    with torch.no_grad():
        vae = pipe.vae
        img = vae.decode(ref / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
        assert torch.allclose(policy.decode(x), ((img + 1) / 2).clamp(0, 1), atol=1e-4)


def test_pipeline_dir_resolves_and_schnell_has_no_guidance(tmp_path):
    directory = save_tiny_flux_pipeline(tmp_path / "schnell", seed=1, guidance_embeds=False)
    policy = build_policy(ModelConfig(name=str(directory), resolution=16, max_sequence_length=8, lora_rank=2))
    assert isinstance(policy, FluxPolicy) and policy.latent_shape == (16, 2, 2)
    x, cond = torch.randn(1, 16, 2, 2), policy.encode_prompts(["a cat"])
    with torch.no_grad():  # no guidance embedding: the value is ignored
        assert torch.equal(policy.velocity(x, torch.tensor([0.5]), cond, guidance_scale=1.0),
                           policy.velocity(x, torch.tensor([0.5]), cond, guidance_scale=7.0))


def test_unset_sizes_are_the_adapters_own_defaults(flux_dir):
    """model.resolution / model.max_sequence_length left unset: FluxPolicy's own defaults apply (the
    config used to pass 64 px and 32 T5 tokens to every adapter)."""
    import inspect

    cfg = load_config("flow-grpo", None, [f"model.name={flux_dir}", "model.train_mode=lora"], recipe="shapes").model
    assert cfg.resolution is None and cfg.max_sequence_length is None
    policy = build_policy(cfg)
    own = inspect.signature(FluxPolicy.__init__).parameters
    assert policy.resolution == own["resolution"].default
    assert policy.max_sequence_length == own["max_sequence_length"].default
    assert policy.latent_shape == (16, own["resolution"].default // 8, own["resolution"].default // 8)
    # a set value still wins
    assert build_policy(ModelConfig(name=str(flux_dir), resolution=RES, max_sequence_length=SEQ)).max_sequence_length == SEQ


def test_saved_lora_loads_into_stock_pipeline(flux_dir, tmp_path):
    policy, pipe = make_policy(flux_dir), load_pipe(flux_dir)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    policy.save_lora(tmp_path / "lora")
    pipe.load_lora_weights(str(tmp_path / "lora"))
    x, sigma = torch.randn(1, *policy.latent_shape, generator=gen), torch.tensor([0.6])
    with torch.no_grad():
        ref = stock_velocity(pipe, x, sigma, PROMPTS[:1], GUIDANCE)
        assert torch.allclose(policy.velocity(x, sigma, policy.encode_prompts(PROMPTS[:1])), ref, atol=1e-5)


def test_tiny_flux_trains_two_iterations(flux_dir, tmp_path):
    from flowgrpo.trainer.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\na red circle on a white table\na mountain lake at dawn\n")
    cfg = load_config("flow-grpo", None, [
        f"model.name={flux_dir}", f"model.resolution={RES}", f"model.max_sequence_length={SEQ}",
        f"model.guidance_scale={GUIDANCE}", "model.train_mode=lora", "model.lora_rank=4",
        "model.lora_alpha=8", "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompts}", "data.prompts_per_iteration=2",
        "data.trees_per_prompt=2", "sampler.num_steps=3", "train.iterations=2", "train.threads=1", "train.lr=1e-3",
        "eval.evaluator=none", "log.progress=false", f"log.out_dir={tmp_path / 'runs'}",
    ], recipe="shapes")
    trainer = Trainer(cfg)
    policy = trainer.policy
    assert isinstance(policy, FluxPolicy)
    lora_before = policy.trainable_state_dict()
    assert lora_before and all("lora" in k for k in lora_before)
    trainable = {id(p) for p in policy.trainable_parameters()}
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if id(p) not in trainable}

    metrics = [trainer.iteration_step().metrics for _ in range(2)]
    assert metrics[0]["onpolicy_ratio_maxdev"] < 1e-5
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    lora_after = policy.trainable_state_dict()
    changed = [k for k in lora_before if not torch.equal(lora_before[k], lora_after[k])]
    assert any("lora_A" in k for k in changed) and any("lora_B" in k for k in changed)
    params = dict(policy.named_parameters())
    for n, t in base.items():
        assert torch.equal(params[n].detach(), t), f"base weight {n} changed"
