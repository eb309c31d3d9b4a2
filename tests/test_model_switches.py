"""Every model switch of ``ModelConfig`` works the same on the tiny SD3, FLUX and Wan adapters.

One implementation (:mod:`flowgrpo.policies.diffusers.switches`, plus the dtype handling of
:mod:`flowgrpo.policies.diffusers.common`) serves the three adapters; each test is parametrised over
them and compares the switch on with the switch off. Tolerances (max abs difference):

* gradient_checkpointing: velocity and LoRA gradients within 1e-5 (recomputation in the same
  order: bitwise equal in practice);
* vae_slicing: decode within 1e-5 (batch-size-dependent kernel numerics only);
* vae_tiling: bitwise equal while the image fits one tile; above it diffusers' tiled path runs
  (blended overlapping tiles, an approximation by design, so not compared numerically);
* offload_text_encoders: encodings within 1e-6, served from the per-prompt cache;
* compile_transformer: velocity within 1e-4 of eager. ``torch.compile`` runs with the backend
  ``FLOWGRPO_COMPILE_BACKEND`` names, ``aot_eager`` here unless the environment sets another one
  (a cold inductor build of the three tiny transformers takes about a minute on two cores;
  ``FLOWGRPO_COMPILE_BACKEND=inductor pytest tests/test_model_switches.py`` runs it);
* dtype: bfloat16 velocity within 8 % of max |v| of float32 (float16 within 1 %), LoRA weights
  and their gradients float32.
"""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

from flowgrpo.config import ModelConfig
from flowgrpo.errors import ConfigError
from flowgrpo.policies import build_policy
from flowgrpo.policies.diffusers import switches as switches_mod
from flowgrpo.policies.diffusers.flux import FluxPolicy
from flowgrpo.policies.tiny.flux import save_tiny_flux_pipeline, tiny_flux_components
from flowgrpo.policies.diffusers.sd3 import SD3Policy
from flowgrpo.policies.tiny.sd3 import tiny_sd3_components, tiny_sd3_pipeline
from flowgrpo.policies.diffusers.switches import SWITCHES, runtime_options
from flowgrpo.policies.diffusers.wan import WanPolicy
from flowgrpo.policies.tiny.wan import save_tiny_wan, tiny_wan_components

PROMPTS = ["a photo of a cat", "a red ball rolling"]
MODELS = {  # adapter, component builder, policy options (SD3 and Wan with classifier-free guidance)
    "SD3": (SD3Policy, tiny_sd3_components, dict(resolution=64, max_sequence_length=16, guidance_scale=2.0)),
    "FLUX": (FluxPolicy, tiny_flux_components, dict(resolution=32, max_sequence_length=16, guidance_scale=3.5)),
    "Wan": (WanPolicy, tiny_wan_components, dict(resolution=32, num_frames=5, max_sequence_length=16,
                                                 guidance_scale=3.0)),
}
pytestmark = pytest.mark.parametrize("model", list(MODELS))


@functools.lru_cache(maxsize=None)
def _components(model: str) -> dict:
    return MODELS[model][1](0)


def fresh_components(model: str) -> dict:
    """Copies of the model's tiny modules (built once per model; tokenizers and scheduler are shared)."""
    return {k: copy.deepcopy(v) if isinstance(v, torch.nn.Module) else v for k, v in _components(model).items()}


def make(model: str, **options):
    """A fresh policy over :func:`fresh_components`."""
    cls, _, defaults = MODELS[model]
    return cls.from_components(fresh_components(model), lora_rank=4, lora_alpha=8.0, **{**defaults, **options})


