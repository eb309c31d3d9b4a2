"""The memory a run will need per GPU, from the modules it has loaded: one line at the start of ``flowgrpo train``.

:func:`run_inputs` fills :class:`~flowgrpo.realsize.budget.MemoryInputs` from the trainer: weight
bytes of the modules the policy actually holds (transformer and its experts, text encoders, VAE;
their real dtypes), its trainable parameters, and the run's settings (group, steps, micro-batches,
switches). The working memory of the rollout forward, of one VAE decode chunk and the activations
of one training micro-batch are counted on ``meta`` copies of the loaded transformer and VAE built
from their configs (:mod:`flowgrpo.realsize.peaks`, :mod:`flowgrpo.realsize.activations`): no
memory is allocated and no real-size model is rebuilt with weights. Meta kernels run torch's Python
references, a few seconds even for a tiny model, so off CUDA (where no device memory is at stake)
the line gives the weights, training state and trajectory only and says so. The activations are counted without the LoRA layers (their extra saved
tensors are [B, N, r], small beside a block's).

:func:`memory_line` lays the inputs out on the run's own layout (processes, engine, FSDP CPU
offload) and, on CUDA, compares the figure with ``torch.cuda.mem_get_info()``'s free bytes: one
``warning:`` line when the run will not fit (:data:`~flowgrpo.realsize.budget.HEADROOM` left
aside). Only diffusers policies are forecast; others get no line.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .budget import GIB, HEADROOM, Layout, MemoryInputs, per_gpu_budget

DOC = "docs/recipes.md#memory-per-gpu-computed"


def _module_bytes(module) -> int:
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _experts(policy) -> list:
    return [m for m in (policy.denoiser, getattr(policy, "transformer_2", None)) if isinstance(m, torch.nn.Module)]


def _entry_of(policy):
    """A :class:`~flowgrpo.realsize.configs.RealTransformer` for the loaded transformer's class and config."""
    from .configs import RealTransformer

    t = policy.denoiser
    config = {k: v for k, v in dict(t.config).items() if not k.startswith("_")}
    side = policy.latent_shape[-1]
    pipe = getattr(policy, "pipe", None)
    return RealTransformer(recipe="(this run)", hub_id="", pipeline=type(pipe).__name__ if pipe is not None else "",
                           class_name=type(t).__name__, config=config, source="the loaded pipeline",
                           experts=tuple("transformer" for _ in _experts(policy)),
                           generic_layout=type(policy).__name__ == "PipelinePolicy",
                           vae_factor=max(1, int(getattr(policy, "resolution", side)) // side))


def _geometry(policy, cfg, batch: int):
    from .activations import Geometry

    text = int(getattr(policy, "max_sequence_length", 256)) + (77 if hasattr(policy, "tokenizer_3") else 0)
    return Geometry(int(getattr(policy, "resolution", 0) or policy.latent_shape[-1] * 8),
                    int(getattr(policy, "num_frames", 1) or 1), text, batch,
                    getattr(getattr(policy, "family", None), "reference_kwarg", None) is not None)


def _rollout_geometry(policy, cfg, entry, micro: int):
    """The rollout forward's geometry: ``micro`` samples, doubled when classifier-free guidance runs."""
    from .recipe_budget import cfg_in_rollout

    return _geometry(policy, cfg, micro * (2 if cfg_in_rollout(entry, cfg.model.guidance_scale) else 1))


def rollout_peak_at(policy, cfg, micro: int) -> int:
    """Working bytes of one no-grad rollout forward of ``policy``'s transformer on ``micro`` samples
    (CFG halves together), counted on a meta copy (:func:`~flowgrpo.realsize.peaks.rollout_forward_peak`)."""
    from .configs import build_transformer
    from .peaks import rollout_forward_peak

    entry = _entry_of(policy)
    dtype = next(_experts(policy)[0].parameters()).dtype
    model = build_transformer(entry, dtype=dtype)
    return rollout_forward_peak(model, entry, _rollout_geometry(policy, cfg, entry, micro), dtype)


def _meta_counts(policy, cfg, dtype, micro: int) -> tuple[int, int, int, int, str]:
    """(update activations, backward transient, rollout peak of ``micro`` samples, VAE decode peak, note)
    of meta copies."""
    from .activations import count_activations, example_inputs
    from .configs import build_transformer
    from .peaks import rollout_forward_peak, vae_decode_peak

    from .recipe_budget import cfg_in_rollout

    entry = _entry_of(policy)
    cfg_update = cfg_in_rollout(entry, cfg.model.guidance_scale) and bool(cfg.loss.cfg_uncond_grad)
    geo = _geometry(policy, cfg, cfg.train.micro_batch * (2 if cfg_update else 1))
    try:
        model = build_transformer(entry, dtype=dtype)
        inputs, _ = example_inputs(entry, geo, dtype=dtype)
        act = count_activations(model, inputs)
        used = act.checkpointing if cfg.model.gradient_checkpointing else act.no_checkpointing
        transient = 2 * act.block_inputs // max(len(act.blocks), 1)
        rollout = rollout_forward_peak(model, entry, _rollout_geometry(policy, cfg, entry, micro), dtype)
    except (ValueError, TypeError, KeyError, RuntimeError, NotImplementedError) as exc:
        return 0, 0, 0, 0, f"activations not counted ({type(exc).__name__}: {str(exc)[:80]})"
    vae = policy.vae
    vae_dtype = next(vae.parameters()).dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(vae_dtype)
    try:
        with torch.device("meta"):
            vae_copy = type(vae).from_config(vae.config)
    finally:
        torch.set_default_dtype(previous)
    chunk = 1 if cfg.model.vae_slicing else int(getattr(policy, "decode_batch", 1))
    decode = vae_decode_peak(vae_copy, entry, dataclasses.replace(geo, batch=1), chunk, vae_dtype)
    return used, transient, rollout, decode, ""


def run_inputs(trainer, working: bool = True, micro: int | None = None) -> tuple[MemoryInputs, str]:
    """The :class:`MemoryInputs` of ``trainer``'s run (its policy as loaded, its config) and a note
    (empty, or what was not counted); ``working`` False leaves the meta forwards out (activations,
    rollout and decode peaks 0: weights, training state and trajectory only). ``micro``: samples per
    rollout forward (default: the trainer's sampler's ``max_micro_batch``, at most the iteration's samples)."""
    from .memory import largest_block_bytes
    from .recipe_budget import text_encoder_mode

    policy, cfg = trainer.policy, trainer.cfg
    experts = _experts(policy)
    trainable = policy.trainable_parameters()
    full = getattr(policy, "train_mode", "lora") == "full"
    trainable_ids = {id(p) for p in trainable}
    base = sum(p.numel() * p.element_size() for m in experts for p in m.parameters() if id(p) not in trainable_ids or full)
    base += sum(_module_bytes(m) - sum(p.numel() * p.element_size() for p in m.parameters()) for m in experts)
    dtype = next(experts[0].parameters()).dtype
    lora_dtype = trainable[0].dtype if trainable else dtype
    samples = cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt
    micro = min(micro or getattr(trainer.sampler, "max_micro_batch", samples), samples)
    used, transient, rollout, decode, note = (_meta_counts(policy, cfg, dtype, micro) if working else
                                              (0, 0, 0, 0, "activations not counted off CUDA"))
    prompt_bytes = 0  # the encodings of a prompt: text tokens x width, small beside the latents; see recipe_budget
    inputs = MemoryInputs(
        transformer_bytes=base, largest_block_bytes=largest_block_bytes(experts[0]),
        trainable_params=sum(p.numel() for p in trainable), trainable_bytes=lora_dtype.itemsize, full_finetune=full,
        reference_copy=full and bool(trainer.objective.needs_reference),
        reference_on_cpu=getattr(cfg.model, "reference_device", "auto") == "cpu",
        ema=bool(cfg.train.ema), ema_on_cpu=getattr(cfg.train, "ema_device", "auto") == "cpu",
        text_encoder_bytes=sum(_module_bytes(m) for m in policy.text_encoders() if m is not None)
        if hasattr(policy, "text_encoders") else 0,
        text_encoders=text_encoder_mode(cfg.model), vae_bytes=_module_bytes(getattr(policy, "vae", None)),
        update_activations=used, backward_transient=transient, rollout_peak=rollout,
        rollout_micro_batch=micro, vae_decode_peak=decode,
        sample_bytes=4 * math.prod(policy.latent_shape) * (2 * cfg.sampler.num_steps + 1), prompt_bytes=prompt_bytes,
        samples=samples, prompts=cfg.data.prompts_per_iteration,
        lagging_copies=int(getattr(trainer.objective, "lagging_copies", 0)),
        lagging_on_cpu=getattr(cfg.train, "old_policy_device", "auto") == "cpu")
    return inputs, note


def run_layout(trainer) -> Layout:
    """The :class:`Layout` ``trainer`` runs on: its processes and engine (FSDP with CPU offload where
    accelerate's plugin offloads)."""
    world = int(trainer.dp.world)
    engine = getattr(trainer.engine, "name", "replicated")
    if engine == "fsdp":
        offload = getattr(getattr(trainer.engine, "plugin", None), "cpu_offload", None)
        engine = "fsdp" if offload in (None, False) or type(offload).__name__ == "NoOffloadPolicy" else "fsdp_offload"
    else:
        engine = "replicated"  # DeepSpeed ZeRO 1 / 2 partition only moments and gradients: an upper bound
    name = f"{world} GPU" + ("s" if world > 1 else "") + ("" if engine == "replicated" else f" {engine}")
    return Layout(name, world, engine)


def free_device_memory(device) -> tuple[int, int] | None:
    """``(free, total)`` bytes of ``device`` (CUDA: ``torch.cuda.mem_get_info``), None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)


def memory_line(trainer) -> tuple[str, bool]:
    """``(line, fits)``: the figure ``trainer``'s run needs per GPU and, on CUDA, whether the device's
    free memory holds it; the line starts with ``warning:`` when it does not."""
    free = free_device_memory(trainer.accelerator.device)
    # the meta forwards cost seconds on a CPU (meta kernels run torch's Python references): counted
    # where a device's memory is at stake, left out of CPU runs (the tiny models' tests)
    inputs, note = run_inputs(trainer, working=free is not None)
    layout = run_layout(trainer)
    budget = per_gpu_budget(inputs, layout)
    need = budget["total"]
    head = f"~{need / GIB:.2f} GiB per GPU ({layout.name}, peak in the {budget['peak_phase']} phase)"
    tail = f"; {note}" if note else ""
    if free is None:
        return f"memory: needs {head}; device {trainer.accelerator.device} not checked{tail}", True
    fits = need <= free[0] * (1 - HEADROOM)
    if fits:
        return f"memory: needs {head}; device has {free[0] / GIB:.1f} GiB free{tail}", True
    return (f"warning: memory: this run needs {head} but the device has {free[0] / GIB:.1f} GiB free "
            f"(of {free[1] / GIB:.1f}): it will likely run out; switches that move memory off the GPU: {DOC}{tail}",
            False)


def print_memory_forecast(trainer) -> None:
    """Print :func:`memory_line` for a diffusers policy (others: nothing)."""
    from ..policies.diffusers.policy import DiffusersPolicy

    if isinstance(trainer.policy, DiffusersPolicy):
        print(memory_line(trainer)[0], flush=True)
