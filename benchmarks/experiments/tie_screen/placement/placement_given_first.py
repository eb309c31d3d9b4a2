"""flowgrpo.shapes.relation_probe.placement_given_first on 16 held-out position prompts (2 draws per cell).
Usage: python placement_given_first.py WEIGHTS_or_RUN_or_"" 0.9 [0.95]. Results of 27 Nov:
benchmarks/results/tie_screen/placement/results.csv."""
import sys, json, torch
torch.set_num_threads(1)
from flowgrpo.commands.probe import load_shapes_policy
from flowgrpo.images import to_uint8
from flowgrpo.shapes.evaluate import finish_ode
from flowgrpo.shapes.prompts import split_specs
from flowgrpo.shapes.relation_probe import placement_given_first
from flowgrpo.shapes.verify import detect
import numpy as np
w = sys.argv[1] or None
pol, shift, desc = load_shapes_policy(w)
specs = list(split_specs("position")[1]); rng = np.random.default_rng(0)
specs = [specs[i] for i in rng.permutation(len(specs))[:16]]
fin = lambda p, x, s: to_uint8(finish_ode(pol, p, x, s))
for sig in [float(a) for a in sys.argv[2:]]:
    r = placement_given_first(fin, detect, specs, sigma=sig, draws=2)
    print(desc[-60:], json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
