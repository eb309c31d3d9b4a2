"""What the Qwen2-VL reward models (HPSv3, VideoAlign) share: a reward head on Qwen2-VL's hidden states.

Both references subclass transformers' ``Qwen2VLForConditionalGeneration`` with a head ``rm_head`` on
the language model's last (normed) hidden states, read at special reward tokens of the prompt
(``<|Reward|>`` for HPSv3; ``<|VQ_reward|>``, ``<|MQ_reward|>``, ``<|TA_reward|>`` for VideoAlign).
Their ``forward`` embeds the tokens, scatters the vision tower's merged patch features into the
``<|image_pad|>`` / ``<|video_pad|>`` positions and calls the language model WITHOUT input ids or
grid sizes, so its rotary positions are the plain sequence positions 0, 1, 2, ... on all three M-RoPE
axes (not Qwen2-VL's 3-d vision positions). :class:`QwenVLRewardModel` does the same.

* :func:`convert_state_dict` turns a reference checkpoint into this module's keys: it strips PEFT's
  ``base_model.model.`` prefix, merges LoRA pairs (``W + scale * B @ A``, in float32), and renames the
  transformers 4.45 layout (``visual.*``, ``model.layers.*``) to the current one (``model.visual.*``,
  ``model.language_model.*``); the generation head ``lm_head`` is dropped (scoring never reads it).
* :func:`build_model` builds the backbone from a Qwen2-VL config on the meta device and loads the
  checkpoint strictly (a mismatch is one line naming the file).
* :func:`smart_resize` is qwen-vl-utils' choice of the input size (multiples of 28 px within a pixel
  budget); :func:`resize` applies it on tensors (antialiased bicubic on float pixels).

transformers is imported inside functions only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flowgrpo.errors import UserError

from .clip_common import empty_model, first_line, load_weights
from .pickscore import from_pretrained

#: Qwen2-VL's input side granularity: 14 px patches merged 2 x 2
SIZE_FACTOR = 28
_PEFT_PREFIX = "base_model.model."
#: transformers 4.45 key prefix -> the current one (``Qwen2VLModel`` holds ``visual`` and ``language_model``)
_RENAMES = (("visual.", "model.visual."), ("model.layers.", "model.language_model.layers."),
            ("model.embed_tokens.", "model.language_model.embed_tokens."), ("model.norm.", "model.language_model.norm."))


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int, factor: int = SIZE_FACTOR) -> tuple[int, int]:
    """(height, width) rounded to multiples of ``factor``, scaled (aspect kept) into [min_pixels, max_pixels]
    when the rounded area leaves it; the budget's upper bound is checked first, as qwen-vl-utils does."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio above 200: {height} x {width}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def resize(frames: Tensor, min_pixels: int, max_pixels: int) -> Tensor:
    """Frames [N, 3, H, W] in [0, 1] -> [N, 3, H', W'] at :func:`smart_resize`'s size (bicubic, antialiased, clamped)."""
    size = smart_resize(frames.shape[-2], frames.shape[-1], min_pixels, max_pixels)
    if tuple(frames.shape[-2:]) != size:
        frames = F.interpolate(frames.float(), size=size, mode="bicubic", align_corners=False, antialias=True)
    return frames.float().clamp(0, 1)


def convert_state_dict(sd: dict[str, Tensor], lora_scale: float | None = None) -> dict[str, Tensor]:
    """A reference checkpoint (plain, or PEFT-wrapped with LoRA) -> :class:`QwenVLRewardModel`'s keys."""
    if all(k.startswith(_PEFT_PREFIX) for k in sd):
        sd = {k[len(_PEFT_PREFIX):]: v for k, v in sd.items()}
    out: dict[str, Tensor] = {}
    for key, value in sd.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if ".base_layer." in key:
            stem, leaf = key.split(".base_layer.")
            a = next((sd[k] for k in (f"{stem}.lora_A.default.weight", f"{stem}.lora_A.weight") if k in sd), None)
            b = next((sd[k] for k in (f"{stem}.lora_B.default.weight", f"{stem}.lora_B.weight") if k in sd), None)
            if leaf == "weight" and a is not None and b is not None:
                if lora_scale is None:
                    raise UserError("the checkpoint holds LoRA weights but no LoRA scale is known (lora_alpha / r)")
                value = (value.float() + lora_scale * (b.float() @ a.float())).to(value.dtype)
            key = f"{stem}.{leaf}"
        out[key] = value
    renamed = {}
    for key, value in out.items():
        for old, new in _RENAMES:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        renamed[key] = value
    renamed.pop("lm_head.weight", None)
    return renamed


