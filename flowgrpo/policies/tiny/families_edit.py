"""Tiny random image-editing pipelines for the generic adapter, built offline (tests, benchmarks).

* FLUX.1-Kontext: ``FluxKontextPipeline`` around the tiny FLUX.1 components of
  :mod:`~flowgrpo.policies.tiny.flux` (the same transformer class; Kontext concatenates the reference
  image's packed latents to the sample's tokens and gives them their own RoPE ids);
* Qwen-Image-Edit: ``QwenImageEditPipeline`` (the Qwen-Image tiny transformer and VL text encoder,
  a ``Qwen2VLProcessor`` that shows the VL encoder the reference, a 32x VAE; see
  :func:`tiny_qwen_image_edit_components`).

Each is deterministic in ``seed`` and leaves the caller's global RNG state untouched.
"""

from __future__ import annotations

import torch

from .flux import tiny_flux_components


def tiny_flux_kontext_pipeline(seed: int = 0):
    """A stock ``FluxKontextPipeline`` over :func:`~flowgrpo.policies.tiny.flux.tiny_flux_components`
    (guidance-distilled, as FLUX.1-Kontext-dev; no IP-adapter image encoder)."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**tiny_flux_components(seed, guidance_embeds=True))


def tiny_qwen_image_edit_components(seed: int = 0) -> dict:
    """Random tiny ``QwenImageEditPipeline`` components.

    The pipeline resizes every reference to about 1024^2 pixels whatever the output size, for its
    VAE and for its VL text encoder, so the tiny model keeps that affordable: a 6-level
    ``AutoencoderKLQwenImage`` (32x downsampling, 4 channels wide: a 1024^2 reference becomes 16 x 16
    packed tokens) and a ``Qwen2VLProcessor`` whose image processor shrinks the VL encoder's view to
    at most 56 x 56 pixels (4 image tokens). The text encoder is the one-block-vision
    ``Qwen2_5_VLForConditionalGeneration`` of the Qwen-Image tiny model over the byte-level tokenizer,
    with Qwen's vision markers as special tokens; the transformer is the Qwen-Image tiny model's.
    """
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor,
                              Qwen2VLProcessor, Qwen2VLVideoProcessor)

    from .families import tiny_qwen_image_components, tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer(max_length=2048)
    markers = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": markers}, replace_extra_special_tokens=False)
    start, end, image, video = tokenizer.convert_tokens_to_ids(markers)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                max_position_embeddings=4096, rope_theta=1e6,
                rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                             out_hidden_size=16, fullatt_block_indexes=[0]),
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56),
                                 tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 6)
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
        vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1] * 6, num_res_blocks=1,
                                     temperal_downsample=[False] * 5, latents_mean=[0.0] * 4,
                                     latents_std=[1.0] * 4).eval()
    transformer = tiny_qwen_image_components(seed)["transformer"]  # Qwen-Image's tiny transformer (4 latent channels)
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "transformer": transformer, "vae": vae,
            "text_encoder": text_encoder, "tokenizer": tokenizer, "processor": processor}


def tiny_qwen_image_edit_pipeline(seed: int = 0):
    """A stock ``QwenImageEditPipeline`` around :func:`tiny_qwen_image_edit_components`."""
    from diffusers import QwenImageEditPipeline

    return QwenImageEditPipeline(**tiny_qwen_image_edit_components(seed))
