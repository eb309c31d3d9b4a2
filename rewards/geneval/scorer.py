"""GenEval's verdict as a pure function of a detector's output, and Flow-GRPO's reward-server scores.

The official scorer is ``evaluation/evaluate_images.py`` of djghosh13/geneval (commit af4902f, cited
by line below as ``ei:N``); Flow-GRPO trains on the scores of ``reward_server/gen_eval.py`` of
yifan123/reward-server (commit 92ac29f, ``rs:N``). Both run the same selection, then judge:

1. **Selection** (ei:230-244, :func:`select_objects`). The confidence bar is ``counting_threshold``
   when the metadata's ``tag`` is exactly ``"counting"``, else ``threshold``; a row is kept when its
   score is strictly above it, compared in the rows' own dtype (float32 for mmdet: a float32 0.3 is
   not above 0.3). Rows are visited most confident first in GenEval's tie order
   (:func:`~.order.descending_order`), cut to the first ``max_objects``, and then, only when
   ``nms_threshold != 1``, greedily thinned: the best remaining row is kept and every later row whose
   IoU with it is not below ``nms_threshold`` is dropped. The IoU counts pixels inclusively,
   ``(x2 - x1 + 1) * (y2 - y1 + 1)`` clipped at 0, 0 for an empty union (ei:130-137), the differences
   in the rows' dtype and the rest in float64, as numpy 1.23 computes ``float32 scalar + 1``.
2. **Include clauses** (ei:173-213, :func:`judge`), in order. A clause takes the first ``count`` kept
   objects of its class and fails when there are fewer. Else with a ``color`` they go to
   ``colour_of`` and all must be that colour; then with a ``position`` ``[relation, group]`` (only if
   the colour passed) every one of them must stand in ``relation`` to every object of include clause
   ``group`` (which must itself have matched). A clause that matched keeps its objects as a group.
3. **Exclude clauses** (ei:215-219): at least ``count`` kept objects of the class fail.

:func:`relations` is ``relative_position`` (ei:140-157): centres and sizes of the two boxes, each
axis' centre offset shrunk by ``position_threshold`` x the sum of the sizes on that axis (floored at
0), no relation when both shrunk offsets are below 1e-3, else a relation when the shrunk offset over
the length of the raw offset is beyond 0.5 (strictly). Arithmetic is in the boxes' dtype, as numpy
does it; the length is ``sqrt(dx*dx + dy*dy)`` (numpy's BLAS ``dot`` may fuse the multiply-add,
which can move a float32 result by one ulp).

Reason strings are the official ones, joined by newlines, "" when correct. Where a failed position
check names two relations, their order is Python's set order, as in the official script (it varies
with ``PYTHONHASHSEED``). Inputs that crash the official script raise ValueError here: a position
clause naming a group not yet seen, an exclude clause with ``count <= 0`` for an absent class.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from .order import descending_order

#: GenEval's colour names, in its order (ei:76): ties in the reason's colour tally are listed this way
COLOURS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
#: the relations of ``relative_position``, in the order it adds them to its set
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

#: ``colour_of(classname, rows [M, 5]) -> M colour names``, rows in the order given
ColourOf = Callable[[str, np.ndarray], Sequence[str]]


class ServerVerdict(NamedTuple):
    """Flow-GRPO's reward-server scores of one image: ``strict`` (every include clause with exactly its
    count, colour and position), ``score`` (the partial credit it trains on) and the reasons."""

    strict: bool
    score: float
    reason: str


def as_rows(name: str, rows) -> np.ndarray:
    """``rows`` as an [N, 5] array (x1, y1, x2, y2, score); its float dtype is kept (integers become
    float64); an empty input of any shape is [0, 5]."""
    a = np.asarray(rows)
    if not np.issubdtype(a.dtype, np.floating):
        a = a.astype(np.float64)
    if a.size == 0:
        return a.reshape(0, 5)
    if a.ndim != 2 or a.shape[1] != 5:
        raise ValueError(f"detections[{name!r}] must be [N, 5] (x1, y1, x2, y2, score), got shape {a.shape}")
    return a


def _overlaps(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU [K] (float64) of one row [5] with rows [K, 5], counting pixels inclusively (ei:130-137)."""
    def area(w, h):  # the difference in the rows' dtype, then float64 as numpy 1.23's scalar + 1
        return np.maximum(w.astype(np.float64) + 1, 0) * np.maximum(h.astype(np.float64) + 1, 0)

    iw = np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0])
    ih = np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1])
    inter = area(iw, ih)
    union = area(np.asarray(box[2] - box[0]), np.asarray(box[3] - box[1])) + area(boxes[:, 2] - boxes[:, 0],
                                                                                   boxes[:, 3] - boxes[:, 1]) - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(union != 0, inter / np.where(union != 0, union, 1), 0.0)


