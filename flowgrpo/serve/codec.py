"""Decoding and checking what a client sends to the reward server (JSON and PNG/JPEG only).

Every check raises :class:`RequestError` with an HTTP status and a one-line reason; nothing here
ever unpickles or evaluates client data. Memory is bounded before it is spent: the body's JSON
values are counted before it is parsed (a 60 MB body of 20 M empty lists would take 1.5 GiB as
Python objects), the number of images per request is checked after parsing, and every image's size
is read from its header (PNG IHDR, JPEG SOF) so that the request's decoded size is known before any
pixel is decompressed.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..rewards.wire import FIELDS, IMAGE_FORMATS

#: decoded bytes counted per pixel: float32 RGB, the tensor the reward receives (the server itself
#: holds uint8 until a batch is scored, a quarter of that)
DECODED_BYTES_PER_PIXEL = 3 * 4
MIB = 1024 * 1024

# The server's default limits (options of create_app and serve_reward).
DEFAULT_MAX_BODY_MB = 64
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
#: decoded images per request and per reward call, as float32 RGB: 64 images of 1024 x 1024 (768 MiB)
#: fit, as do five of 4096 x 4096 (192 MiB each)
DEFAULT_MAX_DECODED_MB = 1024
#: images per request: a pairwise reward judges up to 256 * 255 / 2 = 32,640 pairs
DEFAULT_MAX_IMAGES = 256
#: seconds for a whole request body to arrive (64 MiB at about 1 MiB/s)
DEFAULT_BODY_TIMEOUT_S = 60.0
#: decoded images of all requests in flight, counted as above: one request of the largest size at a
#: time, or about ten of 32 images of 512 x 512 (96 MiB each)
DEFAULT_MAX_INFLIGHT_MB = 1024
#: request bodies in flight (reserved at their Content-Length until answered): four of the largest
DEFAULT_MAX_BODIES_MB = 256
#: seconds a request waits for room in those budgets before it is refused (503, Retry-After)
DEFAULT_QUEUE_TIMEOUT_S = 10.0
#: seconds a connection gets to send a request's header block; open connections at most
#: (:mod:`flowgrpo.serve.guard`; the CLI raises the open-file limit above the latter)
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 256


class RequestError(Exception):
    """A bad request: ``status`` (400, 408, 413, 415, 422, ...) and a one-line ``reason``."""

    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers  # extra response headers (Retry-After on a 503)


@dataclass
class ScoreRequest:
    """A checked ``/score`` body: prompts [B], base64 images [B], groups [B] (or None), base64
    reference images [B] (or None; image editing)."""

    prompts: list[str]
    images: list[str]
    groups: list[int] | None
    references: list[str] | None = None


# a JSON string with its escapes: what is inside it is text, not structure
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def max_json_values(max_images: int, references: bool = False) -> int:
    """The most JSON values (as :func:`count_json_values` counts them) a ``/score`` body may hold: the
    object, its three lists of ``max_images`` each (four for a reward that takes ``references``), and
    some slack."""
    return (4 if references else 3) * max_images + 16


def count_json_values(body: bytes, enough: int = 0) -> int:
    """An upper bound on the values in the JSON text ``body`` (object keys aside): one plus the
    commas, ``[`` and ``{`` outside strings (a list or object holds one element more than the commas
    directly inside it).

    Counted first with the strings' contents included (base64 has none of these characters, so a
    usual body costs three ``bytes.count`` and allocates nothing); only when that exceeds ``enough`` are
    the strings blanked out and the rest counted again (one copy of the structure without them).
    """
    def structure(text: bytes) -> int:
        return 1 + text.count(b",") + text.count(b"[") + text.count(b"{")

    rough = structure(body)
    return rough if rough <= enough else structure(_JSON_STRING.sub(b'""', body))


def parse_score_request(body: bytes, max_images: int | None = None,
                        wants_references: bool = False) -> ScoreRequest:
    """The raw JSON body -> :class:`ScoreRequest`; a body with more JSON values than a request of
    ``max_images`` images can hold is a 413 before it is parsed, malformed JSON a 400, a wrong schema
    a 422, more than ``max_images`` images a 413. ``wants_references``: whether the reward takes reference
    images (then a body must carry them, else it must not)."""
    wants = wants_references
    limit = max_json_values(max_images, wants) if max_images is not None else None
    if limit is not None and count_json_values(body, limit) > limit:
        # each value is a Python object once parsed: 20 M empty lists in 60 MB took 1.5 GiB
        raise RequestError(413, f"the body holds more than {limit} JSON values (lists, objects, strings or "
                                f"numbers): a request holds at most {max_images} images (max_images) with their "
                                f"prompts and groups; send fewer per request")
    try:
        data = json.loads(body)
    except RecursionError:  # "[[[[..." a few KB deep: the parser's recursion limit, not a server fault
        raise RequestError(400, "malformed JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"malformed JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise RequestError(422, "the body must be a JSON object with 'prompts' and 'images'")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise RequestError(422, f"unknown field(s) {', '.join(map(repr, unknown))}; expected {', '.join(FIELDS)}")
    prompts, images, groups, references = (data.get(k) for k in FIELDS)
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
    if references is not None:
        if not wants:
            raise RequestError(422, "this server's reward takes no reference images; leave out 'references'")
        if not isinstance(references, list) or not all(isinstance(s, str) for s in references):
            raise RequestError(422, "'references' must be a list of base64 strings (PNG or JPEG), one per image")
        if len(references) != len(images):
            raise RequestError(422, f"{len(references)} references but {len(images)} images")
    elif wants:
        raise RequestError(422, "this server's reward compares each image with its reference image: send "
                                "'references' (one base64 PNG or JPEG per image)")
    if max_images is not None and len(images) > max_images:
        # pairwise rewards judge every pair of a group: memory and time grow with the square
        raise RequestError(413, f"the request holds {len(images)} images, more than the server's limit of "
                                f"{max_images} per request (max_images); send fewer per request")
    return ScoreRequest(prompts, images, groups, references)


def decoded_bytes(image: Tensor) -> int:
    """What an image [1, 3, H, W] counts against the decoded-size limits (float32 RGB)."""
    return image.shape[-1] * image.shape[-2] * DECODED_BYTES_PER_PIXEL


def open_images(texts: list[str], max_pixels: int, max_bytes: int) -> tuple[list, int]:
    """Base64 PNG/JPEG images -> (PIL images whose headers are read and whose pixels are not, the
    request's decoded size in bytes, see :data:`DECODED_BYTES_PER_PIXEL`).

    An image over ``max_pixels`` (W * H; decompression bombs included) or a request whose images
    would decode to more than ``max_bytes`` is a 413; anything that is not valid base64 or not a
    readable PNG/JPEG header is a 400. On an error the images already opened are closed.
    """
    opened = []
    try:
        total = 0
        for i, text in enumerate(texts):
            im = _open(text, i)
            opened.append(im)
            w, h = im.size
            if w < 1 or h < 1 or w * h > max_pixels:
                raise RequestError(413, f"image {i} is {w}x{h}: more than the server's limit of {max_pixels} "
                                        f"pixels per image (max_image_pixels)")
            total += w * h * DECODED_BYTES_PER_PIXEL
        if total > max_bytes:
            raise RequestError(413, f"the request's {len(texts)} images decode to {total / MIB:.0f} MiB (float32 "
                                    f"RGB), more than the server's limit of {max_bytes / MIB:g} MiB per request "
                                    f"(max_decoded_mb); send fewer or smaller images per request")
    except BaseException:
        close_images(opened)
        raise
    return opened, total


def decode_pixels(opened: list) -> list[Tensor]:
    """PIL images from :func:`open_images` -> uint8 tensors [1, 3, H, W] (the reward gets
    ``uint8 / 255``), one at a time: each PIL copy of the pixels goes before the next image is
    decompressed. Corrupt pixel data is a 400. Closes every image."""
    try:
        images = []
        for i, im in enumerate(opened):
            images.append(_pixels(im, i))
            im.close()
        return images
    finally:
        close_images(opened)


def close_images(opened: list) -> None:
    for im in opened:
        im.close()


def decode_images(texts: list[str], max_pixels: int, max_bytes: int) -> list[Tensor]:
    """:func:`open_images` then :func:`decode_pixels`: base64 PNG/JPEG -> uint8 [1, 3, H, W] each,
    every header checked before any pixel is decompressed."""
    return decode_pixels(open_images(texts, max_pixels, max_bytes)[0])


def _open(text: str, index: int):
    """base64 -> a PIL image whose header is read and whose pixels are not."""
    from PIL import Image

    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"image {index} is not valid base64") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise RequestError(413, f"image {index} is a decompression bomb") from None
    except Exception as exc:  # PIL raises many types for truncated or foreign data
        raise RequestError(400, f"image {index} is not a readable PNG or JPEG ({type(exc).__name__})") from None


def _pixels(im, index: int) -> Tensor:
    """An opened PIL image -> uint8 [1, 3, H, W] (one copy of the pixels besides PIL's own)."""
    try:
        arr = np.array(im if im.mode == "RGB" else im.convert("RGB"))
    except Exception as exc:  # truncated or corrupt pixel data
        raise RequestError(400, f"image {index} is not a readable PNG or JPEG ({type(exc).__name__})") from None
    return torch.from_numpy(arr).permute(2, 0, 1).unsqueeze(0)
