"""Strategies turn the iteration number into a :class:`SamplingPlan` (DESIGN §6)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from flowgrpo.errors import ConfigError
from flowgrpo.registry import Registry

from .plan import SamplingPlan, StepSpec
from .schedule import sigma_grid

STRATEGIES: Registry = Registry("sampling strategy")


class Strategy(ABC):
    """Base class. ``options`` are the strategy-specific keys of ``RunConfig.strategy``.

    Subclasses declare ``OPTIONS`` (name -> default) and implement :meth:`plan`.
    """

    OPTIONS: dict = {}

    def __init__(self, sampler_cfg, options: dict | None = None):
        self.cfg = sampler_cfg
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {unknown} for strategy '{sampler_cfg.strategy}'; "
                f"valid: {', '.join(sorted(self.OPTIONS)) or '(none)'}"
            )
        self.options = {**self.OPTIONS, **options}

    def sigmas(self):
        return sigma_grid(self.cfg.num_steps, self.cfg.shift)

    def sde(self, **kw) -> StepSpec:
        return StepSpec(sde=True, noise_level=self.cfg.noise_level, sde_kind=self.cfg.sde_kind, **kw)

    @abstractmethod
    def plan(self, iteration: int) -> SamplingPlan:
        """The sampling plan for outer iteration ``iteration`` (0-based)."""

    # ---- optional hooks the trainer calls; the defaults change nothing -------------------------
    def edge_train_masks(self, rollout, advantages, iteration: int) -> list | None:
        """Per-depth bool masks [N_d] of edges that enter the backward pass (pruning), or None for all."""
        return None

    def clip_range(self, iteration: int, default: float, rewards=None) -> float:
        """The ratio clip epsilon for this iteration (reward-adaptive strategies override)."""
        return default

    def auxiliary_loss(self, policy, batch, velocity, mean, plan, rollout):
        """An extra loss term for one micro-batch (e.g. an SFT pull toward the best path), or None."""
        return None


@STRATEGIES.register("flow_grpo")
class FlowGRPOStrategy(Strategy):
    """Flow-GRPO: a chain with every step SDE and trained."""

    def plan(self, iteration: int) -> SamplingPlan:
        return SamplingPlan(self.sigmas(), [self.sde() for _ in range(self.cfg.num_steps)])


def build_strategy(sampler_cfg, options: dict | None = None) -> Strategy:
    return STRATEGIES.build(sampler_cfg.strategy, sampler_cfg, options)


# Strategies defined in other modules register themselves on import.
from . import mix  # noqa: E402,F401  (dance_grpo, mix_grpo, mix_grpo_flash, mix_grpo_flash_star)
from . import trees  # noqa: E402,F401  (branch_grpo, branch_grpo_mix, tree_rpo, tempflow_grpo, g2rpo)
