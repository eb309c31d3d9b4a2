"""Does a shapes model draw a position prompt's relation? Two measurements of ``flowgrpo shapes probe``
(:func:`flowgrpo.shapes.probe.run_probe` calls both):

1. **Relation-holds rate** (:func:`relation_holds_rate`): over position samples with exactly one A
   and one B detected, the fraction where the prompt's relation holds (0.40 is chance: two random
   cells share a column or row 3 times in 15), and how the misses split into ties and reversals.
2. **Relation prior at high noise** (:func:`relation_prior`, when the model's x0 prediction is
   given): layout is decided at sigma > 0.7, where the prediction is close to the mean scene the
   prompt asks for. For "A left of B" that mean holds more A in the left columns and more B in the
   right ones. Per position prompt, each cell scores how much more it resembles A's glyph than B's,
   and the score's centre of mass along the relation's axis says which way the prior leans. A model
   that ignores the relation leans the right way for half the prompts; the first scene weights did
   exactly that (a flat column profile), which no sampler or RL can fix.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .verify import Detection, group_hits
from .world import GRID, SceneSpec, relation_cells_kind


def to_model_range(img: np.ndarray) -> Tensor:
    """A drawn uint8 image [H, W, 3] as the model's [3, H, W] in [-1, 1]."""
    return torch.from_numpy(img).permute(2, 0, 1).float() / 127.5 - 1.0


def relation_kind(spec: SceneSpec, dets: list[Detection]) -> str | None:
    """For a position spec with exactly one A and one B detected: ``"holds"``, ``"same_line"`` (A and B
    share the relation's axis coordinate, e.g. one column for "left of") or ``"reversed"`` (the opposite
    relation holds); None when not eligible. Separating the two misses matters because they have
    different causes: a reversed scene is a wrong lean, a same-line scene is two placements that were
    not coordinated (random cells share a column 3/15 of the time)."""
    hits = [group_hits(o, dets) for o in spec.objects]
    if len(hits[0]) != 1 or len(hits[1]) != 1:
        return None
    (a,), (b,) = hits
    return relation_cells_kind(spec.relation, (a.row, a.col), (b.row, b.col))


def relation_outcome(spec: SceneSpec, dets: list[Detection]) -> bool | None:
    """For a position spec: whether its relation holds when exactly one A and one B are detected,
    else None (not eligible)."""
    kind = relation_kind(spec, dets)
    return None if kind is None else kind == "holds"


def same_colour_pair(spec: SceneSpec) -> bool:
    """Whether a position spec's two objects are named with one colour ("a red circle below a red
    triangle"). Such pairs are the hard case for a model that lays out colour first: the colour says
    nothing about which object is A (docs/shapes_world.md, "Which prompts tie")."""
    a, b = spec.objects[0].color, spec.objects[1].color
    return a is not None and a == b


def relation_holds_rate(samples: list[tuple[SceneSpec, list[Detection]]]) -> dict:
    """Over position samples with exactly one A and one B: the fraction where the relation holds, and
    the fractions of the misses in which A and B share a line (``same_line``) or stand reversed; the
    same three (and ``eligible``) apart for pairs of one colour (``same_colour``) and the rest
    (``other_colours``), since the first miss about three times as often (docs/shapes_world.md).

    ``rate`` pools samples, so a prompt drawn 64 times (the pass@k part of the probe) weighs 32 times
    one drawn twice; ``prompt_mean`` is the mean over the ``prompts`` distinct position prompts of each
    prompt's own holds fraction, which every prompt enters once."""
    pos = [(s, d, relation_kind(s, d)) for s, d in samples if s.relation is not None]
    ok = [(s, d, k) for s, d, k in pos if k is not None]

    def rates(kinds: list[str]) -> dict:
        fr = kind_fractions(kinds)
        return {"rate": fr["holds"], "same_line": fr["same_line"], "reversed": fr["reversed"], "eligible": len(kinds)}

    by_prompt: dict[str, list[bool]] = {}
    for s, _, k in ok:
        by_prompt.setdefault(s.prompt, []).append(k == "holds")
    return {**rates([k for _, _, k in ok]), "position_samples": len(pos),
            "prompt_mean": float(np.mean([np.mean(v) for v in by_prompt.values()])) if by_prompt else None,
            "prompts": len(by_prompt),
            "if_independent": placement_null([(s, d) for s, d, _ in ok]),
            "same_colour": rates([k for s, _, k in ok if same_colour_pair(s)]),
            "other_colours": rates([k for s, _, k in ok if not same_colour_pair(s)])}


