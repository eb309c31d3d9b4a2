"""Pieces every adapter of a diffusers transformer pipeline shares (SD3, FLUX, ...).

* :func:`load_frozen`: the pipeline's modules on the policy, in their dtypes (:func:`cast_module`), frozen;
* :func:`make_trainable`: what is trained for a ``train_mode`` (a peft LoRA adapter kept in
  float32, the whole transformer, or nothing);
* :func:`scheduler_grid`: the sigma grid a pipeline's scheduler denoises on, from a copy of it,
  checked to be a flow-matching Euler grid;
* :func:`load_policy`: a policy from a local pipeline folder and a ``ModelConfig``;
* :func:`set_model_options`: the ``ModelConfig`` fields that are unset unless a run sets them
  (``resolution``, ``max_sequence_length``, ``num_frames``): an unset one is not passed, so the
  adapter's own default (its class's keyword default) applies.
* :func:`load_pipeline`: ``from_pretrained`` of a local folder without diffusers' ``torch_dtype``
  FutureWarning; :func:`show_library_progress`: whether diffusers' and transformers' own progress
  bars print (``log.progress``).

Together, ``load_frozen`` and ``make_trainable`` are the ``model.dtype`` handling of every adapter:
transformer and text encoders in the model dtype (but for the submodules their library keeps in
float32), the VAE in float32, LoRA master weights in float32 (peft runs the adapter in float32 and
casts its output back to the layer's dtype). The
memory and speed switches are :mod:`flowgrpo.policies.diffusers.switches`.
"""

from __future__ import annotations

import copy
import os
import warnings

import torch
from torch import Tensor, nn

from ...errors import UserError
from ...model_size import check_pipeline_folder
from ..base import TRAIN_MODES, check_train_mode  # noqa: F401  (the adapters import them from here)
from ..base.lora import DEFAULT_LORA_INIT, DEFAULT_TARGETS, add_lora
from .dtype_bridge import bridge_dtype


