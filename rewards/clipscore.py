"""CLIPScore: image-text agreement of any open_clip model (architecture + pretrained tag or checkpoint).

``formula="clipscore"`` (default): the published metric, CLIPScore (Hessel et al., 2021),
``2.5 * max(cos, 0)`` of the L2-normalised image and text embeddings, with the prompt prefixed by
"A photo depicts " as in the paper's reference code (``prefix`` overrides). ``formula="cosine"``:
the raw cosine, unclamped and unscaled, without a prefix (opt-in: it is not the published metric).
The result is multiplied by ``scale``; the raw cosine is always the component ``cosine``.

Preprocessing: ``preprocess="tensor"`` (default) resizes on the reward's device as open_clip's eval
transform does (the model's ``preprocess_cfg``: shorter side to 224, bicubic, centre crop, mean/std)
but with torch's antialiased bicubic on float pixels instead of PIL's on uint8, so pixels differ by
about one uint8 level; ``preprocess="pil"`` runs open_clip's own transform on PIL images.
"""

from __future__ import annotations

from torch import Tensor

from .clip_common import (PREPROCESS_MODES, OpenClipReward, check_choice, load_open_clip, open_clip_image_cfg,
                          positive_int, resolve_device)

FORMULAS = ("cosine", "clipscore")
PAPER_PREFIX = "A photo depicts "


class CLIPScoreReward(OpenClipReward):
    """``reward(images [B, 3, H, W] in [0, 1], prompts [B]) -> scale * f(cos)`` for an open_clip model.

    Options: ``model_name`` (open_clip architecture, "ViT-L-14"), ``pretrained`` (a tag such as
    "openai" or a checkpoint path), ``device``, ``batch_size``, ``scale`` (1.0, a multiplier),
    ``formula`` ("clipscore": the paper's ``2.5 * max(cos, 0)``, default | "cosine": the raw cosine),
    ``prefix`` (prepended to prompts; default "A photo depicts " for "clipscore", "" for "cosine"),
    ``preprocess`` ("tensor" | "pil"), ``quick_gelu`` (None: as the pretrained tag says, e.g. True
    for "openai"; set it for a checkpoint of a QuickGELU model).
    """

    name = "clipscore"

    def __init__(self, model_name: str = "ViT-L-14", pretrained: str = "openai", device: str | None = None,
                 batch_size: int = 16, scale: float = 1.0, formula: str = "clipscore", prefix: str | None = None,
                 preprocess: str = "tensor", quick_gelu: bool | None = None):
        self.device = resolve_device(device)
        self.batch_size = positive_int("clipscore batch_size", batch_size)
        self.formula = check_choice("clipscore formula", formula, FORMULAS)
        self.preprocess = check_choice("clipscore preprocess", preprocess, PREPROCESS_MODES)
        self.scale = float(scale)
        self.prefix = (PAPER_PREFIX if formula == "clipscore" else "") if prefix is None else str(prefix)
        self.model, self.tokenizer = load_open_clip(model_name, pretrained, self.device, quick_gelu,
                                                    what="clipscore model")
        self.image_cfg = open_clip_image_cfg(self.model)

    def score_pixels(self, pixels: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """CLIP input [b, 3, S, S] and b prompts -> {"score": [b], "cosine": [b]}."""
        cos = self.cosine(pixels, [self.prefix + p for p in prompts])
        score = 2.5 * cos.clamp(min=0) if self.formula == "clipscore" else cos
        return {"score": self.scale * score, "cosine": cos}
