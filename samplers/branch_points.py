"""Branch-point strategies: TempFlow-GRPO and G2RPO.

Both run an ODE main chain (lane 0) and, at each branch step k, give the main node K one-step SDE
children (lane 1) that are completed by ODE to sigma = 0: the SDE edge is the only stochastic choice
of its leaf, so its reward is credited to that edge alone (``tempflow`` / ``g2rpo`` advantage
estimators, :mod:`flowgrpo.advantages.trees`). Forward cost per tree (before CFG doubling):

* TempFlow-GRPO with every step branching: T + K * sum_k (T - 1 - k);
* G2RPO: M + G * sum_{k < M} (1 + sum_lambda (ceil((T - 1 - k) / lambda) - 1)).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

from flowgrpo.errors import ConfigError
from flowgrpo.fields import help_field

from .plan import PlanMeta, SamplingPlan
from .strategy_base import Strategy, StrategyOptions, check_int, check_steps, ode


class _BranchPointStrategy(Strategy):
    """Shared by TempFlow-GRPO and G2RPO: an ODE main chain (lane 0); at each branch step k the main
    node also gets K one-step SDE children (lane 1) that are completed by ODE. The main chain stops at
    the last branch step (nothing after it is needed)."""

    @abstractmethod
    def branch_steps(self) -> list[int]:
        """The steps k at which the main chain branches."""

    @abstractmethod
    def child_rules(self) -> dict:
        """Rules of lane 1 (the SDE children) and any further lanes."""

    def plan(self, iteration: int) -> SamplingPlan:
        t, k_steps = self.cfg.num_steps, self.branch_steps()
        last = k_steps[-1]
        sde = self.sde(branch=self.options.branch, lane=1)
        steps, main = [], []
        for i in range(t):
            if i in k_steps:
                steps.append(sde)
                main.append(((ode(),) if i < last else ()) + (sde,))
            else:
                steps.append(ode())
                main.append((ode(),) if i < last else ())
        rules = {0: main, **self.child_rules()}
        return SamplingPlan(self.sigmas(), steps, meta=self.meta(), rules=rules)

    def meta(self) -> PlanMeta:
        return PlanMeta(branch_steps=self.branch_steps(), branch=self.options.branch)


@dataclass
class TempFlowOptions(StrategyOptions):
    branch: int = help_field(6, "K: one-step SDE children per branch point")
    branch_steps: list | None = help_field(None, "steps at which the main chain branches (None: every step)")

    def check(self, num_steps: int) -> None:
        check_int(self.branch, "branch", 2)
        if self.branch_steps is not None:
            self.branch_steps = check_steps(self.branch_steps, "branch_steps", num_steps)


class TempFlowGRPOStrategy(_BranchPointStrategy):
    """TempFlow-GRPO: ODE main chain; at each branch step k, ``branch`` K (6) one-step SDE children
    continue by Euler ODE to the end. Each branch point's K children form a GRPO group (``tempflow``
    estimator) and their ODE completions' rewards are credited to the SDE edges.

    ``branch_steps`` (None = every step 0..T-1, the case of the paper's cost formula) bounds the
    cost: the forward cost per tree is (k_last + 1) + K * sum_k (T - 1 - k), i.e.
    T + K * sum_k (T - 1 - k) when every step branches. Seed groups in the paper: 4 initial noises x 6 branches
    (``data.trees_per_prompt`` = 4). The noise-aware loss weight is ``loss.grpo.tempflow_weight``.
    """

    Options = TempFlowOptions

    def __init__(self, sampler_cfg, options: dict | None = None, grid=None):
        super().__init__(sampler_cfg, options, grid)
        t, bs = self.cfg.num_steps, self.options.branch_steps
        self._steps = list(range(t)) if bs is None else check_steps(bs, "branch_steps", t)

    def branch_steps(self) -> list[int]:
        return list(self._steps)

    def child_rules(self) -> dict:
        return {1: [(ode(),)] * self.cfg.num_steps}

@dataclass
class G2RPOOptions(StrategyOptions):
    branch: int = help_field(12, "G: one-step SDE children per branch point")
    first_steps: int = help_field(8, "M: the main chain branches at steps 0..M-1")
    granularities: list = help_field([1, 2], "ODE strides lambda of the children's completions")

    def check(self, num_steps: int) -> None:
        check_int(self.branch, "branch", 2)
        check_int(self.first_steps, "first_steps", 1, num_steps)
        if (not isinstance(self.granularities, list) or not self.granularities
                or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in self.granularities)):
            raise ConfigError(f"strategy option 'granularities' must be integers >= 1, got {self.granularities!r}")
        self.granularities = sorted(set(self.granularities))


class G2RPOStrategy(_BranchPointStrategy):
    """G2RPO (Granular-GRPO): ``branch`` G (12) one-step SDE children at each of the first
    ``first_steps`` M (8; of T = 16) steps of an ODE main chain, each completed by Euler ODE at every
    granularity lambda in ``granularities`` (1, 2): the remaining sigma grid subsampled with stride
    lambda (the last step lands on sigma = 0). The completions share the child's first model call;
    lane 2 + j holds granularity j (``plan.meta.lane_granularity`` maps lane -> lambda). The ``g2rpo``
    estimator z-scores each granularity's rewards among the siblings and sums them: A = sum_l A^l.
    """

    Options = G2RPOOptions

    @property
    def lambdas(self) -> list[int]:
        return self.options.granularities

    def branch_steps(self) -> list[int]:
        return list(range(self.options.first_steps))

    def child_rules(self) -> dict:
        t = self.cfg.num_steps
        split = tuple(ode(stride=lam, lane=2 + j) for j, lam in enumerate(self.lambdas))
        rules = {1: [split] * t}
        for j, lam in enumerate(self.lambdas):
            rules[2 + j] = [(ode(stride=lam),)] * t
        return rules

    def meta(self) -> PlanMeta:
        meta = super().meta()
        meta.lane_granularity = {2 + j: lam for j, lam in enumerate(self.lambdas)}
        return meta
