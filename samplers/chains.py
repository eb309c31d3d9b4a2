"""Chain strategies: Flow-GRPO, DanceGRPO and MixGRPO (+ Flash, Flash*).

Every strategy here samples a chain (branch 1) per (prompt, initial noise); they differ in which
steps are stochastic (and trained), which ODE solver runs the deterministic steps and on what grid.

Options (``RunConfig.strategy``, i.e. ``strategy.<name>=...`` overrides) and their defaults:

* ``dance_grpo``: ``eta`` (None = ``sampler.noise_level``).
* ``mix_grpo`` / ``mix_grpo_flash``: ``window`` w (4), ``shift_every`` tau (25 iterations),
  ``stride`` (1), ``mode`` ("progressive" | "random" | "frozen"), ``rollback`` (false), ``start``
  (0: the first window position, and the fixed one in "frozen" mode), ``seed`` (0, for "random");
  Flash adds ``compress`` r~ (0.4).
* ``mix_grpo_flash_star``: ``window`` (4), ``compress`` r~ (0.2); the window is fixed at l = 0.

The defaults are the papers' (FLUX: T = 25, w = 4, tau = 25, stride 1, a = 0.7); the shapes presets
use smaller values suited to its 10-step chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from flowgrpo.errors import ConfigError
from flowgrpo.fields import help_field
from flowgrpo.seeds import MIX_WINDOW

from .plan import PlanMeta, SamplingPlan, StepSpec
from .solvers import compressed_grid
from .strategy_base import Strategy, StrategyOptions, WindowOptions, check_float, check_int, ode


def round_half_up(x: float) -> int:
    """round(x) with halves rounded up (Python's round() rounds halves to even)."""
    return int(math.floor(x + 0.5))


def compressed_steps(remaining: int, ratio: float) -> int:
    """Steps of the compressed grid for ``remaining`` original steps: round(remaining * ratio), at least 1
    when anything remains (0 when nothing does)."""
    if remaining <= 0:
        return 0
    return max(1, round_half_up(remaining * ratio))


class FlowGRPOStrategy(Strategy):
    """Flow-GRPO: a chain with every step SDE and trained."""

    def plan(self, iteration: int) -> SamplingPlan:
        return SamplingPlan(self.sigmas(), [self.sde() for _ in range(self.cfg.num_steps)])


@dataclass
class DanceOptions(StrategyOptions):
    eta: float | None = help_field(None, "DanceGRPO's constant sigma_t (None: sampler.noise_level)")

    def check(self, num_steps: int) -> None:
        if self.eta is not None:
            check_float(self.eta, "eta")


class DanceGRPOStrategy(Strategy):
    """DanceGRPO: a chain with every step SDE of the constant-eta kind ("dance": sigma_t = eta).

    The other DanceGRPO choices live outside the plan and are set by the ``dance-grpo`` preset:
    shared initial noise per group (``sampler.shared_group_noise=true``) and a fresh random subset
    of 60 % of the timesteps trained each iteration (``train.timestep_order=random``,
    ``train.timestep_fraction=0.6``). eta = 0.3 for FLUX / Wan, 0.25 for HunyuanVideo.
    """

    Options = DanceOptions

    def eta(self) -> float:
        return float(self.cfg.noise_level if self.options.eta is None else self.options.eta)

    def plan(self, iteration: int) -> SamplingPlan:
        spec = self.sde(noise_level=self.eta(), sde_kind="dance")
        return SamplingPlan(self.sigmas(), [spec] * self.cfg.num_steps, meta=PlanMeta(eta=self.eta()))


@dataclass
class MixOptions(WindowOptions):
    mode: Literal["progressive", "random", "frozen"] = help_field(
        "progressive", "progressive (slides toward the end) | random (redrawn every tau) | frozen (stays at start)")
    rollback: bool = help_field(False, "progressive: return to start after reaching the end")
    seed: int = help_field(0, "seed of the random mode's window draws")

    def check(self, num_steps: int) -> None:
        if isinstance(self.window, int) and not isinstance(self.window, bool) and self.window > num_steps:
            raise ConfigError(f"strategy option 'window' = {self.window} exceeds sampler.num_steps = {num_steps}")
        super().check(num_steps)
        check_int(self.shift_every, "shift_every", 1)


class MixGRPOStrategy(Strategy):
    """MixGRPO: SDE (and trained) only in a sliding window W = {l, ..., l + w - 1}; Euler ODE elsewhere.

    Window start l at iteration n (k = n // tau shifts so far, l_max = T - w):

    * ``progressive``: l starts at ``start`` and every tau iterations l <- min(l + stride, l_max),
      i.e. l = min(start + k * stride, l_max); it then stays at the end.
    * ``progressive`` with ``rollback``: once the window has reached the end (l = l_max) the next
      shift returns it to ``start`` and the sweep repeats, i.e. l cycles through
      start, start + stride, ..., l_max (the last position clamped to l_max).
    * ``random``: l uniform in {0, ..., l_max}, redrawn every tau iterations from a generator seeded
      by (``seed``, k), so a resumed run sees the same windows.
    * ``frozen``: l = ``start`` always.

    Paper defaults (FLUX): T = 25, w = 4, tau = 25, stride 1, a = 0.7.
    """

    Options = MixOptions

    @property
    def window(self) -> int:
        return self.options.window

    def window_start(self, iteration: int) -> int:
        """The window's first step l for outer iteration ``iteration``."""
        o = self.options
        l_max = self.cfg.num_steps - self.window
        k = iteration // o.shift_every
        if o.mode == "frozen":
            return o.start
        if o.mode == "random":
            return int(np.random.default_rng([o.seed, k, MIX_WINDOW]).integers(0, l_max + 1))
        if o.rollback:
            positions = list(range(o.start, l_max, o.stride)) + [l_max]
            return positions[k % len(positions)]
        return min(o.start + k * o.stride, l_max)

    def window_steps(self, iteration: int) -> list[int]:
        l0 = self.window_start(iteration)
        return list(range(l0, l0 + self.window))

    def plan(self, iteration: int) -> SamplingPlan:
        l0 = self.window_start(iteration)
        steps = [self.sde() if l0 <= i < l0 + self.window else ode() for i in range(self.cfg.num_steps)]
        return SamplingPlan(self.sigmas(), steps, meta=PlanMeta(window_start=l0, window=self.window))


@dataclass
class MixFlashOptions(MixOptions):
    compress: float = help_field(0.4, "r~: the steps after the window are compressed to round(r~ * remaining)")

    def check(self, num_steps: int) -> None:
        super().check(num_steps)
        check_float(self.compress, "compress", 0.0, 1.0, open_lo=True)


class MixGRPOFlashStrategy(MixGRPOStrategy):
    """MixGRPO-Flash: as MixGRPO, but the steps after the window run DPM-Solver++(2M) on a compressed grid.

    Before the window: Euler on the original grid (accelerating both sides collapses quality,
    per the paper). Window: SDE on the original grid. After the window, the T - l - w original steps
    are replaced by round(r~ * (T - l - w)) (halves up, at least 1) DPM-Solver++2 steps from
    sigma_{l+w} to 0, uniform in unshifted time and then shifted like the original grid
    (:func:`~flowgrpo.samplers.solvers.compressed_grid`). The plan's grid is therefore non-uniform
    and shorter than T; ``plan.meta`` records the window and the compressed step count. With a model's
own grid (e.g. SD3's scheduler) the tail instead takes that grid at n evenly spaced fractional
positions between the window's end and T (linear interpolation between grid points).
    DPM-Solver++2 is multistep (one model call per step, like Euler); its first step after the SDE
    window is first order, because the history of a stochastic step is not on the ODE path.
    r~ = 0.4 in the paper.
    """

    Options = MixFlashOptions

    def plan(self, iteration: int) -> SamplingPlan:
        t, w = self.cfg.num_steps, self.window
        l0 = self.window_start(iteration)
        full = self.sigmas()
        end = l0 + w
        n_tail = compressed_steps(t - end, float(self.options.compress))
        steps = [ode()] * l0 + [self.sde() for _ in range(w)]
        sigmas = full[: end + 1]
        if n_tail:
            if self.custom_grid:  # a model's own schedule: the tail follows it, at fractional positions
                pos = torch.linspace(end, t, n_tail + 1, dtype=torch.float64)
                tail = torch.from_numpy(np.interp(pos.numpy(), np.arange(t + 1), full.double().numpy()))
            else:
                tail = compressed_grid(1.0 - end / t, n_tail, self.cfg.shift)
            sigmas = torch.cat([sigmas, tail[1:].to(sigmas.dtype)])
            steps += [StepSpec(sde=False, solver="dpm2")] * n_tail
        return SamplingPlan(sigmas, steps, meta=PlanMeta(window_start=l0, window=w, compressed_steps=n_tail))


@dataclass
class FlashStarOptions(StrategyOptions):
    window: int = help_field(4, "SDE window width w, fixed at the first step")
    compress: float = help_field(0.2, "r~ of the compressed tail")

    def check(self, num_steps: int) -> None:
        MixFlashOptions(window=self.window, compress=self.compress).check(num_steps)


class MixGRPOFlashStarStrategy(MixGRPOFlashStrategy):
    """MixGRPO-Flash*: Flash with the window frozen at l = 0 and r~ = 0.2.

    Speed-up over a T-step rollout S = T / (w + (T - w) * r~); realised as NFE per chain
    w + round((T - w) * r~) (T = 25, w = 4: S = 3.05, NFE 8 instead of 8.2).
    """

    Options = FlashStarOptions

    def __init__(self, sampler_cfg, options: dict | None = None, grid=None):
        super().__init__(sampler_cfg, options, grid)  # only window and compress may be set
        star = self.options
        self.options = MixFlashOptions(window=star.window, compress=star.compress, mode="frozen", start=0)

    def speedup(self) -> float:
        """The paper's formula S = T / (w + (T - w) * r~)."""
        t, w, r = self.cfg.num_steps, self.window, float(self.options.compress)
        return t / (w + (t - w) * r)


@dataclass
class ODEOptions(StrategyOptions):
    solver: Literal["euler", "dpm2"] = help_field("dpm2", "ODE solver of every step: euler | dpm2 (DPM-Solver++ 2M, first order at the first step)")


class ODEStrategy(Strategy):
    """A deterministic chain: every step an ODE step, nothing stochastic and no log-prob.

    For the forward-process objectives (``loss.objective`` = nft | awm | dgpo), which need only the
    clean samples: DiffusionNFT's rollouts are 10 DPM-Solver++2 steps without guidance. Groups differ
    only through their initial noise."""

    Options = ODEOptions

    def plan(self, iteration: int) -> SamplingPlan:
        solver = self.options.solver
        return SamplingPlan(self.sigmas(), [StepSpec(sde=False, solver=solver) for _ in range(self.cfg.num_steps)])
