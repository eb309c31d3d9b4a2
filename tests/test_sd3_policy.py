"""SD3 policy adapter over a tiny random SD3 built offline (no hub, no GPU)."""

import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from flowgrpo.config import ModelConfig
from flowgrpo.errors import UserError
from flowgrpo.policies import build_policy
from flowgrpo.policies.diffusers.sd3 import SD3Policy, build_sd3_policy
from flowgrpo.policies.tiny.sd3 import tiny_sd3_components, tiny_sd3_pipeline

PROMPTS = ["a red circle left of a blue square", "two green triangles", "a photo of a cat", ""]
SEQ = 32  # T5 tokens


def make_policy(**kw) -> SD3Policy:
    kw.setdefault("resolution", 64)
    kw.setdefault("max_sequence_length", SEQ)
    return SD3Policy.from_components(tiny_sd3_components(seed=0), **kw)


def inputs(policy, b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, *policy.latent_shape, generator=g), torch.rand(b, generator=g)


def perturb_lora(policy, seed=1, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_trainable_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def test_tiny_components_deterministic_and_rng_neutral():
    state = torch.get_rng_state()
    a, b, c = tiny_sd3_components(seed=0), tiny_sd3_components(seed=0), tiny_sd3_components(seed=1)
    assert torch.equal(state, torch.get_rng_state())  # the caller's RNG is untouched
    for key in ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        sa, sb, sc = a[key].state_dict(), b[key].state_dict(), c[key].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), key
        assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point()), key
    ids = a["tokenizer"](["a red circle"]).input_ids[0]
    assert ids[0] == a["tokenizer"].bos_token_id and ids[-1] == a["tokenizer"].eos_token_id
    assert a["tokenizer_3"](["a red circle"]).input_ids[0][-1] == a["tokenizer_3"].eos_token_id


