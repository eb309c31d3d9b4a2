"""Chain strategies with partial SDE: DanceGRPO and MixGRPO (+ Flash, Flash*) (DESIGN §6).

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

import numpy as np
import torch

from flowgrpo.errors import ConfigError

from .plan import SamplingPlan, StepSpec
from .solvers import compressed_grid
from .strategies import STRATEGIES, Strategy

WINDOW_MODES = ("progressive", "random", "frozen")


def round_half_up(x: float) -> int:
    """round(x) with halves rounded up (Python's round() rounds halves to even)."""
    return int(math.floor(x + 0.5))


def compressed_steps(remaining: int, ratio: float) -> int:
    """Steps of the compressed grid for ``remaining`` original steps: round(remaining * ratio), at least 1
    when anything remains (0 when nothing does)."""
    if remaining <= 0:
        return 0
    return max(1, round_half_up(remaining * ratio))


@STRATEGIES.register("dance_grpo")
class DanceGRPOStrategy(Strategy):
    """DanceGRPO: a chain with every step SDE of the constant-eta kind ("dance": sigma_t = eta).

    The other DanceGRPO choices live outside the plan and are set by the ``dance-grpo`` preset:
    shared initial noise per group (``sampler.shared_group_noise=true``) and a fresh random subset
    of 60 % of the timesteps trained each iteration (``train.timestep_order=random``,
    ``train.timestep_fraction=0.6``). eta = 0.3 for FLUX / Wan, 0.25 for HunyuanVideo.
    """

    OPTIONS = {"eta": None}

    def eta(self) -> float:
        return float(self.cfg.noise_level if self.options["eta"] is None else self.options["eta"])

    def plan(self, iteration: int) -> SamplingPlan:
        spec = StepSpec(sde=True, noise_level=self.eta(), sde_kind="dance")
        return SamplingPlan(self.sigmas(), [spec] * self.cfg.num_steps, info={"eta": self.eta()})


@STRATEGIES.register("mix_grpo")
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

    OPTIONS = {"window": 4, "shift_every": 25, "stride": 1, "mode": "progressive", "rollback": False, "start": 0,
               "seed": 0}

    def __init__(self, sampler_cfg, options: dict | None = None):
        super().__init__(sampler_cfg, options)
        self._validate()

    def _validate(self) -> None:
        o, t = self.options, self.cfg.num_steps
        for key in ("window", "shift_every", "stride"):
            if not isinstance(o[key], int) or isinstance(o[key], bool) or o[key] < 1:
                raise ConfigError(f"strategy option '{key}' must be an integer >= 1, got {o[key]!r}")
        if o["window"] > t:
            raise ConfigError(f"strategy option 'window' = {o['window']} exceeds sampler.num_steps = {t}")
        if o["mode"] not in WINDOW_MODES:
            raise ConfigError(f"strategy option 'mode' = {o['mode']!r} is not one of: {', '.join(WINDOW_MODES)}")
        if not isinstance(o["rollback"], bool):
            raise ConfigError(f"strategy option 'rollback' expects true/false, got {o['rollback']!r}")
        if not isinstance(o["start"], int) or not 0 <= o["start"] <= t - o["window"]:
            raise ConfigError(f"strategy option 'start' must be in 0..{t - o['window']}, got {o['start']!r}")

    @property
    def window(self) -> int:
        return self.options["window"]

    def window_start(self, iteration: int) -> int:
        """The window's first step l for outer iteration ``iteration``."""
        o = self.options
        l_max = self.cfg.num_steps - self.window
        k = iteration // o["shift_every"]
        if o["mode"] == "frozen":
            return o["start"]
        if o["mode"] == "random":
            return int(np.random.default_rng([o["seed"], k, 97]).integers(0, l_max + 1))
        if o["rollback"]:
            positions = list(range(o["start"], l_max, o["stride"])) + [l_max]
            return positions[k % len(positions)]
        return min(o["start"] + k * o["stride"], l_max)

    def window_steps(self, iteration: int) -> list[int]:
        l0 = self.window_start(iteration)
        return list(range(l0, l0 + self.window))

    def plan(self, iteration: int) -> SamplingPlan:
        l0 = self.window_start(iteration)
        steps = [self.sde() if l0 <= i < l0 + self.window else StepSpec(sde=False, solver="euler")
                 for i in range(self.cfg.num_steps)]
        return SamplingPlan(self.sigmas(), steps, info={"window_start": l0, "window": self.window})


@STRATEGIES.register("mix_grpo_flash")
class MixGRPOFlashStrategy(MixGRPOStrategy):
    """MixGRPO-Flash: as MixGRPO, but the steps after the window run DPM-Solver++(2M) on a compressed grid.

    Before the window: Euler on the original grid (accelerating both sides collapses quality,
    per the paper). Window: SDE on the original grid. After the window, the T - l - w original steps
    are replaced by round(r~ * (T - l - w)) (halves up, at least 1) DPM-Solver++2 steps from
    sigma_{l+w} to 0, uniform in unshifted time and then shifted like the original grid
    (:func:`~flowgrpo.samplers.solvers.compressed_grid`). The plan's grid is therefore non-uniform
    and shorter than T; ``plan.info`` records the window, the compressed step count and the NFE.
    DPM-Solver++2 is multistep (one model call per step, like Euler); its first step after the SDE
    window is first order, because the history of a stochastic step is not on the ODE path.
    r~ = 0.4 in the paper.
    """

    OPTIONS = {**MixGRPOStrategy.OPTIONS, "compress": 0.4}

    def _validate(self) -> None:
        super()._validate()
        r = self.options["compress"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:
            raise ConfigError(f"strategy option 'compress' must be in (0, 1], got {r!r}")

    def plan(self, iteration: int) -> SamplingPlan:
        t, w = self.cfg.num_steps, self.window
        l0 = self.window_start(iteration)
        full = self.sigmas()
        end = l0 + w
        n_tail = compressed_steps(t - end, float(self.options["compress"]))
        steps = [StepSpec(sde=False, solver="euler")] * l0 + [self.sde() for _ in range(w)]
        sigmas = full[: end + 1]
        if n_tail:
            tail = compressed_grid(1.0 - end / t, n_tail, self.cfg.shift)
            sigmas = torch.cat([sigmas, tail[1:].to(sigmas.dtype)])
            steps += [StepSpec(sde=False, solver="dpm2")] * n_tail
        info = {"window_start": l0, "window": w, "compressed_steps": n_tail, "nfe": len(steps),
                "speedup": t / len(steps)}
        return SamplingPlan(sigmas, steps, info=info)


@STRATEGIES.register("mix_grpo_flash_star")
class MixGRPOFlashStarStrategy(MixGRPOFlashStrategy):
    """MixGRPO-Flash*: Flash with the window frozen at l = 0 and r~ = 0.2.

    Speed-up over a T-step rollout S = T / (w + (T - w) * r~); realised as NFE per chain
    w + round((T - w) * r~) (T = 25, w = 4: S = 3.05, NFE 8 instead of 8.2).
    """

    OPTIONS = {"window": 4, "compress": 0.2}

    def __init__(self, sampler_cfg, options: dict | None = None):
        Strategy.__init__(self, sampler_cfg, options)  # only window and compress may be set
        self.options = {**MixGRPOFlashStrategy.OPTIONS, **self.options, "mode": "frozen", "start": 0}
        self._validate()

    def speedup(self) -> float:
        """The paper's formula S = T / (w + (T - w) * r~)."""
        t, w, r = self.cfg.num_steps, self.window, float(self.options["compress"])
        return t / (w + (t - w) * r)