def lora_weights(policy, seed: int = 1) -> dict:
    """Non-zero LoRA weights (B = 0 at init would hide the adapter's gradients and effect)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in policy.trainable_state_dict().items()}


def inputs(policy, b: int = 2):
    g = torch.Generator().manual_seed(0)
    return torch.randn(b, *policy.latent_shape, generator=g), torch.tensor([0.7, 0.3][:b])


def velocity_and_grads(policy, weights):
    policy.load_trainable_state_dict(weights)
    policy.train()
    x, s = inputs(policy)
    v = policy.velocity(x.to(policy.dtype), s, policy.encode_prompts(PROMPTS))
    v.float().square().mean().backward()
    return v.detach().float(), {n: p.grad.clone() for n, p in policy.named_trainable_parameters()}


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_gradient_checkpointing_same_velocity_and_grads(model):
    plain, ckpt = make(model), make(model, gradient_checkpointing=True)
    assert ckpt.transformer.gradient_checkpointing and not plain.transformer.gradient_checkpointing
    weights = lora_weights(plain)
    (v0, g0), (v1, g1) = velocity_and_grads(plain, weights), velocity_and_grads(ckpt, weights)
    assert max_diff(v1, v0) <= 1e-5
    assert g0 and any(g.abs().sum() > 0 for g in g0.values())
    assert max(max_diff(g1[n], g) for n, g in g0.items()) <= 1e-5


def test_vae_slicing_same_decode(model):
    plain, sliced = make(model, decode_batch=3), make(model, decode_batch=3, vae_slicing=True)
    assert sliced.vae.use_slicing and not plain.vae.use_slicing
    z, _ = inputs(plain, b=1)
    z = torch.cat([z, -z, 2 * z])  # one decode call of 3 latents: sliced into 3 calls of 1
    with torch.no_grad():
        assert max_diff(sliced.decode(z), plain.decode(z)) <= 1e-5


def test_vae_tiling_same_decode_within_a_tile_and_tiles_above(model, monkeypatch):
    plain, tiled = make(model), make(model, vae_tiling=True)
    assert tiled.vae.use_tiling and not plain.vae.use_tiling
    z, _ = inputs(plain, b=1)
    with torch.no_grad():  # the policy's resolution fits one tile: the untiled path, same images
        assert torch.equal(tiled.decode(z), plain.decode(z))
    calls = []
    real = tiled.vae.tiled_decode
    monkeypatch.setattr(tiled.vae, "tiled_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    vae = tiled.vae  # latents twice the tile size: diffusers' tiled decode runs
    tile = vae.tile_sample_min_height if model == "Wan" else vae.tile_sample_min_size
    side = 2 * tile // tiled.vae_scale_factor if model != "Wan" else tile // 8 + 8
    big = torch.randn(1, *z.shape[1:-2], side, side, generator=torch.Generator().manual_seed(2))
    if model == "Wan":
        big = big[:, :, :1]  # one latent frame keeps the tiled Wan decode under a second
    with torch.no_grad():
        images, ref = tiled.decode(big), plain.decode(big)
    assert calls and images.shape == ref.shape and torch.isfinite(images).all()


def test_offload_text_encoders_cache_and_cpu(model):
    plain, off = make(model), make(model, offload_text_encoders=True, prompt_cache_size=3)
    encoders = off.text_encoders()
    assert encoders and len(encoders) == len(plain.text_encoders())
    calls = []
    for enc in encoders:
        enc.register_forward_hook(lambda *a: calls.append(1))
    first = off.encode_prompts(PROMPTS)
    n = len(calls)
    second = off.encode_prompts(list(reversed(PROMPTS)) + PROMPTS)
    assert n > 0 and len(calls) == n  # every prompt (and the empty one of guidance) came from the cache
    assert all(p.device.type == "cpu" for enc in encoders for p in enc.parameters())
    ref = plain.encode_prompts(PROMPTS)
    for k, v in first.tensors.items():
        assert torch.equal(second.tensors[k][2:], v) and torch.equal(second.tensors[k][0], v[1])
        assert max_diff(v, ref.tensors[k]) <= 1e-6
    off.encode_prompts(["a mountain lake", "two green triangles"])  # LRU of 3: the oldest entries go
    assert len(calls) > n and len(off._prompt_cache) == 3
    n = len(calls)
    off.encode_prompts(["two green triangles"])
    assert len(calls) == n

    # a move off the CPU leaves the offloaded encoders there (the meta device stands in for a GPU);
    # a cast that stays on the CPU reaches them
    off.to(torch.float64)
    assert all(p.dtype == torch.float64 for enc in encoders for p in enc.parameters())
    off.to("meta")
    assert off.device.type == "meta" and off.vae.device.type == "meta"
    assert all(p.device.type == "cpu" for enc in encoders for p in enc.parameters())


@pytest.fixture
def compile_backend(monkeypatch):
    """The test backend of torch.compile (see the module docstring)."""
    backend = os.environ.get(switches_mod.COMPILE_BACKEND_ENV) or "aot_eager"
    monkeypatch.setenv(switches_mod.COMPILE_BACKEND_ENV, backend)
    return backend


def test_compile_transformer_matches_eager(model, compile_backend):
    import torch._dynamo

    torch._dynamo.reset()
    plain, compiled = make(model), make(model, compile_transformer=True)
    assert compiled.transformer._compiled_call_impl is not None and plain.transformer._compiled_call_impl is None
    weights = lora_weights(plain)
    x, s = inputs(plain)
    out = []
    for policy in (plain, compiled):
        policy.load_trainable_state_dict(weights)
        with torch.no_grad():
            out.append(policy.velocity(x, s, policy.encode_prompts(PROMPTS)))
    assert max_diff(out[1], out[0]) <= 1e-4
    # parameter names (checkpoints, EMA, save_lora) are those of the eager transformer
    assert list(compiled.trainable_state_dict()) == list(plain.trainable_state_dict())


def test_xformers_backend_is_refused_here_and_uses_diffusers_dispatcher_on_cuda(model, monkeypatch):
    from flowgrpo.policies.diffusers import attention
    from flowgrpo.policies.diffusers.attention import processor_backends

    if attention.backend_problem("xformers") is None:
        pytest.skip("xformers and CUDA are available: the switch applies")
    with pytest.raises(ConfigError, match=rf"model\.attention_backend=xformers cannot apply to {model} .*"
                                          r"needs .*(xformers package|CUDA GPU).*usable here: sdpa, native"):
        make(model, attention_backend="xformers")
    with pytest.raises(ConfigError, match="unknown model.attention_backend 'xformer'"):
        make(model, attention_backend="xformer")

    # with xformers and CUDA present (mocked), every attention processor is set to diffusers' xformers backend
    from diffusers.models import attention_dispatch

    monkeypatch.setattr(attention_dispatch, "_check_attention_backend_requirements", lambda backend: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    policy = make(model, attention_backend="xformers")
    assert processor_backends(policy.transformer) and set(processor_backends(policy.transformer)) == {"xformers"}


@pytest.mark.parametrize("dtype, rel", [("bfloat16", 0.08), ("float16", 0.01)])
def test_half_dtype_keeps_fp32_lora_and_vae(model, dtype, rel):
    full, half = make(model), make(model, dtype=dtype)
    weights = lora_weights(full)
    (v0, _), (v1, grads) = velocity_and_grads(full, weights), velocity_and_grads(half, weights)
    assert max_diff(v1, v0) <= rel * v0.abs().max().item()
    assert all(p.dtype == torch.float32 for p in half.trainable_parameters())
    assert all(g.dtype == torch.float32 for g in grads.values()) and any(g.abs().sum() > 0 for g in grads.values())
    assert all(p.dtype == torch.float32 for p in half.vae.parameters())
    # the transformer's and text encoders' own weights are in the half dtype, but for the submodules
    # their library keeps in float32 (Wan's norms / time embedder; T5's wo under float16)
    for module in (half.transformer, *half.text_encoders()):
        keep = set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if not type(module).__module__.startswith("transformers.") or dtype == "float16":
            keep |= set(getattr(module, "_keep_in_fp32_modules", None) or ())
        for n, p in module.named_parameters():
            if "lora_" not in n:
                assert p.dtype == (torch.float32 if keep & set(n.split(".")) else half.dtype), n


def test_switch_that_cannot_apply_is_a_config_error(model):
    cls, _, defaults = MODELS[model]
    comps = fresh_components(model)
    comps["vae"].enable_tiling = None  # a VAE class without tiling (older diffusers, other VAEs)
    with pytest.raises(ConfigError, match=rf"model\.vae_tiling=true cannot apply to {model} .*no enable_tiling\(\)"):
        cls.from_components(comps, **defaults, train_mode="frozen", vae_tiling=True)
    comps = fresh_components(model)
    comps["transformer"]._supports_gradient_checkpointing = False
    with pytest.raises(ConfigError, match=rf"model\.gradient_checkpointing=true cannot apply to {model} "
                                          r".*does not support gradient checkpointing"):
        cls.from_components(comps, **defaults, train_mode="frozen", gradient_checkpointing=True)


def test_config_switches_reach_every_adapter(model, tmp_path):
    """``ModelConfig``'s switches travel through ``build_policy`` (a saved pipeline folder) to the adapter, and
    its half dtype gives the weights the stock loader's ``from_pretrained(torch_dtype=...)`` gives."""
    assert set(runtime_options(ModelConfig())) == set(SWITCHES)
    directory = tmp_path / model
    if model == "SD3":
        tiny_sd3_pipeline(seed=0).save_pretrained(directory)
    elif model == "FLUX":
        save_tiny_flux_pipeline(directory)
    else:
        save_tiny_wan(directory)
    cfg = ModelConfig(name=str(directory), resolution=32 if model != "SD3" else 64, max_sequence_length=16,
                      num_frames=5, lora_rank=4, dtype="bfloat16", gradient_checkpointing=True, vae_slicing=True, vae_tiling=True,
                      offload_text_encoders=True, compile_transformer=True)
    policy = build_policy(cfg)
    assert isinstance(policy, MODELS[model][0])
    assert policy.transformer.gradient_checkpointing and policy.vae.use_slicing and policy.vae.use_tiling
    assert policy.offload_text_encoders and policy.transformer._compiled_call_impl is not None

    import diffusers

    pipe_cls = getattr(diffusers, {"SD3": "StableDiffusion3Pipeline", "FLUX": "FluxPipeline", "Wan": "WanPipeline"}[model])
    stock = pipe_cls.from_pretrained(str(directory), torch_dtype=torch.bfloat16, local_files_only=True)
    encoders = [name for name, _ in policy.named_children() if name.startswith("text_encoder")]
    for name in ("transformer", "vae", *encoders):
        ours = {n.replace(".base_layer", ""): p.dtype for n, p in getattr(policy, name).named_parameters()
                if "lora_" not in n}
        theirs = {n: p.dtype for n, p in getattr(stock, name).named_parameters()}
        want = {n: torch.float32 for n in theirs} if name == "vae" else theirs  # flowgrpo decodes in float32
        assert ours == want, name
