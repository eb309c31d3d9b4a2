"""PickScore (Kirstain et al., 2023): a CLIP ViT-H/14 fine-tuned on Pick-a-Pic preferences.

Score as the PickScore authors compute it: L2-normalised image and text embeddings of the
transformers ``CLIPModel`` ``yuvalkirstain/PickScore_v1``, ``logit_scale.exp() * cosine`` (about
100 x cosine, typical values 18-24). Text goes through the processor's tokenizer with
``padding=True, truncation=True, max_length=77``; the processor defaults to
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` as in the authors' example.

Preprocessing: ``preprocess="tensor"`` (default) follows the processor's image settings on tensors,
on the reward's device: shorter side to ``size["shortest_edge"]`` (bicubic, antialiased), centre
crop to ``crop_size`` with transformers' offset ``(d // 2)``, ``image_mean`` / ``image_std``. The
processor itself works on uint8 images (PIL's bicubic, or torchvision's on uint8 tensors in
transformers 5), so its pixels differ by about one uint8 level. ``preprocess="pil"`` converts the
tensors to PIL images (``round(255 x)``) and runs the processor's image processor itself.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from flowgrpo.errors import UserError

from .clip_common import (PREPROCESS_MODES, ClipReward, check_choice, clip_pixels, first_line, positive_int,
                          resolve_device)


def _is_local(ref: str) -> bool:
    """A local folder (exists, or is written like a path) rather than a hub id "org/name"."""
    s = str(ref)
    return Path(s).expanduser().exists() or s.startswith(("/", ".", "~")) or s.count("/") != 1 or "\\" in s


def from_pretrained(loader, ref: str, what: str):
    """``loader(ref)`` (a transformers ``from_pretrained``) with one-line UserErrors naming ``ref``."""
    ref = str(ref)
    if _is_local(ref):
        path = Path(ref).expanduser()
        if not path.is_dir():
            raise UserError(f"{what}: no such folder {str(path)!r}")
        ref = str(path)
    try:
        return loader(ref)
    except Exception as exc:
        where = "folder" if _is_local(ref) else "hub id (not in the local hub cache while offline?)"
        raise UserError(f"{what}: cannot load {where} {ref!r} ({first_line(exc)})") from None


def _embedding(out) -> Tensor:
    """``get_*_features`` returns a tensor (transformers 4) or an output with ``pooler_output`` (5)."""
    return out if isinstance(out, Tensor) else out.pooler_output


class PickScoreReward(ClipReward):
    """``reward(images [B, 3, H, W] in [0, 1], prompts [B]) -> logit_scale.exp() * cosine [B]``.

    Options: ``model`` (hub id or local folder of a transformers CLIPModel, "yuvalkirstain/PickScore_v1"),
    ``processor`` (hub id or folder, "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"), ``device``,
    ``batch_size``, ``preprocess`` ("tensor" | "pil").
    """

    name = "pickscore"

    def __init__(self, model: str = "yuvalkirstain/PickScore_v1",
                 processor: str = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", device: str | None = None,
                 batch_size: int = 16, preprocess: str = "tensor"):
        from transformers import AutoProcessor, CLIPModel

        self.device = resolve_device(device)
        self.batch_size = positive_int("pickscore batch_size", batch_size)
        self.preprocess = check_choice("pickscore preprocess", preprocess, PREPROCESS_MODES)
        self.model = from_pretrained(CLIPModel.from_pretrained, model, "pickscore model").to(self.device).eval()
        self.processor = from_pretrained(AutoProcessor.from_pretrained, processor, "pickscore processor")
        self.image_cfg = self._image_cfg(self.processor.image_processor)

    @staticmethod
    def _image_cfg(ip) -> dict:
        """Resize / crop / normalisation settings of a CLIP image processor (a dict or, in
        transformers 5, a ``SizeDict`` for ``size`` and ``crop_size``)."""
        def side(value):
            if isinstance(value, int):
                return value, "shortest"
            if value.get("shortest_edge"):
                return int(value.get("shortest_edge")), "shortest"
            return (int(value.get("height")), int(value.get("width"))), "squash"

        size, mode = side(ip.size)
        crop = getattr(ip, "crop_size", None) if getattr(ip, "do_center_crop", True) else None
        bilinear = int(getattr(ip, "resample", 3) or 3) == 2  # PILImageResampling.BILINEAR
        return {"size": size, "crop_size": None if crop is None else side(crop)[0], "mode": mode,
                "mean": tuple(ip.image_mean), "std": tuple(ip.image_std),
                "interpolation": "bilinear" if bilinear else "bicubic"}

    def tensor_pixels(self, images: Tensor) -> Tensor:
        """Images [b, 3, H, W] in [0, 1] -> [b, 3, 224, 224] as the processor's image settings."""
        c = self.image_cfg
        return clip_pixels(images, c["size"], c["mean"], c["std"], mode=c["mode"], crop="floor",
                           interpolation=c["interpolation"], crop_size=c["crop_size"])

    def pil_pixels(self, pils: list) -> Tensor:
        """PIL images -> [b, 3, 224, 224] through the processor's image processor."""
        return self.processor.image_processor(pils, return_tensors="pt")["pixel_values"]

    def score_pixels(self, pixels: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """Processor-normalised pixels [b, 3, 224, 224] and b prompts -> {"score": [b], "cosine": [b]}."""
        text = self.processor.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        text = {k: v.to(self.device) for k, v in text.items()}
        image_emb = _embedding(self.model.get_image_features(pixel_values=pixels.to(self.model.dtype)))
        text_emb = _embedding(self.model.get_text_features(**text))
        image_emb = image_emb / image_emb.norm(dim=-1, keepdim=True)
        text_emb = text_emb / text_emb.norm(dim=-1, keepdim=True)
        cos = (image_emb * text_emb).sum(-1)
        return {"score": self.model.logit_scale.exp() * cos, "cosine": cos}
