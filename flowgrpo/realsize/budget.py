"""Per-GPU memory of a training run, phase by phase, for each layout: arithmetic over counted bytes.

:class:`MemoryInputs` holds what a run keeps and makes, in whole-model bytes (counted elsewhere: on
the meta device for a recipe's published configuration by :mod:`flowgrpo.realsize.table`, or from
the modules a run has loaded by :mod:`flowgrpo.realsize.forecast`). :func:`per_gpu_budget` lays them
out on one :class:`Layout` and returns the bytes of each phase of an iteration; the run needs the
largest. What lives where (``flowgrpo/trainer``):

====================  ==========================================================================
persistent            transformer weights (every expert; FSDP: 1/N plus two gathered blocks; FSDP +
                      CPU offload: only the two gathered blocks), the VAE, LoRA weights (float32),
                      AdamW's two moments (in the trainable weights' dtype), the EMA (``train.ema``;
                      none on the GPU with ``train.ema_device=cpu``), the frozen reference copy of a
                      full fine-tune whose objective has a base-model term (taken before FSDP shards
                      the denoiser, so whole on every GPU; ``model.reference_device=cpu``: one block
                      streamed at a time), the objective's lagging copies of the trainable weights
                      (DiffusionNFT's old policy, AWM's, DGPO's and CRD's copies; none on the GPU
                      with ``train.old_policy_device=cpu``)
text encoders         resident unless ``model.offload_text_encoders`` (then on the GPU only while
                      prompts are encoded) or ``model.precompute_prompts`` (used once before
                      training, then freed)
trajectory            the rollout's stored latents (x and the step mean per step, float32) of this
                      GPU's samples, and its prompts' encodings
encode                persistent + text encoders (no trajectory: prompts are encoded first; with
                      ``model.precompute_prompts`` once, in the trainer's set-up, before AdamW's
                      moments exist, and with whole weights the transformer, its LoRA and a resident
                      reference copy parked in host memory meanwhile)
rollout               persistent + resident encoders + trajectory + one no-grad forward of the
                      rollout micro-batch (CFG halves together)
decode                persistent + resident encoders + trajectory + one VAE decode chunk
update                persistent + resident encoders + trajectory + gradients + activations of one
                      training micro-batch + backward's transient buffers (or, while a lagging copy
                      runs before that forward, the live trainable weights waiting beside it)
step                  persistent + resident encoders + trajectory + gradients + the data-parallel
                      gradient sum (one flat float32 copy of every trainable gradient and the copy
                      ``accelerator.reduce`` all-reduces: 8 B per trainable parameter, DDP only) +
                      AdamW's foreach temporaries (about one trainable copy)
====================  ==========================================================================

FSDP + CPU offload keeps weights, gradients, moments and EMA in CPU memory (FSDP2's
``CPUOffloadPolicy`` through accelerate's ``fsdp_offload_params``); the GPU holds the gathered
blocks. Not counted: the CUDA context and the caching allocator's fragmentation (a few hundred MB to
a few GB on a real run), which is why a layout is said to fit only with :data:`HEADROOM` to spare.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
#: ``sampler.max_micro_batch: auto``: the rollout micro-batch chosen from memory (:mod:`.micro_batch`)
AUTO = "auto"
#: share of a GPU's memory left for the CUDA context, NCCL buffers and allocator fragmentation
HEADROOM = 0.10


@dataclass(frozen=True)
class Layout:
    """How the run is spread: ``gpus`` processes, the transformer ``replicated`` (one GPU or data
    parallel), ``fsdp`` (FSDP2 sharding) or ``fsdp_offload`` (FSDP2 with CPU offload)."""

    name: str
    gpus: int
    engine: str


LAYOUTS = (Layout("1 GPU", 1, "replicated"), Layout("8 GPUs DDP", 8, "replicated"),
           Layout("8 GPUs FSDP", 8, "fsdp"), Layout("8 GPUs FSDP+offload", 8, "fsdp_offload"))


@dataclass
class MemoryInputs:
    """Whole-run bytes and counts a layout divides (see the module docstring).

    Attributes:
        transformer_bytes: every expert's weights in their dtypes (LoRA excluded).
        largest_block_bytes: FSDP's wrap unit (one numbered block).
        trainable_params: LoRA parameters, or every transformer weight for a full fine-tune.
        trainable_bytes: bytes per trainable parameter (LoRA: 4, float32; full: the model dtype's).
        full_finetune: the trainable weights are the transformer's own (no separate LoRA weights).
        reference_copy: a full fine-tune's frozen reference copy exists (its objective needs one).
        reference_on_cpu: ``model.reference_device=cpu``.
        ema: ``train.ema``; ema_on_cpu: ``train.ema_device=cpu``.
        text_encoder_bytes: every text encoder's weights.
        text_encoders: ``resident``, ``visiting`` (offloaded) or ``precomputed``.
        vae_bytes: the VAE's weights.
        update_activations: saved-for-backward bytes of one training micro-batch (its checkpointing law).
        backward_transient: gradient buffers of backward on top of the saved tensors.
        rollout_peak: working bytes of one no-grad rollout forward (``rollout_micro_batch`` samples).
        rollout_micro_batch: samples per rollout forward before CFG doubling (``sampler.max_micro_batch``).
        vae_decode_peak: working bytes of one VAE decode chunk.
        sample_bytes: stored trajectory bytes per sample.
        prompt_bytes: stored encoding bytes per prompt.
        samples: samples per iteration over all processes; prompts: prompts per iteration.
        lagging_copies: the objective's lagging copies of the trainable weights (old policy, EMA
            reference; ``Objective.lagging_copies``).
        lagging_on_cpu: ``train.old_policy_device=cpu`` (the copies, and the live weights while a copy
            runs, in host memory).
    """

    transformer_bytes: int
    largest_block_bytes: int
    trainable_params: int
    trainable_bytes: int
    full_finetune: bool
    reference_copy: bool
    reference_on_cpu: bool
    ema: bool
    ema_on_cpu: bool
    text_encoder_bytes: int
    text_encoders: str
    vae_bytes: int
    update_activations: int
    backward_transient: int
    rollout_peak: int
    rollout_micro_batch: int
    vae_decode_peak: int
    sample_bytes: int
    prompt_bytes: int
    samples: int
    prompts: int
    lagging_copies: int = 0
    lagging_on_cpu: bool = False


def _share(n: int, gpus: int) -> int:
    return -(-n // gpus)


def _parked_at_encode(kinds: dict, engine: str) -> int:
    """Bytes not on the GPU while ``model.precompute_prompts`` encodes: AdamW's moments (not made yet)
    and, for whole (replicated) weights, the transformer, its LoRA and a resident reference copy."""
    moved = kinds["transformer"] + kinds["lora_weights"] + kinds["reference"] if engine == "replicated" else 0
    return kinds["adamw"] + moved


def per_gpu_budget(x: MemoryInputs, layout: Layout) -> dict:
    """Bytes per GPU of ``x`` on ``layout``: the kinds (``transformer``, ``text_encoders``, ``vae``,
    ``lora_weights``, ``adamw``, ``ema``, ``reference``, ``old_policy``, ``gradients``, ``ddp_sum``, ``trajectory``,
    ``rollout_peak``, ``vae_decode_peak``, ``update_activations``), the phases (``encode``,
    ``rollout``, ``decode``, ``update``, ``step``), ``peak_phase`` and ``total`` (the largest phase)."""
    g, engine = layout.gpus, layout.engine
    trainable = x.trainable_params * x.trainable_bytes
    block = x.largest_block_bytes
    if engine == "replicated":
        weights, shard = x.transformer_bytes, 1
    elif engine == "fsdp":
        weights, shard = _share(x.transformer_bytes, g) + 2 * block, g
    else:  # fsdp_offload: weights, gradients, moments and EMA in CPU memory
        weights, shard = 2 * block, 0
    keep = (lambda b: _share(b, shard)) if shard else (lambda b: 0)
    kinds = {
        "transformer": weights,
        "text_encoders": x.text_encoder_bytes,
        "vae": x.vae_bytes,
        "lora_weights": 0 if x.full_finetune else keep(trainable),
        "adamw": keep(2 * trainable),
        "ema": 0 if not x.ema or x.ema_on_cpu else keep(trainable),
        "reference": 0 if not x.reference_copy else block if x.reference_on_cpu else x.transformer_bytes,
        "old_policy": 0 if x.lagging_on_cpu else x.lagging_copies * keep(trainable),
        # FSDP reduce-scatters one block's whole gradients (a full fine-tune's are a block's size)
        "gradients": keep(trainable) + (block if x.full_finetune and engine != "replicated" else 0),
        "ddp_sum": 2 * 4 * x.trainable_params if engine == "replicated" and g > 1 else 0,
        "trajectory": _share(x.samples, g) * x.sample_bytes + _share(x.prompts, g) * x.prompt_bytes,
        "update_activations": x.update_activations + x.backward_transient,
    }
    per_gpu_samples = _share(x.samples, g)
    micro = min(x.rollout_micro_batch, per_gpu_samples)
    kinds["rollout_peak"] = x.rollout_peak * micro // max(x.rollout_micro_batch, 1)
    kinds["vae_decode_peak"] = x.vae_decode_peak
    persistent = sum(kinds[k] for k in ("transformer", "vae", "lora_weights", "adamw", "ema", "reference",
                                        "old_policy"))
    # while a lagging copy runs (before the micro-batch's forward with gradients) the live weights wait
    # beside it: one more trainable copy on the GPU unless train.old_policy_device=cpu
    stash = keep(trainable) if x.lagging_copies and not x.lagging_on_cpu else 0
    encoders = kinds["text_encoders"] if x.text_encoders == "resident" else 0
    base = persistent + encoders + kinds["trajectory"]
    optimizer_temp = keep(trainable)
    phases = {
        # precompute_prompts encodes once in the trainer's set-up, before AdamW's moments exist (torch
        # makes them at the first step), with the whole (unsharded) transformer, its LoRA and a resident
        # reference copy parked in host memory (flowgrpo.policies.diffusers.parking)
        "encode": persistent + kinds["text_encoders"] - (_parked_at_encode(kinds, engine) if
                                                         x.text_encoders == "precomputed" else 0),
        "rollout": base + kinds["rollout_peak"],
        "decode": base + kinds["vae_decode_peak"],
        "update": base + kinds["gradients"] + max(kinds["update_activations"], stash),
        "step": base + kinds["gradients"] + kinds["ddp_sum"] + optimizer_temp,
    }
    peak_phase = max(phases, key=phases.get)
    return {**kinds, "phases": phases, "peak_phase": peak_phase, "total": phases[peak_phase]}


def fits(total_bytes: int, gpu_gib: float, headroom: float = HEADROOM) -> bool:
    """Whether ``total_bytes`` fits a GPU of ``gpu_gib`` GB (decimal, as GPUs are sold: 80 GB =
    80e9 bytes) with ``headroom`` of it to spare."""
    return total_bytes <= gpu_gib * 1e9 * (1 - headroom)


def first_fit(budgets: dict[str, dict], gpu_gib: float) -> str | None:
    """The first layout name of ``budgets`` (in :data:`LAYOUTS` order) whose total fits ``gpu_gib``."""
    return next((name for name, b in budgets.items() if fits(b["total"], gpu_gib)), None)
