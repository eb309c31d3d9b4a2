"""The reward server's wire protocol, shared by the client (:mod:`flowgrpo.rewards.remote`) and the
server (:mod:`flowgrpo.serve`). JSON only, never pickle::

    POST /score   {"prompts": [str], "images": [base64 PNG or JPEG], "groups": [int] (optional),
                   "references": [base64 PNG or JPEG] (optional)}
               -> {"scores": [float | null], "components": {name: [float | null]}}

``references`` (image editing): each image's reference image (its prompt's source image), one per
image, for a reward that compares the two (``wants_references``); the server resizes each to its
image's size before scoring, as the trainer does.

Errors are ``{"error": "<one line>"}``. This module lives beside the client rather than in
``flowgrpo.serve`` because the server builds rewards (``flowgrpo.serve`` imports
``flowgrpo.rewards``): a protocol module under ``serve`` imported by the client would make the two
folders import each other.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from flowgrpo.images import png_bytes, to_uint8

#: the image formats a server decodes (anything else is a 400)
IMAGE_FORMATS = ("PNG", "JPEG")
#: the fields of a ``/score`` body
FIELDS = ("prompts", "images", "groups", "references")


def encode_png_b64(images: Tensor) -> list[str]:
    """images [B, 3, H, W] float in [0, 1] -> B base64 strings of 8-bit RGB PNGs (lossless)."""
    return [base64.b64encode(png_bytes(img)).decode("ascii") for img in to_uint8(images)]


def pack_groups(keys: Sequence[Hashable], limit: int) -> list[list[int]]:
    """Indices [B] packed into chunks of at most ``limit`` that never split a key's members.

    Keys (group ids or prompts) are taken in order of first appearance; a key with more than
    ``limit`` members forms a chunk of its own. Returns lists of indices into ``keys``. The client
    cuts its requests this way and the server its batches, so a group is always scored whole.
    """
    members: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)
    chunks: list[list[int]] = []
    cur: list[int] = []
    for idx in members.values():
        if cur and len(cur) + len(idx) > limit:
            chunks.append(cur)
            cur = []
        cur = cur + idx
    if cur:
        chunks.append(cur)
    return chunks


def one_line(text: object, limit: int = 300) -> str:
    """``text`` with all whitespace runs collapsed to one space, cut to ``limit`` characters."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def json_floats(values: Tensor) -> list[float | None]:
    """A float tensor [B] -> a JSON-safe list: NaN and +-inf become ``null``."""
    return [v if math.isfinite(v) else None for v in values.detach().float().cpu().tolist()]


def parse_floats(values, n: int, what: str) -> Tensor:
    """The inverse of :func:`json_floats`: a list of ``n`` numbers or ``null`` -> float32 [n] (null:
    NaN). Anything else raises ValueError naming ``what``: a non-number, and a number that is not a
    finite float32 (``1e39``, ``1e400``): the protocol's failed sample is ``null``, and a score that
    turned into inf here would silently drop its sample as if it had failed."""
    if not isinstance(values, list) or len(values) != n:
        raise ValueError(f"{what} is not a list of {n} numbers")
    if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
        raise ValueError(f"{what} holds something other than numbers and null")
    try:
        out = torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float32)
    except OverflowError:  # an integer beyond float64
        raise ValueError(f"{what} holds a number beyond float32's range") from None
    given = torch.tensor([v is not None for v in values], dtype=torch.bool)
    if not bool(torch.isfinite(out[given]).all()):
        raise ValueError(f"{what} holds a number that is not a finite float32 (a failed sample is null)")
    return out
