"""Image fidelity in the shapes world: how cleanly an image is drawn, whatever it shows.

Accuracy asks whether an image shows what its prompt asks for; fidelity asks whether it is drawn
the way the world draws: flat glyphs in the palette's exact colours on a pure black canvas. RL
fine-tuning can raise accuracy while the samples pick up background texture and noisy glyphs;
fidelity makes that visible as a number in [0, 1] (1 = a clean render of :mod:`.world`).

Definition, per image (uint8 RGB, 0-255 scale):

1. **Segmentation, as the verifier reads the image.** Each 8x8 grid cell takes its nearest
   template (least mean squared distance: the empty cell or one of the 12 glyphs, the same
   templates and distance as :func:`flowgrpo.shapes.verify.detect`, but without its ``unknown``
   cut-off, so a smeared cell is compared with the template it is closest to). A pixel is
   *foreground* where that template draws a glyph and *background* elsewhere (the empty cells and
   the margins around each glyph); its clean value is the template's: the glyph's palette colour
   or the black canvas (0, 0, 0).
2. **Per-pixel credit.** A pixel's deviation is the largest absolute difference over its three
   channels from its clean value. Within :data:`FULL_CREDIT` (4 of 255, invisible) it earns 1,
   at :data:`NO_CREDIT` (24 of 255, plainly visible on black) or beyond it earns 0, linearly in
   between. Equivalently, the credit averaged over a set of pixels is the fraction of those pixels
   within a tolerance, averaged over tolerances spread evenly from 4 to 24.
3. **Background fidelity** is the mean credit of the background pixels, **foreground fidelity**
   the mean credit of the foreground pixels. **Fidelity** is the mean of the two, so that a few
   noisy glyphs weigh as much as a large textured background; an image without any glyph has
   background fidelity alone.

Fidelity never looks at the prompt: a clean image of the wrong scene scores 1. It is deterministic
(plain numpy on the rounded uint8 image). Measured: the shipped base model scores 1.000 on the
256 held-out evaluation samples, clean renders score exactly 1, and added texture or noise scores
visibly lower (see ``docs/shapes_world.md``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..images import to_uint8
from .verify import _LABELS, _TEMPLATES
from .world import CELL, GLYPHS, GRID, IMAGE_SIZE

#: deviation (0-255 scale, largest over the channels) up to which a pixel earns full credit
FULL_CREDIT = 4.0
#: deviation from which a pixel earns no credit (linear in between)
NO_CREDIT = 24.0

# [K, CELL*CELL] bool: where each verifier template draws a glyph (row 0 is the empty cell)
_FOREGROUND = np.stack([np.zeros((CELL, CELL), bool) if lab is None else GLYPHS[lab[0]] for lab in _LABELS])
_FOREGROUND = _FOREGROUND.reshape(len(_LABELS), CELL * CELL)


def _cells(arr: np.ndarray) -> np.ndarray:
    """uint8 [N, 32, 32, 3] -> float32 [N, 16, CELL*CELL*3], cells row-major, pixels row-major."""
    n = arr.shape[0]
    cells = arr.astype(np.float32).reshape(n, GRID, CELL, GRID, CELL, 3).transpose(0, 1, 3, 2, 4, 5)
    return cells.reshape(n, GRID * GRID, CELL * CELL * 3)


def pixel_credit(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-pixel credit and segmentation of uint8 images ``arr`` [N, 32, 32, 3].

    Returns ``(credit, foreground)``, both [N, 16, CELL*CELL] (grid cell, pixel in the cell, both
    row-major): credit in [0, 1] as defined in the module docstring, and whether the pixel's
    nearest template draws a glyph there.
    """
    if arr.ndim != 4 or arr.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"shapes-world images are [N, {IMAGE_SIZE}, {IMAGE_SIZE}, 3], got {tuple(arr.shape)}")
    cells = _cells(arr)  # [N, 16, 192]
    # distance to each template in turn (memory N x 16 x 192, not N x 16 x K x 192)
    d2 = np.stack([((cells - t) ** 2).mean(-1) for t in _TEMPLATES], axis=-1)  # [N, 16, K]
    best = d2.argmin(-1)  # [N, 16]
    clean = _TEMPLATES[best]  # [N, 16, 192]
    dev = np.abs(cells - clean).reshape(*best.shape, CELL * CELL, 3).max(-1)  # [N, 16, 64]
    credit = np.clip((NO_CREDIT - dev) / (NO_CREDIT - FULL_CREDIT), 0.0, 1.0)
    return credit, _FOREGROUND[best]


def fidelity_parts(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fidelity of uint8 images ``arr`` [N, 32, 32, 3] and its two parts.

    Returns ``(fidelity, background, foreground)``, each float64 [N] in [0, 1];
    ``foreground`` is NaN for an image without any glyph (its fidelity is then ``background``).
    """
    credit, fg = pixel_credit(arr)
    credit, fg = credit.reshape(len(arr), -1), fg.reshape(len(arr), -1)
    n_fg = fg.sum(1)
    background = (credit * ~fg).sum(1) / (~fg).sum(1)  # every image has background pixels (glyph margins)
    with np.errstate(invalid="ignore", divide="ignore"):
        foreground = np.where(n_fg > 0, (credit * fg).sum(1) / n_fg, np.nan)
    fidelity = np.where(n_fg > 0, (background + np.nan_to_num(foreground)) / 2.0, background)
    return fidelity.astype(np.float64), background.astype(np.float64), foreground.astype(np.float64)


def image_fidelity(images: Tensor) -> np.ndarray:
    """Fidelity of each image: ``images`` [N, 3, 32, 32] in [0, 1] (clamped) -> float64 [N] in [0, 1].

    1 means every pixel within 4/255 of the world's clean template (see the module docstring).
    """
    return fidelity_parts(to_uint8(torch.as_tensor(images)))[0]
