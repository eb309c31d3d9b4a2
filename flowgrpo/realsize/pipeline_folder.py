"""A diffusers pipeline folder with the real transformer and random weights: dry-run a recipe before downloading.

:func:`write_pipeline` saves a folder that ``model.name=<folder>`` loads like the real one:

* the transformer (every expert of it) at the recipe's published configuration
  (:mod:`flowgrpo.realsize.configs`), random weights;
* text encoders of the real classes shrunk to two layers and a few dozen hidden units inside, but
  with the real **output** widths, so the transformer's text inputs have their real sizes: SD3:
  CLIP-L 768 and CLIP-G 1280 (pooled 768 + 1280 = ``pooled_projection_dim`` 2048, hidden states
  zero-padded to T5's 4096 = ``joint_attention_dim``), T5 4096; FLUX.1 / Kontext: CLIP-L 768
  pooled, T5 4096; FLUX.2: Mistral-3 5120 (layers 10 / 20 / 30 stacked = 15360); Z-Image: Qwen3
  2560 (``cap_feat_dim``); Qwen-Image (-Edit): Qwen2.5-VL 3584; Wan: UMT5 4096 (``text_dim``);
  HunyuanVideo 1.5: Qwen2.5-VL 3584 and ByT5 1472;
* tokenizers built offline (:mod:`flowgrpo.policies.tiny.sd3`'s CLIP BPE and T5 Unigram ones, CLIP
  at its real 77 tokens; the byte-level Qwen one of :mod:`flowgrpo.policies.tiny.families`);
* a small VAE with the real latent channels and compression (SD3 / FLUX.1 / Z-Image / Qwen-Image:
  16 channels, 8x; FLUX.2: 32, 8x; Wan 2.1: 16 channels, 8x spatial / 4x temporal; Wan 2.2 TI2V-5B:
  48 channels, 16x / 4x; HunyuanVideo 1.5: 32, 16x / 4x), the stock scheduler.

Everything is saved in bfloat16 (2 bytes per weight: the SD3.5-Medium folder is 4.7 GB, Wan 2.1
1.3B 2.7 GB). The transformer is built on the meta device and its random weights are written as they
are drawn (:mod:`flowgrpo.realsize.stream_weights`), so memory stays bounded whatever its size; the
folder is written beside ``out`` and renamed at the end, after a check that the disk has room for it
(:func:`flowgrpo.disk.new_folder`). :data:`WRITERS` maps every recipe's pipeline class to its builder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .configs import REAL_TRANSFORMERS, RealTransformer, build_transformer, transformer_config

CLIP_TOKENS = 77
#: inside widths of the shrunk text encoders (their output widths are the real ones)
_SMALL = dict(layers=2, heads=4, ffn=64)


def _clip(tokenizer, width: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=_SMALL["ffn"], projection_dim=width,
        num_hidden_layers=_SMALL["layers"], num_attention_heads=_SMALL["heads"], max_position_embeddings=CLIP_TOKENS,
        hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)).eval()


def _t5_config(tokenizer, width: int) -> dict:
    """A T5 / UMT5 encoder config ``width`` wide at its output, small inside (16-wide heads, 64-wide FF)."""
    return dict(vocab_size=len(tokenizer), d_model=width, d_kv=16, d_ff=_SMALL["ffn"], num_layers=_SMALL["layers"],
                num_heads=_SMALL["heads"], relative_attention_num_buckets=8, relative_attention_max_distance=32,
                dropout_rate=0.0, feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def sd3_components(entry: RealTransformer) -> dict:
    """``StableDiffusion3Pipeline`` components around the real transformer of ``entry``."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    from ..policies.tiny.sd3 import tiny_clip_tokenizer, tiny_t5_tokenizer

    cfg = entry.config
    clip_l, clip_g, t5_width = 768, 1280, cfg["joint_attention_dim"]
    if clip_l + clip_g != cfg["pooled_projection_dim"]:
        raise ValueError(f"{entry.recipe}: pooled width {cfg['pooled_projection_dim']} is not CLIP-L + CLIP-G")
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(max_length=CLIP_TOKENS), tiny_clip_tokenizer(max_length=CLIP_TOKENS)
    tokenizer_3 = tiny_t5_tokenizer()
    return {
        "transformer": build_transformer(entry),
        "text_encoder": _clip(tokenizer, clip_l), "tokenizer": tokenizer,
        "text_encoder_2": _clip(tokenizer_2, clip_g), "tokenizer_2": tokenizer_2,
        "text_encoder_3": T5EncoderModel(T5Config(**_t5_config(tokenizer_3, t5_width))).eval(),
        "tokenizer_3": tokenizer_3,
        "vae": _kl_vae(cfg["in_channels"], scaling=1.5305, shift=0.0609),
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    }


