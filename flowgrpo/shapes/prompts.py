"""Prompts of the shapes world: the train/held-out split, the fixed evaluation sets, the training pools
as a procedural prompt source (:class:`TrainingPrompts`, what ``data.prompts=shapes`` draws from).

Every shapes prompt parses back into its :class:`SceneSpec` (:func:`parse_prompt`), so the
verifiable reward needs nothing but the prompt string and the image.

The grammar is closed, so "held-out" means *prompts never trained on*: a fixed quarter of every
tag's prompts (combinations of count, colour, shape and relation) is set aside, and neither
pretraining nor GRPO ever sees them. Each held-out prompt is an interpolation: every pair of factors
it combines within a group appears in some training prompt (:func:`factor_pairs`). ``single_object``
has only three prompts, too few to split: its held-out samples use seen prompts with new seeds
(reported apart as ``unseen`` = False).

Training can also draw **colour-free counting prompts** ("four triangles", GenEval's own counting form:
:func:`free_counting_specs`) as a share of the counting draws (``free_counting_share``; off by default).
They train the count with its shape alone, where every coloured counting prompt ties it to one
colour-shape pair. They sit outside the split (none is held out; the held-out pools are the coloured
prompts' either way), and a colour-free group is never drawn in one colour
(:func:`~flowgrpo.shapes.world.place`), so no training image shows a held-out prompt's scene. Measured
in pretraining and in RL, they did not make the default's counting generalise
(docs/results/counting_generalisation.md), so the default world leaves them out.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .world import COLORS, NUMBERS, RELATIONS, SHAPES, TAGS, ObjectSpec, SceneSpec, all_specs

HELDOUT_SEED = 20261122
HELDOUT_FRACTION = 0.25
#: default share of the counting draws of training (pretraining's and RL's) that are colour-free counting
#: prompts (:func:`free_counting_specs`): none, the world as measured everywhere. 0.25 (about their share
#: of the counting prompts, 9 of 37) did not help held-out counting: docs/results/counting_generalisation.md
FREE_COUNTING_SHARE = 0.0
UNSPLIT_TAGS = ("single_object",)  # too few prompts to hold any out
_WORD_TO_NUMBER = {w: n for n, w in NUMBERS.items()}


def _parse_noun(words: list[str], prompt: str) -> ObjectSpec:
    if not words:
        raise ValueError(f"cannot parse shapes prompt {prompt!r}: missing object")
    if words[0] == "a":
        count, rest = 1, words[1:]
    elif words[0] in _WORD_TO_NUMBER:
        count, rest = _WORD_TO_NUMBER[words[0]], words[1:]
    else:
        raise ValueError(f"cannot parse shapes prompt {prompt!r}: expected 'a' or a number, got {words[0]!r}")
    color = None
    if rest and rest[0] in COLORS:
        color, rest = rest[0], rest[1:]
    if len(rest) != 1:
        raise ValueError(f"cannot parse shapes prompt {prompt!r}: expected one shape word, got {rest}")
    noun = rest[0]
    shape = noun[:-1] if count > 1 and noun.endswith("s") else noun
    if shape not in SHAPES:
        raise ValueError(f"cannot parse shapes prompt {prompt!r}: unknown shape {noun!r}; valid: {', '.join(SHAPES)}")
    return ObjectSpec(shape, color, count)


def parse_prompt(prompt: str) -> SceneSpec:
    """Inverse of :func:`~flowgrpo.shapes.world.spec_to_prompt`; the tag follows from the structure."""
    text = " ".join(prompt.lower().split())
    for rel in RELATIONS:
        marker = f" {rel} "
        if marker in text:
            left, right = text.split(marker, 1)
            objs = (_parse_noun(left.split(), prompt), _parse_noun(right.split(), prompt))
            return SceneSpec("position", objs, rel)
    parts = text.split(" and ")
    objs = tuple(_parse_noun(p.split(), prompt) for p in parts)
    if len(objs) == 1:
        o = objs[0]
        tag = "counting" if o.count > 1 else ("colors" if o.color else "single_object")
    elif len(objs) == 2:
        tag = "color_attr" if all(o.color for o in objs) else "two_object"
    else:
        raise ValueError(f"cannot parse shapes prompt {prompt!r}: at most two object groups")
    return SceneSpec(tag, objs)


def factor_pairs(spec: SceneSpec) -> frozenset:
    """The pairs of factors ``spec`` combines within one object group: (count, colour), (count, shape)
    and (colour, shape), each factor as ``(field, value)``. A prompt is an *interpolation* of a prompt
    pool when the pool holds every one of its pairs (in any prompt, of any tag)."""
    pairs = set()
    for o in spec.objects:
        a, b, c = ("count", o.count), ("colour", o.color), ("shape", o.shape)
        pairs |= {(a, b), (a, c), (b, c)}
    return frozenset(pairs)


@lru_cache(maxsize=None)
def _splits() -> dict[str, tuple[tuple[SceneSpec, ...], tuple[SceneSpec, ...]]]:
    """Every tag's (train, held-out) pools; see :func:`split_specs`."""
    held: dict[str, list[SceneSpec]] = {}
    for tag in TAGS:
        specs = all_specs(tag)
        if tag in UNSPLIT_TAGS:
            held[tag] = []
            continue
        order = np.random.default_rng([HELDOUT_SEED, TAGS.index(tag)]).permutation(len(specs))
        k = max(1, int(round(len(specs) * HELDOUT_FRACTION)))
        held[tag] = [specs[i] for i in sorted(order[:k])]
    # Held-out prompts must be interpolations: a combination never captioned whose every pair of
    # factors was. The random quarter held out all three "four yellow ..." prompts, so "four" and
    # "yellow" never met in training, and no conditioning can learn from data what they mean together.
    # The first such prompt (in tag order, then grammar order) goes back to training, which makes
    # the pair seen for the others; the pools that remain held out were never trained on by anything.
    seen = set().union(*(factor_pairs(s) for t in TAGS for s in all_specs(t) if s not in held[t]))
    for tag in TAGS:
        for spec in list(held[tag]):
            missing = factor_pairs(spec) - seen
            if missing:
                held[tag].remove(spec)
                seen |= missing
    out = {}
    for tag in TAGS:
        specs = all_specs(tag)
        if tag in UNSPLIT_TAGS:
            out[tag] = (specs, specs)
        else:
            out[tag] = (tuple(s for s in specs if s not in held[tag]), tuple(held[tag]))
    return out


