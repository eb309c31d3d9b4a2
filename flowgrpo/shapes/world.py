"""The shapes world: scene specifications, GenEval-style prompts and a procedural renderer.

A scene is a handful of flat-coloured glyphs (circle, square, triangle) on a black 32x32 canvas
divided into a 4x4 grid of 8x8 cells. Every object fills exactly one cell with the fixed glyph of
its shape in its colour, and one cell is exactly one transformer patch of the shapes model
(patch size 8, so 16 image tokens). Drawing is therefore trivial for the model: its failures are
*choices* (which cells, which glyph, which colour), the way real text-to-image models draw well
and fail on composition. The verifier reads each cell against the glyph templates without
ambiguity.

Prompts follow GenEval's six task families, tagged ``single_object``, ``two_object``,
``counting``, ``colors``, ``position`` and ``color_attr``. Every prompt is generated from a
:class:`SceneSpec`, which is also what the verifiable reward checks a generated image against.
Relations are read on the grid: "A left of B" means A's column is smaller than B's (any rows),
"A above B" means A's row is smaller.

The whole vocabulary is closed (see :data:`VOCAB`), so the tiny text encoder of the shapes
model is a word-level embedding table and no tokenizer download is ever needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 235),
    "yellow": (235, 215, 40),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
NUMBERS: dict[int, str] = {2: "two", 3: "three", 4: "four"}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
FLIPPED: dict[str, str] = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

GRID = 4  # cells per side
CELL = 8  # pixels per cell side (= the shapes model's patch size)
IMAGE_SIZE = GRID * CELL

VOCAB: tuple[str, ...] = (
    ("<pad>", "<bos>", "<eos>", "a", "and", "left", "right", "of", "above", "below")
    + tuple(NUMBERS.values())
    + tuple(COLORS)
    + SHAPES
    + tuple(s + "s" for s in SHAPES)
)


@dataclass(frozen=True)
class ObjectSpec:
    """``count`` objects of ``shape``; ``color`` is None when the prompt leaves it free."""

    shape: str
    color: str | None = None
    count: int = 1


@dataclass(frozen=True)
class SceneSpec:
    """What a prompt asks for: object groups and an optional relation of group 0 to group 1."""

    tag: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    @property
    def prompt(self) -> str:
        return spec_to_prompt(self)


def _noun(obj: ObjectSpec) -> str:
    words = ([obj.color] if obj.color else []) + [obj.shape + ("s" if obj.count > 1 else "")]
    if obj.count == 1:
        return "a " + " ".join(words)
    return NUMBERS[obj.count] + " " + " ".join(words)


def spec_to_prompt(spec: SceneSpec) -> str:
    """English prompt for a scene, e.g. ``"a blue square left of a yellow triangle"``."""
    if spec.relation is not None:
        return f"{_noun(spec.objects[0])} {spec.relation} {_noun(spec.objects[1])}"
    return " and ".join(_noun(o) for o in spec.objects)


@lru_cache(maxsize=None)
def all_specs(tag: str) -> tuple[SceneSpec, ...]:
    """Every scene spec of one tag, in a fixed order (the grammar is closed, so this is finite)."""
    cols, shapes = list(COLORS), list(SHAPES)
    if tag == "single_object":
        return tuple(SceneSpec(tag, (ObjectSpec(s),)) for s in shapes)
    if tag == "two_object":
        return tuple(SceneSpec(tag, (ObjectSpec(a), ObjectSpec(b))) for a in shapes for b in shapes if a != b)
    if tag == "counting":
        return tuple(SceneSpec(tag, (ObjectSpec(s, c, n),)) for n in NUMBERS for c in cols for s in shapes)
    if tag == "colors":
        return tuple(SceneSpec(tag, (ObjectSpec(s, c),)) for c in cols for s in shapes)
    if tag in ("position", "color_attr"):
        objs = [ObjectSpec(s, c) for c in cols for s in shapes]
        pairs = [(a, b) for a in objs for b in objs if a != b]  # differ in colour or shape: identifiable
        if tag == "color_attr":
            return tuple(SceneSpec(tag, p) for p in pairs)
        return tuple(SceneSpec(tag, p, r) for p in pairs for r in RELATIONS)
    raise ValueError(f"unknown tag {tag!r}; valid tags: {', '.join(TAGS)}")


def sample_spec(rng: np.random.Generator, tag: str | None = None) -> SceneSpec:
    """Draw a random scene spec (uniform over tags unless ``tag`` is given, then uniform in the tag)."""
    tag = tag or TAGS[rng.integers(len(TAGS))]
    specs = all_specs(tag)
    return specs[rng.integers(len(specs))]


# --------------------------------------------------------------------------- caption noise


def wrong_scene(spec: SceneSpec, rng: np.random.Generator) -> SceneSpec:
    """A scene that violates ``spec`` the way a mis-captioned training image does.

    Used by pretraining to make the base model *misaligned* like a web-caption-trained model: it
    draws crisply but follows the prompt only part of the time. Per tag: another shape
    (single_object), one object dropped or replaced (two_object), a count off by one (counting),
    another colour (colors), the opposite relation (position), the two colours swapped, or one
    changed when both are equal (color_attr). The returned spec never satisfies ``spec`` under the
    verifier (its tag is kept only for bookkeeping; it is rendered, never shown as a prompt).
    """
    tag = spec.tag

    def other(seq, value):
        rest = [s for s in seq if s != value]
        return rest[rng.integers(len(rest))]

    if tag in ("single_object", "colors"):
        o = spec.objects[0]
        if tag == "single_object":
            return replace(spec, objects=(replace(o, shape=other(SHAPES, o.shape)),))
        return replace(spec, objects=(replace(o, color=other(list(COLORS), o.color)),))
    if tag == "two_object":
        a, b = spec.objects
        if rng.random() < 0.5:  # dropped object
            return replace(spec, objects=((a,) if rng.random() < 0.5 else (b,)))
        third = [s for s in SHAPES if s not in (a.shape, b.shape)][0]
        return replace(spec, objects=((replace(a, shape=third), b) if rng.random() < 0.5 else (a, replace(b, shape=third))))
    if tag == "counting":
        o = spec.objects[0]
        n = o.count + (1 if o.count == 2 or (o.count < 4 and rng.random() < 0.5) else -1)
        return replace(spec, objects=(replace(o, count=n),))
    if tag == "position":
        return replace(spec, relation=FLIPPED[spec.relation])
    if tag == "color_attr":
        a, b = spec.objects
        if a.color != b.color and a.shape != b.shape:
            return replace(spec, objects=(replace(a, color=b.color), replace(b, color=a.color)))
        # same colour or same shape: swapping would change nothing, so recolour one object
        if rng.random() < 0.5:
            return replace(spec, objects=(replace(a, color=other(list(COLORS), a.color)), b))
        return replace(spec, objects=(a, replace(b, color=other(list(COLORS), b.color))))
    raise ValueError(f"unknown tag {tag!r}; valid tags: {', '.join(TAGS)}")


# --------------------------------------------------------------------------- rendering


def _glyph_masks() -> dict[str, np.ndarray]:
    """Boolean [CELL, CELL] mask of each shape's fixed glyph (a 1-pixel margin around a 6x6 body)."""
    yy, xx = np.mgrid[0:CELL, 0:CELL].astype(np.float32) + 0.5
    c = CELL / 2.0
    r = CELL / 2.0 - 1.0
    square = (np.abs(xx - c) <= r) & (np.abs(yy - c) <= r)
    circle = (xx - c) ** 2 + (yy - c) ** 2 <= (r + 0.3) ** 2
    circle &= ~square | ((xx - c) ** 2 + (yy - c) ** 2 <= r * r + 1.0)  # round off the corners
    top = c - r
    triangle = (yy >= top) & (yy <= c + r) & (np.abs(xx - c) <= (yy - top) / 2.0 + 0.5)
    return {"circle": circle, "square": square, "triangle": triangle}