def _kl_vae(latent_channels: int, scaling: float, shift: float):
    """SD3 / FLUX.1 / Z-Image's ``AutoencoderKL`` layout (4 levels: 8x) with their latent channels and
    scaling / shift factors, 8-16 channels wide inside."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4, sample_size=1024,
        scaling_factor=scaling, shift_factor=shift, use_quant_conv=False, use_post_quant_conv=False).eval()


def flux_components(entry: RealTransformer) -> dict:
    """``FluxPipeline`` / ``FluxKontextPipeline`` components: CLIP-L's text tower (pooled 768 =
    ``pooled_projection_dim``), T5 4096 (= ``joint_attention_dim``), FLUX.1's 16-channel VAE (its
    transformer takes the 2x2-packed 64 channels) and dynamic-shift scheduler."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from ..policies.diffusers.flux import default_flux_scheduler
    from ..policies.tiny.sd3 import tiny_clip_tokenizer, tiny_t5_tokenizer

    cfg = entry.config
    tokenizer, tokenizer_2 = tiny_clip_tokenizer(max_length=CLIP_TOKENS), tiny_t5_tokenizer(max_length=512)
    clip = _clip(tokenizer, cfg["pooled_projection_dim"])
    text_encoder = CLIPTextModel(CLIPTextConfig(**clip.config.to_dict())).eval()
    return {"transformer": build_transformer(entry),
            "text_encoder": text_encoder, "tokenizer": tokenizer,
            "text_encoder_2": T5EncoderModel(T5Config(**_t5_config(tokenizer_2, cfg["joint_attention_dim"]))).eval(),
            "tokenizer_2": tokenizer_2, "vae": _kl_vae(cfg["in_channels"] // 4, scaling=0.3611, shift=0.1159),
            "scheduler": default_flux_scheduler()}


def zimage_components(entry: RealTransformer) -> dict:
    """``ZImagePipeline`` components: a 2-layer ``Qwen3Model`` 2560 wide (= ``cap_feat_dim``) with 2 heads
    of 8 inside, the byte-level Qwen tokenizer with its chat template, a 16-channel KL VAE (8x)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3Config, Qwen3Model

    from ..policies.tiny.families import tiny_qwen_tokenizer

    cfg = entry.config
    tokenizer = tiny_qwen_tokenizer(max_length=512)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=cfg["cap_feat_dim"], intermediate_size=_SMALL["ffn"],
        num_hidden_layers=_SMALL["layers"], num_attention_heads=2, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id)).eval()
    return {"transformer": build_transformer(entry), "text_encoder": text_encoder,
            "tokenizer": tokenizer, "vae": _kl_vae(cfg["in_channels"], scaling=0.3611, shift=0.1159),
            "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)}


def wan_components(entry: RealTransformer) -> dict:
    """``WanPipeline`` components around the real transformer(s) of ``entry`` (Wan 2.1, Wan 2.2 A14B's
    two experts split at boundary 0.875, Wan 2.2 TI2V-5B's 48-channel 16x VAE with per-token timesteps)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    from ..policies.tiny.families_video import WAN22_BOUNDARY
    from ..policies.tiny.sd3 import tiny_t5_tokenizer

    cfg = entry.config
    tokenizer = tiny_t5_tokenizer(max_length=512)
    channels = cfg["in_channels"]
    if channels == 48:  # Wan 2.2 VAE: residual, 2x2-patchified input, 16x spatial
        vae = AutoencoderKLWan(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                               latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1],
                               num_res_blocks=1, scale_factor_spatial=16, scale_factor_temporal=4,
                               temperal_downsample=[False, True, True]).eval()
    else:
        vae = AutoencoderKLWan(base_dim=3, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[False, True, True]).eval()
    components = {
        "transformer": build_transformer(entry), "vae": vae,
        "text_encoder": UMT5EncoderModel(UMT5Config(**_t5_config(tokenizer, cfg["text_dim"]))).eval(),
        "tokenizer": tokenizer,
        "scheduler": UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                             num_train_timesteps=1000, flow_shift=5.0 if channels == 48 else 3.0),
    }
    if len(entry.experts) == 2:
        components["transformer_2"] = build_transformer(entry)
        components["boundary_ratio"] = WAN22_BOUNDARY
    elif channels == 48:
        components.update(transformer_2=None, boundary_ratio=None, expand_timesteps=True)
    return components