def select_objects(detections: Mapping[str, np.ndarray], tag: str, *, threshold: float = 0.3,
                   counting_threshold: float = 0.9, max_objects: int = 16,
                   nms_threshold: float = 1.0) -> dict[str, np.ndarray]:
    """The rows GenEval keeps: class -> row indices (int64 [K], K >= 1) into ``detections[class]``,
    most confident first; classes with none kept are left out (step 1 of the module docstring)."""
    bar = float(counting_threshold) if tag == "counting" else float(threshold)  # a Python float: dtype-neutral
    nms = float(nms_threshold)
    kept: dict[str, np.ndarray] = {}
    for name, raw in detections.items():
        rows = as_rows(name, raw)
        order = descending_order(rows[:, 4])
        order = order[rows[order, 4] > bar][:int(max_objects)]
        if nms != 1 and len(order) > 1:
            keep, rest = [], order
            while len(rest):
                keep.append(rest[0])
                rest = rest[1:][_overlaps(rows[rest[0]], rows[rest[1:]]) < nms]
            order = np.asarray(keep, dtype=np.int64)
        if len(order):
            kept[name] = order
    return kept


def relations(a: np.ndarray, b: np.ndarray, position_threshold: float = 0.1) -> np.ndarray:
    """Where each box of ``a`` [M, >=4] stands relative to each box of ``b`` [K, >=4]: bool [M, K, 4]
    over :data:`RELATIONS` (``relative_position``, ei:140-157; coordinates in pixels)."""
    dtype = np.result_type(a, b)
    pa, pb = a[:, None, :4].astype(dtype), b[None, :, :4].astype(dtype)
    offset = (pa[..., :2] + pa[..., 2:]) / 2 - (pb[..., :2] + pb[..., 2:]) / 2  # [M, K, 2]
    size = np.abs(pa[..., 2:] - pa[..., :2]) + np.abs(pb[..., 2:] - pb[..., :2])
    shrunk = np.maximum(np.abs(offset) - float(position_threshold) * size, 0) * np.sign(offset)
    none = np.all(np.abs(shrunk) < 1e-3, axis=-1)
    length = np.sqrt(offset[..., 0] * offset[..., 0] + offset[..., 1] * offset[..., 1])
    with np.errstate(divide="ignore", invalid="ignore"):
        d = shrunk / length[..., None]
    rel = np.stack([d[..., 0] < -0.5, d[..., 0] > 0.5, d[..., 1] < -0.5, d[..., 1] > 0.5], axis=-1)
    return rel & ~none[..., None]


def _first_miss(found: np.ndarray, targets: np.ndarray, relation: str, position_threshold: float) -> set | None:
    """None when every box of ``found`` stands in ``relation`` to every box of ``targets``; else the
    relations (a set, as the official reason prints it) of the first failing pair, row-major."""
    rel = relations(found, targets, position_threshold)
    holds = rel[..., RELATIONS.index(relation)] if relation in RELATIONS else np.zeros(rel.shape[:2], bool)
    if holds.all():
        return None
    i, j = np.unravel_index(int(np.argmin(holds)), holds.shape)
    true_rels = set()
    for name, on in zip(RELATIONS, rel[i, j]):  # insertion order as the official's, for its set order
        if on:
            true_rels.add(name)
    return true_rels