def as_left_of(relation: str, row: int, col: int) -> tuple[int, int]:
    """The cell (row, col) of a scene for ``relation`` mapped (a reflection or a transpose) into the frame
    in which that relation reads "left of": "A rel B" holds iff A's mapped column < B's."""
    return {"left of": (row, col), "right of": (row, GRID - 1 - col),
            "above": (col, row), "below": (col, GRID - 1 - row)}[relation]


def independent_placement_rates(pa: np.ndarray, pb: np.ndarray) -> dict[str, float]:
    """Holds / same-line / reversed fractions of "A left of B" when A's cell ~ ``pa`` and B's ~ ``pb``
    ([16] distributions over the 4 x 4 cells, row-major) are drawn independently, one object a cell."""
    joint = np.outer(pa, pb)
    np.fill_diagonal(joint, 0.0)  # one object a cell
    col = np.arange(GRID * GRID) % GRID
    ca, cb = col[:, None], col[None, :]
    z = joint.sum()
    if z <= 0:
        return {"holds": None, "same_line": None, "reversed": None}
    return {"holds": float(joint[ca < cb].sum() / z), "same_line": float(joint[ca == cb].sum() / z),
            "reversed": float(joint[ca > cb].sum() / z)}


def placement_null(samples: list[tuple[SceneSpec, list[Detection]]]) -> dict[str, float | None]:
    """What the relation's outcome would be if each object were placed on its own: over eligible position
    samples (exactly one A and one B), A's and B's cells are pooled into two 16-cell distributions (each
    relation mapped onto "left of", :func:`as_left_of`) and drawn independently
    (:func:`independent_placement_rates`). A model whose ``rate`` is close to this ``holds`` places each
    object from its own marginal and coordinates nothing; the gap is what it couples. For reference, the
    training scenes' own marginals (uniform over valid cell pairs) give holds 0.886, same line 0.086,
    reversed 0.029, so a model that draws the data's marginals but not its coupling stops at 0.886."""
    if not samples:
        return {"holds": None, "same_line": None, "reversed": None}
    counts = np.zeros((2, GRID * GRID))  # A's and B's cells in the "left of" frame
    for spec, dets in samples:
        for i, obj in enumerate(spec.objects):
            (hit,) = group_hits(obj, dets)
            r, c = as_left_of(spec.relation, hit.row, hit.col)
            counts[i, r * GRID + c] += 1
    return independent_placement_rates(counts[0] / len(samples), counts[1] / len(samples))


def kind_fractions(kinds: list[str]) -> dict[str, float | None]:
    """Fractions of ``"holds"``, ``"same_line"`` and ``"reversed"`` among ``kinds`` (None for each when empty)."""
    return {k: (float(np.mean([x == k for x in kinds])) if kinds else None) for k in ("holds", "same_line", "reversed")}


@torch.no_grad()
def relation_prior(predict_x0, specs: list[SceneSpec], sigma: float = 0.98, draws: int = 16, seed: int = 11) -> dict:
    """Which way the x0 prediction at noise level ``sigma`` leans for position prompts (item 2 above).

    ``predict_x0(prompts, sigma [B], noise [B, 3, 32, 32])`` -> x0 [B, 3, 32, 32] in [-1, 1], the model's
    prediction of the clean image from x = (1 - sigma) * 0 + sigma * noise (pure noise scaled: no scene
    is given, so the prediction is the model's prior). Per cell, ``share`` = (distance to B's glyph -
    distance to A's) / distance between the two glyphs, about P(A here) - P(B here). Along the relation's
    axis, the centred share of each row or column times its index, summed, is the prompt's lean, signed
    so that > 0 is the relation's way. Returns ``{"leans_right_way": fraction of prompts leaning the
    relation's way, "strength": mean lean, "n": prompts}``: 0.5 and 0.0 for a model blind to the
    relation; the mean scene of "A left of B" leans about 0.4 (tests/test_shapes_probe.py)."""
    from .world import CELL, draw

    def template(o) -> Tensor:
        cell = draw([(o.shape, o.color, 0, 0)])[:CELL, :CELL]
        return to_model_range(cell)

    specs = [s for s in specs if s.relation is not None]
    gen = torch.Generator().manual_seed(seed)
    coord = torch.arange(GRID, dtype=torch.float32)
    offsets = []
    for spec in specs:
        noise = torch.randn(draws, 3, GRID * CELL, GRID * CELL, generator=gen)
        x0 = predict_x0([spec.prompt] * draws, torch.full((draws,), sigma), sigma * noise).float()
        cells = x0.view(draws, 3, GRID, CELL, GRID, CELL).permute(0, 2, 4, 1, 3, 5)  # [n, row, col, 3, 8, 8]
        tpl = [template(o) for o in spec.objects]
        contrast = float(((tpl[0] - tpl[1]) ** 2).mean())  # a cell that is A scores +1, one that is B -1
        dist = [((cells - t) ** 2).mean((-3, -2, -1)).mean(0) for t in tpl]  # [row, col]
        share = (dist[1] - dist[0]) / contrast  # about P(A here) - P(B here)
        horizontal = spec.relation in ("left of", "right of")
        profile = (share - share.mean()).mean(0 if horizontal else 1)  # [GRID] along the relation's axis
        centre = float((profile * coord).sum())  # > 0: A's excess lies at high col / row
        offsets.append(-centre if spec.relation in ("left of", "above") else centre)
    if not offsets:
        return {"leans_right_way": None, "strength": None, "n": 0}
    return {"leans_right_way": float(np.mean([o > 0 for o in offsets])), "strength": float(np.mean(offsets)),
            "n": len(offsets)}


