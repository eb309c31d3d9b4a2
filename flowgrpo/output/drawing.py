"""Deterministic drawing from a policy: the ODE from per-image seeds, with edit models' references.

What ``flowgrpo sample`` and the ``edit`` held-out evaluator draw: each image starts from its own
seeded noise (:func:`noise_seed`), so an image depends on its prompt, its place and the seed only,
not on the batch it is drawn in (up to the last bits of the model's batched matrix products).
"""

from __future__ import annotations

import torch
from torch import Tensor


#: the ranges :func:`noise_seed` keeps apart: beyond them two images would share a seed
MAX_IMAGES_PER_PROMPT = 100
MAX_PROMPTS = 100_000
MAX_SEED = 2**40 - 1


def noise_seed(seed: int, prompt_index: int, j: int) -> int:
    """The noise seed of image ``j`` (0..99) of prompt ``prompt_index`` (0..99999) for ``--seed seed``
    (0..2^40 - 1, so the result stays below 2^64, what a torch generator takes)."""
    return (seed * 100_000 + prompt_index) * 100 + j


def check_draw_flags(*, seed: int | None = None, images_per_prompt: int | None = None, steps: int | None = None,
                     batch_size: int | None = None, num_prompts: int | None = None, source: str = "") -> None:
    """A UserError naming the first flag of a drawing command (``sample``, ``eval --bench``,
    ``unigenbench generate``) outside what :func:`noise_seed` and the sampler take, before a model
    loads; None: not given. ``num_prompts`` is the count read from ``source`` (a prompt file)."""
    from ..errors import UserError
    from ..samplers.plan import MAX_STEPS

    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UserError(f"--seed must be in 0..2^40, got {seed}")
    if images_per_prompt is not None and not 1 <= images_per_prompt <= MAX_IMAGES_PER_PROMPT:
        raise UserError(f"--images-per-prompt must be in 1..{MAX_IMAGES_PER_PROMPT}, got {images_per_prompt}")
    if steps is not None and not 1 <= steps <= MAX_STEPS:
        raise UserError(f"--steps must be in 1..{MAX_STEPS}, got {steps}")
    if batch_size is not None and batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    if num_prompts is not None and num_prompts > MAX_PROMPTS:
        raise UserError(f"{source} holds {num_prompts} prompts; at most {MAX_PROMPTS} are drawn in one call")


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
