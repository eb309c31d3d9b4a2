"""Prompt sources: what each training iteration asks the policy to draw."""

from __future__ import annotations

import numpy as np

from .seeds import PROMPTS
from .shapes.prompts import load_prompt_file, sample_train_spec


class PromptSource:
    """Deterministic prompt batches: ``batch(iteration, n)`` depends only on (seed, iteration).

    ``spec`` is "shapes" (fresh procedural shapes-world prompts every iteration, from the training
    pools only: held-out prompts are never trained on) or the path of a .txt / .jsonl prompt file
    (prompts drawn without replacement within an iteration).
    """

    def __init__(self, spec: str, seed: int = 0):
        self.spec = spec
        self.seed = seed
        self.rows = None if spec == "shapes" else load_prompt_file(spec)

    def batch(self, iteration: int, n: int) -> list[str]:
        rng = np.random.default_rng([self.seed, iteration, PROMPTS])
        if self.rows is None:
            return [sample_train_spec(rng).prompt for _ in range(n)]
        idx = rng.choice(len(self.rows), size=n, replace=len(self.rows) < n)
        return [self.rows[i]["prompt"] for i in idx]
