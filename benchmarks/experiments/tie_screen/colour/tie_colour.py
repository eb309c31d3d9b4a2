"""Relation outcome split by whether A and B share a colour: 132 held-out position prompts x 8 seeds
(8000-8007), 20 Euler steps, or with SAMPLER "sde:A:N" N steps of the flow-GRPO SDE at noise level A
(a diagnostic: the world evaluates with the ODE). Also the strict accuracy and the fidelity of all
these position samples. Usage: python tie_colour.py WEIGHTS [GUIDANCE [SAMPLER]]"""
import sys, json, torch
torch.set_num_threads(1)
from flowgrpo.commands.probe import load_shapes_policy
from flowgrpo.shapes.evaluate import generate_ode, score_shapes, seeded_noise, sigma_grid
from flowgrpo.shapes.prompts import split_specs
from flowgrpo.shapes.verify import detect, group_hits
from flowgrpo.shapes.relation_probe import relation_holds_rate, relation_kind, same_colour_pair
from flowgrpo.images import to_uint8
from flowgrpo.samplers.steps import sde_step


def generate_sde(pol, prompts, seeds, a, n):
    """Flow-GRPO SDE sampling (noise level a, n steps), the noise of each step drawn from the seed."""
    x = seeded_noise(seeds, pol.latent_shape).to(pol.device); sig = sigma_grid(n, 1.0)
    gen = torch.Generator().manual_seed(seeds[0] * 7919 + len(seeds))
    cond = pol.encode_prompts(prompts)
    for i in range(n):
        v = pol.velocity(x, float(sig[i]), cond, None)
        step = sde_step(x, v, float(sig[i]), float(sig[i + 1]), noise_level=a, generator=gen, sigma_max=float(sig[1]))
        x = step.mean if i == n - 1 else step.prev_sample  # the last step lands on its mean (sigma 0)
    return pol.decode(x).cpu()


w = sys.argv[1] or None
g = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
sampler = sys.argv[3] if len(sys.argv) > 3 else "ode"
specs = list(split_specs("position")[1]); seeds = list(range(8000, 8008))
ps = [s for s in specs for _ in seeds]; sd = [x for _ in specs for x in seeds]
pol = load_shapes_policy(w)[0]; pol.guidance_scale = g
if torch.cuda.is_available():  # the seeds' noise is drawn on the CPU either way, so the draws match
    pol.to("cuda")
with torch.no_grad():
    if sampler == "ode":
        imgs = to_uint8(generate_ode(pol, [s.prompt for s in ps], sd, num_steps=20, shift=1.0))
    else:
        _, a, n = sampler.split(":")
        imgs = to_uint8(torch.cat([generate_sde(pol, [s.prompt for s in ps[i:i + 128]], sd[i:i + 128], float(a), int(n))
                                   for i in range(0, len(ps), 128)]))
dets = [detect(im) for im in imgs]
rates = relation_holds_rate(list(zip(ps, dets)))  # the probe's own split (same_colour / other_colours)


def ties_adjacent(one_colour: bool) -> float:
    """Share of the ties whose two objects are neighbours across the relation's axis."""
    ties = [(s, d) for s, d in zip(ps, dets) if same_colour_pair(s) == one_colour and relation_kind(s, d) == "same_line"]
    adj = 0
    for s, d in ties:
        (a,), (b,) = [group_hits(o, d) for o in s.objects]
        adj += abs(a.row - b.row) == 1 if s.relation in ("left of", "right of") else abs(a.col - b.col) == 1
    return adj / max(len(ties), 1)


out = {name: {"holds": r["rate"], "same_line": r["same_line"], "reversed": r["reversed"], "eligible": r["eligible"],
              "ties_adjacent": ties_adjacent(key == "same_colour")}
       for name, key in (("same colour", "same_colour"), ("different colours", "other_colours"))
       for r in [rates[key]]}
ev = score_shapes([s.prompt for s in ps], torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255.0)
print(json.dumps({"weights": w, "guidance": g, "sampler": sampler, "position_accuracy": ev.accuracy,
                  "position_fidelity": ev.fidelity, **out}))
