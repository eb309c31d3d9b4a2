"""``FlowGRPOScheduler``: diffusers' flow-matching Euler scheduler with Flow-GRPO SDE steps.

A drop-in replacement for ``FlowMatchEulerDiscreteScheduler`` (same config, same timesteps and
sigmas, same ``step`` signature). On the steps chosen as SDE steps (``sde_steps``, or a MixGRPO
window ``window_start`` / ``window_size``, or every step by default) ``step`` draws
x' ~ N(mu, s^2 I) with :func:`flowgrpo.samplers.steps.sde_step` instead of taking the Euler step
x' = x + (sigma' - sigma) v, and keeps an :class:`SDERecord` (x, x', mu, s, log-prob) in
``self.records``; every other step is the parent's Euler step, recorded with ``sde=False``.
With ``noise_level=0`` every step is the parent's.

Conventions are diffusers': sigma runs 1 -> 0, ``model_output`` is the velocity v = eps - x0.

    pipe.scheduler = FlowGRPOScheduler.from_config(pipe.scheduler.config, noise_level=0.7)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.configuration_utils import register_to_config
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteSchedulerOutput
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from flowgrpo.samplers.sde import DEFAULT_NOISE_LEVEL, LOG_PROB_CONVENTIONS
from flowgrpo.samplers.sde import sde_kind as get_sde_kind
from flowgrpo.samplers.steps import sde_step


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
        get_sde_kind(sde_kind)  # a ValueError names the valid kinds
        if log_prob not in LOG_PROB_CONVENTIONS:
            raise ValueError(f"unknown log_prob {log_prob!r}; valid: {', '.join(LOG_PROB_CONVENTIONS)}")
        if sde_steps is not None and (window_start is not None or window_size is not None):
            raise ValueError("give either sde_steps or window_start/window_size, not both")
        if (window_start is None) != (window_size is None):
            raise ValueError("window_start and window_size go together")
        self.records: list[SDERecord] = []

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
        """The parent's ``set_timesteps`` (same signature: pipelines inspect it), clearing ``records``."""
        self.records = []
        return super().set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu, timesteps=timesteps)

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
        returns prev_sample [B, ...] in ``model_output``'s dtype (as the parent)."""
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
