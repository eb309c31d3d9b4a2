"""Tiny random pipelines of the families the generic adapter trains, built offline (tests, benchmarks).

* SD3.5-Large: ``StableDiffusion3Pipeline`` with SD3.5-Large's transformer layout (no dual-attention
  blocks, RMS q/k norm, more heads than the SD3.5-M flavour of :mod:`~flowgrpo.policies.tiny.sd3`);
* Z-Image: ``ZImagePipeline`` (``ZImageTransformer2DModel``, a ``Qwen3Model`` text encoder with a
  byte-level BPE tokenizer and a chat template built in memory, the 16-channel ``AutoencoderKL``);
* Qwen-Image: ``QwenImagePipeline`` (``QwenImageTransformer2DModel``, a
  ``Qwen2_5_VLForConditionalGeneration`` text encoder with a one-block vision tower over the same
  byte-level tokenizer, the video-style ``AutoencoderKLQwenImage`` with 4 latent channels). The
  pipeline's system-prompt template is long in bytes (about 144 tokens survive its fixed drop of 34),
  so ``max_sequence_length`` must exceed ~150 for prompts to reach the transformer;
* FLUX.2: ``Flux2Pipeline`` (``Flux2Transformer2DModel`` with one double- and one single-stream
  block, a 30-layer ``Mistral3ForConditionalGeneration`` 16 wide with a one-layer Pixtral vision
  tower, a ``PixtralProcessor`` over the byte-level tokenizer, a two-level ``AutoencoderKLFlux2``);
* the video families (Wan 2.2's two layouts, HunyuanVideo 1.5): :mod:`~flowgrpo.policies.tiny.families_video`;
* the image-editing families (FLUX.1-Kontext, Qwen-Image-Edit): :mod:`~flowgrpo.policies.tiny.families_edit`.

Each is deterministic in ``seed`` and leaves the caller's global RNG state untouched.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...registry import Registry
from .sd3 import _bytes_to_unicode, tiny_sd3_components

#: a minimal ChatML template (what ZImagePipeline's ``apply_chat_template`` needs)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


#: a Mistral-style chat template over message contents that are strings or lists of text parts
#: (what Flux2Pipeline's ``apply_chat_template`` hands the processor)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set text = m['content'] if m['content'] is string else "
    "(m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}"
    "[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}")


def _byte_bpe():
    """A ``tokenizers`` byte-level BPE over the 256 byte symbols, no merges (one token per byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = list(_bytes_to_unicode().values())
    bpe = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return bpe


def tiny_qwen_tokenizer(max_length: int = 64):
    """A byte-level BPE ``Qwen2Tokenizer`` over the 256 byte symbols (no merges) plus Qwen's chat specials."""
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer(tokenizer_object=_byte_bpe(), eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                         unk_token=None, bos_token=None, model_max_length=max_length)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_sd35_large_components(seed: int = 0) -> dict:
    """:func:`~flowgrpo.policies.tiny.sd3.tiny_sd3_components` with SD3.5-Large's transformer layout."""
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


def tiny_qwen_image_components(seed: int = 0) -> dict:
    """Random tiny ``QwenImagePipeline`` components (scheduler: the stock dynamic-shift flow-matching Euler)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = tiny_qwen_tokenizer(max_length=2048)
    n = len(tokenizer)  # the three vision markers sit just past the text vocabulary
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                vocab_size=n + 3, bos_token_id=None, eos_token_id=tokenizer.eos_token_id, max_position_embeddings=2048, rope_theta=1e6,
                rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                             out_hidden_size=16),
        vision_start_token_id=n, vision_end_token_id=n + 1, image_token_id=n + 2, video_token_id=n + 2,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 4)
        text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
        vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                     latents_std=[1.0] * 4).eval()
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "transformer": transformer, "vae": vae,
            "text_encoder": text_encoder, "tokenizer": tokenizer}


def tiny_pixtral_processor():
    """A ``PixtralProcessor`` (FLUX.2's ``tokenizer``) over a byte-level BPE tokenizer with Mistral's
    image and instruction specials and :data:`MISTRAL_TEMPLATE`."""
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=_byte_bpe(), bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", model_max_length=2048)
    tok.add_special_tokens({"additional_special_tokens": [
        "[IMG]", "[IMG_BREAK]", "[IMG_END]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"]})
    return PixtralProcessor(image_processor=PixtralImageProcessor(), tokenizer=tok, patch_size=16,
                            chat_template=MISTRAL_TEMPLATE)


def tiny_flux2_components(seed: int = 0) -> dict:
    """Random tiny ``Flux2Pipeline`` components. The text encoder has 30 layers (16 wide), so the
    pipeline's default ``text_encoder_out_layers=(10, 20, 30)`` applies as for the real model."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    processor = tiny_pixtral_processor()
    tok = processor.tokenizer
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                         max_position_embeddings=2048, num_attention_heads=2, num_hidden_layers=30,
                         num_key_value_heads=1, head_dim=8, rope_theta=1e6, sliding_window=None, **ids),
        vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=16, image_size=32, patch_size=16, head_dim=8),
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=1, vision_feature_layer=-1, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 5)
        text_encoder = Mistral3ForConditionalGeneration(config).eval()
        transformer = Flux2Transformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=3 * 16, timestep_guidance_channels=256, axes_dims_rope=[4] * 4)
        vae = AutoencoderKLFlux2(
            sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 8), layers_per_block=1,
            latent_channels=4, norm_num_groups=4, use_quant_conv=False, use_post_quant_conv=False).eval()
    return {"scheduler": FlowMatchEulerDiscreteScheduler(), "transformer": transformer, "vae": vae,
            "text_encoder": text_encoder, "tokenizer": processor}


#: tiny family name -> a builder ``seed -> pipeline`` (the stock pipeline class around random components)
TINY_PIPELINES: Registry = Registry("tiny pipeline family")


def register_tiny(name: str, pipeline_class: str, components) -> None:
    """Register ``name``: ``diffusers.<pipeline_class>(**components(seed))`` (a duplicate name is refused)."""
    def build(seed: int = 0):
        import diffusers

        return getattr(diffusers, pipeline_class)(**components(seed))

    TINY_PIPELINES.register(name)(build)


register_tiny("sd35-large", "StableDiffusion3Pipeline", tiny_sd35_large_components)
register_tiny("z-image", "ZImagePipeline", tiny_zimage_components)
register_tiny("qwen-image", "QwenImagePipeline", tiny_qwen_image_components)
register_tiny("flux2", "Flux2Pipeline", tiny_flux2_components)
TINY_PIPELINES.register_lazy("wan22-a14b", "flowgrpo.policies.tiny.families_video:tiny_wan22_a14b_pipeline")
TINY_PIPELINES.register_lazy("wan22-5b", "flowgrpo.policies.tiny.families_video:tiny_wan22_5b_pipeline")
TINY_PIPELINES.register_lazy("hunyuan-video15", "flowgrpo.policies.tiny.families_video:tiny_hunyuan_video15_pipeline")
TINY_PIPELINES.register_lazy("flux-kontext", "flowgrpo.policies.tiny.families_edit:tiny_flux_kontext_pipeline")
TINY_PIPELINES.register_lazy("qwen-image-edit", "flowgrpo.policies.tiny.families_edit:tiny_qwen_image_edit_pipeline")


def save_tiny_pipeline(family: str, directory: str | Path, seed: int = 0) -> Path:
    """Write the tiny pipeline of ``family`` (a name in :data:`TINY_PIPELINES`) with ``save_pretrained``."""
    directory = Path(directory)
    TINY_PIPELINES.build(family, seed).save_pretrained(str(directory))
    return directory