def _colours(colour_of: ColourOf, name: str, found: np.ndarray) -> list[str]:
    colours = list(colour_of(name, found))
    if len(colours) != len(found):
        raise ValueError(f"colour_of({name!r}, rows) returned {len(colours)} colours for {len(found)} rows")
    return colours


def _colour_reason(name: str, count: int, colour: str, colours: list[str]) -> str:
    tally = ", ".join(f"{colours.count(c)} {c}" for c in COLOURS if c in colours)
    return f"expected {colour} {name}>={count}, found {colours.count(colour)} {colour}; and {tally}"


def _position_failure(req: Mapping, found: np.ndarray, groups: list, position_threshold: float) -> tuple[str | None, bool]:
    """The official reason why an include clause's ``position`` fails (None: it holds), and whether its
    target group had matched (ei:191-207)."""
    relation, target = req["position"]
    try:
        targets = groups[target]
    except IndexError:
        raise ValueError(f"the position clause of {req['class']!r} names include clause {target!r}, but only "
                         f"{len(groups)} precede it") from None
    if targets is None:
        return f"no target for {req['class']} to be {relation}", False
    miss = _first_miss(found, targets, relation, position_threshold)
    return (None if miss is None else f"expected {req['class']} {relation} target, found {' and '.join(miss)} target"), True


_EMPTY = np.zeros((0, 5))


def judge(metadata: Mapping, objects: Mapping[str, np.ndarray], colour_of: ColourOf,
          position_threshold: float = 0.1) -> tuple[bool, str]:
    """GenEval's ``evaluate`` (ei:160-220) on the kept rows per class (``objects[class]`` [K, 5], most
    confident first): ``(correct, reason)``."""
    correct, reasons, groups = True, [], []
    for req in metadata.get("include", []):
        name, count = req["class"], req["count"]
        found = objects.get(name, _EMPTY)[:count]
        matched = True
        if len(found) < count:
            correct = matched = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        else:
            if "color" in req:
                colours = _colours(colour_of, name, found)
                if colours.count(req["color"]) < count:
                    correct = matched = False
                    reasons.append(_colour_reason(name, count, req["color"], colours))
            if "position" in req and matched:
                why, _ = _position_failure(req, found, groups, position_threshold)
                if why is not None:
                    correct = matched = False
                    reasons.append(why)
        groups.append(found if matched else None)
    for req in metadata.get("exclude", []):
        name = req["class"]
        n = len(objects.get(name, _EMPTY))
        if n >= req["count"]:
            if name not in objects:  # the official script reads objects[name] here: a KeyError
                raise ValueError(f"exclude clause {{class: {name!r}, count: {req['count']!r}}} holds for an absent "
                                 "class; GenEval's script fails on it (counts must be >= 1)")
            correct = False
            reasons.append(f"expected {name}<{req['count']}, found {n}")
    return correct, "\n".join(reasons)


