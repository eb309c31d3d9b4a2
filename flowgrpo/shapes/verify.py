"""Parse a shapes-world image into objects and check it against a :class:`SceneSpec`.

Plain image processing, no learned model: every 8x8 cell of the 4x4 grid is compared with the
templates of the world (an empty cell, and each shape's glyph in each colour) and takes the
nearest one. A cell that is far from every template (a smear, two glyphs blended) is read as an
``unknown`` object: it matches no prompt noun but counts as an extra object, so it fails the
strict rule, as a garbled object does in GenEval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .world import CELL, COLORS, GLYPHS, GRID, IMAGE_SIZE, ObjectSpec, SceneSpec, draw, relation_cells_kind

UNKNOWN = "unknown"
# RMS distance (0-255 scale) above which a non-empty cell matches no template. The closest two
# templates (a circle and a square of one colour) are ~31 apart, two colours of one glyph >= ~50, a
# glyph and the empty cell ~100; an even blend of two colours lands ~38 from both.
UNKNOWN_RMS = 25.0


def _templates() -> tuple[np.ndarray, list[tuple[str, str] | None]]:
    labels: list[tuple[str, str] | None] = [None]  # None = empty cell
    cells = [np.zeros((CELL, CELL, 3), np.float32)]
    for shape in GLYPHS:
        for color in COLORS:
            labels.append((shape, color))
            cells.append(draw([(shape, color, 0, 0)])[:CELL, :CELL].astype(np.float32))
    return np.stack(cells).reshape(len(cells), -1), labels  # [K, CELL*CELL*3]


_TEMPLATES, _LABELS = _templates()


@dataclass(frozen=True)
class Detection:
    """One object: its glyph's shape and colour (``unknown`` when no template fits) and its cell."""

    shape: str
    color: str
    row: int
    col: int


def detect(img: np.ndarray) -> list[Detection]:
    """Objects in one uint8 image [32, 32, 3], row-major over the grid cells."""
    if img.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"shapes-world images are {IMAGE_SIZE}x{IMAGE_SIZE}x3, got {img.shape}")
    cells = img.astype(np.float32).reshape(GRID, CELL, GRID, CELL, 3).transpose(0, 2, 1, 3, 4)
    cells = cells.reshape(GRID * GRID, -1)  # [16, CELL*CELL*3]
    d2 = ((cells[:, None, :] - _TEMPLATES[None]) ** 2).mean(-1)  # [16, K]
    best = d2.argmin(-1)
    found = []
    for idx, k in enumerate(best.tolist()):
        if _LABELS[k] is None:
            continue
        r, c = divmod(idx, GRID)
        if np.sqrt(d2[idx, k]) > UNKNOWN_RMS:
            found.append(Detection(UNKNOWN, UNKNOWN, r, c))
        else:
            shape, color = _LABELS[k]
            found.append(Detection(shape, color, r, c))
    return found


def group_hits(obj: ObjectSpec, dets: list[Detection]) -> list[Detection]:
    """The detections that answer object group ``obj``: its shape, and its colour when it names one."""
    return [d for d in dets if d.shape == obj.shape and (obj.color is None or d.color == obj.color)]


def score(spec: SceneSpec, dets: list[Detection], reversed_credit: float = 0.0) -> dict[str, float]:
    """Check detections against a spec.

    Returns ``{"correct": 0/1, "score": partial credit in [0, 1]}``. ``correct`` is the world's
    strict rule: every group has exactly its count, nothing extra, and the relation holds on the grid.
    It is stricter than GenEval's scorer, which asks at least each class's count and ignores other
    classes (:mod:`flowgrpo.rewards.geneval.shapes_world` runs GenEval's rules on the same parse, and names where
    the two differ).
    ``score`` averages the individual checks, giving the policy a denser signal. Its relation check
    is 1 when the relation holds, ``reversed_credit`` when A and B stand on different lines the wrong
    way round, and 0 when they share the relation's line (a tie) or are not one of each;
    ``correct`` never counts a reversal.
    """
    checks: list[float] = []
    matched: list[list[Detection]] = []
    for obj in spec.objects:
        hits = group_hits(obj, dets)
        matched.append(hits)
        checks.append(max(0.0, 1.0 - abs(len(hits) - obj.count) / obj.count))  # close counts get partial credit
    expected = sum(o.count for o in spec.objects)
    checks.append(1.0 if len(dets) == expected else 0.0)
    if spec.relation is not None:
        rel = 0.0
        if len(matched[0]) == 1 and len(matched[1]) == 1:
            (a,), (b,) = matched
            kind = relation_cells_kind(spec.relation, (a.row, a.col), (b.row, b.col))
            rel = 1.0 if kind == "holds" else reversed_credit if kind == "reversed" else 0.0
        checks.append(rel)
    correct = all(c == 1.0 for c in checks)
    return {"correct": float(correct), "score": float(np.mean(checks))}


def verify(spec: SceneSpec, img: np.ndarray, reversed_credit: float = 0.0) -> dict[str, float]:
    """:func:`detect` then :func:`score` for one uint8 image [32, 32, 3]."""
    return score(spec, detect(img), reversed_credit)
