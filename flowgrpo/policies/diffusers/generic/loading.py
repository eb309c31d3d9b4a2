"""Loading a pipeline folder for the generic adapter: what makes a pipeline trainable
(:func:`check_trainable`), the ``model.name=pipeline`` factory (:func:`build_pipeline_policy`) and its
one-line errors."""

from __future__ import annotations

import inspect
from pathlib import Path

from torch import nn

from flowgrpo.errors import UserError, first_line

from ..common import load_pipeline, lora_options
from ..switches import runtime_options, torch_dtype
from ..wan import is_flow_solver
from .adapter import PipelinePolicy
from .families import family_of


def check_trainable(pipe) -> None:
    """ValueError naming what ``pipe`` lacks for the generic adapter (a transformer, a flow-matching
    scheduler, ``__call__`` keywords)."""
    if not isinstance(getattr(pipe, "transformer", None), nn.Module):
        raise ValueError("it has no `transformer` component (UNet pipelines are not flow-matching transformers)")
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is None or not ("FlowMatch" in type(scheduler).__name__ or is_flow_solver(scheduler)):
        raise ValueError(f"its scheduler {type(scheduler).__name__} is not a flow-matching one")
    params = inspect.signature(type(pipe).__call__).parameters
    missing = [p for p in ("prompt", "latents", "output_type", "num_inference_steps", "height", "width")
               if p not in params]
    if missing:
        raise ValueError(f"its __call__ lacks the keyword(s) {', '.join(missing)}")


def build_pipeline_policy(cfg) -> PipelinePolicy:
    """Factory for ``model.name=<pipeline folder>`` of a class without a dedicated adapter."""
    from diffusers import DiffusionPipeline

    path = Path(cfg.path or "").expanduser()
    dtype = torch_dtype(cfg.dtype)
    try:
        pipe = load_pipeline(DiffusionPipeline, path, dtype)
    except (OSError, ValueError, ImportError, AttributeError) as exc:
        raise UserError(f"cannot load the diffusers pipeline in {str(path)!r}: {exc}") from None
    name = type(pipe).__name__
    try:
        check_trainable(pipe)
        return PipelinePolicy(pipe, family_of(name), resolution=cfg.resolution, guidance_scale=cfg.guidance_scale,
                              train_mode=cfg.train_mode, **lora_options(cfg),
                              max_sequence_length=cfg.max_sequence_length, num_frames=cfg.num_frames, dtype=dtype,
                              **runtime_options(cfg))
    except ValueError as exc:
        raise UserError(f"{name} in {str(path)!r} cannot be trained: {exc}") from None
    except RuntimeError as exc:  # the stock pipeline itself failed on the probe's call
        raise UserError(f"{name} in {str(path)!r} failed when probed at model.resolution={cfg.resolution} "
                        f"({type(exc).__name__}: {first_line(exc, 300)}){resolution_hint(pipe)}") from None


def resolution_hint(pipe) -> str:
    """A hint naming the pipeline's VAE downsampling factor, the usual lower bound of its resolution."""
    factor = getattr(pipe, "vae_scale_factor", None) or getattr(pipe, "vae_scale_factor_spatial", None)
    if not factor:
        return ""
    return (f"; its VAE downsamples by {factor} and the transformer may patch the latents further, so the "
            f"resolution must be a multiple of {factor} and usually of {2 * factor}")
