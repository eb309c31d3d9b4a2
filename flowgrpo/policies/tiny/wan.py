"""A tiny random Wan 2.1 text-to-video pipeline built offline, for tests and benchmarks.

Every component has the real class and wiring of ``WanPipeline`` — ``WanTransformer3DModel``
(patch (1, 2, 2), RMS q/k norm across heads, cross-attention norm), an ``AutoencoderKLWan`` with
Wan's 4x temporal / 8x spatial compression and 16 latent channels, and a ``UMT5EncoderModel`` —
but with a few thousand random weights each. The tokenizer is the offline T5-style Unigram
tokenizer of :mod:`flowgrpo.policies.tiny.sd3` (Wan's real one is UMT5's SentencePiece model).

The scheduler is Wan's stock one (``UniPCMultistepScheduler`` with flow sigmas and ``flow_shift``);
:class:`~flowgrpo.policies.diffusers.wan.WanPolicy` reads only its ``flow_shift`` (see ``WanPolicy.sigma_grid``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .sd3 import tiny_t5_tokenizer

TEXT_DIM = 32
#: a 2-layer UMT5 encoder of width TEXT_DIM (real Wan 2.1: umt5-xxl, 4096 wide, 24 layers)
UMT5_TINY = dict(d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                 relative_attention_max_distance=32, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                 is_encoder_decoder=False, use_cache=False)
#: 2 blocks of 2 heads x 12 (real Wan 2.1 1.3B: 30 blocks of 12 heads x 128)
TRANSFORMER_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                        out_channels=16, text_dim=TEXT_DIM, freq_dim=256, ffn_dim=32, num_layers=2,
                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def tiny_wan_components(seed: int = 0, flow_shift: float = 3.0) -> dict:
    """Random tiny Wan 2.1 T2V components keyed as ``WanPipeline`` expects (deterministic in ``seed``;
    the caller's global RNG state is left untouched)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                                   eos_token_id=tokenizer.eos_token_id, **UMT5_TINY)).eval()
        transformer = WanTransformer3DModel(**TRANSFORMER_TINY)
        vae = AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
        ).eval()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=flow_shift)
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}


def tiny_wan_pipeline(seed: int = 0, flow_shift: float = 3.0):
    """A stock ``WanPipeline`` around :func:`tiny_wan_components`."""
    from diffusers import WanPipeline

    return WanPipeline(**tiny_wan_components(seed, flow_shift))


def save_tiny_wan(directory: str | Path, seed: int = 0, flow_shift: float = 3.0) -> Path:
    """Write a tiny ``WanPipeline`` with ``save_pretrained`` (``model.name=<directory>`` then loads it
    through the ``wan`` adapter). Returns the directory."""
    directory = Path(directory)
    tiny_wan_pipeline(seed, flow_shift).save_pretrained(str(directory))
    return directory
