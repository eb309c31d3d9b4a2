"""Declarative entries for the pipeline families the generic adapter trains.

A pipeline class with no entry here still goes through the generic adapter with the defaults of
:class:`PipelineFamily`; an entry only says what cannot be inferred from one recorded step (which
``__call__`` keyword carries ``model.guidance_scale``, fixed call options, LoRA targets, defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowgrpo.registry import Registry

#: attention projections of diffusers' ``Attention`` modules (every transformer here has them)
ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass(frozen=True)
class PipelineFamily:
    """What the generic adapter needs to know about one diffusers pipeline class.

    Attributes:
        pipeline: the pipeline class name (``_class_name`` of ``model_index.json``).
        guidance_kwarg: the ``__call__`` keyword that receives ``model.guidance_scale``.
        guidance_attr: instead, a dotted attribute of the pipeline that holds it for each call
            (HunyuanVideo 1.5's ``guider.guidance_scale``: its guidance is a component, not a keyword).
        call_kwargs: fixed ``__call__`` options of every recorded run (e.g. a negative prompt).
        timestep_arg: the transformer's timestep argument (a keyword, or a positional index).
        lora_targets: peft target module names of the LoRA adapter (on every expert).
        resolution, max_sequence_length, num_frames: the family's defaults where ``model.*`` leaves
            them unset (``num_frames`` only for pipelines whose ``__call__`` takes it).
        experts: the pipeline attributes of its denoisers, in the order they take over (Wan 2.2
            A14B: ``transformer`` for high noise, then ``transformer_2``); one that is None in a
            pipeline is absent (Wan 2.1 / 2.2 TI2V-5B have no ``transformer_2``).
        boundary_config: the pipeline config key of the switch between two experts: the second
            runs where the scheduler's timestep is below ``value * num_train_timesteps``.
        decode_batch: the largest batch the pipeline's VAE decodes (``model.*`` has no key for it).
        reference_kwarg: for an image-editing pipeline, the ``__call__`` keyword of the reference
            images (each prompt comes with one; the policy then needs them to encode prompts).
        area_kwarg: a ``__call__`` keyword that caps the output area and so must be ``resolution ** 2``
            (FLUX.1-Kontext's ``max_area`` rescales any height / width to 1024^2 by default).
        prompts_per_call: 1 for a pipeline that refuses several prompts in one call
            (QwenImageEditPlusPipeline): it is probed, encoded and replayed one prompt at a time
            (:mod:`~flowgrpo.diffusers.replay.row_calls`); None: any batch.
    """

    pipeline: str
    guidance_kwarg: str = "guidance_scale"
    guidance_attr: str | None = None
    call_kwargs: dict = field(default_factory=dict)
    timestep_arg: str | int = "timestep"
    lora_targets: tuple[str, ...] = ATTENTION_TARGETS
    resolution: int = 1024
    max_sequence_length: int = 256
    num_frames: int = 81
    experts: tuple[str, ...] = ("transformer",)
    boundary_config: str | None = None
    decode_batch: int = 8
    reference_kwarg: str | None = None
    area_kwarg: str | None = None
    prompts_per_call: int | None = None


FAMILIES: Registry[PipelineFamily] = Registry("pipeline family")
_ENTRIES = (
    PipelineFamily("StableDiffusion3Pipeline", lora_targets=(
        *ATTENTION_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
    PipelineFamily("FluxPipeline", lora_targets=(
        *ATTENTION_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
    # true CFG runs only with a negative prompt (the pipeline's own docs use " ")
    PipelineFamily("QwenImagePipeline", guidance_kwarg="true_cfg_scale", call_kwargs={"negative_prompt": " "},
                   lora_targets=(*ATTENTION_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
    # ZImageTransformer2DModel(x, t, cap_feats): positional arguments
    PipelineFamily("ZImagePipeline", timestep_arg=1, max_sequence_length=512),
    # single-stream blocks fuse q, k, v and the MLP input into one projection
    # Wan 2.2 (the generic adapter takes WanPipeline folders with transformer_2 or expand_timesteps;
    # Wan 2.1 ones keep the wan adapter): self- and cross-attention and the feed-forward of every block
    PipelineFamily("WanPipeline", resolution=480, max_sequence_length=512, experts=("transformer", "transformer_2"),
                   boundary_config="boundary_ratio",
                   lora_targets=(*ATTENTION_TARGETS, "ffn.net.0.proj", "ffn.net.2")),
    # guidance is the guider component's; the text goes through two encoders (MLLM and ByT5 glyphs)
    # (diffusers 0.42.1: its VAE's mid-block attention mask [B, L, L] does not broadcast for B > 1)
    PipelineFamily("HunyuanVideo15Pipeline", guidance_attr="guider.guidance_scale", resolution=480, num_frames=121,
                   decode_batch=1),
    # image editing: the reference image's latent tokens follow the sample's in the transformer input.
    # Kontext: the reference enters at model.resolution (square; its auto-resize to a preferred
    # Kontext resolution is off: at 1024 it picks 1024x1024 for a square image anyway)
    PipelineFamily("FluxKontextPipeline", reference_kwarg="image", area_kwarg="max_area",
                   call_kwargs={"_auto_resize": False}, max_sequence_length=512, lora_targets=(
                       *ATTENTION_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
    # Qwen-Image-Edit: the VL text encoder sees the reference too; true CFG as Qwen-Image
    PipelineFamily("QwenImageEditPipeline", guidance_kwarg="true_cfg_scale", call_kwargs={"negative_prompt": " "},
                   reference_kwarg="image",
                   lora_targets=(*ATTENTION_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
    # Qwen-Image-Edit-Plus (several references per prompt; one here): diffusers 0.42.1 takes one prompt per call
    PipelineFamily("QwenImageEditPlusPipeline", guidance_kwarg="true_cfg_scale", call_kwargs={"negative_prompt": " "},
                   reference_kwarg="image", prompts_per_call=1, decode_batch=1,
                   lora_targets=(*ATTENTION_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
    PipelineFamily("Flux2Pipeline", max_sequence_length=512, lora_targets=(
        *ATTENTION_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "to_qkv_mlp_proj")),
)
for _entry in _ENTRIES:
    FAMILIES.register(_entry.pipeline)(lambda entry=_entry: entry)


def family_of(pipeline_class: str) -> PipelineFamily:
    """The entry of ``pipeline_class``, or one with every default when there is none."""
    if pipeline_class in FAMILIES:
        return FAMILIES.build(pipeline_class)
    return PipelineFamily(pipeline=pipeline_class)
