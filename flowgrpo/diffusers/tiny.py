"""A tiny random FLUX.1 pipeline built offline, for tests and benchmarks.

Every component has FLUX's real architecture class and wiring — ``FluxTransformer2DModel`` (one
double-stream and one single-stream block, 3-axis RoPE), an ``AutoencoderKL`` with a 2x
downsampling and 4 latent channels (packed 2x2 into 16 transformer channels, as FLUX packs its 16
channels into 64), a ``CLIPTextModel`` whose pooled output feeds ``pooled_projections`` and a
``T5EncoderModel`` whose hidden states are the joint-attention context — with random weights.

Tokenizers are the offline ones of :mod:`flowgrpo.policies.sd3_tiny` (a truncated CLIP BPE and a
Unigram T5 vocabulary). Call the pipeline with a small ``max_sequence_length`` (e.g. 32).

Shapes at ``height = width = 32``: latents [B, 64, 16] packed ((32 / 2 / 2)^2 tokens of 4 * 4
channels); decoded images [B, 3, 32, 32].
"""

from __future__ import annotations

import torch

from flowgrpo.policies.sd3_tiny import CLIP_MAX_LENGTH, tiny_clip_tokenizer, tiny_t5_tokenizer

#: widths of the tiny text encoders (real FLUX: CLIP-L 768, T5-XXL 4096)
CLIP_WIDTH = 32
T5_WIDTH = 32


def tiny_flux_components(seed: int = 0, guidance_embeds: bool = False, shift: float = 3.0) -> dict:
    """Random tiny FLUX components keyed as ``FluxPipeline`` expects, scheduler included.

    Args:
        seed: weights are deterministic in ``seed``; the caller's global RNG state is untouched.
        guidance_embeds: True for a FLUX.1-dev-like transformer (distilled guidance input),
            False for a schnell-like one.
        shift: the scheduler's static shift (FLUX uses dynamic shifting from the image size; the
            tiny one uses a static shift so the grid does not depend on the resolution).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = tiny_clip_tokenizer(max_length=CLIP_MAX_LENGTH)
    tokenizer_2 = tiny_t5_tokenizer()
    latent_channels = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=CLIP_WIDTH, intermediate_size=2 * CLIP_WIDTH,
            projection_dim=CLIP_WIDTH, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=CLIP_MAX_LENGTH, hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )).eval()
        t5 = dict(d_model=T5_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                  relative_attention_num_buckets=8, relative_attention_max_distance=32, use_cache=False,
                  feed_forward_proj="gated-gelu", is_encoder_decoder=False)
        text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), pad_token_id=tokenizer_2.pad_token_id,
                                                 eos_token_id=tokenizer_2.eos_token_id, **t5)).eval()
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=4 * latent_channels, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=T5_WIDTH,
            pooled_projection_dim=CLIP_WIDTH, guidance_embeds=guidance_embeds, axes_dims_rope=(4, 4, 8),
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=latent_channels,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            block_out_channels=(8, 8), layers_per_block=1, norm_num_groups=4, sample_size=32,
            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
        ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    return dict(scheduler=scheduler, transformer=transformer, vae=vae, text_encoder=text_encoder,
                tokenizer=tokenizer, text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)


def tiny_flux_pipeline(seed: int = 0, guidance_embeds: bool = False, shift: float = 3.0):
    """A stock ``FluxPipeline`` around :func:`tiny_flux_components` (same seed, same weights)."""
    from diffusers import FluxPipeline

    return FluxPipeline(**tiny_flux_components(seed, guidance_embeds=guidance_embeds, shift=shift))
