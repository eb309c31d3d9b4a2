"""Stages ``flux`` and ``wan`` of ``flowgrpo bench gpu``: rollout + update at FLUX.1-dev and Wan 2.1 1.3B size.

* **flux**: a random-weight FLUX.1-dev transformer at its published configuration (12 B: 19 double-
  and 38 single-stream blocks, 24 x 128 wide) in bf16, 512 px, LoRA r = 32 on flowgrpo's FLUX
  targets, embedded guidance 3.5 (no CFG), 128 T5 tokens, T = 10 SDE steps, 1 prompt x 4 images:
  flowgrpo's trainer against Flow-GRPO's own FLUX functions from the checkout
  (:mod:`flowgrpo.benchmarks.reference_flux`) on the same weights: medians, ratios, peaks and the
  largest latent / log-prob differences of the same chains (the reference replays flowgrpo's).
* **wan**: Wan 2.1 T2V 1.3B's transformer (30 blocks, 12 x 128) in bf16, 33 frames of 480 x 480 px
  (9 x 30 x 30 = 8100 video tokens), CFG 5, 512 text tokens, T = 10, 1 prompt x 2 videos: flowgrpo
  alone. Flow-GRPO has Wan code (``wan_pipeline_with_logprob``, ``scripts/train_wan2_1.py``); an
  adapter for it is not written yet, so the reference side is recorded as left out with that reason.

The text encoders and VAE are the real classes with the real output widths but two small layers
inside (:mod:`flowgrpo.realsize.pipeline_folder`'s builders): the transformer is what is measured,
and both sides run the same ones. Each side runs alone on the device (flowgrpo first, its chains kept
for the replay; the reference built afterwards from the same seed), so each peak is its own. Every
row carries (d) the computed per-GPU figure and (e) the model FLOPs utilisation
(:mod:`flowgrpo.benchmarks.gpu_points`). ``--tiny``: the same path on tiny transformers of the
same classes on the CPU.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from .bench_reference import PROMPTS, REFERENCE, compare_chains, settings_for
from .gpu_points import annotate, flowgrpo_side, forecast_memory, free_device, measure_side, over_forecast, ratios
from .gpu_setup import parameter_count, synchronize

FLOWGRPO = "flowgrpo"


@dataclass(frozen=True)
class SizePlan:
    """One size stage. ``recipe``: the :mod:`flowgrpo.realsize.configs` entry whose transformer is
    built; ``policy``: the bench adapter; ``overrides``: transformer config keys replaced (the tiny
    form's widths); ``resolution`` (px), ``frames``, ``guidance_scale``, ``cfg`` (real classifier-free
    guidance, else embedded), ``text_tokens`` (T5 tokens), ``num_steps``, ``prompts`` x ``group``
    samples, ``warmup`` / ``repeats`` iterations per side."""

    recipe: str
    policy: str
    resolution: int
    frames: int
    guidance_scale: float
    cfg: bool
    text_tokens: int
    num_steps: int = 10
    prompts: int = 1
    group: int = 4
    warmup: int = 1
    repeats: int = 2
    overrides: dict = field(default_factory=dict)


_TINY_FLUX = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
_TINY_WAN = dict(num_attention_heads=2, attention_head_dim=12, text_dim=32, ffn_dim=32, num_layers=2,
                 rope_max_seq_len=32)
#: (stage, tiny) -> plan
SIZE_PLANS = {
    ("flux", False): SizePlan("flux1-dev", "flux", 512, 1, 3.5, False, 128),
    ("flux", True): SizePlan("flux1-dev", "flux", 64, 1, 3.5, False, 32, num_steps=3, group=2, warmup=0, repeats=1,
                             overrides=_TINY_FLUX),
    ("wan", False): SizePlan("wan21-t2v-1.3b", "wan", 480, 33, 5.0, True, 512, group=2),
    ("wan", True): SizePlan("wan21-t2v-1.3b", "wan", 32, 33, 5.0, True, 32, num_steps=3, group=2, warmup=0, repeats=1,
                            overrides=_TINY_WAN),
}


def build_size_components(plan: SizePlan, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """The pipeline components of ``plan``'s recipe on ``device``: the transformer at its published
    configuration (with ``plan.overrides``) built on the device in ``dtype``, the small text encoders
    in ``dtype``, the VAE in float32. Deterministic in ``seed``."""
    from flowgrpo.realsize.configs import build_transformer, transformer_config
    from flowgrpo.realsize.pipeline_folder import WRITERS

    entry = transformer_config(plan.recipe)
    entry = dataclasses.replace(entry, config={**entry.config, **plan.overrides})
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        components = WRITERS[entry.pipeline](entry)  # its transformer on the meta device: replaced below
        components["transformer"] = build_transformer(entry, device=device, dtype=dtype).eval()
    for name, value in components.items():
        if isinstance(value, torch.nn.Module) and name != "transformer":
            value.to(device=device, dtype=torch.float32 if name == "vae" else dtype).eval().requires_grad_(False)
    return components


def run_size_stage(stage: str, device: torch.device, dtype: torch.dtype, *, tiny: bool, flow_grpo: str | None,
                   budget_s: float, peak_tflops: float | None, log) -> dict:
    """Stage ``stage`` ("flux" or "wan"; module docstring). Returns {"settings", "model", "rows" (one
    per side: medians, peak, ratios to the reference, (d) and (e)), "reference" (why it is left out,
    where it is), "max_latent_diff", "max_logprob_diff"}."""
    from flowgrpo.policies.diffusers.flux import FLUX_LORA_TARGETS

    plan = SIZE_PLANS[(stage, tiny)]
    began = time.perf_counter()
    s = dataclasses.replace(settings_for(plan.num_steps, plan.resolution, guidance_scale=plan.guidance_scale),
                            max_sequence_length=plan.text_tokens)
    samples = plan.prompts * plan.group
    name = str(dtype).split(".")[-1]
    overrides = [f"model.dtype={name}", f"train.micro_batch={samples}", "log.trackers=[]"]
    if plan.policy == "wan":
        overrides.append(f"model.num_frames={plan.frames}")
    result: dict = {"settings": {**dataclasses.asdict(plan), "dtype": name, "lora_rank": 32, "lora_alpha": 64.0}}
    log(f"{stage}: building {plan.recipe}{' (tiny)' if tiny else ''} ({name}) on {device}")
    t0 = time.perf_counter()
    components = build_size_components(plan, device, dtype)
    synchronize(device)
    transformer = components["transformer"]
    config = dict(transformer.config)
    result["model"] = {"build_s": time.perf_counter() - t0, "class": type(transformer).__name__,
                       "transformer_params": parameter_count(transformer)}
    log(f"{stage}: built in {result['model']['build_s']:.1f} s: {result['model']['transformer_params'] / 1e9:.3f} B")
    del transformer  # the components hold it until the side takes them
    flops = dict(cls=result["model"]["class"], config=config, resolution=plan.resolution, frames=plan.frames, text_tokens=plan.text_tokens,
                 samples=samples, num_steps=plan.num_steps, cfg=plan.cfg, kl=s.beta > 0, peak_tflops=peak_tflops)
    computed = ("tiny model: the computed figures are for the published sizes (run without --tiny)" if tiny else
                dict(recipe=plan.recipe, resolution=plan.resolution, frames=plan.frames if plan.frames > 1 else None,
                     micro_batch=samples, rank=32, checkpointing=False))
    code = None
    if stage != "flux":
        result["reference"] = ("left out: Flow-GRPO's Wan code (wan_pipeline_with_logprob, scripts/train_wan2_1.py) "
                               "has no adapter in this bench yet")
    elif not flow_grpo:
        result["reference"] = "left out: no Flow-GRPO checkout (--flow-grpo PATH)"
    else:
        from .reference_flux import load_flux_reference

        try:
            code = load_flux_reference(flow_grpo)
            result["reference"] = str(code.path)
        except FileNotFoundError as exc:
            result["reference"] = f"left out: {exc}"
    half = budget_s / (2 if code is not None else 1)
    with flowgrpo_side(components, plan.policy, s, plan.prompts, plan.group, overrides) as flow:
        del components
        forecast = forecast_memory(flow.trainer, device)
        chains = flow.rollout(list(PROMPTS[:plan.prompts]), 0)[2] if code is not None else None
        row = measure_side(flow, device, plan.prompts, plan.group, warmup=plan.warmup, repeats=plan.repeats,
                           budget_s=half, log=log, label=f"{stage} flowgrpo")
        row.update(forecast)
        row.update(over_forecast(row))
    del flow
    free_device(device)
    rows = [{"side": FLOWGRPO, **row}]
    if code is not None:
        from .reference_flux import FluxReferenceSide, pack_flux

        ref = FluxReferenceSide(code, s, plan.group, FLUX_LORA_TARGETS, build_size_components(plan, device, dtype))
        log(f"{stage}: Flow-GRPO replays flowgrpo's chains")
        result["max_latent_diff"], result["max_logprob_diff"] = compare_chains(
            ref, list(PROMPTS[:plan.prompts]), chains, pack=pack_flux)
        del chains
        log(f"{stage}: max |latent diff| {result['max_latent_diff']:.2e}, max |log-prob diff| "
            f"{result['max_logprob_diff']:.2e}")
        left = max(1.0, budget_s - (time.perf_counter() - began))
        ref_row = measure_side(ref, device, plan.prompts, plan.group, warmup=plan.warmup, repeats=plan.repeats,
                               budget_s=left, log=log, label=f"{stage} Flow-GRPO")
        del ref
        free_device(device)
        rows.insert(0, {"side": REFERENCE, **ref_row})
    base = rows[0] if code is not None else None
    for r in rows:
        r["vs_flow_grpo"] = ratios(r, base)
        annotate(r, flops=flops, computed=computed)
    result["rows"] = rows
    return result
