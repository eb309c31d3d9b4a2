"""Tiny random pipelines of the families the generic adapter trains, built offline (tests, benchmarks).

* SD3.5-Large: ``StableDiffusion3Pipeline`` with SD3.5-Large's transformer layout (no dual-attention
  blocks, RMS q/k norm, more heads than the SD3.5-M flavour of :mod:`~flowgrpo.policies.sd3_tiny`);
* Z-Image: ``ZImagePipeline`` (``ZImageTransformer2DModel``, a ``Qwen3Model`` text encoder with a
  byte-level BPE tokenizer and a chat template built in memory, the 16-channel ``AutoencoderKL``).

Each is deterministic in ``seed`` and leaves the caller's global RNG state untouched.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .sd3_tiny import _bytes_to_unicode, tiny_sd3_components

#: a minimal ChatML template (what ZImagePipeline's ``apply_chat_template`` needs)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen_tokenizer(max_length: int = 64):
    """A byte-level BPE ``Qwen2Tokenizer`` over the 256 byte symbols (no merges) plus Qwen's chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2Tokenizer

    symbols = list(_bytes_to_unicode().values())
    bpe = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = Qwen2Tokenizer(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                         unk_token=None, bos_token=None, model_max_length=max_length)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_sd35_large_components(seed: int = 0) -> dict:
    """:func:`~flowgrpo.policies.sd3_tiny.tiny_sd3_components` with SD3.5-Large's transformer layout."""
    from diffusers import SD3Transformer2DModel

    comps = tiny_sd3_components(seed)
    old = comps["transformer"].config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        comps["transformer"] = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=3, attention_head_dim=8,
            num_attention_heads=6, caption_projection_dim=48, joint_attention_dim=old.joint_attention_dim,
            pooled_projection_dim=old.pooled_projection_dim, pos_embed_max_size=32, qk_norm="rms_norm")
    return comps


def tiny_zimage_components(seed: int = 0) -> dict:
    """Random tiny ``ZImagePipeline`` components (scheduler: Z-Image's dynamic-shift flow-matching Euler)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = tiny_qwen_tokenizer()
    sd3 = tiny_sd3_components(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 3)
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id)).eval()
        transformer = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    return {"scheduler": scheduler, "transformer": transformer, "vae": sd3["vae"], "text_encoder": text_encoder,
            "tokenizer": tokenizer}


def save_tiny_pipeline(family: str, directory: str | Path, seed: int = 0) -> Path:
    """Write the tiny pipeline of ``family`` ("sd35-large" or "z-image") with ``save_pretrained``."""
    from diffusers import StableDiffusion3Pipeline, ZImagePipeline

    builders = {"sd35-large": (StableDiffusion3Pipeline, tiny_sd35_large_components),
                "z-image": (ZImagePipeline, tiny_zimage_components)}
    if family not in builders:
        raise ValueError(f"unknown tiny family {family!r}; valid: {', '.join(builders)}")
    cls, components = builders[family]
    directory = Path(directory)
    cls(**components(seed)).save_pretrained(str(directory))
    return directory
