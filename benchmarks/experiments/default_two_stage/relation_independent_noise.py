"""Relation holds on the 132 held-out position prompts with a distinct seed for every sample (no noise shared
across prompts, unlike coupling.py). Usage: python relation_independent_noise.py WEIGHTS_or_RUN PER_PROMPT BASE_SEED"""
import sys, json, numpy as np, torch
torch.set_num_threads(1)
from flowgrpo.shapes.prompts import split_specs
from flowgrpo.commands.probe import load_shapes_policy
from flowgrpo.shapes.evaluate import generate_ode
from flowgrpo.shapes.relation_probe import relation_holds_rate
from flowgrpo.shapes.verify import detect
from flowgrpo.images import to_uint8
run, k, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
specs = list(split_specs("position")[1])
ps = [s for s in specs for _ in range(k)]; sd = [base + i for i in range(len(ps))]
pol = load_shapes_policy(run)[0]
with torch.no_grad():
    imgs = to_uint8(generate_ode(pol, [s.prompt for s in ps], sd, num_steps=20, shift=1.0))
r = relation_holds_rate([(s, detect(im)) for s, im in zip(ps, imgs)])
print(json.dumps({"run": run, "per_prompt": k, "base_seed": base, "rate": r["rate"], "prompt_mean": r["prompt_mean"],
                  "eligible": r["eligible"], "same_line": r["same_line"], "reversed": r["reversed"],
                  "if_independent": r["if_independent"]["holds"]}))
