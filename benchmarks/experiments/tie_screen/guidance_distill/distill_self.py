"""Guidance distillation of an RL-trained shapes policy into itself (issue 29, 27 Nov, fourth session):
the policy's guidance-1 prediction is fine-tuned toward its own frozen copy's classifier-free-guided
one at scale G,  target = x0_u + G (x0_c - x0_u), on states x_sigma = (1 - sigma) x0 + sigma eps
whose x0 are the policy's OWN guidance-1 samples of training prompts (no world data, no reward):
2048 samples drawn once (seeds 0..2047, 20 Euler steps), 10 % of the captions empty (target: the
teacher's unconditional prediction, so guidance keeps working), the pretraining noise-level sampler.
The question: does the guided policy's coordination (ties) move into guidance 1 at the same accuracy
and fidelity? The EMA (0.99) of the student is saved as OUT/step_N every 200 steps.

With SIGMA_LO > 0 the guidance applies only where sigma >= SIGMA_LO (a guidance interval: below it the
target is the teacher's conditional prediction). The sample pool is kept in OUT/pool.pt and reused.

Usage: python distill_self.py RUN_OR_WEIGHTS OUT G [STEPS [LR [SIGMA_LO [POOL]]]]
"""
import sys
from pathlib import Path
import numpy as np
import torch
torch.set_num_threads(1)
from flowgrpo.shapes.evaluate import generate_ode
from flowgrpo.shapes.prompts import sample_train_spec
from flowgrpo.commands.probe import load_shapes_policy
from distill import distill  # the same loop (this script's folder is on sys.path when run)

src, out, G = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 800
lr = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-4
sigma_lo = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
batch, pool_n = 64, 2048
torch.manual_seed(0); rng = np.random.default_rng(0)
policy = load_shapes_policy(src)[0]
teacher = policy.model
out.mkdir(parents=True, exist_ok=True)
pool_path = Path(sys.argv[7]) if len(sys.argv) > 7 else out / "pool.pt"
if pool_path.exists():
    pool = torch.load(pool_path)
else:
    prompts = [sample_train_spec(rng).prompt for _ in range(pool_n)]
    with torch.no_grad():
        imgs = generate_ode(policy, prompts, list(range(pool_n)), num_steps=20, shift=1.0)
    pool = {"x0": imgs * 2 - 1, "prompts": prompts}
    torch.save(pool, pool_path)


def from_pool(rng, b):
    """b of the policy's own samples, 10 % of their captions empty."""
    idx = rng.integers(pool_n, size=b)
    return pool["x0"][idx], ["" if rng.random() < 0.1 else pool["prompts"][i] for i in idx]


distill(teacher, from_pool, G, sigma_lo, steps, lr, out, {"teacher": src, "data": "own samples"}, rng, batch)
