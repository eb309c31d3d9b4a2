"""Decoding and checking what a client sends to the reward server (JSON and PNG/JPEG only).

Every check raises :class:`RequestError` with an HTTP status and a one-line reason; nothing here
ever unpickles or evaluates client data.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

FORMATS = ("PNG", "JPEG")


class RequestError(Exception):
    """A bad request: ``status`` (400, 413, 415, 422, ...) and a one-line ``reason``."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class ScoreRequest:
    """A checked ``/score`` body: prompts [B], base64 images [B], groups [B] (or None)."""

    prompts: list[str]
    images: list[str]
    groups: list[int] | None


def parse_score_request(body: bytes) -> ScoreRequest:
    """The raw JSON body -> :class:`ScoreRequest`; malformed JSON is a 400, a wrong schema a 422."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"malformed JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise RequestError(422, "the body must be a JSON object with 'prompts' and 'images'")
    unknown = sorted(set(data) - {"prompts", "images", "groups"})
    if unknown:
        raise RequestError(422, f"unknown field(s) {', '.join(map(repr, unknown))}; expected prompts, images, groups")
    prompts, images, groups = data.get("prompts"), data.get("images"), data.get("groups")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError(422, "'prompts' must be a list of strings")
    if not isinstance(images, list) or not all(isinstance(s, str) for s in images):
        raise RequestError(422, "'images' must be a list of base64 strings (PNG or JPEG)")
    if len(prompts) != len(images):
        raise RequestError(422, f"{len(prompts)} prompts but {len(images)} images")
    if groups is not None:
        if not isinstance(groups, list) or not all(isinstance(g, int) and not isinstance(g, bool) for g in groups):
            raise RequestError(422, "'groups' must be a list of integers")
        if len(groups) != len(images):
            raise RequestError(422, f"{len(groups)} groups but {len(images)} images")
    return ScoreRequest(prompts, images, groups)


def decode_image(text: str, max_pixels: int, index: int = 0) -> Tensor:
    """One base64 PNG/JPEG -> float tensor [1, 3, H, W] in [0, 1] (``uint8 / 255``).

    The size is checked from the header before any pixel is decompressed (a decompression bomb is a
    413); anything that is not valid base64 or not a readable PNG/JPEG is a 400.
    """
    from PIL import Image

    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"image {index} is not valid base64") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw), formats=FORMATS) as im:
                w, h = im.size
                if w < 1 or h < 1 or w * h > max_pixels:
                    raise RequestError(413, f"image {index} is {w}x{h}: more than the server's limit of "
                                            f"{max_pixels} pixels")
                arr = np.asarray(im.convert("RGB"))
    except RequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise RequestError(413, f"image {index} is a decompression bomb") from None
    except Exception as exc:  # PIL raises many types for truncated or foreign data
        raise RequestError(400, f"image {index} is not a readable PNG or JPEG ({type(exc).__name__})") from None
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).unsqueeze(0).float().div_(255.0)


def json_floats(values: Tensor) -> list[float | None]:
    """A float tensor [B] -> a JSON-safe list: NaN and +-inf become ``null``."""
    return [v if math.isfinite(v) else None for v in values.detach().float().cpu().tolist()]
