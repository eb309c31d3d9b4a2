"""Sampling plans: what happens at each of the T steps of a rollout (DESIGN §1, §6)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import Tensor

ODE_SOLVERS = ("euler",)


@dataclass(frozen=True)
class StepSpec:
    """One step of a plan.

    Attributes:
        sde: stochastic step with a log-prob (trainable) or deterministic ODE step.
        branch: children per node at this step (1 = chain). With branch > 1 the parent's velocity
            is computed once and shared by its children (a shared prefix costs one forward).
        noise_level: SDE noise level a (or eta for the "dance" kind).
        sde_kind: "flow_grpo" | "dance" | "cps".
        solver: ODE solver for deterministic steps (see :data:`ODE_SOLVERS`).
        train: whether this SDE step's transitions enter the loss.
    """

    sde: bool = True
    branch: int = 1
    noise_level: float = 0.7
    sde_kind: str = "flow_grpo"
    solver: str = "euler"
    train: bool = True

    def __post_init__(self):
        if self.branch < 1:
            raise ValueError(f"branch must be >= 1, got {self.branch}")
        if self.solver not in ODE_SOLVERS:
            raise ValueError(f"unknown ODE solver {self.solver!r}; valid: {', '.join(ODE_SOLVERS)}")


@dataclass
class SamplingPlan:
    """A sigma grid [T + 1] (1 -> 0) and one :class:`StepSpec` per step."""

    sigmas: Tensor
    steps: list[StepSpec]
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if len(self.sigmas) != len(self.steps) + 1:
            raise ValueError(f"plan has {len(self.steps)} steps but {len(self.sigmas)} sigmas (need steps + 1)")

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def leaves_per_tree(self) -> int:
        return math.prod(s.branch for s in self.steps)

    def nodes_per_depth(self, trees: int = 1) -> list[int]:
        """Nodes at depths 0..T for ``trees`` roots."""
        out = [trees]
        for s in self.steps:
            out.append(out[-1] * s.branch)
        return out

    def nfe(self, trees: int = 1) -> int:
        """Model evaluations of one rollout (one per node per non-final depth), before CFG doubling."""
        return sum(self.nodes_per_depth(trees)[:-1])

    def trained_steps(self) -> list[int]:
        return [i for i, s in enumerate(self.steps) if s.sde and s.train]
