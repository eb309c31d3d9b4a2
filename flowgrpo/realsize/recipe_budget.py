"""A recipe's :class:`~flowgrpo.realsize.budget.MemoryInputs`, counted on the meta device.

Every module the recipe's pipeline loads is built at its published size without weights: the
transformer(s) (:mod:`flowgrpo.realsize.configs`), the text encoders and the VAE
(:mod:`flowgrpo.realsize.components`). The update's activations come from
:mod:`flowgrpo.realsize.activations`, the rollout forward's and the VAE decode's working memory from
:mod:`flowgrpo.realsize.peaks`; the rest (group size, steps, micro-batches, switches) from the
recipe YAML through :func:`flowgrpo.config.load_config`.
"""

from __future__ import annotations

import dataclasses

import torch

from .activations import ActivationCount, Geometry, example_inputs
from .budget import AUTO, LAYOUTS, MemoryInputs, first_fit, per_gpu_budget
from .components import build_component, component_bytes, recipe_components
from .configs import build_transformer, recipe_config, transformer_config
from .memory import TrainingState
from .peaks import rollout_forward_peak, vae_decode_peak, vae_latent

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def decode_batch(entry) -> int:
    """The adapter's VAE decode chunk (sd3 / flux: 8; wan: 1; the generic adapter: its family's)."""
    if entry.adapter == "wan":
        return 1
    if entry.adapter in ("sd3", "flux"):
        return 8
    from ..policies.diffusers.generic.families import family_of

    return int(family_of(entry.pipeline).decode_batch)


def cfg_in_rollout(entry, guidance_scale: float) -> bool:
    """Whether a rollout forward carries the unconditional half too (real CFG, not embedded guidance)."""
    return guidance_scale > 1 and not entry.config.get("guidance_embeds")


def text_encoder_mode(model_cfg) -> str:
    """``precomputed`` (``model.precompute_prompts``), ``visiting`` (``model.offload_text_encoders``) or
    ``resident``."""
    if getattr(model_cfg, "precompute_prompts", False):
        return "precomputed"
    return "visiting" if model_cfg.offload_text_encoders else "resident"


def objective_copies(cfg) -> tuple[bool, int]:
    """``(needs_reference, lagging_copies)`` of ``cfg``'s objective: whether it keeps a frozen base model
    (a full fine-tune then copies the denoiser) and how many lagging copies of the trainable weights."""
    from ..objectives import build_objective

    objective = build_objective(cfg, "cpu")
    return bool(objective.needs_reference), int(objective.lagging_copies)


def recipe_inputs(recipe: str, geo: Geometry, info: dict, state: TrainingState, act: ActivationCount,
                  preset: str | None = None, **switches) -> tuple[MemoryInputs, dict]:
    """``recipe``'s :class:`MemoryInputs` for a training micro-batch ``geo`` (``info``, ``state``,
    ``act``: :func:`~flowgrpo.realsize.table.recipe_geometry`'s info, the transformer's
    :class:`TrainingState` and activation count), with ``switches`` (``offload_text_encoders``,
    ``precompute_prompts``, ``reference_device``, ``ema_device``, ``old_policy_device``, ``train_mode``)
    replacing the recipe's.
    Returns ``(inputs, components)``, components: :func:`component_bytes` of the recipe."""
    entry = transformer_config(recipe)
    cfg = recipe_config(recipe, preset)
    for key, value in switches.items():
        owner = cfg.train if key in ("ema_device", "old_policy_device") else cfg.model
        if value is not None:
            setattr(owner, key, value)
    m, tc = cfg.model, cfg.train
    dtype = _DTYPES[m.dtype]
    parts = component_bytes(recipe, dtype)
    full = m.train_mode == "full"
    samples = cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt
    cfg_factor = 2 if cfg_in_rollout(entry, m.guidance_scale) else 1
    # auto is chosen per device at run start (flowgrpo.realsize.micro_batch): the table counts its largest
    micro = samples if cfg.sampler.max_micro_batch == AUTO else min(cfg.sampler.max_micro_batch, samples)
    rollout_geo = dataclasses.replace(geo, batch=micro * cfg_factor)
    model = build_transformer(entry, dtype=dtype)
    rollout = rollout_forward_peak(model, entry, rollout_geo, dtype)
    vae_part = next(p for p in recipe_components(recipe) if p.name == "vae")
    vae = build_component(vae_part, dtype=dtype)
    chunk = 1 if m.vae_slicing else decode_batch(entry)
    decode = vae_decode_peak(vae, entry, geo, chunk, dtype)
    latent = vae_latent(vae, entry, geo, 1, dtype).numel()
    sample_bytes = 4 * latent * (2 * cfg.sampler.num_steps + 1)  # x per level and the step mean, float32
    one, _ = example_inputs(entry, dataclasses.replace(geo, batch=1), dtype=dtype)
    prompt_bytes = cfg_factor * sum(v.numel() * v.element_size() for k, v in one.items()
                                    if isinstance(v, torch.Tensor) and k not in ("hidden_states", "timestep"))
    per_block_inputs = act.block_inputs // max(len(act.blocks), 1)
    used = act.checkpointing if info["checkpointing"] else act.no_checkpointing
    reference, lagging = objective_copies(cfg)
    inputs = MemoryInputs(
        transformer_bytes=state.base_bytes, largest_block_bytes=state.largest_block_bytes,
        trainable_params=state.transformer_params if full else state.lora_params,
        trainable_bytes=dtype.itemsize if full else 4, full_finetune=full,
        reference_copy=full and reference, reference_on_cpu=getattr(m, "reference_device", "auto") == "cpu",
        ema=bool(tc.ema), ema_on_cpu=getattr(tc, "ema_device", "auto") == "cpu",
        text_encoder_bytes=sum(p["bytes"] for p in parts.values() if p["text_encoder"]),
        text_encoders=text_encoder_mode(m), vae_bytes=parts["vae"]["bytes"],
        update_activations=used, backward_transient=2 * per_block_inputs,
        rollout_peak=rollout, rollout_micro_batch=micro, vae_decode_peak=decode,
        sample_bytes=sample_bytes, prompt_bytes=prompt_bytes, samples=samples, prompts=cfg.data.prompts_per_iteration,
        lagging_copies=lagging, lagging_on_cpu=tc.old_policy_device == "cpu")
    return inputs, parts


def budgets(inputs: MemoryInputs, layouts=LAYOUTS) -> dict:
    """``{layout name: per_gpu_budget(...)}`` over ``layouts`` plus ``fits_80`` / ``fits_24``: the first
    layout whose total fits an 80 GB / 24 GB GPU (None: none does)."""
    out = {layout.name: per_gpu_budget(inputs, layout) for layout in layouts}
    return {"layouts": out, "fits_80": first_fit(out, 80), "fits_24": first_fit(out, 24)}