def qwen_image_components(entry: RealTransformer) -> dict:
    """``QwenImagePipeline`` / ``QwenImageEditPipeline`` components: a ``Qwen2_5_VLForConditionalGeneration``
    with the real text width 3584 (= ``joint_attention_dim``; 28 heads of 128 and 4 key-value heads as
    Qwen2.5-VL-7B, so its multimodal rotary sections are the real 16/24/24) but two layers and a
    64-wide MLP, a one-block vision tower projecting to 3584, the byte-level tokenizer with Qwen's
    vision markers, Qwen-Image's 16-channel video VAE (8x) 4 channels wide; the edit pipeline also
    gets a ``Qwen2VLProcessor`` whose VL view of a reference is at most 56 x 56 pixels."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    from ..policies.tiny.families import tiny_qwen_tokenizer

    cfg, channels = entry.config, entry.config["out_channels"]
    tokenizer = tiny_qwen_tokenizer(max_length=2048)
    markers = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": markers}, replace_extra_special_tokens=False)
    start, end, image, video = tokenizer.convert_tokens_to_ids(markers)
    width = cfg["joint_attention_dim"]
    text = dict(hidden_size=width, intermediate_size=_SMALL["ffn"], num_hidden_layers=_SMALL["layers"],
                num_attention_heads=width // 128, num_key_value_heads=4, vocab_size=len(tokenizer), bos_token_id=None,
                eos_token_id=tokenizer.eos_token_id, max_position_embeddings=4096, rope_theta=1e6,
                rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"})
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                             out_hidden_size=width, fullatt_block_indexes=[0]),
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    components = {
        "transformer": build_transformer(entry),
        "text_encoder": Qwen2_5_VLForConditionalGeneration(config).eval(), "tokenizer": tokenizer,
        "vae": AutoencoderKLQwenImage(base_dim=4, z_dim=channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                      temperal_downsample=[False, True, True], latents_mean=[0.0] * channels,
                                      latents_std=[1.0] * channels).eval(),
        "scheduler": FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
            base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential"),
    }
    if entry.pipeline == "QwenImageEditPipeline":
        components["processor"] = Qwen2VLProcessor(
            image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56), tokenizer=tokenizer,
            video_processor=Qwen2VLVideoProcessor())
    return components


def flux2_components(entry: RealTransformer) -> dict:
    """``Flux2Pipeline`` components: a ``Mistral3ForConditionalGeneration`` 5120 wide (its hidden states
    of layers 10, 20 and 30 stacked = ``joint_attention_dim`` 15360) with 30 layers of 2 heads x 8 and
    a 64-wide MLP, a one-layer Pixtral vision tower, the Pixtral processor over the byte-level
    tokenizer, FLUX.2's VAE with 32 latent channels and 8x (the transformer takes 2x2-packed 128)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from ..policies.tiny.families import tiny_pixtral_processor

    cfg = entry.config
    width, stacked = cfg["joint_attention_dim"] // 3, 30
    processor = tiny_pixtral_processor()
    tok = processor.tokenizer
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=width, intermediate_size=_SMALL["ffn"],
                         max_position_embeddings=2048, num_attention_heads=2, num_hidden_layers=stacked,
                         num_key_value_heads=1, head_dim=8, rope_theta=1e6, sliding_window=None, **ids),
        vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=16, image_size=32, patch_size=16, head_dim=8),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1, vision_feature_layer=-1, **ids)
    vae = AutoencoderKLFlux2(
        sample_size=1024, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
        latent_channels=cfg["in_channels"] // 4, norm_num_groups=4, use_quant_conv=False,
        use_post_quant_conv=False).eval()
    return {"transformer": build_transformer(entry),
            "text_encoder": Mistral3ForConditionalGeneration(config).eval(), "tokenizer": processor, "vae": vae,
            "scheduler": FlowMatchEulerDiscreteScheduler()}


