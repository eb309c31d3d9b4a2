"""The shapes world in GenEval's terms: each prompt's GenEval metadata, and the verifier's parse as detections.

:func:`spec_metadata` writes a :class:`~flowgrpo.shapes.world.SceneSpec` as a line of GenEval's
``evaluation_metadata.jsonl`` (the shape is the class; a counting prompt also excludes one more of
its shape, as GenEval's counting lines do; "A left of B" makes B include clause 0 and A clause 1 with
``position: ["left of", 0]``). :func:`parse_detections` hands the verifier's parse of an image to
:func:`flowgrpo.rewards.geneval.evaluate_detections`: one row per parsed glyph, its glyph's pixel
box in the image (x2, y2 one past the last pixel, as mmdet's boxes from masks) with score 1, under its
shape's name; ``colour_of`` returns the parsed colour. :func:`geneval_verdict` is the two together.

Where the verdicts differ (docs/shapes_world.md#the-shapes-world-in-genevals-terms): the verifier is
stricter. It wants exactly the asked objects and nothing else, while GenEval asks at least ``count`` of
each class (exactly, for counting) and ignores other classes; GenEval's colour rule reads only the
``count`` most confident objects of a class, and with every score 1 those are the last ones in
row-major order; GenEval's position rule is a cone (the shrunk centre offset must point within 60
degrees of the direction), the verifier's a half-plane on the grid.
"""

from __future__ import annotations

import numpy as np

from flowgrpo.shapes.verify import Detection, detect
from flowgrpo.shapes.world import CELL, GLYPHS, SceneSpec


def _glyph_box(shape: str) -> tuple[int, int, int, int]:
    """The glyph's box in its cell: x1, y1, x2, y2 with x2, y2 one past its last pixel."""
    ys, xs = np.nonzero(GLYPHS[shape])
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1


_BOXES = {shape: _glyph_box(shape) for shape in GLYPHS}


def _clause(obj, with_colour: bool = True) -> dict:
    clause = {"class": obj.shape, "count": obj.count}
    if obj.color is not None and with_colour:
        clause["color"] = obj.color
    return clause


def spec_metadata(spec: SceneSpec) -> dict:
    """GenEval metadata of a shapes scene: ``{"tag", "include", ["exclude"], "prompt"}``."""
    if spec.relation is not None:
        a, b = spec.objects
        include = [_clause(b), dict(_clause(a), position=[spec.relation, 0])]
    else:
        include = [_clause(o) for o in spec.objects]
    meta = {"tag": spec.tag, "include": include}
    if spec.tag == "counting":
        o = spec.objects[0]
        meta["exclude"] = [{"class": o.shape, "count": o.count + 1}]
    meta["prompt"] = spec.prompt
    return meta


def parse_detections(dets: list[Detection]) -> tuple[dict[str, np.ndarray], callable]:
    """GenEval detections of a parse: ``({shape: rows [N, 5] float32}, colour_of)``, rows in the parse's
    row-major cell order with score 1. Cells the verifier could not read (``unknown``) are a class of
    their own, which no GenEval clause names."""
    rows: dict[str, list[list[float]]] = {}
    colour_at: dict[tuple[float, float], str] = {}
    for d in dets:
        x1, y1, x2, y2 = _BOXES.get(d.shape, (0, 0, CELL, CELL))
        box = [d.col * CELL + x1, d.row * CELL + y1, d.col * CELL + x2, d.row * CELL + y2]
        rows.setdefault(d.shape, []).append(box + [1.0])
        colour_at[(box[0], box[1])] = d.color  # one glyph per cell: its corner names it

    def colour_of(name: str, found) -> list[str]:
        return [colour_at[(float(r[0]), float(r[1]))] for r in np.asarray(found)]

    return {k: np.asarray(v, dtype=np.float32) for k, v in rows.items()}, colour_of


def geneval_verdict(spec: SceneSpec, img: np.ndarray) -> tuple[bool, str]:
    """GenEval's ``(correct, reason)`` for one uint8 image [32, 32, 3] of the shapes world."""
    from .scorer import evaluate_detections

    detections, colour_of = parse_detections(detect(img))
    return evaluate_detections(spec_metadata(spec), detections, colour_of)


#: the kinds of :func:`explain_disagreement`, each a rule on which the verifier and GenEval differ
DISAGREEMENTS = {
    "same_shape_pair": "two groups of one shape (\"a red circle left of a blue circle\"): GenEval's clauses are per "
                       "class, so both take the same most confident circle and one colour check fails",
    "extra_objects": "more objects than asked (another shape, an unreadable cell, or more of a shape than a "
                     "non-counting prompt asks): GenEval asks at least the count and ignores other classes, the "
                     "verifier wants exactly the scene",
    "position_cone": "the relation holds on the grid (a half-plane: A's column left of B's) but not within "
                     "GenEval's cone (the centre offset, shrunk by 0.1 x the sizes, within 60 degrees of the axis)",
}


def explain_disagreement(spec: SceneSpec, dets: list[Detection], verifier_correct: bool,
                         geneval_correct: bool) -> str | None:
    """Which rule of :data:`DISAGREEMENTS` makes the two verdicts differ on a parse ``dets`` of a scene
    for ``spec`` (None when they agree, or for a difference no rule explains)."""
    if verifier_correct == geneval_correct:
        return None
    if len(spec.objects) == 2 and spec.objects[0].shape == spec.objects[1].shape:
        return "same_shape_pair"
    if geneval_correct and len(dets) > sum(o.count for o in spec.objects):
        return "extra_objects"
    if verifier_correct and spec.relation is not None:
        return "position_cone"
    return None
