"""Held-out accuracy of bare shapes weights (64 prompts x 4 seeds, 20 Euler steps) at each guidance
scale given. Usage: python heldout_accuracy_guidance.py WEIGHTS_DIR_or_"" 1 1.5 2 3."""
import sys, torch
torch.set_num_threads(1)
from flowgrpo.shapes.model import ShapesFlowModel
from flowgrpo.shapes.evaluate import evaluate_shapes_model
m = ShapesFlowModel.load(sys.argv[1] or None)
for g in [float(x) for x in sys.argv[2:]]:
    r = evaluate_shapes_model(m, guidance_scale=g)
    print(g, round(r["accuracy"], 3), {k: round(v, 2) for k, v in r["per_tag"].items()}, flush=True)
