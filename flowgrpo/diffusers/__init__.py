"""Plug Flow-GRPO into stock diffusers pipelines (SD3, FLUX, Wan, ...).

* :class:`~flowgrpo.diffusers.scheduler.FlowGRPOScheduler`: a ``FlowMatchEulerDiscreteScheduler``
  whose chosen steps are SDE steps with recorded mean / std / log-prob.
* :class:`~flowgrpo.diffusers.recorder.StepRecorder`: a ``callback_on_step_end`` that keeps the
  latents and the conditioning tensors of each step.
* :func:`~flowgrpo.diffusers.rollout.rollout`: runs a stock pipeline with both and returns a
  :class:`~flowgrpo.samplers.forest.Rollout` chain the trainer consumes.
* :mod:`flowgrpo.diffusers.tiny`: a tiny random FLUX pipeline built offline (tests).

Submodules import diffusers lazily: ``import flowgrpo.diffusers`` is cheap.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "FlowGRPOScheduler": "scheduler", "SDERecord": "scheduler",
    "StepRecorder": "recorder",
    "rollout": "rollout", "PipelineRollout": "rollout",
    "tiny_flux_components": "tiny", "tiny_flux_pipeline": "tiny",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
