"""Are A and B placed jointly, or each from its own marginal? 132 held-out position prompts x 8 seeds
(8000-8007), 20 Euler ODE steps (the sample set of ../colour/tie_colour.py). Over samples with exactly
one A and one B detected: the observed relation-holds rate, and the rate the same samples would give if
each object's cell were drawn independently from its observed cell distribution (one object a cell):

    holds_if_independent = sum_{c1 != c2, relation holds} pA(c1) pB(c2) / sum_{c1 != c2} pA(c1) pB(c2)

with pA, pB the empirical 16-cell distributions of A and B, pooled over the prompts of one relation
(each relation's cells mapped onto "left of" by a reflection or a transpose). ``training_data`` is the
same null for the training distribution's own marginals (uniform over valid cell pairs, world.place):
0.886. A model with holds ~ holds_if_independent coordinates nothing; the gap is what it couples.
Usage: python coupling.py WEIGHTS_or_RUN [GUIDANCE]"""
import sys, json
import numpy as np, torch
torch.set_num_threads(1)
from flowgrpo.trainer.checkpoint import load_shapes_policy
from flowgrpo.shapes.evaluate import generate_ode
from flowgrpo.shapes.prompts import split_specs
from flowgrpo.shapes.verify import detect, group_hits
from flowgrpo.shapes.world import GRID, relation_holds
from flowgrpo.images import to_uint8


def to_left_of(relation: str, r: int, c: int) -> tuple[int, int]:
    """The cell (r, c) of a ``relation`` scene mapped so that the relation reads "left of"."""
    return {"left of": (r, c), "right of": (r, GRID - 1 - c), "above": (c, r), "below": (c, GRID - 1 - r)}[relation]


def independent_holds(pa: np.ndarray, pb: np.ndarray) -> dict:
    """Holds / same-column / reversed rates of "A left of B" when A ~ pa and B ~ pb ([16] cell
    distributions) are drawn independently into distinct cells."""
    tot = {"holds": 0.0, "same_line": 0.0, "reversed": 0.0}
    for c1 in range(GRID * GRID):
        for c2 in range(GRID * GRID):
            if c1 == c2:
                continue
            k1, k2 = c1 % GRID, c2 % GRID  # columns
            kind = "holds" if k1 < k2 else "same_line" if k1 == k2 else "reversed"
            tot[kind] += pa[c1] * pb[c2]
    z = sum(tot.values())
    return {k: v / z for k, v in tot.items()}


def training_marginals() -> tuple[np.ndarray, np.ndarray]:
    pa, pb = np.zeros(GRID * GRID), np.zeros(GRID * GRID)
    for c1 in range(GRID * GRID):
        for c2 in range(GRID * GRID):
            if c1 != c2 and relation_holds("left of", divmod(c1, GRID), divmod(c2, GRID)):
                pa[c1] += 1; pb[c2] += 1
    return pa / pa.sum(), pb / pb.sum()


if __name__ == "__main__":
    w = sys.argv[1] or None
    g = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    specs = list(split_specs("position")[1]); seeds = list(range(8000, 8008))
    ps = [s for s in specs for _ in seeds]; sd = [x for _ in specs for x in seeds]
    pol = load_shapes_policy(w)[0]; pol.guidance_scale = g
    if torch.cuda.is_available():
        pol.to("cuda")
    with torch.no_grad():
        imgs = to_uint8(generate_ode(pol, [s.prompt for s in ps], sd, num_steps=20, shift=1.0))
    pa, pb = np.zeros(GRID * GRID), np.zeros(GRID * GRID)
    kinds = []
    for s, im in zip(ps, imgs):
        hits = [group_hits(o, detect(im)) for o in s.objects]
        if len(hits[0]) != 1 or len(hits[1]) != 1:
            continue
        (a,), (b,) = hits
        ra, ca = to_left_of(s.relation, a.row, a.col); rb, cb = to_left_of(s.relation, b.row, b.col)
        pa[ra * GRID + ca] += 1; pb[rb * GRID + cb] += 1
        kinds.append("holds" if ca < cb else "same_line" if ca == cb else "reversed")
    n = len(kinds)
    observed = {k: kinds.count(k) / n for k in ("holds", "same_line", "reversed")}
    ind = independent_holds(pa / n, pb / n)
    col = lambda p: [round(float(x), 3) for x in (p / p.sum()).reshape(GRID, GRID).sum(0)]
    print(json.dumps({"weights": w, "guidance": g, "eligible": n, "observed": observed, "if_independent": ind,
                      "training_data_if_independent": independent_holds(*training_marginals()),
                      "column_marginal_A": col(pa), "column_marginal_B": col(pb)}))
