"""Run a stock diffusers pipeline as a Flow-GRPO sampler and return the trainer's ``Rollout``.

:func:`rollout` calls the pipeline unchanged (``output_type="latent"`` by default) with a
:class:`~flowgrpo.diffusers.scheduler.FlowGRPOScheduler` (swapped in from the pipeline's own
scheduler config when it has another one) and a :class:`~flowgrpo.diffusers.recorder.StepRecorder`,
then assembles the recorded steps into a :class:`~flowgrpo.samplers.forest.Rollout` of chains: one
tree per (prompt, sample), ``levels[d].x`` [N, ...] the latents at depth d (N = prompts x
trees_per_prompt, prompt-major as the pipelines repeat prompts), SDE edges carrying mean / std / log-prob.
The call's ``generator`` draws the initial noise and, handed to the scheduler for the call, every
SDE step's noise: the same seed gives the same rollout.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flowgrpo.samplers.forest import Level, Rollout
from flowgrpo.samplers.plan import MAX_STEPS, PlanMeta, SamplingPlan, StepSpec

from .recorder import StepRecorder
from .scheduler import FlowGRPOScheduler, SDERecord

#: the per-prompt sample count argument of the pipelines (images, videos)
_PER_PROMPT_ARGS = ("num_images_per_prompt", "num_videos_per_prompt")


@dataclass
class PipelineRollout:
    """What :func:`rollout` returns.

    Attributes:
        rollout: the chain forest (``rollout.transitions(...)`` feeds the loss).
        conditioning: the pipeline's callback tensors of step 0 (prompt embeddings, ...).
        recorder: the :class:`StepRecorder` (transformer calls for velocity recomputation).
        records: the scheduler's per-step :class:`SDERecord` s.
        output: the pipeline's output images / videos / latents (``output_type`` decides).
    """

    rollout: Rollout
    conditioning: dict[str, torch.Tensor]
    recorder: StepRecorder
    records: list[SDERecord]
    output: Any


#: the per-call scales a pipeline may combine cond / uncond outputs with, hints for the StepRecorder
#: (FLUX's and Qwen-Image's true CFG scale first: their guidance_scale is distilled guidance)
_CFG_ARGS = ("true_cfg_scale", "guidance_scale", "guidance_scale_2")


def is_flow_scheduler(scheduler) -> bool:
    """Whether ``scheduler`` denoises on flow-matching sigmas: a ``FlowMatch*`` scheduler, or one of
    another family run on flow sigmas (Wan's UniPC: ``use_flow_sigmas`` / ``prediction_type="flow_prediction"``)."""
    config = scheduler.config
    return (isinstance(scheduler, FlowMatchEulerDiscreteScheduler) or type(scheduler).__name__.startswith("FlowMatch")
            or bool(config.get("use_flow_sigmas")) or config.get("prediction_type") == "flow_prediction")


def ensure_flowgrpo_scheduler(pipe, **options) -> FlowGRPOScheduler:
    """Give ``pipe`` a FlowGRPOScheduler built from its scheduler's config (``options`` override it).

    A flow-sigma scheduler of another family (Wan's ``UniPCMultistepScheduler`` with ``flow_shift``)
    becomes flow-matching Euler with ``shift = flow_shift`` on the same sigma grid. A pipeline of
    another kind (DDPM / DDIM noise prediction) is a one-line ValueError, its scheduler untouched.
    """
    if getattr(pipe, "scheduler", None) is None or not hasattr(pipe.scheduler, "config"):
        raise TypeError(f"a diffusers pipeline with a scheduler is wanted (e.g. StableDiffusion3Pipeline), got "
                        f"{type(pipe).__name__}")
    known = inspect.signature(FlowGRPOScheduler.__init__).parameters
    unknown = sorted(set(options) - set(known) - {"self"})
    if unknown:  # from_config dropped them silently
        raise ValueError(f"FlowGRPOScheduler has no option {', '.join(map(repr, unknown))}; valid: "
                         f"{', '.join(k for k in known if k not in ('self', 'kwargs'))}")
    if not is_flow_scheduler(pipe.scheduler):
        config = pipe.scheduler.config
        raise ValueError(f"{type(pipe).__name__}'s scheduler {type(pipe.scheduler).__name__} (prediction_type "
                         f"{config.get('prediction_type')!r}) is not a flow-matching scheduler; FlowGRPOScheduler "
                         "and rollout() need a flow-matching pipeline (SD3, FLUX, Wan, ...: a FlowMatch* scheduler, "
                         "or one with use_flow_sigmas / prediction_type='flow_prediction')")
    if not isinstance(pipe.scheduler, FlowGRPOScheduler) or options:
        config = dict(pipe.scheduler.config)
        if "shift" not in config and config.get("flow_shift") is not None:
            options = {"shift": float(config["flow_shift"]), **options}
        pipe.scheduler = FlowGRPOScheduler.from_config({k: v for k, v in config.items() if k in known}, **options)
    return pipe.scheduler


def plan_from_scheduler(scheduler: FlowGRPOScheduler, sde: list[bool]) -> SamplingPlan:
    """A chain :class:`SamplingPlan` with the scheduler's sigmas [T + 1] and one StepSpec per step."""
    cfg = scheduler.config
    steps = [StepSpec(sde=s, noise_level=float(cfg.noise_level), sde_kind=cfg.sde_kind, log_prob=cfg.log_prob)
             if s else StepSpec(sde=False) for s in sde]
    meta = PlanMeta(window_start=cfg.window_start, window=cfg.window_size)
    return SamplingPlan(scheduler.sigmas.detach().float().cpu().clone(), steps, meta=meta)


def levels_from_records(records: list[SDERecord]) -> list[Level]:
    """Depth 0 .. T chain levels from the scheduler records of one call (N = batch)."""
    n = records[0].sample.shape[0]
    idx = torch.arange(n, device=records[0].sample.device)
    levels = [Level(x=records[0].sample, parent=torch.full_like(idx, -1), tree=idx)]
    for r in records:
        if r.sde:
            levels.append(Level(x=r.prev_sample, parent=idx, tree=idx, mean=r.mean, std=r.std, log_prob=r.log_prob))
        else:
            levels.append(Level(x=r.prev_sample, parent=idx, tree=idx))
    return levels


def _check_prompts(prompts) -> list[str]:
    """``prompts`` as a non-empty list of strings (one string: a list of one); else a one-line error."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"rollout(): prompts is a string or a list of strings, got {type(prompts).__name__}"
                        + (f" holding {type(next(p for p in prompts if not isinstance(p, str))).__name__}"
                           if isinstance(prompts, (list, tuple)) else ""))
    if not prompts:  # was an IndexError inside the pipeline
        raise ValueError("rollout(): no prompts given")
    return list(prompts)


def rollout(pipe, prompts: str | list[str], *, trees_per_prompt: int = 1, num_inference_steps: int = 10,
            generator: torch.Generator | None = None, output_type: str = "latent",
            scheduler_options: dict | None = None, group_size: int | None = None, **pipe_kwargs) -> PipelineRollout:
    """Sample ``trees_per_prompt`` chains per prompt with the stock pipeline and record them.

    Args:
        pipe: a diffusers flow-matching pipeline (SD3, FLUX, Wan, ...).
        prompts: P prompts; one GRPO group per prompt.
        trees_per_prompt: G samples (chains) per prompt, the GRPO group size (passed as
            num_images_per_prompt / num_videos_per_prompt); ``data.trees_per_prompt`` of a run.
        num_inference_steps: T.
        generator: the pipeline's generator, or one per sample (N = P * G): it draws the initial
            noise and then, handed to the scheduler for the call (:meth:`FlowGRPOScheduler.set_generator`),
            every SDE step's noise, so the same seed gives the same rollout bit for bit; None: torch's
            global RNG.
        output_type: the pipeline's output type ("latent" skips decoding).
        scheduler_options: FlowGRPOScheduler config overrides (noise_level, sde_kind, sde_steps,
            window_start, window_size, log_prob); without them a FlowGRPOScheduler is kept as is.
        group_size: deprecated name of ``trees_per_prompt`` (still accepted, with a DeprecationWarning;
            it will be removed).
        pipe_kwargs: anything else for the pipeline (height, width, guidance_scale, ...).

    Returns: :class:`PipelineRollout`; its ``rollout`` has N = P * G trees, T + 1 levels
    (``levels[d].x`` [N, ...] float32), ``tree_prompt`` = ``tree_group`` = [N] prompt index.
    """
    prompts = _check_prompts(prompts)
    if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, numbers.Integral) \
            or not 1 <= num_inference_steps <= MAX_STEPS:  # 0 was an IndexError, 2.5 a TypeError inside
        raise ValueError(f"rollout(): num_inference_steps={num_inference_steps!r} is invalid; valid: an integer "
                         f"in 1..{MAX_STEPS}")
    if scheduler_options is not None and not isinstance(scheduler_options, Mapping):
        raise TypeError(f"rollout(): scheduler_options is a dict of FlowGRPOScheduler options, got "
                        f"{type(scheduler_options).__name__}")
    gens = generator if isinstance(generator, list) else [generator]
    if not all(g is None or isinstance(g, torch.Generator) for g in gens):
        raise TypeError(f"rollout(): generator is a torch.Generator, a list of them or None, got "
                        f"{type(generator).__name__}")
    for name in _CFG_ARGS:
        value = pipe_kwargs.get(name)
        if isinstance(value, numbers.Real) and not math.isfinite(value):  # NaN guidance made NaN latents
            raise ValueError(f"rollout(): {name}={value!r} is not a finite number")
    if group_size is not None:
        if trees_per_prompt != 1:
            raise ValueError("rollout(): give trees_per_prompt only (group_size is its deprecated name)")
        warnings.warn("rollout(group_size=...) is deprecated; use trees_per_prompt=...", DeprecationWarning,
                      stacklevel=2)
        trees_per_prompt = group_size
    if not (isinstance(trees_per_prompt, numbers.Integral) and not isinstance(trees_per_prompt, bool)
            and trees_per_prompt >= 1):
        raise ValueError(f"rollout(): trees_per_prompt={trees_per_prompt!r} is invalid; valid: an integer >= 1")
    scheduler = ensure_flowgrpo_scheduler(pipe, **(scheduler_options or {}))
    params = inspect.signature(pipe.__call__).parameters
    per_prompt = next((a for a in _PER_PROMPT_ARGS if a in params), None)
    if per_prompt is None and trees_per_prompt != 1:
        raise ValueError(f"{type(pipe).__name__} takes no per-prompt sample count; use trees_per_prompt=1")
    if per_prompt is not None:
        pipe_kwargs[per_prompt] = trees_per_prompt
    n = len(prompts) * trees_per_prompt
    if isinstance(generator, list) and len(generator) not in (1, n):
        raise ValueError(f"rollout(): {len(generator)} generators for a batch of {n} ({len(prompts)} prompts x "
                         f"trees_per_prompt {trees_per_prompt}); give one generator or one per sample")
    hints = [pipe_kwargs[a] for a in _CFG_ARGS if pipe_kwargs.get(a) is not None]
    recorder = StepRecorder(guidance_scales=hints).attach(pipe)
    # stock pipelines call scheduler.step without their generator: hand it over for this call only
    previous = scheduler.generator
    scheduler.set_generator(generator)
    try:
        if "callback_on_step_end" in params:  # else the recorder follows the steps through the scheduler
            pipe_kwargs.update(callback_on_step_end=recorder,
                               callback_on_step_end_tensor_inputs=recorder.tensor_inputs(pipe))
        # by keyword: some pipelines take another input first (Flux2Pipeline's reference image)
        out = pipe(prompt=prompts, num_inference_steps=num_inference_steps, generator=generator,
                   output_type=output_type, **pipe_kwargs)
    finally:
        recorder.detach()
        scheduler.set_generator(previous)
    records = list(scheduler.records)
    if len(records) != len(scheduler.sigmas) - 1:
        raise RuntimeError(f"the scheduler recorded {len(records)} steps for a {len(scheduler.sigmas) - 1}-step grid")
    plan = plan_from_scheduler(scheduler, [r.sde for r in records])
    tree_prompt = torch.arange(len(prompts)).repeat_interleave(trees_per_prompt)
    calls = sum(len(c) for c in recorder.calls)
    forest = Rollout(plan=plan, levels=levels_from_records(records), prompts=prompts, tree_prompt=tree_prompt,
                     tree_group=tree_prompt.clone(), nfe=calls)
    images = out.frames if hasattr(out, "frames") else out.images
    return PipelineRollout(forest, recorder.conditioning, recorder, records, images)