GLYPHS: dict[str, np.ndarray] = _glyph_masks()


def relation_holds(relation: str, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether the object in cell ``a = (row, col)`` stands in ``relation`` to the one in cell ``b``."""
    (ar, ac), (br, bc) = a, b
    return {"left of": ac < bc, "right of": ac > bc, "above": ar < br, "below": ar > br}[relation]


def relation_cells_kind(relation: str, a: tuple[int, int], b: tuple[int, int]) -> str:
    """``"holds"``, ``"same_line"`` (``a`` and ``b`` share the relation's axis coordinate, e.g. one column
    for "left of") or ``"reversed"`` (the opposite relation holds) for cells ``a``, ``b`` = (row, col)."""
    if relation_holds(relation, a, b):
        return "holds"
    axis = 1 if relation in ("left of", "right of") else 0
    return "same_line" if a[axis] == b[axis] else "reversed"


def place(spec: SceneSpec, rng: np.random.Generator) -> list[tuple[str, str, int, int]]:
    """Random cells for the objects of ``spec``: ``[(shape, colour, row, col)]``, one object a cell.

    Free colours are drawn at random, except that a group of two or more objects with a free colour
    ("four triangles") never comes out in one colour: drawn again until it shows two colours at least.
    Why: such a scene would be the image of a coloured prompt ("four yellow triangles") that may be
    held out, under another caption. A relation, when given, holds between the first object of group 0
    and the first object of group 1.
    """
    while True:
        objs = _place_once(spec, rng)
        start, one_colour = 0, False
        for o in spec.objects:
            if o.color is None and o.count > 1:
                one_colour |= len({col for _, col, _, _ in objs[start:start + o.count]}) == 1
            start += o.count
        if not one_colour:
            return objs


def _place_once(spec: SceneSpec, rng: np.random.Generator) -> list[tuple[str, str, int, int]]:
    objs = []
    for o in spec.objects:
        for _ in range(o.count):
            objs.append((o.shape, o.color or list(COLORS)[rng.integers(len(COLORS))]))
    for _ in range(1000):
        cells = rng.choice(GRID * GRID, size=len(objs), replace=False)
        rc = [divmod(int(c), GRID) for c in cells]
        if spec.relation is None or relation_holds(spec.relation, rc[0], rc[spec.objects[0].count]):
            return [(s, col, r, c) for (s, col), (r, c) in zip(objs, rc)]
    raise RuntimeError(f"could not place the objects of {spec.prompt!r}")  # unreachable for this grammar


def draw(objects: list[tuple[str, str, int, int]]) -> np.ndarray:
    """Paint ``[(shape, colour, row, col)]`` glyphs. Returns uint8 [IMAGE_SIZE, IMAGE_SIZE, 3]."""
    img = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for shape, color, r, c in objects:
        cell = img[r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL]
        cell[GLYPHS[shape]] = COLORS[color]
    return img


def render(spec: SceneSpec, rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """Render a scene satisfying ``spec``. Returns uint8 [32, 32, 3]; ``size`` must be 32 (the grid)."""
    if size != IMAGE_SIZE:
        raise ValueError(f"the shapes world is {IMAGE_SIZE}x{IMAGE_SIZE} ({GRID}x{GRID} cells of {CELL} px), got size={size}")
    return draw(place(spec, rng))
