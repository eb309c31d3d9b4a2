"""The least memory a run's settings need, against all the memory the machine has: an impossible run
is refused in one line before its run folder exists, instead of growing until the kernel kills it.

A rollout keeps every step's latents of every tree, and the shapes world's evaluation holds every
sample's image, so a mistyped ``data.trees_per_prompt=100000000`` took the trainer to the machine's
24 GiB and a SIGKILL, and ``data.prompts_per_iteration=1000000000`` past 10 GiB. The figures here are
floors, never estimates: what those tensors alone take (float32), without the model, activations or
anything else. A run over its floor cannot fit whatever happens; a run under it may still not fit
(:mod:`flowgrpo.realsize.forecast` gives the full figure for the diffusers models on CUDA).
"""

from __future__ import annotations

import math
import os

import torch

#: bytes of one latent element: the sampler's step math and its stored trajectory are float32
LATENT_BYTES = 4
GIB = 1 << 30


def machine_bytes(device: torch.device) -> int | None:
    """All the memory of ``device``: the GPU's total, or the host's physical memory (bytes); None
    where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # a platform without these names
        return None


def rollout_floor_bytes(prompts: int, trees: int, steps: int, latent_shape: tuple[int, ...]) -> int:
    """The latents one iteration's rollout keeps at the least: ``prompts * trees`` chains of
    ``steps + 1`` latents of ``latent_shape`` (a tree shares its prefix but has at least one chain),
    float32 (bytes)."""
    return prompts * trees * (steps + 1) * math.prod(latent_shape) * LATENT_BYTES


def check_memory_floor(cfg, policy, evaluator, device: torch.device, share: float = 1.0) -> None:
    """Refuse (UserError naming the keys) a run whose rollout needs more memory than ``device`` has,
    or whose evaluation does (:func:`check_evaluation_floor`). ``share``: the fraction of the
    iteration's trees this process rolls out; counted on a GPU, whose memory is its own, not on the
    host, whose memory the processes share."""
    from .errors import UserError

    total = machine_bytes(device)
    if total is None:
        return
    shape = tuple(policy.latent_shape)
    d, s = cfg.data, cfg.sampler
    need = rollout_floor_bytes(d.prompts_per_iteration, d.trees_per_prompt, s.num_steps, shape)
    if device.type == "cuda":
        need = int(need * share)
    if need > total:
        raise UserError(
            f"data.prompts_per_iteration={d.prompts_per_iteration} x data.trees_per_prompt={d.trees_per_prompt} "
            f"samples of {s.num_steps + 1} latents {list(shape)} (sampler.num_steps={s.num_steps}) need "
            f"{need / GIB:.3g} GiB for the rollout's latents alone, more than this machine's {total / GIB:.3g} GiB "
            f"({device.type}): lower them")
    check_evaluation_floor(cfg, policy, evaluator, device)


def check_evaluation_floor(cfg, policy, evaluator, device: torch.device) -> None:
    """Refuse (UserError naming ``eval.num_prompts`` and ``eval.seeds_per_prompt``) an evaluation whose
    evaluator holds every sample's image at once (``samples_held``, the shapes world's) when those
    images alone need more memory than ``device`` has; ``flowgrpo eval`` checks it too."""
    from .errors import UserError

    held = getattr(evaluator, "samples_held", None)
    total = machine_bytes(device)
    if held is None or total is None:
        return
    shape = tuple(policy.latent_shape)
    need = held() * math.prod(shape) * LATENT_BYTES
    if need > total:
        raise UserError(
            f"eval.num_prompts={cfg.eval.num_prompts} x eval.seeds_per_prompt={cfg.eval.seeds_per_prompt} "
            f"images {list(shape)} need {need / GIB:.3g} GiB for the evaluation's images alone, more than this "
            f"machine's {total / GIB:.3g} GiB ({device.type}): lower them")