class QwenVLRewardModel(nn.Module):
    """Qwen2-VL backbone + ``rm_head``: :meth:`forward` -> head outputs at the reward tokens [B, K, out]."""

    def __init__(self, config, head: nn.Module):
        from transformers import Qwen2VLModel

        super().__init__()
        self.model = Qwen2VLModel(config)
        self.rm_head = head
        self.head_dtype = torch.float32

    def _vision(self, pixels: Tensor, grid: Tensor, kind: str) -> Tensor:
        """Merged patch features [tokens, D] of all images (or videos) of the batch."""
        fn = self.model.get_image_features if kind == "image" else self.model.get_video_features
        out = fn(pixels, grid)
        feats = getattr(out, "pooler_output", out)
        return torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats

    def forward(self, reward_token_ids: list[int], input_ids: Tensor, attention_mask: Tensor,
                pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None,
                pixel_values_videos: Tensor | None = None, video_grid_thw: Tensor | None = None, **_) -> Tensor:
        """Processor outputs (ids [B, L], mask [B, L], flattened patches) -> head outputs [B, K, out]
        at the K reward tokens of each sequence, in sequence order."""
        cfg = self.model.config
        embeds = self.model.get_input_embeddings()(input_ids)
        for pixels, grid, token, kind in ((pixel_values, image_grid_thw, cfg.image_token_id, "image"),
                                          (pixel_values_videos, video_grid_thw, cfg.video_token_id, "video")):
            if pixels is not None:
                feats = self._vision(pixels.to(embeds.dtype), grid, kind).to(embeds.dtype)
                embeds = embeds.masked_scatter((input_ids == token).unsqueeze(-1).expand_as(embeds), feats)
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        hidden = self.model.language_model(inputs_embeds=embeds, attention_mask=attention_mask,
                                           position_ids=positions.unsqueeze(0).expand(3, -1, -1)).last_hidden_state
        marks = torch.isin(input_ids, torch.tensor(reward_token_ids, device=input_ids.device))
        counts = marks.sum(-1)
        k = len(reward_token_ids)
        if not bool((counts == k).all()):
            raise ValueError(f"every sequence needs its {k} reward token(s) {reward_token_ids}; counts {counts.tolist()}")
        picked = hidden[marks].view(input_ids.shape[0], k, -1)
        return self.rm_head(picked.to(self.head_dtype))


def load_qwen2vl_config(base: str, what: str):
    """The ``Qwen2VLConfig`` of a hub id or folder; another model type is a one-line UserError."""
    from transformers import AutoConfig

    config = from_pretrained(AutoConfig.from_pretrained, base, what)
    if getattr(config, "model_type", None) != "qwen2_vl":
        raise UserError(f"{what}: {base!r} is a {getattr(config, 'model_type', '?')!r} model, not qwen2_vl")
    return config


def build_model(config, head_factory, sd: dict[str, Tensor], path, what: str, device: torch.device,
                dtype: torch.dtype, head_dtype: torch.dtype | None = None) -> QwenVLRewardModel:
    """The reward model with the (converted) checkpoint ``sd`` loaded strictly, in ``dtype`` (the head
    in ``head_dtype``, default ``dtype``); the text vocabulary follows the checkpoint's embedding rows
    (the references resize it after adding their tokens)."""
    embed = sd.get("model.language_model.embed_tokens.weight")
    if embed is None or embed.ndim != 2:
        raise UserError(f"{what}: {str(path)!r} has no Qwen2-VL token embedding (not a Qwen2-VL reward checkpoint)")
    text = getattr(config, "text_config", config)
    text.vocab_size = int(embed.shape[0])
    model = empty_model(lambda: QwenVLRewardModel(config, head_factory(int(text.hidden_size))))
    load_weights(model, sd, path, what, assign=True)
    model = model.to(device=device, dtype=dtype).eval()
    model.head_dtype = head_dtype or dtype
    model.rm_head.to(model.head_dtype)
    return model


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on CUDA (the references' precision), float32 elsewhere; else the named dtype."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    choices = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype not in choices:
        raise UserError(f"dtype must be auto, {', '.join(choices)}; got {dtype!r}")
    return choices[dtype]


def load_processor(base: str, special_tokens: list[str], what: str):
    """The base model's processor with ``special_tokens`` added to its tokenizer, as the references do;
    returns ``(processor, their ids)``."""
    from transformers import AutoProcessor

    processor = from_pretrained(AutoProcessor.from_pretrained, base, what)
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is None or getattr(processor, "image_processor", None) is None:
        raise UserError(f"{what}: {base!r} holds no Qwen2-VL processor (tokenizer + image processor)")
    try:
        tokenizer.padding_side = "right"
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot take the tokens
        raise UserError(f"{what}: cannot add {special_tokens} to the tokenizer of {base!r} ({first_line(exc)})") from None
    return processor, [int(i) for i in tokenizer.convert_tokens_to_ids(list(special_tokens))]


def encode(processor, texts: list[str], device: torch.device, images: list[Tensor] | None = None,
           videos: list[Tensor] | None = None) -> dict:
    """Processor inputs for chat ``texts`` with images [3, H, W] or videos [T, 3, H, W] in [0, 1],
    already at their model size (no resize, no rescale: the processor normalises and patchifies)."""
    kwargs = {"do_resize": False, "do_rescale": False}
    extra = {}
    if images is not None:
        extra = {"images": images, "images_kwargs": kwargs}
    if videos is not None:
        vkw = {**kwargs, "do_sample_frames": False}
        if hasattr(getattr(processor, "video_processor", None), "cap_pixels_per_frame"):
            vkw["cap_pixels_per_frame"] = False  # frames arrive at their size: no per-frame cap to apply
        extra = {"videos": videos, "videos_kwargs": vkw}
    batch = processor(text=texts, padding=True, return_tensors="pt", **extra)
    return {k: v.to(device) for k, v in batch.items() if isinstance(v, Tensor)}
