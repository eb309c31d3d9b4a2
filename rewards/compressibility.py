"""JPEG compressibility rewards (DDPO): the encoded size of each image."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from flowgrpo.images import to_uint8

from .base import RewardOutput


def jpeg_kilobytes(images: Tensor, quality: int = 95) -> Tensor:
    """Size in kB of each image [B, 3, H, W] in [0, 1] saved as JPEG at ``quality``. Returns [B]."""
    sizes = []
    for img in to_uint8(images):
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(img)).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility:
    """Reward = -(JPEG size in kB): smaller files score higher. Option ``quality`` (DDPO: 95)."""

    name = "jpeg_compressibility"
    #: PIL's JPEG quality scale (:func:`~flowgrpo.rewards.base.check_option_values`)
    option_ranges = {"quality": {"ge": 1, "le": 100}}

    def __init__(self, quality: int = 95):
        self.quality = int(quality)

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        kb = jpeg_kilobytes(images, self.quality)
        return RewardOutput(-kb, {"jpeg_kb": kb})


class JpegIncompressibility(JpegCompressibility):
    """Reward = +(JPEG size in kB): busier images score higher. Option ``quality`` (DDPO: 95)."""

    name = "jpeg_incompressibility"

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        kb = jpeg_kilobytes(images, self.quality)
        return RewardOutput(kb, {"jpeg_kb": kb})
