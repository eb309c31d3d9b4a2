"""Deterministic held-out evaluation: ODE sampling with fixed seeds, scored by the verifiable reward."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from torch import Tensor

from .policies.base import Policy
from .samplers import euler_step, sigma_grid
from .shapes.prompts import heldout_specs, is_heldout, parse_prompt, seen_specs
from .shapes.verify import verify


def seeded_noise(seeds: list[int], shape: tuple[int, ...]) -> Tensor:
    """One standard-normal latent per seed, [len(seeds), *shape]; independent of batch layout."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds])


@torch.no_grad()
def generate_ode(policy: Policy, prompts: list[str], seeds: list[int], num_steps: int = 20, shift: float = 1.0,
                 guidance_scale: float | None = None, micro_batch: int = 128) -> Tensor:
    """Euler ODE sampling. Returns images [N, 3, H, W] in [0, 1] (float32, on CPU)."""
    out = []
    sigmas = sigma_grid(num_steps, shift)
    for start in range(0, len(prompts), micro_batch):
        p = prompts[start:start + micro_batch]
        cond = policy.encode_prompts(p)
        x = seeded_noise(seeds[start:start + micro_batch], policy.latent_shape).to(policy.device)
        for i in range(num_steps):
            s = torch.full((x.shape[0],), float(sigmas[i]), device=x.device)
            v = policy.velocity(x, s, cond, guidance_scale)
            x = euler_step(x, v, sigmas[i], sigmas[i + 1])
        out.append(policy.decode(x).cpu())
    return torch.cat(out)


def to_uint8(images: Tensor) -> np.ndarray:
    """[N, 3, H, W] in [0, 1] -> uint8 [N, H, W, 3]."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def score_shapes(prompts: list[str], images: Tensor) -> dict:
    """Held-out metrics: strict accuracy overall, per tag and on never-trained prompts only
    (``accuracy_unseen``), the mean partial score, and the per-sample verdicts (``correct``)."""
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
    return {
        "accuracy": float(np.mean(correct)),
        "accuracy_unseen": float(np.mean(unseen)) if unseen else None,  # null in JSON, never NaN
        "num_unseen": len(unseen),
        "score": float(np.mean(scores)),
        "per_tag": {t: float(np.mean(v)) for t, v in sorted(per_tag.items())},
        "num_samples": len(prompts),
        "correct": correct,
    }


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


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean and standard error of the per-sample change ``after - before`` (same prompts and seeds)."""
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    if len(d) < 2:
        return float(d.mean()) if len(d) else 0.0, float("nan")
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


def evaluate_policy(policy: Policy, num_prompts: int = 64, seeds_per_prompt: int = 4, num_steps: int = 20,
                    shift: float = 1.0, guidance_scale: float | None = None, return_images: bool = False,
                    split: str = "heldout") -> dict:
    """Shapes-world evaluation of a policy on a fixed prompt split (accuracy overall and per tag)."""
    prompts, seeds = heldout_prompts(num_prompts, seeds_per_prompt, split=split)
    was_training = policy.training
    policy.eval()
    images = generate_ode(policy, prompts, seeds, num_steps, shift, guidance_scale)
    policy.train(was_training)
    res = score_shapes(prompts, images)
    if return_images:
        res["images"], res["prompts"] = images, prompts
    return res


def evaluate_shapes_model(model, num_prompts: int = 64, seeds_per_prompt: int = 4, num_steps: int = 20,
                          guidance_scale: float = 1.0) -> dict:
    """Evaluate a bare :class:`~flowgrpo.shapes.model.ShapesFlowModel` (used during pretraining)."""
    from .policies.shapes import ShapesPolicy

    policy = ShapesPolicy(model, guidance_scale=guidance_scale, train_mode="frozen")
    res = evaluate_policy(policy, num_prompts, seeds_per_prompt, num_steps, guidance_scale=guidance_scale)
    res.pop("correct")
    return res
