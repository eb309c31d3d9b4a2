"""The shapes world: scene specifications, GenEval-style prompts and a procedural renderer.

A scene is a handful of flat-coloured shapes (circle, square, triangle) on a black background.
Prompts follow GenEval's six task families, tagged ``single_object``, ``two_object``,
``counting``, ``colors``, ``position`` and ``color_attr``. Every prompt is generated from a
:class:`SceneSpec`, which is also what the verifiable reward checks a generated image against.

The whole vocabulary is closed (see :data:`VOCAB`), so the tiny text encoder of the shapes
model is a word-level embedding table and no tokenizer download is ever needed.
"""

from __future__ import annotations

from dataclasses import dataclass

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
TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

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


def sample_spec(rng: np.random.Generator, tag: str | None = None) -> SceneSpec:
    """Draw a random scene spec (uniform over tags unless ``tag`` is given)."""
    tag = tag or TAGS[rng.integers(len(TAGS))]
    colors, shapes = list(COLORS), list(SHAPES)

    def pick(seq):
        return seq[rng.integers(len(seq))]

    def two_distinct(seq):
        i, j = rng.choice(len(seq), size=2, replace=False)
        return seq[i], seq[j]

    if tag == "single_object":
        return SceneSpec(tag, (ObjectSpec(pick(shapes)),))
    if tag == "two_object":
        a, b = two_distinct(shapes)
        return SceneSpec(tag, (ObjectSpec(a), ObjectSpec(b)))
    if tag == "counting":
        n = int(pick(list(NUMBERS)))
        return SceneSpec(tag, (ObjectSpec(pick(shapes), pick(colors), n),))
    if tag == "colors":
        return SceneSpec(tag, (ObjectSpec(pick(shapes), pick(colors)),))
    if tag in ("position", "color_attr"):
        # two objects that differ in colour or in shape, so each is identifiable
        while True:
            o1 = ObjectSpec(pick(shapes), pick(colors))
            o2 = ObjectSpec(pick(shapes), pick(colors))
            if (o1.shape, o1.color) != (o2.shape, o2.color):
                break
        relation = pick(list(RELATIONS)) if tag == "position" else None
        return SceneSpec(tag, (o1, o2), relation)
    raise ValueError(f"unknown tag {tag!r}; valid tags: {', '.join(TAGS)}")


# --------------------------------------------------------------------------- rendering


def _shape_mask(shape: str, cx: float, cy: float, r: float, size: int) -> np.ndarray:
    """Boolean [size, size] mask of one shape of half-extent ``r`` pixels centred at (cx, cy)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    if shape == "circle":
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    if shape == "square":
        return (np.abs(xx - cx) <= r) & (np.abs(yy - cy) <= r)
    if shape == "triangle":  # upright isosceles triangle, base 2r, height 2r: fill ratio 1/2
        top, bottom = cy - r, cy + r
        half_width = (yy - top) / (2 * r) * r
        return (yy >= top) & (yy <= bottom) & (np.abs(xx - cx) <= half_width)
    raise ValueError(f"unknown shape {shape!r}; valid shapes: {', '.join(SHAPES)}")


def _relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float], margin: float) -> bool:
    (ax, ay), (bx, by) = a, b
    return {
        "left of": ax < bx - margin,
        "right of": ax > bx + margin,
        "above": ay < by - margin,
        "below": ay > by + margin,
    }[relation]


def render(spec: SceneSpec, rng: np.random.Generator, size: int = 32, max_tries: int = 200) -> np.ndarray:
    """Render a scene satisfying ``spec``.

    Returns: uint8 image [size, size, 3]. Objects do not touch (a 2-pixel gap), so connected
    components recover them exactly; unconstrained colours are drawn at random.
    """
    scale = size / 32.0
    objs = []
    for o in spec.objects:
        for _ in range(o.count):
            color = o.color or list(COLORS)[rng.integers(len(COLORS))]
            objs.append((o.shape, color))
    for _ in range(max_tries):
        placed: list[tuple[float, float, float]] = []
        ok = True
        for _shape in objs:
            r = float(rng.uniform(4.0, 5.5)) * scale
            for _ in range(50):
                cx, cy = rng.uniform(r + 1, size - r - 1, size=2)
                if all(max(abs(cx - px), abs(cy - py)) > r + pr + 2 * scale for px, py, pr in placed):
                    placed.append((float(cx), float(cy), r))
                    break
            else:
                ok = False
                break
        if ok and spec.relation is not None:
            ok = _relation_holds(spec.relation, placed[0][:2], placed[1][:2], margin=4 * scale)
        if ok:
            break
    else:
        raise RuntimeError(f"could not place the objects of {spec.prompt!r} in {size}x{size}")
    img = np.zeros((size, size, 3), dtype=np.uint8)
    for (shape, color), (cx, cy, r) in zip(objs, placed):
        img[_shape_mask(shape, cx, cy, r, size)] = COLORS[color]
    return img