def split_specs(tag: str) -> tuple[tuple[SceneSpec, ...], tuple[SceneSpec, ...]]:
    """(train, held-out) prompt pools of one tag: a fixed shuffle holds out a quarter, then any held-out
    prompt that is not an interpolation of the training pools (:func:`factor_pairs`) goes back to
    training (today one: "four yellow circles").

    Tags in :data:`UNSPLIT_TAGS` return the full pool as both (nothing can be held out)."""
    if tag not in TAGS:
        raise ValueError(f"unknown tag {tag!r}; valid tags: {', '.join(TAGS)}")
    return _splits()[tag]


def is_heldout(spec: SceneSpec) -> bool:
    """Whether ``spec``'s prompt is never trained on (always False for unsplit tags)."""
    return spec.tag not in UNSPLIT_TAGS and spec in split_specs(spec.tag)[1]


@lru_cache(maxsize=None)
def free_counting_specs() -> tuple[SceneSpec, ...]:
    """The colour-free counting prompts, "two circles" ... "four triangles" (count, then shape order):
    training-only, outside :func:`split_specs` (see the module docstring)."""
    return tuple(SceneSpec("counting", (ObjectSpec(s, None, n),)) for n in NUMBERS for s in SHAPES)


def sample_train_spec(rng: np.random.Generator, tag: str | None = None,
                      free_counting_share: float = FREE_COUNTING_SHARE) -> SceneSpec:
    """A random *training* scene: uniform over tags, then over the tag's training pool; for counting, a
    colour-free counting prompt (:func:`free_counting_specs`) with probability ``free_counting_share``.
    At share 0 (the default) no random number is spent on the choice, so the draws are those of the
    world without colour-free counting, the one the shipped weights were pretrained on."""
    tag = tag or TAGS[rng.integers(len(TAGS))]
    if tag == "counting" and free_counting_share > 0 and rng.random() < free_counting_share:
        free = free_counting_specs()
        return free[rng.integers(len(free))]
    pool = split_specs(tag)[0]
    return pool[rng.integers(len(pool))]


def _eval_specs(num_prompts: int, which: int, salt: int) -> list[SceneSpec]:
    # each tag's prompts in a fixed shuffled order, repeated only once all have been drawn: every
    # prompt of a pool weighs the same (independent draws gave one of counting's 9 held-out prompts
    # 4 of the set's 11 counting slots)
    rng = np.random.default_rng([HELDOUT_SEED, salt])
    pools = {t: split_specs(t)[which] for t in TAGS}
    orders = {t: rng.permutation(len(pools[t])) for t in TAGS}
    out = []
    for i in range(num_prompts):
        tag, j = TAGS[i % len(TAGS)], i // len(TAGS)
        out.append(pools[tag][orders[tag][j % len(pools[tag])]])
    return out


def heldout_specs(num_prompts: int = 64) -> list[SceneSpec]:
    """The fixed held-out evaluation set: ``num_prompts`` scenes balanced over the six tags, drawn
    from the held-out pools (prompts never trained on wherever the grammar allows), each tag's
    prompts once in a fixed order before any repeats."""
    return _eval_specs(num_prompts, 1, 1)


def seen_specs(num_prompts: int = 64) -> list[SceneSpec]:
    """The fixed *seen* evaluation set: like :func:`heldout_specs` but from the training pools."""
    return _eval_specs(num_prompts, 0, 2)


class TrainingPrompts:
    """The training pools as a procedural prompt source (:class:`flowgrpo.data.PromptSource` with
    ``data.prompts=shapes``): fresh prompts every draw (:func:`sample_train_spec`, with
    ``free_counting_share`` of the counting draws colour-free), never a held-out one; keyed by the six tags."""

    tags = TAGS

    def __init__(self, free_counting_share: float = FREE_COUNTING_SHARE):
        if not 0.0 <= free_counting_share <= 1.0:
            raise ValueError(f"free_counting_share must be in [0, 1], got {free_counting_share}")
        self.free_counting_share = free_counting_share

    def sample(self, rng: np.random.Generator, tag: str | None = None) -> tuple[str, str]:
        """(prompt, tag) of one training scene drawn with ``rng`` (of ``tag`` when given)."""
        spec = sample_train_spec(rng, tag, self.free_counting_share)
        return spec.prompt, spec.tag
