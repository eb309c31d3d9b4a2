"""Recording what a stock diffusers pipeline hands its transformer and its scheduler in one step.

:func:`record_pipeline` runs ``pipeline(**call_kwargs)`` (the pipeline's own prompt encoding,
latent preparation and guidance logic) with two temporary instance attributes:

* ``transformer.forward`` (and that of every other expert named in ``experts``, e.g. Wan 2.2's
  ``transformer_2``) records the positional and keyword arguments of every call and which expert
  received it (a :class:`TransformerCall`); with ``run_transformer=False`` it returns zeros shaped
  like the latent input instead of running the network (prompt encoding then costs the text
  encoders only, and the pipeline's denoising loop leaves the latents as they are: a zero velocity);
* ``scheduler.step`` records the velocity the pipeline combined from those calls, the sample and the
  sigma of the step (a :class:`StepRecord`) and stops the pipeline after ``max_steps`` steps.

Nothing of the pipeline is changed once the function returns.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@contextlib.contextmanager
def pipeline_warnings_off():
    """diffusers' log warnings off (errors still show) for the duration: around the stock pipeline calls an
    adapter makes internally (a probe, prompt encoding, decoding), whose warnings, such as Qwen-Image's
    "negative_prompt is passed but classifier-free guidance is not enabled", are about calls the user
    never made."""
    from diffusers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


@dataclass
class TransformerCall:
    """One transformer call: ``args`` / ``kwargs`` as the pipeline passed them, ``output`` its first
    returned element (a tensor [k*B, ...] or a list of per-sample tensors; None when not run) and
    ``module``, the pipeline attribute of the expert called (``"transformer"``, ``"transformer_2"``)."""

    args: tuple
    kwargs: dict[str, Any]
    output: Any = None
    module: str = "transformer"


@dataclass
class StepRecord:
    """One denoising step: the calls the pipeline made, the velocity it handed ``scheduler.step``
    (``velocity`` [B, ...], same layout as ``sample``), the ``sample`` [B, ...] it stepped and its sigma."""

    calls: list[TransformerCall]
    velocity: Tensor
    sample: Tensor
    sigma: float


@dataclass
class PipelineRecord:
    """What :func:`record_pipeline` saw: the steps (at most ``max_steps``) and the scheduler's sigma
    grid [num_steps + 1] (float32, CPU) after the pipeline set its timesteps."""

    steps: list[StepRecord] = field(default_factory=list)
    sigmas: Tensor | None = None
    pending: list[TransformerCall] = field(default_factory=list)
    #: what the pipeline returned, when it ran to its end
    output: Any = None


class _Stop(Exception):
    """Raised inside the pipeline once enough steps are recorded."""


def zeros_like_tree(value):
    """Zeros with the structure of ``value`` (a tensor, or a list / tuple of tensors)."""
    if isinstance(value, Tensor):
        return torch.zeros_like(value)
    return type(value)(zeros_like_tree(v) for v in value)


def latent_input(args: tuple, kwargs: dict):
    """The transformer's latent input: keyword ``hidden_states`` (or ``x``), else the first positional one."""
    for key in ("hidden_states", "x"):
        if key in kwargs:
            return kwargs[key]
    if not args:
        raise ValueError("the transformer was called without hidden_states or a positional latent input")
    return args[0]


@contextlib.contextmanager
def _patched(obj, name: str, replacement):
    had = name in vars(obj)
    old = vars(obj).get(name)
    object.__setattr__(obj, name, replacement)
    try:
        yield
    finally:
        if had:
            object.__setattr__(obj, name, old)
        else:
            object.__delattr__(obj, name)


def _stub_output(args: tuple, kwargs: dict, sample_shape: tuple[int, ...] | None):
    """Zeros standing for the transformer's output: shaped like its latent input, or [n, *sample_shape]
    where the input holds more than the sample (HunyuanVideo 1.5 appends condition channels)."""
    latent = latent_input(args, kwargs)
    if isinstance(latent, Tensor) and sample_shape is not None and latent[0].numel() != math.prod(sample_shape):
        return torch.zeros(latent.shape[0], *sample_shape, dtype=latent.dtype, device=latent.device)
    return zeros_like_tree(latent)


def _recording_forward(record: PipelineRecord, name: str, real_forward, run_transformer: bool,
                       sample_shape: tuple[int, ...] | None):
    """A stand-in for expert ``name``'s ``forward`` that records each call into ``record.pending``."""

    @functools.wraps(real_forward)  # the signature stays inspectable (pipelines inspect it)
    def forward(*args, **kwargs):
        call = TransformerCall(tuple(args), dict(kwargs), module=name)
        record.pending.append(call)
        if run_transformer:
            out = real_forward(*args, **kwargs)
            call.output = out[0] if isinstance(out, (tuple, list)) else out.sample
            return out
        return (_stub_output(args, kwargs, sample_shape),)

    return forward


@torch.no_grad()
def record_pipeline(pipeline, call_kwargs: dict, *, max_steps: int, run_transformer: bool,
                    experts: tuple[str, ...] = ("transformer",),
                    sample_shape: tuple[int, ...] | None = None) -> PipelineRecord:
    """Run ``pipeline(**call_kwargs)`` until ``max_steps`` scheduler steps are recorded (see the module
    docstring). ``max_steps=0`` stops at the first ``scheduler.step`` without recording it as a step
    (its calls stay in ``record.pending``); ``experts``: the pipeline attributes whose calls are
    recorded (those that are None are skipped); ``sample_shape``: the scheduler's per-sample shape,
    when known, for the zeros that stand in for the transformer. Returns the :class:`PipelineRecord`."""
    record = PipelineRecord()
    scheduler = pipeline.scheduler
    real_step = scheduler.step
    real_set_timesteps = scheduler.set_timesteps
    modules = {name: getattr(pipeline, name, None) for name in experts}
    modules = {name: m for name, m in modules.items() if m is not None}

    @functools.wraps(real_set_timesteps)
    def set_timesteps(*args, **kwargs):
        out = real_set_timesteps(*args, **kwargs)
        record.sigmas = torch.as_tensor(scheduler.sigmas, dtype=torch.float32).detach().cpu().reshape(-1)
        return out

    @functools.wraps(real_step)
    def step(model_output, timestep, sample, *args, **kwargs):
        if max_steps == 0:
            raise _Stop
        index = len(record.steps)
        sigma = float(record.sigmas[index]) if record.sigmas is not None else float("nan")
        record.steps.append(StepRecord(record.pending, model_output.detach().clone(), sample.detach().clone(), sigma))
        record.pending = []
        if len(record.steps) >= max_steps:
            raise _Stop
        return real_step(model_output, timestep, sample, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        for name, module in modules.items():
            stack.enter_context(_patched(module, "forward",
                                         _recording_forward(record, name, module.forward, run_transformer,
                                                            sample_shape)))
        stack.enter_context(_patched(scheduler, "step", step))
        stack.enter_context(_patched(scheduler, "set_timesteps", set_timesteps))
        stack.enter_context(pipeline_warnings_off())
        with contextlib.suppress(_Stop):  # raised once enough steps are recorded
            record.output = pipeline(**call_kwargs)
    return record
