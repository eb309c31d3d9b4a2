"""The shapes world's evaluator: ODE sampling with fixed seeds, scored by the verifier.

Registered as ``shapes`` in :data:`flowgrpo.evaluation.EVALUATORS`; the shapes policy names it as
its own (``eval.evaluator=auto``).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch import Tensor

from ..evaluators import EvalResult, seed_standard_error
from ..images import to_uint8
from ..samplers import euler_step, sigma_grid
from .fidelity import fidelity_parts
from .prompts import heldout_specs, is_heldout, parse_prompt, seen_specs
from .verify import verify


def seeded_noise(seeds: list[int], shape: tuple[int, ...]) -> Tensor:
    """One standard-normal latent per seed, [len(seeds), *shape]; independent of batch layout."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds])


@torch.no_grad()
def euler_ode(policy, prompts: list[str], x: Tensor, sigmas: Tensor, guidance_scale: float | None = None,
              micro_batch: int = 128) -> Tensor:
    """Euler ODE from states x [N, 3, H, W] along ``sigmas`` (descending, [T + 1], ending at 0).
    Returns images [N, 3, H, W] in [0, 1] (float32, on CPU)."""
    out = []
    for start in range(0, len(prompts), micro_batch):
        cond = policy.encode_prompts(prompts[start:start + micro_batch])
        xs = x[start:start + micro_batch].to(policy.device)
        for i in range(len(sigmas) - 1):
            v = policy.velocity(xs, float(sigmas[i]), cond, guidance_scale)
            xs = euler_step(xs, v, sigmas[i], sigmas[i + 1])
        out.append(policy.decode(xs).cpu())
    return torch.cat(out)


def generate_ode(policy, prompts: list[str], seeds: list[int], num_steps: int = 20, shift: float = 1.0,
                 guidance_scale: float | None = None, micro_batch: int = 128) -> Tensor:
    """Euler ODE sampling from each seed's noise (:func:`seeded_noise`) over ``num_steps`` steps of the
    shifted grid. Returns images [N, 3, H, W] in [0, 1] (float32, on CPU)."""
    return euler_ode(policy, prompts, seeded_noise(seeds, policy.latent_shape), sigma_grid(num_steps, shift),
                     guidance_scale, micro_batch)


def finish_ode(policy, prompts: list[str], x: Tensor, sigma: float, num_steps: int = 20,
               micro_batch: int = 128) -> Tensor:
    """Complete Euler ODE sampling from states x [N, 3, H, W] at noise level ``sigma`` to 0, in
    ceil(num_steps * sigma) equal steps (the density of a ``num_steps`` grid at shift 1). Returns
    images [N, 3, H, W] in [0, 1] (float32, on CPU)."""
    steps = max(1, int(np.ceil(num_steps * sigma - 1e-9)))
    return euler_ode(policy, prompts, x, torch.linspace(float(sigma), 0.0, steps + 1), None, micro_batch)


def score_shapes(prompts: list[str], images: Tensor) -> EvalResult:
    """Held-out metrics: strict accuracy overall, per tag and on never-trained prompts only
    (``accuracy_unseen``), the mean partial score, the mean image fidelity (how cleanly the images
    are drawn, whatever they show: :mod:`flowgrpo.shapes.fidelity`) and the per-sample verdicts
    (``correct``)."""
    arr = to_uint8(images)
    per_tag: dict[str, list[float]] = defaultdict(list)
    scores, correct, unseen = [], [], []
    for prompt, img in zip(prompts, arr):
        spec = parse_prompt(prompt)
        r = verify(spec, img)
        per_tag[spec.tag].append(r["correct"])
        correct.append(r["correct"])
        scores.append(r["score"])
        if is_heldout(spec):
            unseen.append(r["correct"])
    return EvalResult(
        accuracy=float(np.mean(correct)),
        accuracy_unseen=float(np.mean(unseen)) if unseen else None,  # null in JSON, never NaN
        num_unseen=len(unseen),
        score=float(np.mean(scores)),
        fidelity=float(np.mean(fidelity_parts(arr)[0])),
        per_tag={t: float(np.mean(v)) for t, v in sorted(per_tag.items())},
        num_samples=len(prompts),
        correct=[float(c) for c in correct],
        accuracy_se=seed_standard_error(correct, prompts),
    )


def heldout_prompts(num_prompts: int = 64, seeds_per_prompt: int = 4, base_seed: int = 1000,
                    split: str = "heldout") -> tuple[list[str], list[int]]:
    """The fixed evaluation (prompt, seed) pairs, prompt-major, seeds ``base_seed + j``.

    ``split="heldout"``: prompts never trained on (wherever the grammar allows);
    ``split="seen"``: prompts from the training pools."""
    if split not in ("heldout", "seen"):
        raise ValueError(f"unknown evaluation split {split!r}; valid: heldout, seen")
    specs = heldout_specs(num_prompts) if split == "heldout" else seen_specs(num_prompts)
    prompts = [s.prompt for s in specs for _ in range(seeds_per_prompt)]
    seeds = [base_seed + i for i in range(len(prompts))]
    return prompts, seeds


def evaluate_policy(policy, num_prompts: int = 64, seeds_per_prompt: int = 4, num_steps: int = 20,
                    shift: float = 1.0, guidance_scale: float | None = None, return_images: bool = False,
                    split: str = "heldout") -> EvalResult:
    """Shapes-world evaluation of a policy on a fixed prompt split (accuracy overall and per tag)."""
    prompts, seeds = heldout_prompts(num_prompts, seeds_per_prompt, split=split)
    was_training = policy.training
    policy.eval()
    images = generate_ode(policy, prompts, seeds, num_steps, shift, guidance_scale)
    policy.train(was_training)
    res = score_shapes(prompts, images)
    if return_images:
        res.images, res.prompts = images, prompts
    return res


def evaluate_shapes_model(model, num_prompts: int = 64, seeds_per_prompt: int = 4, num_steps: int = 20,
                          guidance_scale: float = 1.0) -> dict:
    """Evaluate a bare :class:`~flowgrpo.shapes.model.ShapesFlowModel` (used during pretraining)."""
    from .policy import ShapesPolicy

    policy = ShapesPolicy(model, guidance_scale=guidance_scale, train_mode="frozen")
    return evaluate_policy(policy, num_prompts, seeds_per_prompt, num_steps, guidance_scale=guidance_scale).to_json()


class ShapesEvaluator:
    """``eval.evaluator=shapes``: verifier accuracy on ``eval.num_prompts`` x ``eval.seeds_per_prompt``
    fixed (prompt, seed) pairs, sampled by ``eval.num_steps`` Euler ODE steps on the ``shift`` grid."""

    name = "shapes"

    def __init__(self, eval_cfg, shift: float = 1.0):
        self.num_prompts, self.seeds_per_prompt = eval_cfg.num_prompts, eval_cfg.seeds_per_prompt
        self.num_steps, self.shift = eval_cfg.num_steps, shift

    def samples_held(self) -> int:
        """Samples whose images one evaluation holds at once: all of them (``generate_ode`` returns
        [N, 3, H, W]); :mod:`flowgrpo.memory_floor` refuses a count the machine cannot hold."""
        return self.num_prompts * self.seeds_per_prompt

    def evaluate(self, policy, split: str = "heldout", keep_images: bool = False) -> EvalResult:
        return evaluate_policy(policy, self.num_prompts, self.seeds_per_prompt, self.num_steps, self.shift,
                               return_images=keep_images, split=split)
