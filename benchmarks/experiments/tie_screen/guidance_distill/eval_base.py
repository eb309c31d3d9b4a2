"""Held-out accuracy, per-tag accuracy and fidelity of bare shapes weights at guidance 1 (the
training run's own `eval_before`: 64 prompts x 4 seeds, 20 Euler steps). Usage: python eval_base.py WEIGHTS..."""
import json, sys, torch
torch.set_num_threads(1)
from flowgrpo.shapes.model import ShapesFlowModel
from flowgrpo.shapes.evaluate import evaluate_shapes_model
for w in sys.argv[1:]:
    r = evaluate_shapes_model(ShapesFlowModel.load(w or None), guidance_scale=1.0)
    print(json.dumps({"weights": w, "accuracy": r["accuracy"], "accuracy_unseen": r["accuracy_unseen"],
                      "fidelity": r["fidelity"], "per_tag": r["per_tag"]}), flush=True)