def judge_reward_server(metadata: Mapping, objects: Mapping[str, np.ndarray], colour_of: ColourOf,
                        position_threshold: float = 0.1) -> ServerVerdict:
    """Flow-GRPO's ``evaluate_reward`` (rs:201-264) on the kept rows per class: every include clause
    needs exactly ``count`` kept objects of its class (all of them the colour, and in the position);
    exclude clauses are not read. The partial credit is the mean of per-check credits: the count
    ``1 - |count - found| / count`` (negative past twice the count), then with a colour
    ``1 - |count - of that colour| / count``, with a position 1 (and a 0 before it when it fails);
    a wrong count adds one 0 for the colour or position it could not check."""
    correct, reasons, groups, credits = True, [], [], []
    for req in metadata.get("include", []):
        name, count = req["class"], req["count"]
        found = objects.get(name, _EMPTY)
        matched = True
        credits.append(1 - abs(count - len(found)) / count)
        if len(found) != count:
            correct = matched = False
            reasons.append(f"expected {name}=={count}, found {len(found)}")
            if "color" in req or "position" in req:
                credits.append(0.0)
        else:
            if "color" in req:
                colours = _colours(colour_of, name, found)
                n = colours.count(req["color"])
                credits.append(1 - abs(count - n) / count)
                if n != count:
                    correct = matched = False
                    reasons.append(_colour_reason(name, count, req["color"], colours))
            if "position" in req and matched:
                why, had_target = _position_failure(req, found, groups, position_threshold)
                if why is not None:
                    correct = matched = False
                    reasons.append(why)
                    credits.append(0.0)
                if had_target:
                    credits.append(1.0)  # rs:258 appends it after the pairs' loop, failed or not
        groups.append(found if matched else None)
    score = sum(credits) / len(credits) if credits else 0
    return ServerVerdict(correct, float(score), "\n".join(reasons))


def _kept_rows(detections: Mapping, metadata: Mapping, threshold, counting_threshold, max_objects,
               nms_threshold) -> dict[str, np.ndarray]:
    if "tag" not in metadata:
        raise ValueError("GenEval metadata needs a 'tag' (it picks the confidence threshold)")
    rows = {name: as_rows(name, r) for name, r in detections.items()}
    kept = select_objects(rows, metadata["tag"], threshold=threshold, counting_threshold=counting_threshold,
                          max_objects=max_objects, nms_threshold=nms_threshold)
    return {name: rows[name][idx] for name, idx in kept.items()}


def evaluate_detections(metadata: Mapping, detections: Mapping[str, np.ndarray], colour_of: ColourOf, *,
                        threshold: float = 0.3, counting_threshold: float = 0.9, max_objects: int = 16,
                        nms_threshold: float = 1.0, position_threshold: float = 0.1) -> tuple[bool, str]:
    """GenEval's verdict on one image: ``(correct, reason)`` exactly as ``evaluate_images.py`` gives it.

    Args:
        metadata: one line of GenEval's ``evaluation_metadata.jsonl``: ``tag``, ``include`` and
            ``exclude`` clauses (``class``, ``count``, optional ``color``, ``position``).
        detections: class name -> the detector's rows [N, 5] for that class (x1, y1, x2, y2 in
            pixels, score), unsorted, before any threshold (mmdet's per-class arrays).
        colour_of: ``(classname, rows [M, 5]) -> M colour names`` for the rows the colour rule
            looks at, in the order given: the first M kept rows of the class, most confident first
            (:func:`select_objects` gives their indices, so a caller can find their masks).
        threshold, counting_threshold, max_objects, nms_threshold, position_threshold: the official
            script's options (``threshold``, ``counting_threshold``, ``max_objects``,
            ``max_overlap``, ``position_threshold``), at their defaults.
    """
    objects = _kept_rows(detections, metadata, threshold, counting_threshold, max_objects, nms_threshold)
    return judge(metadata, objects, colour_of, position_threshold)


def reward_server_scores(metadata: Mapping, detections: Mapping[str, np.ndarray], colour_of: ColourOf, *,
                         threshold: float = 0.3, counting_threshold: float = 0.9, max_objects: int = 16,
                         nms_threshold: float = 1.0, position_threshold: float = 0.1) -> ServerVerdict:
    """Flow-GRPO's reward-server scores on one image (:func:`judge_reward_server` after the same
    selection as :func:`evaluate_detections`, whose arguments it takes)."""
    objects = _kept_rows(detections, metadata, threshold, counting_threshold, max_objects, nms_threshold)
    return judge_reward_server(metadata, objects, colour_of, position_threshold)
