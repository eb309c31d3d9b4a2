"""Held-out accuracy of a run's newest checkpoint on the 64 evaluation prompts x 16 samples (1,024, a seed
each, as the evaluator draws them; the runs' own evaluation draws 4 a prompt). Usage: python eval_16_seeds.py RUN"""
import sys, json, torch
torch.set_num_threads(1)
from flowgrpo.commands.probe import load_shapes_policy
from flowgrpo.shapes.evaluate import evaluate_policy
pol = load_shapes_policy(sys.argv[1])[0]
with torch.no_grad():
    r = evaluate_policy(pol, num_prompts=64, seeds_per_prompt=16).to_json()
print(json.dumps({"run": sys.argv[1].split("/")[-1], "seeds_per_prompt": 16, "accuracy": r["accuracy"], "accuracy_unseen": r.get("accuracy_unseen"), "per_tag": r["per_tag"], "num_samples": r.get("num_samples")}))
