"""Are A and B placed jointly, or each from its own marginal? 132 held-out position prompts x 8 seeds
(8000-8007), 20 Euler ODE steps (the sample set of ../colour/tie_colour.py). Over samples with exactly
one A and one B detected: the observed relation-holds rate, and the rate the same samples would give if
each object's cell were drawn independently from its observed cell distribution, one object a cell
(flowgrpo.shapes.relation_probe.placement_null, the probe's ``if_independent``). ``training_data`` is
the same null for the training scenes' own marginals (uniform over valid cell pairs): 31/35 = 0.886.
A model with holds ~ if_independent coordinates nothing; the gap is what it couples.
Usage: python coupling.py WEIGHTS_or_RUN [GUIDANCE]"""
import sys, json
import numpy as np, torch
torch.set_num_threads(1)
from flowgrpo.commands.probe import load_shapes_policy
from flowgrpo.shapes.evaluate import generate_ode
from flowgrpo.shapes.prompts import split_specs
from flowgrpo.shapes.relation_probe import as_left_of, independent_placement_rates, relation_holds_rate
from flowgrpo.shapes.verify import detect, group_hits
from flowgrpo.shapes.world import GRID, relation_holds
from flowgrpo.images import to_uint8


def training_marginals() -> tuple[np.ndarray, np.ndarray]:
    """A's and B's cell distributions [16] over the training scenes of "A left of B"."""
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
    samples = [(s, detect(im)) for s, im in zip(ps, imgs)]
    rates = relation_holds_rate(samples)
    cols = np.zeros((2, GRID))  # A's and B's column in the "left of" frame
    for s, dets in samples:
        hits = [group_hits(o, dets) for o in s.objects]
        if len(hits[0]) == 1 and len(hits[1]) == 1:
            for i, (h,) in enumerate(hits):
                cols[i, as_left_of(s.relation, h.row, h.col)[1]] += 1
    col = lambda i: [round(float(x), 3) for x in cols[i] / max(cols[i].sum(), 1)]
    print(json.dumps({"weights": w, "guidance": g, "eligible": rates["eligible"],
                      "observed": {"holds": rates["rate"], "same_line": rates["same_line"], "reversed": rates["reversed"]},
                      "if_independent": rates["if_independent"],
                      "training_data_if_independent": independent_placement_rates(*training_marginals()),
                      "column_marginal_A": col(0), "column_marginal_B": col(1)}))
