"""ImageReward (Xu et al., NeurIPS 2023): BLIP's ViT-L/16 and BERT cross-attention encoder with an MLP head.

Architecture (THUDM/ImageReward ``ImageReward/ImageReward.py``, ``models/BLIP``), assembled here from
transformers' BLIP components: the image goes through a ViT-L/16 at 224 px (BLIP's ``VisionTransformer``:
pre-norm blocks, fused qkv, exact GELU, LayerNorm eps 1e-6; transformers' ``BlipVisionModel``). The prompt,
tokenised with BERT's ``bert-base-uncased`` WordPiece (plus BLIP's added ``[DEC]`` / ``[ENC]`` specials,
vocabulary 30,524) padded to 35 tokens, goes through BLIP's 12-layer BERT whose every layer also
cross-attends to all image tokens (``BlipTextModel`` run bidirectionally with ``encoder_hidden_states``).
The text encoder's first-token state ([CLS], 768-d) feeds the MLP head, the same five linear layers
as the LAION aesthetic predictor (:class:`~flowgrpo.rewards.aesthetic.AestheticHead`). The score is
``(mlp - 0.16717362830052426) / 1.0333394966054072``, ImageReward's normalisation to its training
set's mean and spread (values roughly -2 to 2).

Weights: ``ImageReward.pt`` (hub repository ``THUDM/ImageReward``), ImageReward's own state dict
(``blip.visual_encoder.*``, ``blip.text_encoder.*``, ``mlp.layers.*``), renamed on load
(:func:`convert_state_dict`) and loaded strictly; BLIP's unused contrastive projections
(``blip.vision_proj``, ``blip.text_proj``) are skipped. ``med_config.json`` (same repository) may
override the text encoder's settings.

Preprocessing (tensor path): the authors' ``Resize(224, bicubic)`` of the shorter side, ``CenterCrop(224)``,
CLIP mean / std, on float pixels with antialiasing; ``preprocess="pil"`` runs torchvision's transform
on PIL images as the authors do.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from flowgrpo.errors import UserError
from flowgrpo.text_inputs import loads_json

from .aesthetic import AestheticHead
from .clip_common import (CLIP_MEAN, CLIP_STD, PREPROCESS_MODES, ClipReward, check_choice, clip_pixels,
                          empty_model, existing_file, first_line, load_state_dict_file, load_weights, positive_int,
                          resolve_device)
from .pickscore import from_pretrained

#: ImageReward's score normalisation (``ImageReward.__init__``: ``self.mean``, ``self.std``)
SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
#: prompts are padded / truncated to this many tokens (``ImageReward.score``)
MAX_TEXT_TOKENS = 35
#: BLIP's ``create_vit("large", 224)``: ViT-L/16 (transformers ``BlipVisionConfig`` names)
VIT_LARGE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                 image_size=224, patch_size=16, layer_norm_eps=1e-6, hidden_act="gelu")
#: ImageReward's ``med_config.json``: BERT-base with cross-attention (``BlipTextConfig`` names)
MED_CONFIG = dict(vocab_size=30524, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                  max_position_embeddings=512, layer_norm_eps=1e-12, pad_token_id=0)
#: ImageReward state dict prefix -> this module's
_RENAMES = (("blip.visual_encoder.", "vision."), ("blip.text_encoder.", "text."), ("mlp.layers.", "head.layers."))
_VIT_RENAMES = (("cls_token", "embeddings.class_embedding"), ("pos_embed", "embeddings.position_embedding"),
                ("patch_embed.proj.", "embeddings.patch_embedding."), ("norm.", "post_layernorm."))
_BLOCK_RENAMES = (("norm1.", "layer_norm1."), ("norm2.", "layer_norm2."), ("attn.qkv.", "self_attn.qkv."),
                  ("attn.proj.", "self_attn.projection."), ("mlp.", "mlp."))


def _vit_key(key: str) -> str:
    """A BLIP ``VisionTransformer`` parameter name -> ``BlipVisionModel``'s."""
    if key.startswith("blocks."):
        _, index, rest = key.split(".", 2)
        for old, new in _BLOCK_RENAMES:
            if rest.startswith(old):
                return f"encoder.layers.{index}.{new}{rest[len(old):]}"
        return key
    for old, new in _VIT_RENAMES:
        if key == old or key.startswith(old):
            return new + key[len(old):]
    return key


