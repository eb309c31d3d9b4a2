"""``FlowGRPOScheduler``: diffusers' flow-matching Euler scheduler with Flow-GRPO SDE steps.

A drop-in replacement for ``FlowMatchEulerDiscreteScheduler`` (same config, same timesteps and
sigmas, same ``step`` signature). On the steps chosen as SDE steps (``sde_steps``, or a MixGRPO
window ``window_start`` / ``window_size``, or every step by default) ``step`` draws
x' ~ N(mu, s^2 I) with :func:`flowgrpo.samplers.steps.sde_step` instead of taking the Euler step
x' = x + (sigma' - sigma) v, and keeps an :class:`SDERecord` (x, x', mu, s, log-prob) in
``self.records``; every other step is the parent's Euler step, recorded with ``sde=False``.
With ``noise_level=0`` every step is the parent's.

Conventions are diffusers': sigma runs 1 -> 0, ``model_output`` is the velocity v = eps - x0.

The SDE noise comes from the generator ``step`` is given, else from :meth:`FlowGRPOScheduler.set_generator`'s,
else from torch's global RNG: stock pipelines call ``scheduler.step`` without their ``generator``, so
a reproducible direct call hands the pipeline's generator to the scheduler first
(:func:`~flowgrpo.diffusers.rollout.rollout` does it itself).

    pipe.scheduler = FlowGRPOScheduler.from_config(pipe.scheduler.config, noise_level=0.7)
    pipe.scheduler.set_generator(gen)
    images = pipe(prompt, generator=gen).images

A pipeline saved with this scheduler (``save_pretrained``) names it in model_index.json as
``["flowgrpo.diffusers.scheduler", "FlowGRPOScheduler"]`` and loads again, options included, with
diffusers' loaders wherever flowgrpo is installed.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

# SchedulerMixin is imported for diffusers' pipeline loader: it finds a component's load method by
# looking the loadable base classes up by name in the module that model_index.json names (this one,
# for a saved FlowGRPOScheduler); without it here a saved pipeline does not load ("does not seem to
# have any of the loading methods")
from diffusers import FlowMatchEulerDiscreteScheduler, SchedulerMixin  # noqa: F401
from diffusers.configuration_utils import register_to_config
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteSchedulerOutput
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from flowgrpo.samplers.sde import DEFAULT_NOISE_LEVEL, LOG_PROB_CONVENTIONS, SDE_KINDS
from flowgrpo.samplers.sde import sde_kind as get_sde_kind
from flowgrpo.samplers.steps import sde_step


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _bad(name: str, value, valid: str) -> ValueError:
    """The one-line error for option ``name``: its value and the valid range."""
    return ValueError(f"FlowGRPOScheduler: {name}={value!r} is invalid; valid: {valid}")


def check_sde_options(noise_level, sde_kind, sde_steps, window_start, window_size, log_prob) -> None:
    """Raise a one-line ValueError (the option, its value, the valid range) for a bad SDE option.

    Checked here rather than at the first step: a negative or NaN noise level gives NaN samples
    and a string fails deep inside the pipeline call. Step indices beyond the grid are checked by
    :meth:`FlowGRPOScheduler.set_timesteps`, which knows the grid.
    """
    if not isinstance(sde_kind, str) or sde_kind not in SDE_KINDS:
        raise _bad("sde_kind", sde_kind, ", ".join(SDE_KINDS))
    if (not isinstance(noise_level, numbers.Real) or isinstance(noise_level, bool)
            or not math.isfinite(noise_level) or noise_level < 0):
        raise _bad("noise_level", noise_level, "a finite number >= 0 (0: plain Euler)")
    if sde_kind == "cps" and noise_level > 1:
        # CPS's std is sigma' sin(a pi / 2): a in [0, 1] spans zero to full noise
        raise _bad("noise_level", noise_level, "a number in [0, 1] for sde_kind='cps'")
    if log_prob not in LOG_PROB_CONVENTIONS:
        raise _bad("log_prob", log_prob, ", ".join(LOG_PROB_CONVENTIONS))
    if log_prob == "mse" and sde_kind != "cps":
        raise _bad("log_prob", log_prob, f"gaussian for sde_kind={sde_kind!r} ('mse' needs sde_kind='cps')")
    if sde_steps is not None and (not isinstance(sde_steps, (list, tuple))
                                  or not all(_is_int(i) and i >= 0 for i in sde_steps)):
        raise _bad("sde_steps", sde_steps, "None or a list of step indices >= 0")
    if sde_steps is not None and (window_start is not None or window_size is not None):
        raise ValueError("FlowGRPOScheduler: give either sde_steps or window_start/window_size, not both")
    if (window_start is None) != (window_size is None):
        raise ValueError(f"FlowGRPOScheduler: window_start={window_start!r} and window_size={window_size!r}: "
                         "give both or neither")
    if window_start is not None and not (_is_int(window_start) and window_start >= 0):
        raise _bad("window_start", window_start, "a step index >= 0")
    if window_size is not None and not (_is_int(window_size) and window_size >= 1):
        raise _bad("window_size", window_size, "a number of steps >= 1")


@dataclass
class SDERecord:
    """One scheduler step of one pipeline call (batch B).

    Attributes:
        step_index: grid index i of the step (sigma = sigmas[i], sigma_next = sigmas[i + 1]).
        sigma, sigma_next: floats.
        sample: x_sigma [B, ...] float32 (detached), the step's input.
        prev_sample: x_sigma' [B, ...] float32 (before the cast back to the model dtype).
        sde: whether the step was an SDE step; the fields below are None when it was not.
        mean: mu [B, ...] float32. std: s [B] float32. log_prob: [B] float32 (mean over
            non-batch dims, :func:`flowgrpo.samplers.steps.gaussian_log_prob`). sigma_t: [B].
    """

    step_index: int
    sigma: float
    sigma_next: float
    sample: Tensor
    prev_sample: Tensor
    sde: bool = False
    mean: Tensor | None = None
    std: Tensor | None = None
    log_prob: Tensor | None = None
    sigma_t: Tensor | None = None


class FlowGRPOScheduler(FlowMatchEulerDiscreteScheduler):
    """Flow-matching Euler with SDE steps that record their transition (see the module doc).

    Extra config options (saved by ``save_pretrained``, restored by ``from_pretrained`` /
    ``from_config``):
        noise_level: a of the SDE (eta for ``sde_kind="dance"``); 0 = plain Euler everywhere.
        sde_kind: "flow_grpo" | "dance" | "cps" (:mod:`flowgrpo.samplers.sde`).
        sde_steps: step indices that are SDE steps (None: all, unless a window is set).
        window_start, window_size: MixGRPO's SDE window [start, start + size) (alternative to sde_steps).
        log_prob: log-prob convention, "gaussian" or (cps) "mse".
        record: keep :class:`SDERecord` s in ``self.records`` (cleared by ``set_timesteps``).

    A bad option is a one-line ValueError at construction (:func:`check_sde_options`); SDE steps
    outside the grid are one at ``set_timesteps``.

    Attributes:
        generator: what SDE steps draw their noise from when ``step`` gets no generator
            (:meth:`set_generator`); None: torch's global RNG.
    """

    @register_to_config
    def __init__(
        self,
        num_train_timesteps: int = 1000,
        shift: float = 1.0,
        use_dynamic_shifting: bool = False,
        base_shift: float | None = 0.5,
        max_shift: float | None = 1.15,
        base_image_seq_len: int = 256,
        max_image_seq_len: int = 4096,
        invert_sigmas: bool = False,
        shift_terminal: float | None = None,
        use_karras_sigmas: bool = False,
        use_exponential_sigmas: bool = False,
        use_beta_sigmas: bool = False,
        time_shift_type: str = "exponential",
        stochastic_sampling: bool = False,
        noise_level: float = DEFAULT_NOISE_LEVEL,
        sde_kind: str = "flow_grpo",
        sde_steps: list[int] | None = None,
        window_start: int | None = None,
        window_size: int | None = None,
        log_prob: str = "gaussian",
        record: bool = True,
    ):
        super().__init__(
            num_train_timesteps=num_train_timesteps, shift=shift, use_dynamic_shifting=use_dynamic_shifting,
            base_shift=base_shift, max_shift=max_shift, base_image_seq_len=base_image_seq_len,
            max_image_seq_len=max_image_seq_len, invert_sigmas=invert_sigmas, shift_terminal=shift_terminal,
            use_karras_sigmas=use_karras_sigmas, use_exponential_sigmas=use_exponential_sigmas,
            use_beta_sigmas=use_beta_sigmas, time_shift_type=time_shift_type,
            stochastic_sampling=stochastic_sampling,
        )
        check_sde_options(noise_level, sde_kind, sde_steps, window_start, window_size, log_prob)
        self.records: list[SDERecord] = []
        self.generator: torch.Generator | list[torch.Generator] | None = None

    def set_generator(self, generator: torch.Generator | list[torch.Generator] | None) -> None:
        """Draw the SDE noise of the following steps from ``generator`` (one, or one per sample of the
        batch) when ``step`` is given none, as stock pipelines do; None: torch's global RNG.

        Pass the pipeline's own generator: its initial noise draws come first, so the same seed
        gives the same call bit for bit.
        """
        self.generator = generator

    # ------------------------------------------------------------------ which steps are SDE
    def is_sde_step(self, step_index: int) -> bool:
        """Whether grid step ``step_index`` is stochastic under the current config and grid.

        A step whose SDE has std 0 (noise level 0; cps into sigma' = 0) is an Euler step.
        """
        cfg = self.config
        if cfg.sde_steps is not None:
            chosen = step_index in set(cfg.sde_steps)
        elif cfg.window_start is not None:
            chosen = cfg.window_start <= step_index < cfg.window_start + cfg.window_size
        else:
            chosen = True
        if not chosen:
            return False
        sigma_next = float(self.sigmas[step_index + 1])
        return not get_sde_kind(cfg.sde_kind).deterministic_at(sigma_next, float(cfg.noise_level))

    def sde_mask(self) -> list[bool]:
        """[T] per step of the current grid: SDE (True) or Euler (False)."""
        return [self.is_sde_step(i) for i in range(len(self.sigmas) - 1)]

    def set_timesteps(self, num_inference_steps: int | None = None, device=None, sigmas: list[float] | None = None,
                      mu: float | None = None, timesteps: list[float] | None = None):
        """The parent's ``set_timesteps`` (same signature: pipelines inspect it), clearing ``records``;
        a ValueError when ``sde_steps`` or the window lie outside the new grid (they would silently
        make every step Euler)."""
        self.records = []
        out = super().set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu, timesteps=timesteps)
        cfg, n = self.config, len(self.sigmas) - 1
        outside = [i for i in cfg.sde_steps or () if i >= n]
        if outside:
            raise ValueError(f"FlowGRPOScheduler: sde_steps={list(cfg.sde_steps)!r} has step(s) {outside} outside "
                             f"this {n}-step grid; valid step indices: 0..{n - 1}")
        if cfg.window_start is not None and cfg.window_start >= n:
            raise ValueError(f"FlowGRPOScheduler: window_start={cfg.window_start} (window_size={cfg.window_size}) "
                             f"lies outside this {n}-step grid; valid window_start: 0..{n - 1}")
        return out

    # ------------------------------------------------------------------ the step
    def step(
        self,
        model_output: torch.FloatTensor,
        timestep: float | torch.FloatTensor,
        sample: torch.FloatTensor,
        s_churn: float = 0.0,
        s_tmin: float = 0.0,
        s_tmax: float = float("inf"),
        s_noise: float = 1.0,
        generator: torch.Generator | None = None,
        per_token_timesteps: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> FlowMatchEulerDiscreteSchedulerOutput | tuple:
        """The parent's ``step``, SDE on the chosen steps. Shapes: model_output, sample [B, ...];
        returns prev_sample [B, ...] in ``model_output``'s dtype (as the parent). The noise comes from
        ``generator``, else ``self.generator`` (a list: one generator per sample), else the global RNG."""
        if generator is None:
            generator = self.generator
        if isinstance(generator, list) and len(generator) not in (1, sample.shape[0]):
            raise ValueError(f"FlowGRPOScheduler: {len(generator)} generators for a batch of {sample.shape[0]}; "
                             "give one generator or one per sample")
        if self.step_index is None:
            self._init_step_index(timestep)
        i = self.step_index
        sigma, sigma_next = float(self.sigmas[i]), float(self.sigmas[i + 1])
        if per_token_timesteps is not None or not self.is_sde_step(i):
            out = super().step(model_output, timestep, sample, s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax,
                               s_noise=s_noise, generator=generator, per_token_timesteps=per_token_timesteps,
                               return_dict=return_dict)
            if self.config.record:
                prev = out.prev_sample if return_dict else out[0]
                self.records.append(SDERecord(i, sigma, sigma_next, sample.detach().float(),
                                              prev.detach().float()))
            return out

        x = sample.to(torch.float32)
        noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        res = sde_step(x, model_output, sigma, sigma_next, noise_level=float(self.config.noise_level),
                       kind=self.config.sde_kind, noise=noise, sigma_max=float(self.sigmas[1]),
                       log_prob=self.config.log_prob)
        if self.config.record:
            self.records.append(SDERecord(i, sigma, sigma_next, x.detach(), res.prev_sample.detach(), True,
                                          res.mean.detach(), res.std.detach(), res.log_prob.detach(),
                                          res.sigma_t.detach()))
        self._step_index += 1
        prev_sample = res.prev_sample.to(model_output.dtype)
        if not return_dict:
            return (prev_sample,)
        return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=prev_sample)
