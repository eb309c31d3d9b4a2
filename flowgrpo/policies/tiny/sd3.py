"""A tiny random Stable Diffusion 3 (3.5-Medium flavour) built offline, for tests and benchmarks.

Every component has the real architecture class and wiring of SD3 — ``SD3Transformer2DModel``
(MMDiT with one dual-attention block and RMS q/k-norm, as SD3.5-M), a 16-channel ``AutoencoderKL``
with an 8x downsampling, two ``CLIPTextModelWithProjection`` of different widths and a
``T5EncoderModel`` wider than both CLIPs (so the CLIP features are zero-padded as in the real
model) — but with a few thousand to a few hundred thousand random weights each.

Tokenizers are built without any hub access:

* CLIP: a real byte-level BPE ``CLIPTokenizer`` whose vocabulary is the first merges of CLIP's own
  BPE table (``bpe_simple_vocab_16e6.txt.gz``, shipped inside ``open_clip``); every string still
  tokenizes (byte fallback). Without open_clip, a bytes-only vocabulary is used.
* T5: a SentencePiece-style Unigram ``T5Tokenizer`` built from an in-memory ``vocab=`` list
  (characters, "▁"-prefixed characters and the whole words of the CLIP vocabulary above).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import itertools
from pathlib import Path

import torch

#: number of CLIP BPE merges kept in the tiny CLIP vocabulary (512 byte symbols + merges + 2 specials)
CLIP_MERGES = 2000
CLIP_MAX_LENGTH = 16
#: ``model.name=sd3-tiny``'s own image side and T5 tokens (used where the run leaves them unset)
TINY_RESOLUTION = 64
TINY_MAX_SEQUENCE_LENGTH = 32


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable unicode map of byte-level BPE (GPT-2 / CLIP)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _open_clip_bpe_file() -> Path | None:
    spec = importlib.util.find_spec("open_clip")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        path = Path(loc) / "bpe_simple_vocab_16e6.txt.gz"
        if path.exists():
            return path
    return None


@functools.lru_cache(maxsize=4)
def _clip_vocab_and_merges(num_merges: int) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    symbols = list(_bytes_to_unicode().values())
    merges: list[tuple[str, str]] = []
    path = _open_clip_bpe_file()
    if path is not None and num_merges > 0:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            next(fh)  # version header
            for line in itertools.islice(fh, num_merges):
                a, b = line.split()
                merges.append((a, b))
    vocab = symbols + [s + "</w>" for s in symbols] + [a + b for a, b in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return tuple(vocab), tuple(merges)


def tiny_clip_tokenizer(num_merges: int = CLIP_MERGES, max_length: int = CLIP_MAX_LENGTH):
    """A ``CLIPTokenizer`` over a truncated copy of CLIP's BPE table (built offline)."""
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab_and_merges(num_merges)
    return CLIPTokenizer(vocab={tok: i for i, tok in enumerate(vocab)}, merges=list(merges), model_max_length=max_length)


def tiny_t5_tokenizer(max_length: int = 256):
    """A Unigram ``T5Tokenizer`` (pad=0, </s>=1, <unk>=2) built from an in-memory vocabulary."""
    from transformers import T5Tokenizer

    vocab, _ = _clip_vocab_and_merges(CLIP_MERGES)
    words = sorted({t[:-4] for t in vocab if t.endswith("</w>") and len(t) > 5 and t[:-4].isascii() and t[:-4].isalpha()})
    chars = [chr(c) for c in range(33, 127)]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [(c, -4.0) for c in chars] + [("▁" + c, -4.0) for c in chars] + [("▁" + w, -2.0) for w in words]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def tiny_sd3_components(seed: int = 0, clip_max_length: int = CLIP_MAX_LENGTH, shift: float = 3.0) -> dict:
    """Random tiny SD3 components keyed as ``StableDiffusion3Pipeline`` expects, scheduler included
    (SD3's ``FlowMatchEulerDiscreteScheduler`` with timestep shift ``shift``; the stock value is 3).

    Deterministic in ``seed``; the caller's global RNG state is left untouched.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = tiny_clip_tokenizer(max_length=clip_max_length)
    tokenizer_2 = tiny_clip_tokenizer(max_length=clip_max_length)
    tokenizer_3 = tiny_t5_tokenizer()

    def clip(width: int):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, projection_dim=width,
            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=clip_max_length,
            hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )).eval()

    clip_1, clip_2, t5_width = 32, 48, 96  # real SD3: 768, 1280 (CLIP-L, CLIP-G) and 4096 (T5-XXL)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = clip(clip_1)
        text_encoder_2 = clip(clip_2)
        text_encoder_3 = T5EncoderModel(T5Config(
            vocab_size=len(tokenizer_3), d_model=t5_width, d_kv=24, d_ff=128, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
            feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
            pad_token_id=tokenizer_3.pad_token_id, eos_token_id=tokenizer_3.eos_token_id,
        )).eval()
        transformer = SD3Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
            attention_head_dim=16, num_attention_heads=4, caption_projection_dim=64,
            joint_attention_dim=t5_width, pooled_projection_dim=clip_1 + clip_2, pos_embed_max_size=32,
            dual_attention_layers=(0,), qk_norm="rms_norm",
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4, sample_size=64,
            scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
        ).eval()
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
        "transformer": transformer, "vae": vae,
        "text_encoder": text_encoder, "tokenizer": tokenizer,
        "text_encoder_2": text_encoder_2, "tokenizer_2": tokenizer_2,
        "text_encoder_3": text_encoder_3, "tokenizer_3": tokenizer_3,
    }


def tiny_sd3_pipeline(seed: int = 0, shift: float = 3.0):
    """A stock ``StableDiffusion3Pipeline`` around :func:`tiny_sd3_components` (same seed, same weights)."""
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline(**tiny_sd3_components(seed, shift=shift))


def build_tiny_sd3_policy(cfg):
    """Factory for ``model.name=sd3-tiny``: an :class:`~flowgrpo.policies.diffusers.sd3.SD3Policy` over random tiny
    weights. Unset ``model.resolution`` / ``model.max_sequence_length`` are this model's own
    :data:`TINY_RESOLUTION` / :data:`TINY_MAX_SEQUENCE_LENGTH` (SD3's 512 px would only slow it down)."""
    from ..diffusers.common import lora_options, set_model_options
    from ..diffusers.sd3 import SD3Policy
    from ..diffusers.switches import runtime_options, torch_dtype

    sizes = {"resolution": TINY_RESOLUTION, "max_sequence_length": TINY_MAX_SEQUENCE_LENGTH, **set_model_options(cfg)}
    return SD3Policy.from_components(
        tiny_sd3_components(seed=0), guidance_scale=cfg.guidance_scale, train_mode=cfg.train_mode,
        **lora_options(cfg), dtype=torch_dtype(cfg.dtype), **sizes,
        **runtime_options(cfg),
    )
