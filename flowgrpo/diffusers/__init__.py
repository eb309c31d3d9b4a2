"""Plug Flow-GRPO into stock diffusers pipelines (SD3, FLUX, Wan, ...).

* :class:`~flowgrpo.diffusers.scheduler.FlowGRPOScheduler`: a ``FlowMatchEulerDiscreteScheduler``
  whose chosen steps are SDE steps with recorded mean / std / log-prob.
* :class:`~flowgrpo.diffusers.recorder.StepRecorder`: a ``callback_on_step_end`` that keeps the
  latents and the conditioning tensors of each step.
* :func:`~flowgrpo.diffusers.rollout.rollout`: runs a stock pipeline with both and returns a
  :class:`~flowgrpo.samplers.forest.Rollout` chain the trainer consumes.

Importing this package imports diffusers (``rollout`` names the function, not the submodule).
"""

from __future__ import annotations

from .recorder import StepRecorder
from .rollout import PipelineRollout, ensure_flowgrpo_scheduler, rollout
from .scheduler import FlowGRPOScheduler, SDERecord

__all__ = ["FlowGRPOScheduler", "PipelineRollout", "SDERecord", "StepRecorder", "ensure_flowgrpo_scheduler",
           "rollout"]
