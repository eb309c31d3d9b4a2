"""GenEval's colour rule: zero-shot CLIP over ten colours on each object's masked crop.

As ``evaluate_images.py`` (djghosh13/geneval, lines 81-127) with clip_benchmark's zero-shot classifier:

* **Crop** (ei:94-106): the image (RGB) composited with the object's mask over a flat ``#999``
  (153, 153, 153) background, then cut to the object's box with PIL's ``crop`` (coordinates
  rounded half to even, as PIL rounds them), then the model's eval transform (open_clip's
  ``image_transform``: shorter side to 224 bicubic, centre crop, CLIP mean / std).
* **Classes** (ei:109-119): per object class, each colour c's text embedding is the mean of the
  L2-normalised embeddings of "a photo of a {c} {class}", "a photo of a {c}-colored {class}" and
  "a photo of a {c} object", normalised again.
* **Verdict**: the colour whose text embedding has the largest cosine with the crop's normalised
  image embedding (``100 x`` the cosine in clip_benchmark; the factor does not change the argmax).
  On CUDA the model runs under float16 autocast, as clip_benchmark's ``amp=True``; on the CPU in float32.

Weights: open_clip ``ViT-L-14`` with ``openai`` weights (a pretrained tag read from the hub cache, or a
checkpoint file), loaded by :func:`~flowgrpo.rewards.clip_common.load_open_clip`.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from ..clip_common import load_open_clip, open_clip_image_cfg
from .scorer import COLOURS

TEMPLATES: tuple[str, ...] = ("a photo of a {c} {name}", "a photo of a {c}-colored {name}", "a photo of a {c} object")
#: ei:84, the ``bgcolor`` option's default
BACKGROUND = (153, 153, 153)


def masked_crop(image: np.ndarray, box, mask: np.ndarray | None):
    """The PIL image GenEval classifies for one object: ``image`` uint8 [H, W, 3] RGB where ``mask``
    [H, W] bool is set, #999 elsewhere (no mask: the image as is), cut to ``box`` (x1, y1, x2, y2, ...)."""
    from PIL import Image

    pil = Image.fromarray(np.ascontiguousarray(image, np.uint8))
    if mask is not None:
        pil = Image.composite(pil, Image.new("RGB", pil.size, BACKGROUND), Image.fromarray(np.asarray(mask, bool)))
    return pil.crop(tuple(float(v) for v in box[:4]))


class ColourClassifier:
    """``classifier(crops: list[PIL], classnames: list[str]) -> colour names`` (module docstring).

    Args:
        model_name, pretrained: the open_clip architecture and its weights (tag or file).
        device: where CLIP runs. batch_size: crops per forward pass.
        what: the option named in loading errors (``reward.options.geneval.clip_pretrained``).
    """

    def __init__(self, model_name: str = "ViT-L-14", pretrained: str | None = "openai",
                 device: torch.device | None = None, batch_size: int = 16, what: str = "open_clip model"):
        from open_clip import image_transform

        self.device = device or torch.device("cpu")
        self.batch_size = int(batch_size)
        self.model, self.tokenizer = load_open_clip(model_name, pretrained, self.device, what=what)
        cfg = open_clip_image_cfg(self.model)
        self.transform = image_transform(cfg["size"], is_train=False, mean=cfg["mean"], std=cfg["std"],
                                         resize_mode=cfg["mode"], interpolation=cfg["interpolation"])
        self._classes: dict[str, torch.Tensor] = {}

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.float16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def colour_embeddings(self, name: str) -> torch.Tensor:
        """The ten colours' text embeddings for objects of class ``name``: [D, 10], columns unit length."""
        if name not in self._classes:
            columns = []
            with self._autocast():
                for colour in COLOURS:
                    texts = self.tokenizer([t.format(c=colour, name=name) for t in TEMPLATES]).to(self.device)
                    mean = F.normalize(self.model.encode_text(texts), dim=-1).mean(dim=0)
                    columns.append(mean / mean.norm())
            self._classes[name] = torch.stack(columns, dim=1)
        return self._classes[name]

    @torch.no_grad()
    def __call__(self, crops: list, classnames: list[str]) -> list[str]:
        """The colour of each crop (a PIL image) of an object of class ``classnames[i]``."""
        out: list[str] = []
        for start in range(0, len(crops), self.batch_size):
            part = crops[start:start + self.batch_size]
            pixels = torch.stack([self.transform(c) for c in part]).to(self.device)
            with self._autocast():
                features = F.normalize(self.model.encode_image(pixels), dim=-1)
                for f, name in zip(features, classnames[start:start + self.batch_size]):
                    logits = 100.0 * f @ self.colour_embeddings(name)
                    out.append(COLOURS[int(logits.float().argmax())])
        return out