def placed_first_scene(spec: SceneSpec, cell: tuple[int, int], sigma: float, lead_sigma: float,
                       noise: Tensor) -> Tensor:
    """The noisy state [3, 32, 32] of a sampler at ``sigma`` in which group 0's first object A has already
    been drawn in ``cell`` = (row, col): A's cell at noise ``lead_sigma``, the rest of the canvas (where B
    has yet to appear) at ``sigma``; ``noise`` [3, 32, 32] is the shared Gaussian draw."""
    from .world import CELL, draw

    a = spec.objects[0]
    x0 = to_model_range(draw([(a.shape, a.color or "red", *cell)]))
    level = torch.full((1, x0.shape[1], x0.shape[2]), float(sigma))
    r, c = cell
    level[:, r * CELL:(r + 1) * CELL, c * CELL:(c + 1) * CELL] = lead_sigma
    return (1 - level) * x0 + level * noise


@torch.no_grad()
def placement_given_first(finish, detect, specs: list[SceneSpec], sigma: float = 0.9, lead_sigma: float = 0.3,
                          draws: int = 4, seed: int = 13) -> dict:
    """Where does B go once A has been drawn? The coordination a tie needs, measured directly.

    For each position spec and each cell where its relation can hold for A (for "A left of B": A in
    columns 0-2), the sampler's state is set to :func:`placed_first_scene` (A drawn, B not yet) and
    ``finish(prompts, x [N, 3, 32, 32], sigma)`` -> uint8 [N, 32, 32, 3] completes the ODE from
    ``sigma``; ``detect(img)`` reads the scene. Over the samples where A stayed in its cell and exactly
    one B appeared: the fraction of B on A's line of the relation's axis (``same_line``; 3 of the 15
    other cells, 0.2, when B is placed without looking at A; 0 for a model that coordinates), on the
    relation's side (``holds``) and on the other (``reversed``); ``kept_first`` is the fraction of
    samples in which A stayed where it was drawn."""
    from .world import CELL, GRID

    gen = torch.Generator().manual_seed(seed)
    states, prompts, meta = [], [], []
    for spec in specs:
        if spec.relation is None:
            continue
        for r in range(GRID):
            for c in range(GRID):
                # cells where some B cell satisfies the relation
                if not any(relation_cells_kind(spec.relation, (r, c), divmod(k, GRID)) == "holds"
                           for k in range(GRID * GRID)):
                    continue
                for _ in range(draws):
                    noise = torch.randn(3, GRID * CELL, GRID * CELL, generator=gen)
                    states.append(placed_first_scene(spec, (r, c), sigma, lead_sigma, noise))
                    prompts.append(spec.prompt)
                    meta.append((spec, (r, c)))
    if not states:
        return {"same_line": None, "holds": None, "reversed": None, "kept_first": None, "eligible": 0, "n": 0}
    images = finish(prompts, torch.stack(states), sigma)
    kinds, kept = [], 0
    for (spec, cell), img in zip(meta, images):
        dets = detect(img)
        a_hits, b_hits = (group_hits(o, dets) for o in spec.objects[:2])
        if not any((d.row, d.col) == cell for d in a_hits):
            continue
        kept += 1
        if len(a_hits) == 1 and len(b_hits) == 1:
            kinds.append(relation_cells_kind(spec.relation, cell, (b_hits[0].row, b_hits[0].col)))
    return {**kind_fractions(kinds), "kept_first": kept / len(states), "eligible": len(kinds), "n": len(states),
            "sigma": sigma, "lead_sigma": lead_sigma}
