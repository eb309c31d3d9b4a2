"""Deterministic drawing from a policy: the ODE from per-image seeds, with edit models' references.

What ``flowgrpo sample`` and the ``edit`` held-out evaluator draw: each image starts from its own
seeded noise (:func:`noise_seed`), so an image depends on its prompt, its place and the seed only,
not on the batch it is drawn in (up to the last bits of the model's batched matrix products).
"""

from __future__ import annotations

import torch
from torch import Tensor


def noise_seed(seed: int, prompt_index: int, j: int) -> int:
    """The noise seed of image ``j`` (0..99) of prompt ``prompt_index`` (0..99999) for ``--seed seed``."""
    return (seed * 100_000 + prompt_index) * 100 + j


def draw(policy, prompts: list[str], seeds: list[int], steps: int, shift: float,
         references: list[Tensor] | None = None) -> Tensor:
    """Images [B, 3, H, W] (videos [B, F, 3, H, W]) float in [0, 1] on the CPU for ``prompts`` [B]:
    the Euler ODE over ``policy.sigma_grid(steps, shift)`` with the policy's guidance from the noises
    of ``seeds`` [B] (each ``torch.randn(latent_shape)`` of a CPU generator seeded with it). Step math
    in float32, the model in its own dtype; ``references``: an edit model's reference images [3, h, w]."""
    from ..samplers.solvers import solve_ode

    device = policy.device
    model_dtype = next(policy.parameters()).dtype
    noise = torch.stack([torch.randn(policy.latent_shape, generator=torch.Generator().manual_seed(int(s)))
                         for s in seeds]).to(device)
    with torch.no_grad():
        cond = policy.encode_prompts(list(prompts), references)

        def velocity(x, sigma):
            return policy.velocity(x.to(model_dtype), torch.full((x.shape[0],), sigma, device=device), cond).float()

        return policy.decode(solve_ode(velocity, noise, policy.sigma_grid(steps, shift))).float().cpu().clamp(0, 1)