def convert_state_dict(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """ImageReward's state dict -> :class:`ImageRewardModel`'s keys. The contrastive projections
    and the text ``position_ids`` buffer, which scoring never reads, are dropped; any other key
    outside the three modules is kept, so a strict load reports it."""
    out = {}
    for key, value in sd.items():
        if key.startswith(("blip.vision_proj.", "blip.text_proj.")) or key.endswith("embeddings.position_ids"):
            continue
        for old, new in _RENAMES:
            if key.startswith(old):
                rest = key[len(old):]
                key = new + (_vit_key(rest) if new == "vision." else rest)
                break
        out[key] = value
    return out


class ImageRewardModel(nn.Module):
    """BLIP ViT + cross-attention BERT + MLP: ``(pixels [b, 3, S, S], ids [b, L], mask [b, L]) -> raw [b]``."""

    def __init__(self, vision: dict, text: dict):
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        super().__init__()
        self.vision = BlipVisionModel(BlipVisionConfig(**vision))
        text_cfg = BlipTextConfig(**{**text, "encoder_hidden_size": vision["hidden_size"]})
        self.text = BlipTextModel(text_cfg, add_pooling_layer=False)
        self.head = AestheticHead(text_cfg.hidden_size)

    def forward(self, pixels: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        image = self.vision(pixel_values=pixels).last_hidden_state  # [b, 1 + patches, Dv]
        image_mask = torch.ones(image.shape[:-1], dtype=torch.long, device=image.device)
        text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                         encoder_attention_mask=image_mask).last_hidden_state  # [b, L, Dt]
        return self.head(text[:, 0].float()).squeeze(-1)


def _json_overrides(path, defaults: dict, what: str) -> dict:
    """``defaults`` updated with the keys of the JSON file at ``path`` that ``defaults`` names (None: defaults)."""
    if path is None:
        return dict(defaults)
    p = existing_file(path, what)
    try:
        data = loads_json(p.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{what}: cannot read {str(p)!r} as JSON ({first_line(exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what}: {str(p)!r} is not a JSON object")
    return {**defaults, **{k: v for k, v in data.items() if k in defaults}}


def load_tokenizer(ref: str):
    """BERT's tokenizer with BLIP's ``[DEC]`` (bos) and ``[ENC]`` specials, as ImageReward's ``init_tokenizer``."""
    from transformers import BertTokenizer

    tok = from_pretrained(BertTokenizer.from_pretrained, ref, "imagereward tokenizer")
    if tok.bos_token != "[DEC]":
        tok.add_special_tokens({"bos_token": "[DEC]"})
    if "[ENC]" not in tok.get_vocab():
        tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tok


class ImageRewardReward(ClipReward):
    """``reward(images [B, 3, H, W] in [0, 1], prompts [B]) -> normalised ImageReward [B]``.

    Options: ``checkpoint`` (path to ``ImageReward.pt``; required), ``med_config`` (path to its
    ``med_config.json``; default: the v1.0 text encoder), ``vision_config`` (JSON overriding the
    ViT-L/16 settings, ``BlipVisionConfig`` names; for other BLIP sizes), ``tokenizer`` (hub id or
    folder, "bert-base-uncased"), ``device``, ``batch_size``, ``preprocess`` ("tensor" | "pil").
    Component ``raw``: the MLP output before normalisation.
    """

    name = "imagereward"

    def __init__(self, checkpoint: str, med_config: str | None = None, vision_config: str | None = None,
                 tokenizer: str = "bert-base-uncased", device: str | None = None, batch_size: int = 16,
                 preprocess: str = "tensor"):
        self.device = resolve_device(device)
        self.batch_size = positive_int("imagereward batch_size", batch_size)
        self.preprocess = check_choice("imagereward preprocess", preprocess, PREPROCESS_MODES)
        what = "imagereward checkpoint"
        sd = convert_state_dict(load_state_dict_file(checkpoint, what))
        vision = _json_overrides(vision_config, VIT_LARGE, "imagereward vision_config")
        text = _json_overrides(med_config, MED_CONFIG, "imagereward med_config")
        model = empty_model(lambda: ImageRewardModel(vision, text))
        load_weights(model, sd, Path(checkpoint), what, assign=True)
        self.model = model.to(self.device, torch.float32).eval()
        self.tokenizer = load_tokenizer(tokenizer)
        self.size = int(vision["image_size"])

    def tensor_pixels(self, images: Tensor) -> Tensor:
        """Images [b, 3, H, W] in [0, 1] -> [b, 3, 224, 224]: shorter side to 224 (bicubic), centre crop, CLIP mean/std."""
        return clip_pixels(images, self.size, CLIP_MEAN, CLIP_STD, mode="shortest", crop="round")

    def pil_pixels(self, pils: list) -> Tensor:
        """PIL images -> [b, 3, 224, 224] through the authors' torchvision transform."""
        from torchvision import transforms as T

        transform = T.Compose([T.Resize(self.size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(self.size),
                               T.ToTensor(), T.Normalize(CLIP_MEAN, CLIP_STD)])
        return torch.stack([transform(p.convert("RGB")) for p in pils])

    def score_pixels(self, pixels: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """Model input [b, 3, 224, 224] and b prompts -> {"score": normalised [b], "raw": MLP output [b]}."""
        text = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=MAX_TEXT_TOKENS,
                              return_tensors="pt")
        raw = self.model(pixels.to(self.device), text["input_ids"].to(self.device),
                         text["attention_mask"].to(self.device))
        return {"score": (raw - SCORE_MEAN) / SCORE_STD, "raw": raw}
