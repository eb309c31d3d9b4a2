"""The monitors of one held-out evaluation, measured on its samples whatever the model.

:class:`MonitoredEvaluator` wraps the run's evaluator (any of :data:`flowgrpo.evaluation.EVALUATORS`):
it asks for the held-out samples, measures the monitors on them and returns the evaluator's result with
``monitors`` filled in (name -> float; ``EvalResult.metrics()`` logs them as ``monitor.<name>``):

* the image statistics of :mod:`.stats` (means over the samples);
* ``reward.<name>``: each held-out reward's mean score over the samples it could score (``monitor.rewards``:
  the evaluation's images and prompts, never trained on; videos every ``reward.frame_stride``-th frame);
* ``velocity_norm`` (:func:`velocity_norm_ratio`): the evaluated policy's mean velocity norm over the base
  model's on the same states.

The "seen" split (``eval.seen``) is evaluated without monitors.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..rewards.video import score_frames
from .config import MonitorConfig
from .stats import image_stats


def spread(items: list, n: int) -> list:
    """``n`` of ``items`` (all when fewer) spread evenly over the list, in order."""
    if n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


@torch.no_grad()
def velocity_norm_ratio(policy, prompts: list[str], num_steps: int, shift: float = 1.0, batch_size: int = 8,
                        seed: int = 0) -> float:
    """Mean velocity norm of ``policy`` over the base model's, on the same states.

    Sample ``i`` starts from the noise ``torch.randn(latent_shape)`` of a CPU generator seeded ``seed + i``
    with prompt ``prompts[i]`` and follows the policy's Euler ODE over ``policy.sigma_grid(num_steps,
    shift)``; at every step the policy's velocity ``v`` and the base model's ``v_base`` (the policy under
    ``adapter_disabled``: LoRA off, or the frozen copy of a full fine-tune) are taken on the same state,
    prompt and sigma. Returns ``sum ||v|| / sum ||v_base||`` over samples and steps (L2 norms over each
    sample's latent, guidance as the policy samples): 1 for the base model itself, above 1 where training
    inflated the velocity (NormGuard)."""
    device, dtype = policy.device, next(policy.parameters()).dtype
    sigmas = policy.sigma_grid(num_steps, shift).float().cpu()
    norms = torch.zeros(2, dtype=torch.float64)
    was_training = policy.training
    policy.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start:start + batch_size]
            x = torch.stack([torch.randn(policy.latent_shape, generator=torch.Generator().manual_seed(seed + start + i))
                             for i in range(len(batch))]).to(device)
            cond = policy.encode_prompts(list(batch))
            for i in range(num_steps):
                sigma = torch.full((len(batch),), float(sigmas[i]), device=device)
                v = policy.velocity(x.to(dtype), sigma, cond).float()
                with policy.adapter_disabled():
                    v_base = policy.velocity(x.to(dtype), sigma, cond).float()
                norms[0] += v.flatten(1).norm(dim=1).double().sum().cpu()
                norms[1] += v_base.flatten(1).norm(dim=1).double().sum().cpu()
                x = x + (sigmas[i + 1] - sigmas[i]).item() * v
    finally:
        policy.train(was_training)
    return float(norms[0] / norms[1]) if norms[1] > 0 else math.nan


def reward_means(rewards: dict, images: Tensor, prompts: list[str], batch_size: int = 8,
                 frame_stride: int = 1) -> dict[str, float]:
    """``reward.<name>`` -> the mean of each reward's finite scores of ``images`` [N, 3, H, W] (videos
    [N, F, 3, H, W]: every ``frame_stride``-th frame) with ``prompts`` [N], in batches of ``batch_size``
    (NaN when it scored none)."""
    out = {}
    for name, fn in rewards.items():
        scores = torch.cat([score_frames(fn, images[i:i + batch_size], prompts[i:i + batch_size], None,
                                         frame_stride).scores.double().cpu().reshape(-1)
                            for i in range(0, len(prompts), batch_size)])
        finite = scores[torch.isfinite(scores)]
        out[f"reward.{name}"] = float(finite.mean()) if len(finite) else math.nan
    return out


class MonitoredEvaluator:
    """The run's evaluator with the monitors measured on its held-out samples (module docstring).

    Args: inner, the evaluator; mcfg, the ``monitor`` section; rewards, the held-out rewards (name ->
    reward); shift, the sigma grid's shift; frame_stride, ``reward.frame_stride``; velocity, whether
    the policy can give the base model's velocity (False: ``velocity_norm`` is not measured)."""

    def __init__(self, inner, mcfg: MonitorConfig, rewards: dict, shift: float = 1.0, frame_stride: int = 1,
                 velocity: bool = True):
        self.inner, self.mcfg, self.rewards = inner, mcfg, rewards
        self.name = inner.name
        self.shift, self.frame_stride = shift, frame_stride
        self.velocity = velocity and mcfg.velocity_samples > 0

    def __getattr__(self, attr):  # the inner evaluator's other attributes (options, prompts, ...)
        return getattr(self.inner, attr)

    def evaluate(self, policy, split: str = "heldout", keep_images: bool = False):
        if split != "heldout":
            return self.inner.evaluate(policy, split=split, keep_images=keep_images)
        res = self.inner.evaluate(policy, split=split, keep_images=True)
        if res.images is not None:
            res.monitors = self.measure(policy, res.images, list(res.prompts))
        if not keep_images:
            res.images, res.prompts = None, None
        return res

    def measure(self, policy, images: Tensor, prompts: list[str]) -> dict[str, float]:
        """The monitors of one evaluation's ``images`` [N, 3, H, W] (videos [N, F, 3, H, W]) and ``prompts``."""
        m = self.mcfg
        out = image_stats(images, m.dark_level, m.grid_period, m.high_freq_cutoff).means()
        out.update(reward_means(self.rewards, images, prompts, m.batch_size, self.frame_stride))
        if self.velocity:
            chosen = spread(list(dict.fromkeys(prompts)), m.velocity_samples)  # distinct prompts first
            chosen += spread(prompts, m.velocity_samples - len(chosen))
            out["velocity_norm"] = velocity_norm_ratio(policy, chosen, m.velocity_steps, self.shift, m.batch_size)
        return out