def hunyuan_video15_components(entry: RealTransformer) -> dict:
    """``HunyuanVideo15Pipeline`` components: a ``Qwen2_5_VLTextModel`` at the real 3584 (=
    ``text_embed_dim``; 28 x 128 heads, 4 key-value heads, rotary sections 16/24/24) with three layers,
    a ByT5 ``T5EncoderModel`` 1472 wide (= ``text_embed_2_dim``), the video VAE with 32 latent channels,
    16x spatial and 4x temporal compression (8 to 64 channels wide: its last level must be a multiple
    of the latent channels), CFG guider and the stock scheduler."""
    from diffusers import AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from ..policies.tiny.families import tiny_qwen_tokenizer

    cfg = entry.config
    width = cfg["text_embed_dim"]
    tokenizer, tokenizer_2 = tiny_qwen_tokenizer(max_length=2048), ByT5Tokenizer()
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=_SMALL["ffn"], num_hidden_layers=3,
        num_attention_heads=width // 128, num_key_value_heads=4, max_position_embeddings=2048, rope_theta=1e6,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"})).eval()
    t5 = _t5_config(tokenizer_2, cfg["text_embed_2_dim"])
    t5.pop("feed_forward_proj")
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=cfg["out_channels"], block_out_channels=(8, 16, 32, 64),
        layers_per_block=1, spatial_compression_ratio=16, temporal_compression_ratio=4,
        downsample_match_channel=False, upsample_match_channel=False).eval()
    return {"transformer": build_transformer(entry),
            "text_encoder": text_encoder, "tokenizer": tokenizer,
            "text_encoder_2": T5EncoderModel(T5Config(**t5)).eval(), "tokenizer_2": tokenizer_2, "vae": vae,
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=5.0), "guider": ClassifierFreeGuidance(guidance_scale=6.0)}


#: pipeline class -> components builder of the families this module writes
WRITERS = {"StableDiffusion3Pipeline": sd3_components, "WanPipeline": wan_components,
           "FluxPipeline": flux_components, "FluxKontextPipeline": flux_components,
           "ZImagePipeline": zimage_components, "QwenImagePipeline": qwen_image_components,
           "QwenImageEditPipeline": qwen_image_components, "Flux2Pipeline": flux2_components,
           "HunyuanVideo15Pipeline": hunyuan_video15_components}


#: room left on the disk beyond the weights: configs, tokenizer files, safetensors headers
FOLDER_MARGIN_BYTES = 64 * 2**20


def write_pipeline(recipe: str, out: str | Path, seed: int = 0, **overrides) -> Path:
    """Write ``recipe``'s random-weight pipeline folder into ``out`` (bf16 safetensors); returns ``out``.

    ``overrides`` replace transformer config keys (tests: ``num_layers=1``). ValueError for a recipe
    whose family has no writer (:data:`WRITERS`); a UserError when ``out`` exists and is not an empty
    folder, when its disk has too little room, or when a write fails (nothing is left then)."""
    import dataclasses

    import diffusers

    from ..disk import check_new_folder, new_folder, tensor_bytes, tensor_write_errors
    from ..policies.diffusers.common import cast_module
    from .stream_weights import attach_streamed_save, is_meta_module

    out = check_new_folder(out, "--out")
    entry = transformer_config(recipe)
    entry = dataclasses.replace(entry, config={**entry.config, **overrides})
    if entry.pipeline not in WRITERS:
        supported = [r for r, e in REAL_TRANSFORMERS.items() if e.pipeline in WRITERS]
        raise ValueError(f"{recipe}: writing a {entry.pipeline} folder is not supported yet "
                         f"(supported: {', '.join(supported)})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        components = WRITERS[entry.pipeline](entry)
    pipe = getattr(diffusers, entry.pipeline)(**components)
    modules = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    for module in modules:
        cast_module(module, torch.bfloat16)  # the classes' float32 submodules stay float32
        if is_meta_module(module):  # the transformer(s): written as drawn
            attach_streamed_save(module, seed)
    need = tensor_bytes(t for m in modules for t in m.state_dict().values()) + FOLDER_MARGIN_BYTES
    with new_folder(out, "pipeline folder", need, tensor_write_errors()) as tmp:
        pipe.save_pretrained(str(tmp), safe_serialization=True)
    return out
