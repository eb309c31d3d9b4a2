"""Engine levers (issue 46 item 1): each switch gives the plain path's results, on the CPU in float32.

* ``model.attention_backend=native`` (PyTorch SDPA through diffusers' attention dispatcher; SD3's
  joint attention through :class:`~flowgrpo.policies.diffusers.attention.DispatchJointAttnProcessor`)
  gives the velocities of ``sdpa`` (diffusers' default processors) within 1e-6 on the tiny SD3, FLUX
  and Z-Image (the generic adapter), and a one-iteration training run the same metrics and LoRA;
* a backend this machine cannot run (``flash``, ``xformers``: no package, no CUDA) stops
  ``flowgrpo train`` with one line naming it, why, and the backends usable here;
* ``model.compile_transformer=regional`` compiles each repeated block in place (diffusers'
  ``compile_repeated_blocks()`` on FLUX, every ``transformer_blocks`` entry on SD3, whose class names
  no ``_repeated_blocks``), not the whole forward, and gives the eager velocities, gradients and
  one-iteration update within float32 tolerance; ``compile_s`` reports the compile time.

The GPU kernels (flash, flash-3, sage, xformers) and the speed of either lever are not measured here:
no device. ``torch.compile`` runs with ``$FLOWGRPO_COMPILE_BACKEND`` or ``aot_eager`` (as
tests/test_model_switches.py).
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch

from conftest import fresh_tiny_policy, tiny_components
from flowgrpo.config import ModelConfig, load_config
from flowgrpo.errors import ConfigError
from flowgrpo.policies import build_policy
from flowgrpo.policies.diffusers import attention as attention_mod
from flowgrpo.policies.diffusers import switches as switches_mod
from flowgrpo.policies.diffusers.attention import DispatchJointAttnProcessor, processor_backends
from flowgrpo.policies.diffusers.flux import FluxPolicy
from flowgrpo.policies.diffusers.sd3 import SD3Policy
from flowgrpo.policies.diffusers.switches import repeated_blocks
from flowgrpo.policies.tiny.families import save_tiny_pipeline
from flowgrpo.policies.tiny.flux import tiny_flux_components
from flowgrpo.policies.tiny.sd3 import tiny_sd3_components
from flowgrpo.trainer.trainer import Trainer

PROMPTS = ["a photo of a cat", "a red ball rolling"]
MODELS = {  # adapter, component builder, policy options
    "SD3": (SD3Policy, tiny_sd3_components, dict(resolution=64, max_sequence_length=16, guidance_scale=2.0)),
    "FLUX": (FluxPolicy, tiny_flux_components, dict(resolution=32, max_sequence_length=16, guidance_scale=3.5)),
}
TIMING = {"rollout_s", "collect_s", "train_s", "iter_s", "compile_s"}


def make(model: str, **options):
    """A fresh policy over copies of the model's tiny modules."""
    cls, build, defaults = MODELS[model]
    return fresh_tiny_policy(cls, build, lora_rank=4, lora_alpha=8.0, **{**defaults, **options})


@pytest.fixture(scope="module")
def zimage_dir(tmp_path_factory):
    """A saved tiny Z-Image pipeline (the generic adapter's family)."""
    return save_tiny_pipeline("z-image", tmp_path_factory.mktemp("zimage") / "base")


def make_zimage(base, **options):
    return build_policy(ModelConfig(name=str(base), train_mode="lora", resolution=64, max_sequence_length=32,
                                    guidance_scale=3.0, lora_rank=4, lora_alpha=8, **options))