def test_latent_shape_velocity_shape_and_dtype():
    policy = make_policy()
    assert policy.latent_shape == (16, 8, 8)
    cond = policy.encode_prompts(PROMPTS)
    assert cond.tensors["prompt_embeds"].shape == (4, 16 + SEQ, 96)
    assert cond.tensors["pooled_prompt_embeds"].shape == (4, 80)
    x, s = inputs(policy)
    v = policy.velocity(x, s, cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert SD3Policy.from_components(tiny_sd3_components(), resolution=128).latent_shape == (16, 16, 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        make_policy(resolution=72)

    bf = make_policy(dtype="bfloat16")
    vb = bf.velocity(x, s, bf.encode_prompts(PROMPTS))
    assert vb.dtype == torch.bfloat16 and vb.shape == x.shape  # returned as produced; the caller casts
    assert all(p.dtype == torch.float32 for p in bf.trainable_parameters())  # LoRA trains in fp32


def test_encoding_matches_stock_pipeline():
    policy = make_policy(train_mode="frozen")
    pipe = tiny_sd3_pipeline(seed=0)
    with torch.no_grad():
        emb, _, pooled, _ = pipe.encode_prompt(PROMPTS, None, None, device=torch.device("cpu"),
                                               do_classifier_free_guidance=False, max_sequence_length=SEQ)
    enc = policy._encode(PROMPTS)
    torch.testing.assert_close(enc["prompt_embeds"], emb, rtol=0, atol=1e-6)
    torch.testing.assert_close(enc["pooled_prompt_embeds"], pooled, rtol=0, atol=1e-6)


def test_cfg_combines_two_passes():
    g = 4.5
    policy = make_policy(guidance_scale=g)
    cond = policy.encode_prompts(PROMPTS[:3])
    assert cond.uncond is not None
    x, s = inputs(policy, b=3)
    with torch.no_grad():
        v = policy.velocity(x, s, cond)
        v_c = policy._forward(x, s, cond.tensors)
        v_u = policy._forward(x, s, {k: t.expand(3, *t.shape[1:]) for k, t in cond.uncond.items()})
        v_1 = policy.velocity(x, s, cond, guidance_scale=1.0)
    assert (v_c - v_u).abs().max() > 1e-4  # the prompt matters
    torch.testing.assert_close(v, v_u + g * (v_c - v_u), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_1, v_c, rtol=1e-5, atol=1e-5)


def test_lora_starts_as_identity_then_differs():
    policy = make_policy(lora_rank=4, lora_alpha=8.0)
    cond = policy.encode_prompts(PROMPTS)
    x, s = inputs(policy)
    with torch.no_grad():
        v0 = policy.velocity(x, s, cond)
    ref = policy.reference_velocity(x, s, cond)
    torch.testing.assert_close(v0, ref, rtol=0, atol=1e-6)
    perturb_lora(policy)
    with torch.no_grad():
        v1 = policy.velocity(x, s, cond)
    assert (v1 - v0).abs().max() > 1e-3
    torch.testing.assert_close(policy.reference_velocity(x, s, cond), ref, rtol=0, atol=1e-6)
    with torch.no_grad():  # adapters re-enabled after the reference pass
        torch.testing.assert_close(policy.velocity(x, s, cond), v1)


def test_only_lora_is_trainable_and_gets_gradients():
    policy = make_policy(lora_rank=4, lora_alpha=8.0).train()
    assert policy.transformer.training
    assert not any(m.training for m in (policy.text_encoder, policy.text_encoder_2, policy.text_encoder_3, policy.vae))
    named = dict(policy.named_trainable_parameters())
    assert named and all("lora_" in n for n in named)
    assert all(n.startswith("transformer.") for n in named)
    for n, p in policy.named_parameters():
        assert p.requires_grad == (n in named), n
    for target in (".attn.to_q.", ".attn.add_q_proj.", ".attn.to_add_out.", ".attn2.to_q.", ".ff.net.0.proj.",
                   ".ff_context.net.2."):
        assert any(target in n for n in named), target

    cond = policy.encode_prompts(PROMPTS)
    x, s = inputs(policy)
    policy.velocity(x, s, cond).square().mean().backward()
    grads = [p.grad for n, p in named.items() if "lora_B" in n]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for n, p in policy.named_parameters() if n not in named)

    full = make_policy(train_mode="full")
    assert {id(p) for p in full.trainable_parameters()} == {id(p) for p in full.transformer.parameters()}
    for enc in (full.text_encoder, full.text_encoder_2, full.text_encoder_3, full.vae):
        assert not any(p.requires_grad for p in enc.parameters())
    full.snapshot_reference()
    with torch.no_grad():
        v0 = full.velocity(x, s, full.encode_prompts(PROMPTS))
        for p in full.trainable_parameters():
            p.add_(0.01)
    torch.testing.assert_close(full.reference_velocity(x, s, full.encode_prompts(PROMPTS)), v0)
    assert make_policy(train_mode="frozen").trainable_parameters() == []


def test_decode_is_the_stock_pipelines_decode():
    """decode(z) = the pipeline's own tail: vae.decode(z / scaling + shift) then image_processor.postprocess,
    whatever the decode chunking."""
    pipe = tiny_sd3_pipeline(seed=0)
    cfg = pipe.vae.config
    assert cfg.shift_factor != 0.0 and cfg.scaling_factor != 1.0  # both factors are exercised
    x, _ = inputs(make_policy(train_mode="frozen"), b=5, seed=3)
    x = 3.0 * x  # large latents: the decoded values leave [-1, 1], so the clamp is exercised too
    with torch.no_grad():
        raw = pipe.vae.decode(x / cfg.scaling_factor + cfg.shift_factor, return_dict=False)[0]
        expected = pipe.image_processor.postprocess(raw, output_type="pt")
        chunked = make_policy(train_mode="frozen", decode_batch=2).decode(x)  # chunks of 2, 2, 1
        whole = make_policy(train_mode="frozen", decode_batch=8).decode(x)
    assert chunked.shape == (5, 3, 64, 64) and chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(whole, expected, rtol=0, atol=1e-5)
    assert (raw.abs() > 1).any()
    assert (chunked[0] - chunked[1]).abs().max() > 1e-3  # different latents, different images


def test_velocity_deterministic_across_builds():
    """Same seed, same components: two policies give bitwise-equal encodings and velocities; another seed differs."""
    a, b = make_policy(), make_policy()
    other = SD3Policy.from_components(tiny_sd3_components(seed=1), resolution=64, max_sequence_length=SEQ)
    x, s = inputs(a)
    with torch.no_grad():
        ca, cb = a.encode_prompts(PROMPTS), b.encode_prompts(PROMPTS)
        va, vb, vo = a.velocity(x, s, ca), b.velocity(x, s, cb), other.velocity(x, s, other.encode_prompts(PROMPTS))
        va2 = a.velocity(x, s, ca)
    for k in ca.tensors:
        assert torch.equal(ca.tensors[k], cb.tensors[k]), k
    assert torch.equal(va, vb) and torch.equal(va, va2)
    assert (va - vo).abs().max() > 1e-3


def test_save_lora_loads_into_stock_pipeline(tmp_path):
    policy = make_policy(lora_rank=4, lora_alpha=8.0)  # scale 2 != 1: alpha must travel with the weights
    perturb_lora(policy)
    out = policy.save_lora(tmp_path / "lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()

    pipe = tiny_sd3_pipeline(seed=0)
    pipe.load_lora_weights(str(out))
    cond = policy.encode_prompts(PROMPTS)
    x, s = inputs(policy)
    args = dict(hidden_states=x, timestep=s * 1000, encoder_hidden_states=cond.tensors["prompt_embeds"],
                pooled_projections=cond.tensors["pooled_prompt_embeds"], return_dict=False)
    with torch.no_grad():
        ours = policy.transformer(**args)[0]
        theirs = pipe.transformer(**args)[0]
        base = policy.reference_velocity(x, s, cond)
    assert (ours - base).abs().max() > 1e-3  # the adapter does something
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lora"):
        make_policy(train_mode="full").save_lora(tmp_path / "x")


def test_build_from_local_folder_and_registry(tmp_path):
    with pytest.raises(UserError, match="nowhere"):
        build_sd3_policy(ModelConfig(name="sd3", path=str(tmp_path / "nowhere")))
    with pytest.raises(UserError, match="model.path"):
        build_sd3_policy(ModelConfig(name="sd3", path=None))

    tiny_sd3_pipeline(seed=0, shift=2.0).save_pretrained(tmp_path / "pipe")  # a non-stock scheduler config
    cfg = ModelConfig(name="sd3", path=str(tmp_path / "pipe"), resolution=64, max_sequence_length=SEQ,
                      guidance_scale=3.0, lora_rank=4, lora_alpha=4.0)
    loaded = build_policy(cfg)
    tiny = build_policy(ModelConfig(name="sd3-tiny", resolution=64, max_sequence_length=SEQ, guidance_scale=3.0))
    assert isinstance(loaded, SD3Policy) and isinstance(tiny, SD3Policy)
    assert loaded.latent_shape == tiny.latent_shape == (16, 8, 8)
    # the folder's scheduler_config.json sets the loaded policy's grid; the registry's tiny one is SD3's stock
    torch.testing.assert_close(loaded.sigma_grid(5).double(), torch.tensor(diffusers_sigmas(5, 2.0), dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(tiny.sigma_grid(5).double(), torch.tensor(diffusers_sigmas(5, 3.0), dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)
    x, s = inputs(tiny)
    with torch.no_grad():
        torch.testing.assert_close(loaded.velocity(x, s, loaded.encode_prompts(PROMPTS)),
                                   tiny.velocity(x, s, tiny.encode_prompts(PROMPTS)), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- sigma grid
def diffusers_sigmas(num_steps: int, shift: float = 1.0, num_train: int = 1000, mu: float | None = None) -> list[float]:
    """float64 re-derivation of ``FlowMatchEulerDiscreteScheduler`` (static or exponential dynamic shift).

    The training schedule is t_k = k / N for k = N..1, shifted by ``shift`` unless the shift is
    dynamic; its ends are sigma_max and sigma_min. ``set_timesteps(T)`` spaces T timesteps
    uniformly from sigma_max * N to sigma_min * N, divides by N, shifts again (or applies the
    exponential time shift e^mu / (e^mu + 1/s - 1)) and appends a terminal 0.
    """
    train = [k / num_train for k in range(num_train, 0, -1)]
    if mu is None:
        train = [shift * t / (1 + (shift - 1) * t) for t in train]
    hi, lo = train[0] * num_train, train[-1] * num_train
    out = []
    for i in range(num_steps):
        s = (hi + (lo - hi) * i / (num_steps - 1) if num_steps > 1 else hi) / num_train
        out.append(shift * s / (1 + (shift - 1) * s) if mu is None else math.exp(mu) / (math.exp(mu) + 1 / s - 1))
    return out + [0.0]


def test_unset_sizes_are_the_adapters_own_defaults(tmp_path):
    """model.resolution / model.max_sequence_length left unset: SD3Policy's own defaults for an SD3
    folder, the tiny model's own for sd3-tiny (the config used to pass 64 px and 32 T5 tokens)."""
    import inspect

    from flowgrpo.policies.tiny.sd3 import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

    tiny_sd3_pipeline(seed=0).save_pretrained(tmp_path / "pipe")
    cfg = ModelConfig(name=str(tmp_path / "pipe"), lora_rank=4)
    assert cfg.resolution is None and cfg.max_sequence_length is None
    own = inspect.signature(SD3Policy.__init__).parameters
    loaded = build_policy(cfg)
    assert (loaded.resolution, loaded.max_sequence_length) == (own["resolution"].default,
                                                                own["max_sequence_length"].default)
    tiny = build_policy(ModelConfig(name="sd3-tiny", lora_rank=4))
    assert (tiny.resolution, tiny.max_sequence_length) == (TINY_RESOLUTION, TINY_MAX_SEQUENCE_LENGTH)
    tiny = build_policy(ModelConfig(name="sd3-tiny", lora_rank=4, resolution=128, max_sequence_length=8))
    assert (tiny.resolution, tiny.max_sequence_length) == (128, 8)


@pytest.mark.parametrize("num_steps", [4, 10, 28])
def test_sigma_grid_is_the_sd3_schedulers(num_steps):
    from flowgrpo.samplers import sigma_grid as flux_grid

    policy = make_policy(train_mode="frozen")  # tiny components: the scheduler has shift 3
    assert policy.scheduler.config.shift == 3.0
    grid = policy.sigma_grid(num_steps)
    expected = torch.tensor(diffusers_sigmas(num_steps, shift=3.0), dtype=torch.float64)
    assert grid.dtype == torch.float32 and grid.shape == (num_steps + 1,)
    torch.testing.assert_close(grid.double(), expected, rtol=1e-6, atol=1e-7)
    assert float(grid[0]) == 1.0 and float(grid[-1]) == 0.0
    assert bool((grid[1:] < grid[:-1]).all())
    # the last non-zero sigma is the doubly shifted training sigma_min, well above the FLUX grid's
    assert float(grid[-2]) > 0.0
    # not the FLUX-style grid (linspace(1, 1/T, T) shifted once): the test fails on that fallback
    flux = flux_grid(num_steps, 3.0)
    assert (grid - flux).abs().max() > 1e-2
    # the shift argument is ignored: the scheduler config owns it
    assert torch.equal(policy.sigma_grid(num_steps, 1.0), grid) and torch.equal(policy.sigma_grid(num_steps, 5.0), grid)


def test_sigma_grid_follows_the_scheduler_config_and_leaves_it_untouched():
    from diffusers import FlowMatchEulerDiscreteScheduler

    comps = tiny_sd3_components(seed=0)
    sched = comps["scheduler"]
    before = (sched.sigmas.clone(), sched.timesteps.clone())
    policy = SD3Policy.from_components(comps, resolution=64, max_sequence_length=SEQ, train_mode="frozen")
    policy.sigma_grid(7)
    assert torch.equal(sched.sigmas, before[0]) and torch.equal(sched.timesteps, before[1])
    assert getattr(sched, "num_inference_steps", None) is None

    comps["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=1.0)
    plain = SD3Policy.from_components(comps, resolution=64, max_sequence_length=SEQ, train_mode="frozen")
    torch.testing.assert_close(plain.sigma_grid(6).double(), torch.tensor(diffusers_sigmas(6, 1.0), dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)

    # dynamic shifting: mu from the number of latent patches, as StableDiffusion3Pipeline computes it
    comps["scheduler"] = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                         base_image_seq_len=256, max_image_seq_len=4096)
    dyn = SD3Policy.from_components(comps, resolution=128, max_sequence_length=SEQ, train_mode="frozen")
    tokens = (128 // 8 // 2) ** 2  # latent side 16, patch 2
    mu = 0.5 + (1.15 - 0.5) * (tokens - 256) / (4096 - 256)
    torch.testing.assert_close(dyn.sigma_grid(5).double(), torch.tensor(diffusers_sigmas(5, mu=mu), dtype=torch.float64),
                               rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="num_steps"):
        dyn.sigma_grid(0)


def test_euler_on_sigma_grid_reproduces_the_stock_pipeline():
    """Euler steps x <- x + (sigma' - sigma) * velocity over policy.sigma_grid(T), with guidance, land on the
    latents StableDiffusion3Pipeline(output_type="latent") produces from the same initial noise."""
    steps, g = 4, 3.0
    pipe = tiny_sd3_pipeline(seed=0)
    policy = make_policy(train_mode="frozen", guidance_scale=g)
    x0, _ = inputs(policy, b=2, seed=5)
    with torch.no_grad():
        theirs = pipe(prompt=PROMPTS[:2], height=64, width=64, num_inference_steps=steps, guidance_scale=g,
                      latents=x0.clone(), output_type="latent", max_sequence_length=SEQ).images
        cond = policy.encode_prompts(PROMPTS[:2])
        sig = policy.sigma_grid(steps)
        x = x0.clone()
        for i in range(steps):
            x = x + (sig[i + 1] - sig[i]) * policy.velocity(x, sig[i].expand(2), cond).float()
    torch.testing.assert_close(pipe.scheduler.sigmas, sig, rtol=0, atol=0)  # the pipeline ran on this grid
    assert (x - x0).abs().max() > 1e-2
    torch.testing.assert_close(x, theirs, rtol=1e-4, atol=1e-4)