def float32_submodules(module: nn.Module, dtype: torch.dtype) -> frozenset[str]:
    """Names of the submodules that the library's own ``from_pretrained(torch_dtype=dtype)`` keeps in
    float32: diffusers models' ``_keep_in_fp32_modules`` for any half dtype (Wan's norms, time
    embedder and RoPE); transformers models' ``_keep_in_fp32_modules`` for float16 only (T5's ``wo``)
    and their ``_keep_in_fp32_modules_strict`` for float16 and bfloat16."""
    if dtype == torch.float32:
        return frozenset()
    names = set(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    if not type(module).__module__.startswith("transformers.") or dtype == torch.float16:
        names.update(getattr(module, "_keep_in_fp32_modules", None) or ())
    return frozenset(names)


def cast_module(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast the floating weights and persistent buffers of ``module`` in place to ``dtype``, except those
    under :func:`float32_submodules` (float32), as loading the module in ``dtype`` would; only tensors
    whose dtype differs are touched (a pipeline loaded in ``dtype`` is left as loaded, and diffusers'
    warning about ``.to(dtype)`` casts is avoided). Non-persistent buffers stay as built: the
    libraries compute them at construction in the precision they need and ``from_pretrained(dtype=...)``
    leaves them so (transformers' RoPE ``inv_freq`` stays float32; cast to bf16 it moves a Qwen or
    Mistral text encoder's prompt embeddings by up to 2 % of their scale). Returns ``module``."""
    keep = float32_submodules(module, dtype)
    tensors = list(module.named_parameters())
    for prefix, sub in module.named_modules():
        skip = getattr(sub, "_non_persistent_buffers_set", set())
        tensors += [(f"{prefix}.{n}" if prefix else n, b) for n, b in sub.named_buffers(recurse=False)
                    if n not in skip]
    for name, tensor in tensors:
        want = torch.float32 if keep and not keep.isdisjoint(name.split(".")) else dtype
        if tensor.is_floating_point() and tensor.dtype != want:
            tensor.data = tensor.data.to(want)
    return module


def load_frozen(policy: nn.Module, dtype: torch.dtype, **modules: nn.Module | None) -> None:
    """Set ``policy.<name> = module`` for each module, frozen: the VAE (name ``vae``) in float32 and
    eval (bridged, :func:`~flowgrpo.policies.diffusers.dtype_bridge.bridge_dtype`, to callers in ``dtype``), text encoders (``text_encoder*``) in ``dtype`` and eval, anything else (the transformer) in
    ``dtype`` (:func:`cast_module`: the submodules the library keeps in float32 stay so). None stays None."""
    for name, module in modules.items():
        if module is not None:
            cast_module(module, torch.float32 if name == "vae" else dtype)
            if name == "vae" and dtype != torch.float32:
                bridge_dtype(module)  # stock pipelines hand it tensors in their dtype
            if name == "vae" or name.startswith("text_encoder"):
                module = module.eval()
            module.requires_grad_(False)
        setattr(policy, name, module)


def make_trainable(transformer: nn.Module, train_mode: str, *, lora_rank: int, lora_alpha: float, lora_targets,
                   lora_init: bool | str = DEFAULT_LORA_INIT, adapter_name: str = "default") -> None:
    """Set up ``transformer`` (already frozen) for ``train_mode``.

    lora: a peft adapter ``adapter_name`` on ``lora_targets`` (module names, a named set or a regex:
    :func:`~flowgrpo.policies.base.lora.resolve_targets`) started with peft's ``init_lora_weights=lora_init``,
    its weights in float32 even when the base runs in bf16; full: every transformer weight; frozen: nothing.
    """
    if check_train_mode(train_mode) == "lora":
        add_lora(transformer, lora_rank, lora_alpha, lora_targets, name=adapter_name, init=lora_init)
        for p in transformer.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    elif train_mode == "full":
        transformer.requires_grad_(True)


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


#: ModelConfig fields whose null means "the adapter's own default" (the adapter class's keyword default)
ADAPTER_DEFAULTED = ("resolution", "max_sequence_length", "num_frames")


def set_model_options(cfg, names: tuple[str, ...] = ("resolution", "max_sequence_length")) -> dict:
    """``{name: value}`` of the fields ``names`` (from :data:`ADAPTER_DEFAULTED`) that ``cfg`` sets; an
    unset (None) field is left out, so the adapter's keyword default applies."""
    return {n: getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None}


#: diffusers' FutureWarning for the ``torch_dtype=`` keyword (newer releases call it ``dtype=``; the
#: releases flowgrpo supports from 0.32 know only ``torch_dtype=``, so it is passed and the warning dropped)
_TORCH_DTYPE_WARNING = r"`torch_dtype` is deprecated"
#: the values of HF_HUB_DISABLE_PROGRESS_BARS that turn the bars off (then log.progress=true leaves them off)
TRUE_VALUES = ("1", "ON", "YES", "TRUE")
#: whether the libraries' own progress bars print (:func:`show_library_progress`)
_LIBRARY_BARS: dict[str, bool | None] = {"enabled": None}  # None: as the libraries are


def show_library_progress(enabled: bool) -> None:
    """Show or hide diffusers' and transformers' own progress bars (a pipeline's component loading,
    weight loading, a stock pipeline's denoising loop) from now on in this process: a run's
    ``log.progress``. Applied at once where the libraries are imported, and by :func:`load_pipeline`
    before every load (so a run that never loads a pipeline never imports them for this)."""
    _LIBRARY_BARS["enabled"] = bool(enabled)
    import sys

    for name in ("diffusers", "transformers"):
        if name in sys.modules:
            _apply_progress(name)


def _apply_progress(library: str) -> None:
    import importlib

    if _LIBRARY_BARS["enabled"] is None:
        return
    if _LIBRARY_BARS["enabled"] and os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").upper() in TRUE_VALUES:
        return  # the user turned Hugging Face's bars off for good
    logging = importlib.import_module(f"{library}.utils.logging")
    (logging.enable_progress_bar if _LIBRARY_BARS["enabled"] else logging.disable_progress_bar)()


def load_pipeline(pipeline_cls, path, dtype: torch.dtype):
    """``pipeline_cls.from_pretrained(path, torch_dtype=dtype, local_files_only=True)`` without diffusers'
    ``torch_dtype`` FutureWarning, its bars shown as :func:`show_library_progress` last said, after
    :func:`~flowgrpo.model_size.check_pipeline_folder` (a UserError for a config that describes a model
    far larger than the folder's weights)."""
    check_pipeline_folder(path)  # an absurd size in a component's config.json, before anything is built
    for library in ("diffusers", "transformers"):
        _apply_progress(library)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_DTYPE_WARNING, category=FutureWarning)
        return pipeline_cls.from_pretrained(str(path), torch_dtype=dtype, local_files_only=True)


def lora_options(cfg) -> dict:
    """The LoRA keyword arguments every adapter takes, from a ``ModelConfig``: rank, alpha, init and
    targets (None for ``model.lora_targets=default``, so the adapter's own list applies)."""
    targets = cfg.lora_targets
    return {"lora_rank": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_init": cfg.lora_init,
            "lora_targets": None if targets == DEFAULT_TARGETS else targets}


def load_policy(policy_cls, pipeline_cls, path, cfg, dtype: torch.dtype, what: str, **options):
    """``policy_cls.from_components`` over ``pipeline_cls.from_pretrained(path)`` (local files only) with
    the ``ModelConfig`` fields every adapter takes (the LoRA's: :func:`lora_options`; ``resolution`` and
    ``max_sequence_length`` only where set: :func:`set_model_options`), plus ``options``; load and argument errors become one-line
    UserErrors (``what``: "an SD3", "a FLUX", ...)."""
    try:
        pipe = load_pipeline(pipeline_cls, path, dtype)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load {what} pipeline from {str(path)!r}: {exc}") from None
    try:
        return policy_cls.from_components(
            pipe.components, guidance_scale=cfg.guidance_scale, train_mode=cfg.train_mode, **lora_options(cfg),
            dtype=dtype, **set_model_options(cfg), **options,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