def perturb_lora(policy, seed: int = 1) -> None:
    """Non-zero adapter weights (B = 0 at init would hide the adapter inside the attention)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def velocity_and_grads(policy):
    """The velocity of two fixed inputs and the LoRA gradients of its mean square."""
    perturb_lora(policy)
    policy.train()
    x = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    v = policy.velocity(x, torch.tensor([0.7, 0.3]), policy.encode_prompts(PROMPTS))
    v.square().mean().backward()
    return v.detach(), {n: p.grad.clone() for n, p in policy.named_trainable_parameters()}


def assert_same(a, b, atol: float) -> None:
    (v0, g0), (v1, g1) = a, b
    torch.testing.assert_close(v1, v0, rtol=0, atol=atol)
    assert g0 and set(g0) == set(g1) and any(g.abs().sum() > 0 for g in g0.values())
    for n, g in g0.items():
        torch.testing.assert_close(g1[n], g, rtol=0, atol=atol, msg=n)


# ---------------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("model", ["SD3", "FLUX", "Z-Image"])
def test_native_attention_matches_sdpa(model, request):
    if model == "Z-Image":
        build = functools.partial(make_zimage, request.getfixturevalue("zimage_dir"))
    else:
        build = functools.partial(make, model)
    plain, native = build(), build(attention_backend="native")
    # the switch reached every attention processor (SD3's through the dispatching port of its processor)
    assert processor_backends(native.transformer) and set(processor_backends(native.transformer)) == {"native"}
    assert set(processor_backends(plain.transformer)) != {"native"}
    if model == "SD3":
        assert all(isinstance(m.processor, DispatchJointAttnProcessor) for m in attention_mod._attention_modules(
            native.transformer))
    assert_same(velocity_and_grads(plain), velocity_and_grads(native), atol=1e-6)
    # diffusers' process-wide default backend is left as it was: the plain policy still runs its default
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    assert _AttentionBackendRegistry._active_backend.value == os.environ.get("DIFFUSERS_ATTN_BACKEND", "native")


def test_wan22_attention_backend_and_regional_compile_reach_both_experts(tmp_path, monkeypatch):
    """The generic adapter's second expert (Wan 2.2 A14B's transformer_2) gets both levers too."""
    monkeypatch.setenv(switches_mod.COMPILE_BACKEND_ENV, "aot_eager")  # compiling is lazy: nothing runs here
    base = save_tiny_pipeline("wan22-a14b", tmp_path / "base")
    policy = build_policy(ModelConfig(name=str(base), train_mode="lora", resolution=32, num_frames=5,
                                      max_sequence_length=16, guidance_scale=4.0, lora_rank=4, lora_alpha=8,
                                      attention_backend="native", compile_transformer="regional"))
    for network in (policy.transformer, policy.transformer_2):
        assert set(processor_backends(network)) == {"native"}
        blocks = repeated_blocks(network)
        assert blocks and all(b._compiled_call_impl is not None for b in blocks)
        assert network._compiled_call_impl is None


def write_prompts(root):
    root.mkdir(parents=True, exist_ok=True)
    (root / "prompts.txt").write_text("\n".join([*PROMPTS, "a mountain lake at dawn"]) + "\n")
    return root / "prompts.txt"


def sd3_config(tmp_path, *extra):
    """A one-iteration flow_grpo LoRA run of sd3-tiny writing under ``tmp_path``."""
    prompt_file = write_prompts(tmp_path)
    return load_config("shapes", None, [
        "model.name=sd3-tiny", "model.train_mode=lora", "model.resolution=64", "model.max_sequence_length=16",
        "model.lora_rank=4", "model.lora_alpha=8", "model.guidance_scale=4.5", "reward.weights={jpeg_compressibility: 1.0}",
        f"data.prompts={prompt_file}", "data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=2",
        "sampler.strategy=flow_grpo", "train.iterations=1", "train.threads=1", "train.lr=1e-3", "loss.grpo.kl_beta=0.04",
        "log.progress=false", "log.trackers=[]", "eval.evaluator=none", f"log.out_dir={tmp_path}", *extra,
    ], recipe="shapes")


def one_iteration(cfg):
    """(metrics without timings, LoRA weights after, trainer) of one iteration from perturbed LoRA weights."""
    torch.manual_seed(0)
    trainer = Trainer(cfg)
    perturb_lora(trainer.policy)
    metrics = trainer.iteration_step().metrics
    timings = {k: metrics.pop(k) for k in TIMING if k in metrics}
    return metrics, trainer.policy.trainable_state_dict(), trainer, timings


def assert_same_iteration(a, b, rel: float, atol: float) -> None:
    (m0, w0, *_), (m1, w1, *_) = a, b
    assert set(m0) == set(m1)
    assert m0["grad_norm"] > 0 and m0["kl"] > 0
    for k, v in m0.items():
        if isinstance(v, float) and math.isnan(v):
            assert math.isnan(m1[k]), k
        else:
            assert m1[k] == pytest.approx(v, rel=rel, abs=atol), k
    for n, w in w0.items():
        torch.testing.assert_close(w1[n], w, rtol=rel, atol=atol, msg=n)


def test_native_attention_one_iteration_matches_sdpa(tmp_path):
    plain = one_iteration(sd3_config(tmp_path / "plain"))
    native = one_iteration(sd3_config(tmp_path / "native", "model.attention_backend=native"))
    assert set(processor_backends(native[2].policy.transformer)) == {"native"}
    assert_same_iteration(plain, native, rel=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["flash", "xformers"])
def test_unavailable_backend_is_one_line_naming_usable_ones(backend, tmp_path, capsys):
    if attention_mod.backend_problem(backend) is None:
        pytest.skip(f"{backend} can run on this machine")
    from flowgrpo.cli import main

    rc = main(["train", "model.name=sd3-tiny", f"model.attention_backend={backend}", f"data.prompts={write_prompts(tmp_path)}",
               "reward.weights={jpeg_compressibility: 1.0}", "train.iterations=1", "log.progress=false",
               "log.trackers=[]", f"log.out_dir={tmp_path}", "log.run_name=run"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith("flowgrpo: error: ") and f"model.attention_backend={backend} cannot apply" in line
    assert "SD3Transformer2DModel" in line and "usable here: sdpa, native" in line
    want = {"flash": "flash-attn", "xformers": "xformers package"}[backend]
    assert want in line and (torch.cuda.is_available() or "CUDA GPU" in line), line
    assert not (tmp_path / "run").exists()


def test_attention_backend_errors_name_the_class_and_the_processor(monkeypatch):
    with pytest.raises(ConfigError, match="unknown model.attention_backend 'bogus'; valid: sdpa, native, flex, flash"):
        make("FLUX", attention_backend="bogus")
    from diffusers.models.attention_processor import AttnProcessor2_0

    comps = tiny_components(tiny_sd3_components)
    comps["transformer"].transformer_blocks[0].attn.set_processor(AttnProcessor2_0())  # a processor of its own
    with pytest.raises(ConfigError, match=r"model\.attention_backend=native cannot apply to SD3 \(SD3Transformer2DModel\)"
                                          r": SD3Transformer2DModel's attention processor AttnProcessor2_0 calls its "
                                          r"kernel itself.*; use model.attention_backend=sdpa"):
        SD3Policy.from_components(comps, **MODELS["SD3"][2], attention_backend="native")
    comps = tiny_components(tiny_flux_components)
    comps["transformer"].set_attention_backend = None  # a class without diffusers' dispatcher switch
    with pytest.raises(ConfigError, match=r"FluxTransformer2DModel has no set_attention_backend\(\)"):
        FluxPolicy.from_components(comps, **MODELS["FLUX"][2], attention_backend="native")

    # with the package and CUDA present (mocked) the backend is diffusers' dispatcher on every processor
    from diffusers.models import attention_dispatch

    monkeypatch.setattr(attention_dispatch, "_check_attention_backend_requirements", lambda backend: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "xformers" in attention_mod.usable_backends()
    for model in MODELS:
        policy = make(model, attention_backend="xformers")
        assert set(processor_backends(policy.transformer)) == {"xformers"}


# ---------------------------------------------------------------------------------------------- compile


@pytest.fixture
def compile_backend(monkeypatch):
    backend = os.environ.get(switches_mod.COMPILE_BACKEND_ENV) or "aot_eager"
    monkeypatch.setenv(switches_mod.COMPILE_BACKEND_ENV, backend)
    import torch._dynamo

    torch._dynamo.reset()
    return backend


def test_compile_modes_and_old_configs():
    for value, mode in ((False, False), (True, "whole"), ("whole", "whole"), ("regional", "regional")):
        assert load_config("shapes", None, [f"model.compile_transformer={str(value).lower()}"],
                           recipe="shapes").model.compile_transformer == value
    with pytest.raises(ConfigError, match="compile_transformer.*not one of: False, True, whole, regional"):
        load_config("shapes", None, ["model.compile_transformer=blocks"], recipe="shapes")
    with pytest.raises(ConfigError, match="unknown model.compile_transformer 'blocks'"):
        make("FLUX", compile_transformer="blocks")
    whole = make("FLUX", compile_transformer=True)  # true keeps meaning the whole forward
    assert whole.compile_transformer == "whole" and whole.transformer._compiled_call_impl is not None
    assert all(b._compiled_call_impl is None for b in repeated_blocks(whole.transformer))


@pytest.mark.parametrize("model", ["FLUX", "SD3"])
def test_regional_compile_matches_eager(model, compile_backend):
    plain, regional = make(model), make(model, compile_transformer="regional")
    blocks = repeated_blocks(regional.transformer)
    if model == "FLUX":  # diffusers' _repeated_blocks: both block kinds
        assert {type(b).__name__ for b in blocks} == {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    else:  # no _repeated_blocks: the entries of its block list
        assert blocks == list(regional.transformer.transformer_blocks)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert regional.transformer._compiled_call_impl is None and plain.transformer._compiled_call_impl is None
    assert_same(velocity_and_grads(plain), velocity_and_grads(regional), atol=1e-5)
    # parameter names (checkpoints, EMA, save_lora) are the eager transformer's
    assert list(regional.trainable_state_dict()) == list(plain.trainable_state_dict())


@pytest.mark.slow  # two compiled runs, about 55 s on 2 cores (CI budget); test_regional_compile_matches_eager stays
def test_regional_compile_one_iteration_matches_plain(tmp_path, compile_backend):
    plain = one_iteration(sd3_config(tmp_path / "plain"))
    regional = one_iteration(sd3_config(tmp_path / "regional", "model.compile_transformer=regional"))
    policy, timings = regional[2].policy, regional[3]
    assert all(b._compiled_call_impl is not None for b in repeated_blocks(policy.transformer))
    assert "compile_s" not in plain[3] and 0 < timings["compile_s"] <= timings["iter_s"]
    assert_same_iteration(plain, regional, rel=1e-4, atol=1e-5)
