"""The published text encoders and VAEs of the recipes' pipelines, buildable without weights.

:mod:`flowgrpo.realsize.configs` holds each recipe's transformer; this module holds the rest of what
the pipeline folder loads (``model_index.json``'s module components: every ``text_encoder*`` and the
``vae``), as the class and the ``config.json`` numbers of the real checkpoint, with where they were
read (the hub is not reachable from here: the numbers come from public copies of those config
files and from diffusers' own conversion scripts). :func:`build_component` builds one on the
``meta`` device, so its parameter count and bytes are exact without a download; nothing here is a
hard-coded byte total.

Text encoders load in ``model.dtype`` as the transformer does (the adapters pass one
``torch_dtype``), so their bytes are counted in that dtype. Tokenizers, schedulers, processors and
guiders hold no weights and are not components here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------- text encoders
#: CLIP ViT-L/14's text tower (openai/clip-vit-large-patch14 config.json text_config; SD3.5's
#: text_encoder/config.json and FLUX.1's text_encoder/config.json are copies of it)
_CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
               num_attention_heads=12, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
#: OpenCLIP ViT-bigG/14's text tower (SD3.5's text_encoder_2/config.json, as SDXL's text_encoder_2)
_CLIP_BIGG = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                  num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
#: google/t5-v1_1-xxl's encoder (SD3.5's text_encoder_3 and FLUX.1's text_encoder_2 config.json)
_T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu", is_encoder_decoder=False)
#: google/umt5-xxl's encoder (Wan 2.1 / 2.2 text_encoder/config.json; diffusers
#: scripts/convert_wan_to_diffusers.py loads it as UMT5EncoderModel)
_UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                 feed_forward_proj="gated-gelu", is_encoder_decoder=False)
#: google/byt5-small's encoder (HunyuanVideo 1.5's text_encoder_2: diffusers
#: scripts/convert_hunyuan_video1_5_to_diffusers.py load_byt5; its few hundred added glyph tokens left out)
_BYT5_SMALL = dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                   feed_forward_proj="gated-gelu", is_encoder_decoder=False)
#: Qwen/Qwen2.5-VL-7B-Instruct config.json (Qwen-Image's text_encoder; HunyuanVideo 1.5 keeps its
#: language model only: the conversion script's ``text_encoder.language_model``)
_QWEN25_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                          rope_theta=1e6, tie_word_embeddings=False,
                          rope_scaling={"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]})
_QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                            fullatt_block_indexes=[7, 15, 23, 31])
#: Qwen/Qwen3-4B config.json (Z-Image-Turbo's text_encoder, a Qwen3Model: no LM head)
_QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 tie_word_embeddings=True)
#: mistralai/Mistral-Small-3.1-24B-Instruct-2503 config.json (FLUX.2-dev's text_encoder,
#: Mistral3ForConditionalGeneration: text model, Pixtral vision tower, projector and LM head)
_MISTRAL_SMALL_TEXT = dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                           num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           max_position_embeddings=131072, rope_theta=1e9, sliding_window=None)
_PIXTRAL_VISION = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14)

# ---------------------------------------------------------------------------- VAEs
#: SD3.5's vae/config.json (16 latent channels, 8x, no quant convs); FLUX.1 and Z-Image use the same
#: layout with other scaling / shift factors (which hold no weights)
_SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                layers_per_block=2, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)
#: Wan 2.2 TI2V-5B's VAE: diffusers scripts/convert_wan_to_diffusers.py ``vae22_diffusers_config``
_WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                  patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)


@dataclass(frozen=True)
class RealComponent:
    """One weight-holding pipeline component at its published size.

    Attributes:
        name: the pipeline's component name (``text_encoder_2``, ``vae``).
        library: ``transformers`` or ``diffusers`` (where ``class_name`` lives).
        class_name: the model class of ``model_index.json``.
        config: its config numbers (transformers: the config class's keywords; diffusers: ``__init__``'s).
        config_class: transformers' config class (empty for diffusers).
        source: where the numbers were read.
    """

    name: str
    library: str
    class_name: str
    config: dict
    source: str
    config_class: str = ""

    @property
    def is_text_encoder(self) -> bool:
        return self.name.startswith("text_encoder")


def _hf(name, cls, config_cls, config, source) -> RealComponent:
    return RealComponent(name, "transformers", cls, config, source, config_cls)


def _vae(cls, config, source) -> RealComponent:
    return RealComponent("vae", "diffusers", cls, config, source)


_SD3 = (_hf("text_encoder", "CLIPTextModelWithProjection", "CLIPTextConfig", _CLIP_L, "CLIP-L text tower"),
        _hf("text_encoder_2", "CLIPTextModelWithProjection", "CLIPTextConfig", _CLIP_BIGG, "OpenCLIP bigG text tower"),
        _hf("text_encoder_3", "T5EncoderModel", "T5Config", _T5_XXL, "T5 v1.1 XXL encoder"),
        _vae("AutoencoderKL", _SD3_VAE, "SD3.5 vae/config.json"))
_FLUX1 = (_hf("text_encoder", "CLIPTextModel", "CLIPTextConfig", _CLIP_L, "CLIP-L text tower"),
          _hf("text_encoder_2", "T5EncoderModel", "T5Config", _T5_XXL, "T5 v1.1 XXL encoder"),
          _vae("AutoencoderKL", _SD3_VAE, "FLUX.1 vae/config.json (SD3's layout)"))
_WAN = (_hf("text_encoder", "UMT5EncoderModel", "UMT5Config", _UMT5_XXL, "UMT5 XXL encoder"),)
_QWEN_VL = _hf("text_encoder", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
               {"text_config": _QWEN25_VL_7B_TEXT, "vision_config": _QWEN25_VL_7B_VISION}, "Qwen2.5-VL-7B-Instruct")
_QWEN_VAE = _vae("AutoencoderKLQwenImage", {}, "Qwen-Image vae/config.json: the class defaults (base 96, z 16)")

#: pipeline class -> its weight-holding components other than the transformer(s)
REAL_COMPONENTS: dict[str, tuple[RealComponent, ...]] = {
    "StableDiffusion3Pipeline": _SD3,
    "FluxPipeline": _FLUX1,
    "FluxKontextPipeline": _FLUX1,
    "Flux2Pipeline": (_hf("text_encoder", "Mistral3ForConditionalGeneration", "Mistral3Config",
                          {"text_config": _MISTRAL_SMALL_TEXT, "vision_config": _PIXTRAL_VISION,
                           "spatial_merge_size": 2, "multimodal_projector_bias": False,
                           "tie_word_embeddings": False}, "Mistral-Small-3.1-24B (24.0 B with its LM head)"),
                      _vae("AutoencoderKLFlux2", {}, "FLUX.2 vae: the class defaults (32 latent channels)")),
    "QwenImagePipeline": (_QWEN_VL, _QWEN_VAE),
    "QwenImageEditPipeline": (_QWEN_VL, _QWEN_VAE),
    "ZImagePipeline": (_hf("text_encoder", "Qwen3Model", "Qwen3Config", _QWEN3_4B, "Qwen3-4B"),
                       _vae("AutoencoderKL", _SD3_VAE, "Z-Image vae/config.json (FLUX.1's VAE)")),
    "WanPipeline": _WAN + (_vae("AutoencoderKLWan", {}, "Wan 2.1 VAE: the class defaults (base 96, z 16)"),),
    "HunyuanVideo15Pipeline": (
        _hf("text_encoder", "Qwen2_5_VLTextModel", "Qwen2_5_VLTextConfig", _QWEN25_VL_7B_TEXT,
            "Qwen2.5-VL-7B's language model"),
        _hf("text_encoder_2", "T5EncoderModel", "T5Config", _BYT5_SMALL, "ByT5-small encoder (Glyph-SDXL-v2)"),
        _vae("AutoencoderKLHunyuanVideo15", {}, "HunyuanVideo 1.5 VAE: the class defaults (the conversion script's)")),
}
#: recipes whose VAE differs from their pipeline class's usual one
_RECIPE_VAE = {"wan22-ti2v-5b": _vae("AutoencoderKLWan", _WAN22_VAE, "vae22_diffusers_config")}


def recipe_components(recipe: str) -> tuple[RealComponent, ...]:
    """The weight-holding components of ``recipe``'s pipeline besides its transformer(s); KeyError
    naming the known pipelines when its pipeline class has no entry."""
    from .configs import transformer_config

    entry = transformer_config(recipe)
    try:
        parts = REAL_COMPONENTS[entry.pipeline]
    except KeyError:
        raise KeyError(f"no published text encoder / VAE configuration for {entry.pipeline} "
                       f"(known: {', '.join(REAL_COMPONENTS)})") from None
    if recipe in _RECIPE_VAE:
        parts = tuple(p for p in parts if p.name != "vae") + (_RECIPE_VAE[recipe],)
    return parts


def build_component(part: RealComponent, device: str | torch.device = "meta", dtype: torch.dtype = torch.bfloat16):
    """``part`` built on ``device`` in ``dtype`` (meta: shapes only, no memory)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if part.library == "diffusers":
                import diffusers

                return getattr(diffusers, part.class_name)(**part.config)
            import transformers

            config = getattr(transformers, part.config_class)(**part.config)
            return getattr(transformers, part.class_name)(config)
    finally:
        torch.set_default_dtype(previous)


def component_bytes(recipe: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, dict]:
    """``{name: {"params", "bytes", "class_name", "text_encoder"}}`` of every component of
    :func:`recipe_components`, counted on the meta device in ``dtype``."""
    out = {}
    for part in recipe_components(recipe):
        model = build_component(part, dtype=dtype)
        out[part.name] = {"params": sum(p.numel() for p in model.parameters()),
                          "bytes": sum(p.numel() * p.element_size() for p in model.parameters())
                          + sum(b.numel() * b.element_size() for b in model.buffers()),
                          "class_name": part.class_name, "text_encoder": part.is_text_encoder}
    return out
