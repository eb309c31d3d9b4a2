"""relation_rates.py at classifier-free guidance scales: 48 held-out position prompts x 8 seeds, 20
Euler steps, shift 1. Usage: python relation_rates_guidance.py WEIGHTS_DIR_or_RUN_or_"" 2 4 ("" = the
shipped weights; a run: its EMA weights, as `flowgrpo shapes probe --weights RUN`). Results of 27 Nov (third session):
benchmarks/results/tie_screen/placement/results.csv."""
import sys, json, numpy as np, torch
torch.set_num_threads(1)
from flowgrpo.commands.probe import load_shapes_policy
from flowgrpo.shapes.evaluate import generate_ode
from flowgrpo.shapes.prompts import split_specs
from flowgrpo.shapes.verify import detect
from flowgrpo.shapes.relation_probe import relation_holds_rate
from flowgrpo.images import to_uint8
w = sys.argv[1] or None
specs = list(split_specs("position")[1])
rng = np.random.default_rng(0); specs = [specs[i] for i in rng.permutation(len(specs))[:48]]
seeds = list(range(8000, 8008))
ps = [s for s in specs for _ in seeds]; sd = [x for _ in specs for x in seeds]
pol = load_shapes_policy(w)[0]
for g in [float(x) for x in sys.argv[2:]]:
    pol.guidance_scale = g  # the empty prompt is encoded for guidance once the scale is not 1
    with torch.no_grad():
        imgs = to_uint8(generate_ode(pol, [s.prompt for s in ps], sd, num_steps=20, shift=1.0))
    r = relation_holds_rate([(s, detect(im)) for s, im in zip(ps, imgs)])
    print(w, "cfg", g, json.dumps(r), flush=True)
