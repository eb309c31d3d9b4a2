"""Reference images of image-editing prompts: reading them, resizing them, handing them to pipelines.

A prompt file's ``image`` column (:func:`flowgrpo.data.load_prompt_file`) names one image
per prompt; :class:`~flowgrpo.data.PromptSource` draws them with the prompts as float tensors
[3, H, W] in [0, 1] at their own size. The policy of an edit pipeline resizes them to its resolution
and hands them to the pipeline as PIL images (:func:`to_pil`); rewards that ask for them
(``wants_references``) get them resized to the generated images' size (:func:`resize_references`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .errors import UserError


def read_reference(path: str | Path, where: str = "") -> Tensor:
    """The image at ``path`` as float32 [3, H, W] in [0, 1] (RGB; alpha dropped, greyscale repeated).
    A missing or unreadable file is a :class:`UserError` naming it (and ``where``, e.g. "prompts.jsonl:3")."""
    prefix = f"{where}: " if where else ""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{prefix}reference image not found: {path}")
    try:
        with Image.open(path) as im:
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise UserError(f"{prefix}cannot read reference image {path}: {exc}") from None
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1).float() / 255.0


def resize_references(refs: list[Tensor] | Tensor, height: int, width: int) -> Tensor:
    """References (a list of [3, h, w] or a tensor [B, 3, h, w], in [0, 1]) as one tensor [B, 3, height,
    width] in [0, 1]: bilinear with antialiasing where a size differs, untouched where it does not."""
    out = []
    for ref in refs:
        ref = ref.float()
        if tuple(ref.shape[-2:]) != (height, width):
            ref = torch.nn.functional.interpolate(ref[None], size=(height, width), mode="bilinear",
                                                  align_corners=False, antialias=True)[0]
        out.append(ref.clamp(0.0, 1.0))
    return torch.stack(out)


def quantize(refs: Tensor) -> Tensor:
    """[B, 3, H, W] in [0, 1] rounded to multiples of 1/255 (what :func:`to_pil` keeps exactly)."""
    return (refs.clamp(0.0, 1.0) * 255.0).round() / 255.0


def to_pil(refs: Tensor) -> list[Image.Image]:
    """[B, 3, H, W] in [0, 1] -> B RGB PIL images (rounded to 8 bits)."""
    arr = (refs.detach().float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in arr]


def probe_references(n: int, size: int) -> Tensor:
    """``n`` distinct deterministic images [n, 3, size, size] in [0, 1] (colour gradients, 8-bit exact):
    what an edit pipeline's probe and decode calls are given when no reference is at hand."""
    ramp = torch.linspace(0.0, 1.0, size)
    out = []
    for i in range(n):
        hue = torch.tensor([(i * 0.37) % 1.0, (0.2 + i * 0.61) % 1.0, (0.7 + i * 0.23) % 1.0]).reshape(3, 1, 1)
        out.append(0.5 * hue + 0.25 * ramp.reshape(1, 1, -1) + 0.25 * ramp.reshape(1, -1, 1).flip(1) * (i % 2))
    return quantize(torch.stack(out))
