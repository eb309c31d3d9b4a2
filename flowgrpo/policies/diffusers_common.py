"""Pieces every adapter of a diffusers transformer pipeline shares (SD3, FLUX, ...).

* :func:`load_frozen`: the pipeline's modules on the policy, in their dtypes, frozen;
* :func:`make_trainable`: what is trained for a ``train_mode`` (a peft LoRA adapter kept in
  float32, the whole transformer, or nothing) and gradient checkpointing;
* :func:`scheduler_grid`: the sigma grid a pipeline's scheduler denoises on, from a copy of it,
  checked to be a flow-matching Euler grid;
* :func:`load_policy`: a policy from a local pipeline folder and a ``ModelConfig``.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from ..errors import UserError
from .lora import add_lora

TRAIN_MODES = ("lora", "full", "frozen")


def check_train_mode(train_mode: str) -> str:
    if train_mode not in TRAIN_MODES:
        raise ValueError(f"unknown train_mode {train_mode!r}; valid: {', '.join(TRAIN_MODES)}")
    return train_mode


def load_frozen(policy: nn.Module, dtype: torch.dtype, **modules: nn.Module | None) -> None:
    """Set ``policy.<name> = module`` for each module, frozen: the VAE (name ``vae``) in float32 and
    eval, text encoders (``text_encoder*``) in ``dtype`` and eval, anything else (the transformer) in
    ``dtype``. None stays None. ``.to(dtype)`` only where some floating weight differs (diffusers
    warns on every cast)."""
    for name, module in modules.items():
        if module is not None:
            want = torch.float32 if name == "vae" else dtype
            if any(p.is_floating_point() and p.dtype != want for p in module.parameters()):
                module = module.to(want)
            if name == "vae" or name.startswith("text_encoder"):
                module = module.eval()
            module.requires_grad_(False)
        setattr(policy, name, module)


def make_trainable(transformer: nn.Module, train_mode: str, *, lora_rank: int, lora_alpha: float, lora_targets,
                   adapter_name: str = "default", gradient_checkpointing: bool = False) -> None:
    """Set up ``transformer`` (already frozen) for ``train_mode``.

    lora: a peft adapter ``adapter_name`` on ``lora_targets`` (module names or a regex), its weights
    in float32 even when the base runs in bf16; full: every transformer weight; frozen: nothing.
    """
    if check_train_mode(train_mode) == "lora":
        add_lora(transformer, lora_rank, lora_alpha, lora_targets, name=adapter_name)
        for p in transformer.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    elif train_mode == "full":
        transformer.requires_grad_(True)
    if gradient_checkpointing and train_mode != "frozen":
        transformer.enable_gradient_checkpointing()


def scheduler_grid(scheduler, num_steps: int, **set_timesteps_kwargs) -> Tensor:
    """``scheduler.sigmas`` (float32, CPU) after ``set_timesteps(num_steps, **kwargs)`` on a deep copy
    (``scheduler`` itself is untouched); ValueError unless it is num_steps + 1 decreasing sigmas
    ending at 0. ``sigmas=`` among the kwargs replaces ``num_steps`` as diffusers'
    ``retrieve_timesteps`` does."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    sched = copy.deepcopy(scheduler)
    if set_timesteps_kwargs.get("sigmas") is not None:
        sched.set_timesteps(device="cpu", **set_timesteps_kwargs)
    else:
        set_timesteps_kwargs.pop("sigmas", None)
        sched.set_timesteps(num_steps, device="cpu", **set_timesteps_kwargs)
    sigmas = torch.as_tensor(sched.sigmas, dtype=torch.float32).detach().cpu().reshape(-1)
    if len(sigmas) != num_steps + 1 or float(sigmas[-1]) != 0.0 or not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError(f"{type(sched).__name__} gives {len(sigmas)} sigmas for {num_steps} steps "
                         f"({sigmas.tolist()[:4]}...): a flow-matching Euler-type scheduler with "
                         "num_steps + 1 decreasing sigmas ending at 0 is required")
    return sigmas


def load_policy(policy_cls, pipeline_cls, path, cfg, dtype: torch.dtype, what: str, **options):
    """``policy_cls.from_components`` over ``pipeline_cls.from_pretrained(path)`` (local files only) with
    the ``ModelConfig`` fields every adapter takes, plus ``options``; load and argument errors become
    one-line UserErrors (``what``: "an SD3", "a FLUX", ...)."""
    try:
        pipe = pipeline_cls.from_pretrained(str(path), torch_dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load {what} pipeline from {str(path)!r}: {exc}") from None
    try:
        return policy_cls.from_components(
            pipe.components, resolution=cfg.resolution, guidance_scale=cfg.guidance_scale,
            train_mode=cfg.train_mode, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
            max_sequence_length=cfg.max_sequence_length, dtype=dtype, **options,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
