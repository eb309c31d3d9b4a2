"""Parse a shapes-world image into objects and check it against a :class:`SceneSpec`.

Plain image processing, no learned model: pixels brighter than a threshold are assigned the
nearest palette colour, each colour's mask is split into 4-connected components, and a component's
shape is read from which corners of its bounding box it fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from .world import COLORS, SceneSpec, _relation_holds

_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)  # [K, 3]
_COLOR_NAMES = list(COLORS)


@dataclass(frozen=True)
class Detection:
    shape: str
    color: str
    cx: float
    cy: float
    area: int


def detect(img: np.ndarray, min_area: int | None = None, brightness: int = 90) -> list[Detection]:
    """Objects in one uint8 image [H, W, 3]; components smaller than ``min_area`` pixels are noise."""
    h, w, _ = img.shape
    min_area = min_area if min_area is not None else max(6, int(round(10 * h * w / 1024)))
    pix = img.astype(np.float32)
    fg = pix.max(axis=-1) >= brightness
    dist = ((pix[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1)  # [H, W, K]
    label_of = dist.argmin(-1)
    found: list[Detection] = []
    for k, name in enumerate(_COLOR_NAMES):
        mask = fg & (label_of == k)
        if not mask.any():
            continue
        comps, n = ndimage.label(mask)
        for idx, sl in enumerate(ndimage.find_objects(comps), start=1):
            comp = comps[sl] == idx
            area = int(comp.sum())
            if area < min_area:
                continue
            # Corner pixels of the bounding box separate the shapes cleanly: a square fills all
            # four, an upright triangle only the bottom two, a circle none. (Fill ratio alone
            # overlaps between small circles and triangles after pixelisation.)
            top = (comp[0, 0] + comp[0, -1]) / 2.0
            bottom = (comp[-1, 0] + comp[-1, -1]) / 2.0
            if top >= 0.5 and bottom >= 0.5:
                shape = "square"
            elif bottom >= 0.5:
                shape = "triangle"
            else:
                shape = "circle"
            ys, xs = np.nonzero(comp)
            found.append(Detection(shape, name, float(xs.mean() + sl[1].start + 0.5),
                                   float(ys.mean() + sl[0].start + 0.5), area))
    return found


def score(spec: SceneSpec, dets: list[Detection], size: int = 32) -> dict[str, float]:
    """Check detections against a spec.

    Returns ``{"correct": 0/1, "score": partial credit in [0, 1]}``. ``correct`` is GenEval's
    strict rule: every group has exactly its count, nothing extra, and the relation holds.
    ``score`` averages the individual checks, giving the policy a denser signal.
    """
    checks: list[float] = []
    matched: list[list[Detection]] = []
    for obj in spec.objects:
        hits = [d for d in dets if d.shape == obj.shape and (obj.color is None or d.color == obj.color)]
        matched.append(hits)
        # partial credit for being close on counts
        checks.append(max(0.0, 1.0 - abs(len(hits) - obj.count) / obj.count))
    expected = sum(o.count for o in spec.objects)
    checks.append(1.0 if len(dets) == expected else 0.0)
    if spec.relation is not None:
        ok = len(matched[0]) == 1 and len(matched[1]) == 1 and _relation_holds(
            spec.relation,
            (matched[0][0].cx, matched[0][0].cy),
            (matched[1][0].cx, matched[1][0].cy),
            margin=2 * size / 32.0,
        )
        checks.append(1.0 if ok else 0.0)
    correct = all(c == 1.0 for c in checks)
    return {"correct": float(correct), "score": float(np.mean(checks))}


def verify(spec: SceneSpec, img: np.ndarray) -> dict[str, float]:
    """:func:`detect` then :func:`score` for one uint8 image [H, W, 3]."""
    return score(spec, detect(img), size=img.shape[0])
