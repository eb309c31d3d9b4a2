"""A tiny random FLUX.1 built offline, for tests and benchmarks.

Every component has the real class and wiring of ``FluxPipeline`` — ``FluxTransformer2DModel``
(one double-stream and one single-stream block, 3-axis RoPE, optional guidance embedding as in
FLUX.1-dev), a 16-channel ``AutoencoderKL`` with 8x downsampling and FLUX's scaling/shift factors,
a ``CLIPTextModel`` (pooled text feature) and a ``T5EncoderModel`` (token features), and FLUX's
dynamic-shifting ``FlowMatchEulerDiscreteScheduler`` — with a few thousand random weights each.
VAE, text encoders and their offline tokenizers come from :mod:`flowgrpo.policies.tiny.sd3`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..diffusers.flux import default_flux_scheduler
from .sd3 import CLIP_MAX_LENGTH, tiny_sd3_components


def tiny_flux_components(seed: int = 0, guidance_embeds: bool = True, clip_max_length: int = CLIP_MAX_LENGTH) -> dict:
    """Random tiny FLUX components keyed as ``FluxPipeline`` expects (scheduler included).

    The VAE, CLIP and T5 are those of :func:`~flowgrpo.policies.tiny.sd3.tiny_sd3_components` (FLUX.1
    and SD3 share the 16-channel VAE architecture; FLUX uses CLIP-L's text tower without its
    projection, pooled output only), with FLUX.1's VAE scaling and shift factors. The transformer
    is a tiny ``FluxTransformer2DModel``. ``guidance_embeds=True`` is the FLUX.1-dev flavour
    (guidance-distilled), False FLUX.1-schnell's. Deterministic in ``seed``; the caller's global RNG
    state is left untouched.
    """
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel

    sd3 = tiny_sd3_components(seed, clip_max_length=clip_max_length)
    clip_with_projection = sd3["text_encoder"]
    text_encoder = CLIPTextModel(clip_with_projection.config).eval()
    text_encoder.load_state_dict(clip_with_projection.text_model.state_dict())
    vae = sd3["vae"]
    vae.register_to_config(scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's ae config
    t5 = sd3["text_encoder_3"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=t5.config.d_model,
            pooled_projection_dim=text_encoder.config.hidden_size, guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 4, 8),
        )
    return {
        "scheduler": default_flux_scheduler(), "transformer": transformer, "vae": vae,
        "text_encoder": text_encoder, "tokenizer": sd3["tokenizer"],
        "text_encoder_2": t5, "tokenizer_2": sd3["tokenizer_3"],
    }


def tiny_flux_pipeline(seed: int = 0, guidance_embeds: bool = True):
    """A stock ``FluxPipeline`` around :func:`tiny_flux_components` (same seed, same weights)."""
    from diffusers import FluxPipeline

    return FluxPipeline(**tiny_flux_components(seed, guidance_embeds=guidance_embeds))


def save_tiny_flux_pipeline(directory: str | Path, seed: int = 0, guidance_embeds: bool = True) -> Path:
    """Write a tiny FLUX pipeline with ``save_pretrained`` (``model.name=<directory>`` then selects the
    flux adapter through its model_index.json); returns the directory."""
    directory = Path(directory)
    tiny_flux_pipeline(seed, guidance_embeds).save_pretrained(str(directory))
    return directory
