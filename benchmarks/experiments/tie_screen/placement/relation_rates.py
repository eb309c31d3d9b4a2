"""Relation holds / same line / reversed in free sampling: 48 held-out position prompts x 8 seeds,
Euler ODE at each STEPS:SHIFT given. Usage: python relation_rates.py WEIGHTS_DIR_or_"" 20:1 [10:1 ...]
("" = the shipped weights). Results of 27 Nov:
benchmarks/results/tie_screen/placement/results.csv."""
import sys, json, numpy as np, torch
torch.set_num_threads(1)
from flowgrpo.shapes.policy import ShapesPolicy
from flowgrpo.shapes.model import ShapesFlowModel
from flowgrpo.shapes.evaluate import generate_ode
from flowgrpo.shapes.prompts import split_specs
from flowgrpo.shapes.verify import detect
from flowgrpo.shapes.relation_probe import relation_holds_rate
from flowgrpo.images import to_uint8
w = sys.argv[1] if len(sys.argv) > 1 else None
pol = ShapesPolicy(ShapesFlowModel.load(w), train_mode="frozen") if w else ShapesPolicy(train_mode="frozen")
pol.eval()
specs = list(split_specs("position")[1])
rng = np.random.default_rng(0); specs = [specs[i] for i in rng.permutation(len(specs))[:48]]
seeds = list(range(8000, 8008))
ps = [s for s in specs for _ in seeds]; sd = [x for _ in specs for x in seeds]
for steps, shift in [(int(a), float(b)) for a, b in (x.split(":") for x in sys.argv[2:])]:
    with torch.no_grad():
        imgs = to_uint8(generate_ode(pol, [s.prompt for s in ps], sd, num_steps=steps, shift=shift))
    r = relation_holds_rate([(s, detect(im)) for s, im in zip(ps, imgs)])
    print(steps, shift, json.dumps(r), flush=True)
