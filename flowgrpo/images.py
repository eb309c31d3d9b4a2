"""Float images to 8-bit pixels, PNG bytes and grids, written once for every writer, reward and wire format.

Images are float tensors in [0, 1], channels first ([B, 3, H, W], or one [3, H, W]); their 8-bit
pixels are ``round(255 * clamp(x, 0, 1))``, computed in float32 whatever the input dtype, channels
last ([B, H, W, 3] / [H, W, 3] uint8 numpy), as PIL, imageio and the verifiers take them.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from torch import Tensor


def to_uint8(images: Tensor) -> np.ndarray:
    """[B, 3, H, W] (or one [3, H, W]) float in [0, 1] -> uint8 numpy [B, H, W, 3] (or [H, W, 3]),
    ``round(255 * clamp(x, 0, 1))`` in float32, on the CPU."""
    if images.ndim not in (3, 4):
        raise ValueError(f"to_uint8 takes [B, 3, H, W] or [3, H, W] images, got shape {tuple(images.shape)}")
    # one float copy (clamp), then in place: the reward server scores 4096^2 batches through this,
    # where each extra float32 temporary of 5 images is ~1 GB
    pixels = images.detach().float().clamp(0, 1).mul_(255).round_().to(torch.uint8)
    return pixels.permute(*((0, 2, 3, 1) if images.ndim == 4 else (1, 2, 0))).cpu().numpy()


def png_bytes(image: Tensor | np.ndarray, compress_level: int = 1) -> bytes:
    """PNG bytes (8-bit RGB, lossless) of one image: a float tensor [3, H, W] in [0, 1] (converted by
    :func:`to_uint8`) or uint8 pixels [H, W, 3]. ``compress_level``: zlib level 0-9 (1: fast; the
    pixels are the same at every level)."""
    from PIL import Image

    pixels = to_uint8(image) if isinstance(image, Tensor) else image
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


def image_grid(images: Tensor, ncol: int, pad: int = 2, scale: int = 1) -> np.ndarray:
    """images [N, 3, H, W] in [0, 1] -> uint8 grid [rows*(H+pad), ncol*(W+pad), 3] (white padding);
    ``scale`` > 1 enlarges each image by pixel repetition first."""
    n, _, h, w = images.shape
    if scale > 1:
        images = torch.nn.functional.interpolate(images, scale_factor=scale, mode="nearest")
        h, w = h * scale, w * scale
    rows = (n + ncol - 1) // ncol
    grid = np.full((rows * (h + pad) + pad, ncol * (w + pad) + pad, 3), 255, dtype=np.uint8)
    arr = to_uint8(images)
    for i in range(n):
        r, c = divmod(i, ncol)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = arr[i]
    return grid
