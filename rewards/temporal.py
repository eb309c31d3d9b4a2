"""Temporal consistency of a video: VBench's subject consistency (Huang et al., CVPR 2024).

VBench (Vchitect/VBench ``vbench/subject_consistency.py``) embeds every frame with DINO ViT-B/16
(the [CLS] output after the final LayerNorm, L2-normalised) and scores a video of F frames as

    S = 1 / (F - 1) * sum_{i=1..F-1} ( max(0, cos(f_i, f_{i-1})) + max(0, cos(f_i, f_0)) ) / 2,

the mean similarity of each frame to the previous one and to the first one, in [0, 1]: 1 for a
static video, lower when the subject's appearance drifts or jumps. Components ``adjacent`` and
``first_frame`` are the two means.

Preprocessing as VBench's ``dino_transform(224)``: the shorter side resized to 224 (bilinear, no
antialiasing, long side ``int(224 * long / short)``, no crop), ImageNet mean / std; DINO interpolates
its position embeddings for the non-square input (transformers' ``interpolate_pos_encoding``).

Weights: a transformers ``ViTModel`` of DINO ViT-B/16, hub id ``facebook/dino-vitb16`` or a local folder.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import RewardOutput
from .clip_common import positive_int, resolve_device
from .pickscore import from_pretrained

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: VBench's ``dino_transform(224)``: the shorter side in pixels
SHORT_SIDE = 224


def consistency(features: Tensor) -> dict[str, Tensor]:
    """L2-normalised frame features [F, D] (F >= 2) -> {"score", "adjacent", "first_frame"} (0-d tensors)."""
    adjacent = (features[1:] * features[:-1]).sum(-1).clamp(min=0)
    first = (features[1:] * features[:1]).sum(-1).clamp(min=0)
    return {"score": ((adjacent + first) / 2).mean(), "adjacent": adjacent.mean(), "first_frame": first.mean()}


class TemporalConsistencyReward:
    """``reward(videos [B, F, 3, H, W] (or B tensors [F, 3, H, W]) in [0, 1], prompts [B]) -> [B]`` in [0, 1].

    Options: ``model`` (hub id or folder of a transformers ViTModel, "facebook/dino-vitb16"),
    ``size`` (the shorter side the frames are resized to, 224 as VBench), ``device``, ``batch_size``
    (frames per forward). Prompts are not read.
    """

    name = "temporal_consistency"
    takes_videos = True

    def __init__(self, model: str = "facebook/dino-vitb16", size: int = SHORT_SIDE, device: str | None = None,
                 batch_size: int = 64):
        from transformers import ViTModel

        self.device = resolve_device(device)
        self.size = positive_int("temporal_consistency size", size)
        self.batch_size = positive_int("temporal_consistency batch_size", batch_size)
        self.model = from_pretrained(lambda ref: ViTModel.from_pretrained(ref, add_pooling_layer=False), model,
                                     "temporal_consistency model").to(self.device).eval()

    def pixels(self, frames: Tensor) -> Tensor:
        """Frames [n, 3, H, W] in [0, 1] -> [n, 3, h, w], shorter side ``size``, ImageNet-normalised."""
        h, w = frames.shape[-2:]
        short, long = min(h, w), max(h, w)
        new_long = int(self.size * long / short)
        size = (self.size, new_long) if h <= w else (new_long, self.size)
        x = frames.float()
        if tuple(size) != (h, w):
            x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=False)
        mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    def features(self, frames: Tensor) -> Tensor:
        """Frames [n, 3, H, W] in [0, 1] -> L2-normalised DINO [CLS] features [n, D]."""
        out = []
        for i in range(0, frames.shape[0], self.batch_size):
            x = self.pixels(frames[i:i + self.batch_size].to(self.device))
            cls = self.model(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state[:, 0]
            out.append(F.normalize(cls.float(), dim=-1))
        return torch.cat(out)

    @torch.no_grad()
    def __call__(self, videos, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        if isinstance(videos, Tensor) and videos.ndim != 5:
            raise ValueError(f"temporal_consistency scores videos [B, F, 3, H, W]; got {tuple(videos.shape)}")
        videos = list(videos)
        if any(v.ndim != 4 or v.shape[1] != 3 or v.shape[0] < 2 for v in videos):
            raise ValueError("temporal_consistency scores videos [F, 3, H, W] of at least 2 frames; got "
                             f"{[tuple(v.shape) for v in videos]}")
        parts = [consistency(self.features(v)) for v in videos]
        if not parts:
            return RewardOutput(torch.zeros(0))
        merged = {k: torch.stack([p[k] for p in parts]).cpu() for k in parts[0]}
        return RewardOutput(merged.pop("score"), merged)
