"""Tiny random video pipelines of the families the generic adapter trains, built offline (tests).

* Wan 2.2 A14B layout: ``WanPipeline`` with two experts of Wan 2.1's tiny transformer layout
  (:mod:`~flowgrpo.policies.tiny.wan`): ``transformer`` for high noise and ``transformer_2`` below
  ``boundary_ratio`` = 0.875 (the A14B T2V value), Wan's UniPC scheduler on flow sigmas;
* Wan 2.2 TI2V-5B layout: ``WanPipeline`` with one transformer over 48 latent channels, the Wan 2.2
  VAE (residual, 2x2 patchified input, 16x spatial compression) and per-token timesteps
  (``expand_timesteps=True``).

Each builder takes a seed, returns the stock pipeline, and leaves the caller's global RNG untouched.
"""

from __future__ import annotations

import torch

from .wan import TRANSFORMER_TINY, tiny_wan_components

#: the A14B text-to-video boundary: ``transformer`` while t >= 0.875 * 1000
WAN22_BOUNDARY = 0.875


def tiny_wan22_a14b_pipeline(seed: int = 0):
    """A ``WanPipeline`` in the Wan 2.2 A14B layout (two experts split at :data:`WAN22_BOUNDARY`)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    components = tiny_wan_components(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 11)
        components["transformer_2"] = WanTransformer3DModel(**TRANSFORMER_TINY)
    return WanPipeline(**components, boundary_ratio=WAN22_BOUNDARY)


def tiny_wan22_5b_pipeline(seed: int = 0):
    """A ``WanPipeline`` in the Wan 2.2 TI2V-5B layout (one expert, 48 channels, per-token timesteps)."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    components = tiny_wan_components(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 12)
        components["transformer"] = WanTransformer3DModel(**{**TRANSFORMER_TINY, "in_channels": 48, "out_channels": 48})
        components["vae"] = AutoencoderKLWan(
            base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
            latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True]).eval()
    return WanPipeline(**components, transformer_2=None, boundary_ratio=None, expand_timesteps=True)


def tiny_hunyuan_video15_pipeline(seed: int = 0, guidance_scale: float = 6.0):
    """A ``HunyuanVideo15Pipeline`` (text to video): ``HunyuanVideo15Transformer3DModel`` (one block, one
    refiner block), a ``Qwen2_5_VLTextModel`` over the byte-level Qwen tokenizer, a ``T5EncoderModel``
    with the (vocabulary-free) ``ByT5Tokenizer`` for quoted glyph text, the video VAE with 4x spatial and
    2x temporal compression, and a ``ClassifierFreeGuidance`` guider holding the guidance scale."""
    from diffusers import (AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline,
                           HunyuanVideo15Transformer3DModel)
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from .families import tiny_qwen_tokenizer

    tokenizer, tokenizer_2 = tiny_qwen_tokenizer(max_length=2048), ByT5Tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 13)
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1e6, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})).eval()
        text_encoder_2 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.0, is_encoder_decoder=False, use_cache=False)).eval()
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
            num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16, text_embed_2_dim=32,
            image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v")
        vae = AutoencoderKLHunyuanVideo15(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16), layers_per_block=1,
            spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
            upsample_match_channel=False).eval()
    return HunyuanVideo15Pipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
