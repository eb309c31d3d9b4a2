"""LAION aesthetic predictor v2 ("improved aesthetic predictor"): an MLP on CLIP ViT-L/14 image embeddings.

The score is the head's output (roughly 1..10) on the L2-normalised image embedding of OpenAI's
CLIP ViT-L/14 (open_clip "ViT-L-14" with the "openai" tag, which runs with QuickGELU). The head is
the "sac+logos+ava1-l14-linearMSE" architecture: Linear(768, 1024) -> Dropout(0.2) ->
Linear(1024, 128) -> Dropout(0.2) -> Linear(128, 64) -> Dropout(0.1) -> Linear(64, 16) ->
Linear(16, 1), weights ``sac+logos+ava1-l14-linearMSE.pth`` (state dict keys ``layers.0.weight``
...); the input width is read from the file. The prompt is not used.

Preprocessing: as :mod:`flowgrpo.rewards.clipscore` (``preprocess="tensor"`` resizes float pixels
with antialiased bicubic; ``"pil"`` is open_clip's own eval transform, the same as OpenAI CLIP's
``preprocess`` used by the authors).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flowgrpo.errors import UserError

from .clip_common import (PREPROCESS_MODES, OpenClipReward, check_choice, load_open_clip, load_state_dict_file,
                          load_weights, open_clip_image_cfg, positive_int, resolve_device)


class AestheticHead(nn.Module):
    """The LAION aesthetic MLP: embeddings [B, D] -> scores [B, 1] (D = 768 for ViT-L/14)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def load_aesthetic_head(path, device: torch.device) -> AestheticHead:
    """The aesthetic head from a state dict file (input width from ``layers.0.weight``), in eval mode."""
    what = "aesthetic head"
    sd = load_state_dict_file(path, what)
    first = sd.get("layers.0.weight")
    if first is None or first.ndim != 2:
        raise UserError(f"{what}: {str(path)!r} has no 2-d 'layers.0.weight' (not an aesthetic-predictor MLP)")
    head = AestheticHead(int(first.shape[1]))
    load_weights(head, sd, path, what)
    return head.to(device).eval()


class AestheticReward(OpenClipReward):
    """``reward(images [B, 3, H, W] in [0, 1], prompts [B]) -> aesthetic score [B]`` (prompts unused).

    Options: ``head`` (path to ``sac+logos+ava1-l14-linearMSE.pth``; required), ``clip_model``
    (open_clip architecture, "ViT-L-14"), ``clip_pretrained`` (tag or checkpoint path, "openai"),
    ``device``, ``batch_size``, ``preprocess`` ("tensor" | "pil"), ``quick_gelu`` (None: as the tag says).
    """

    name = "aesthetic"

    def __init__(self, head: str, clip_model: str = "ViT-L-14", clip_pretrained: str = "openai",
                 device: str | None = None, batch_size: int = 16, preprocess: str = "tensor",
                 quick_gelu: bool | None = None):
        self.device = resolve_device(device)
        self.batch_size = positive_int("aesthetic batch_size", batch_size)
        self.preprocess = check_choice("aesthetic preprocess", preprocess, PREPROCESS_MODES)
        self.head = load_aesthetic_head(head, self.device)
        self.model, self.tokenizer = load_open_clip(clip_model, clip_pretrained, self.device, quick_gelu,
                                                    what="aesthetic CLIP model")
        self.image_cfg = open_clip_image_cfg(self.model)
        width = self.head.layers[0].in_features
        dim = int(self.model.visual.output_dim)
        if width != dim:
            raise UserError(f"aesthetic head {str(head)!r} takes {width}-d embeddings but {clip_model!r} gives {dim}-d")

    def score_pixels(self, pixels: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """CLIP input [b, 3, S, S] -> {"score": head(normalised image embedding) [b]}."""
        return {"score": self.head(self.image_embeddings(pixels).float()).squeeze(-1)}
