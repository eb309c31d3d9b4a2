"""Sampling plans: what happens at each of the T steps of a rollout (ODE or SDE, branching factor,
noise level and SDE kind, ODE solver, whether the step trains); a strategy makes the plan of each
iteration."""

from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass, field

from torch import Tensor

from .sde import DEFAULT_NOISE_LEVEL, LOG_PROB_CONVENTIONS, sde_kind

#: the most denoising steps a rollout, an evaluation or ``flowgrpo sample`` takes. Published recipes
#: use 10-50 (DDPM's 1000 is the most any sampler uses); a rollout keeps every step's latents, so a
#: mistyped 1e6 would grow past any machine's memory before its first image instead of failing
MAX_STEPS = 1000
ODE_SOLVERS = ("euler", "dpm2")  # dpm2: DPM-Solver++(2M) midpoint, samplers/solvers.py
#: How the K > 1 SDE children of one node draw their noise (BranchGRPO's branching noise):
#: "iid" independent standard normals; "shared" the marginal-preserving branching noise
#: xi_b = (xi_0 + c * eta_b) / sqrt(1 + c^2) (xi_0 shared by the siblings, eta_b their own, so every
#: child keeps the N(0, 1) marginal and siblings correlate by 1 / (1 + c^2)); "scaled" the BranchGRPO
#: reference code's variant xi_b = c * eta_b (independent, scaled: the marginal is N(0, c^2), so the
#: children are not drawn from the density their log-prob scores).
BRANCH_NOISE = ("iid", "shared", "scaled")


@dataclass(frozen=True)
class StepSpec:
    """One step of a plan.

    Attributes:
        sde: stochastic step with a log-prob (trainable) or deterministic ODE step.
        branch: children per node at this step (1 = chain). With branch > 1 the parent's velocity
            is computed once and shared by its children (a shared prefix costs one forward). A plan
            makes it 1 where the step turns out deterministic (std 0: CPS into sigma' = 0, noise level 0).
        noise_level: SDE noise level a (or eta for the "dance" kind).
        sde_kind: "flow_grpo" | "dance" | "cps" (:mod:`flowgrpo.samplers.sde`).
        log_prob: log-prob convention of SDE edges, "gaussian" or (CPS) "mse".
        solver: ODE solver for deterministic steps (see :data:`ODE_SOLVERS`).
        train: whether this SDE step's transitions enter the loss.
        stride: grid points this edge spans (ODE only): the child sits at grid index
            min(i + stride, T). G2RPO completes children at several ODE granularities this way.
        lane: lane of the children in :attr:`SamplingPlan.rules` (None: the parent's lane).
        branch_noise: how K > 1 SDE children share noise, see :data:`BRANCH_NOISE`.
        branch_noise_scale: c of the "shared" and "scaled" branching noise.

    In a plan without ``rules`` a StepSpec is what every node does at step i. In a tree program
    (``rules``), one StepSpec is one *group of children* of a node: ``branch`` children, all with
    this edge kind, in lane ``lane``.
    """

    sde: bool = True
    branch: int = 1
    noise_level: float = DEFAULT_NOISE_LEVEL
    sde_kind: str = "flow_grpo"
    log_prob: str = "gaussian"
    solver: str = "euler"
    train: bool = True
    stride: int = 1
    lane: int | None = None
    branch_noise: str = "iid"
    branch_noise_scale: float = 4.0

    def __post_init__(self):
        if self.branch < 1:
            raise ValueError(f"branch must be >= 1, got {self.branch}")
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        if self.sde and self.stride != 1:
            raise ValueError("an SDE edge spans one grid step (stride 1)")
        if self.branch_noise not in BRANCH_NOISE:
            raise ValueError(f"unknown branch_noise {self.branch_noise!r}; valid: {', '.join(BRANCH_NOISE)}")
        sde_kind(self.sde_kind)  # a ValueError names the valid kinds
        if self.log_prob not in LOG_PROB_CONVENTIONS:
            raise ValueError(f"unknown log_prob {self.log_prob!r}; valid: {', '.join(LOG_PROB_CONVENTIONS)}")
        if self.solver not in ODE_SOLVERS:
            raise ValueError(f"unknown ODE solver {self.solver!r}; valid: {', '.join(ODE_SOLVERS)}")


Rule = tuple  # tuple[StepSpec, ...]: the child groups of one node


@dataclass
class PlanMeta:
    """Descriptive facts about a plan, for logs and tests (None where a strategy has no such notion).

    Attributes:
        window_start, window: first step and width of an SDE window (MixGRPO, BranchGRPO-Mix, TreeRPO).
        compressed_steps: ODE steps of a compressed tail (MixGRPO-Flash).
        eta: DanceGRPO's constant sigma_t.
        splits, branch: BranchGRPO's split steps and children per split (or per branch point).
        depth_pruned_steps: steps left out of the gradient by BranchGRPO's depth pruning.
        noise_levels: per-depth noise levels inside a TreeRPO window.
        branch_steps: steps at which TempFlow-GRPO / G2RPO branch.
        lane_granularity: G2RPO's lane -> ODE stride lambda of its completions.
    """

    window_start: int | None = None
    window: int | None = None
    compressed_steps: int | None = None
    eta: float | None = None
    splits: list[int] | None = None
    branch: int | None = None
    depth_pruned_steps: list[int] | None = None
    noise_levels: list[float] | None = None
    branch_steps: list[int] | None = None
    lane_granularity: dict[int, int] | None = None


@dataclass
class SamplingPlan:
    """A sigma grid [T + 1] (1 -> 0) and one :class:`StepSpec` per step, optionally a tree program.

    Without ``rules`` every node at step i does ``steps[i]`` (chains, and trees whose nodes of one
    depth all branch alike, e.g. BranchGRPO). A **tree program** (``rules``) lets nodes of one depth
    differ: every node carries a *lane* (an int role) and its grid index; a lane-l node at grid index i
    produces the child groups ``rules[l][i]`` (a tuple of :class:`StepSpec`, possibly empty: the node
    ends there). Lane 0 defaults to ``(steps[i],)`` when ``rules`` has no lane 0. Nodes reaching grid
    index T are the leaves, whatever their depth. TempFlow-GRPO: lane 0 an ODE main chain whose
    branch steps also spawn K one-step SDE children into lane 1, which runs ODE to the end.

    ``steps[i]`` always describes the SDE edges that start at grid step i (noise level, kind,
    train), which is what the loss needs to recompute their means; rules are checked against it.
    """

    sigmas: Tensor
    steps: list[StepSpec]
    meta: PlanMeta = field(default_factory=PlanMeta)
    rules: dict | None = None  # {lane: [Rule] * T}

    def __post_init__(self):
        if len(self.sigmas) != len(self.steps) + 1:
            raise ValueError(f"plan has {len(self.steps)} steps but {len(self.sigmas)} sigmas (need steps + 1)")
        # A step whose SDE kind has std 0 into its sigma' (CPS into sigma' = 0: s = sigma' sin(a pi / 2);
        # any kind at noise level 0) is deterministic: it is run as an ODE step rather than as a
        # zero-variance "SDE" (whose log-prob would be NaN), in chains and in every lane of a tree
        # program alike, and with one child (K children would be K identical copies).
        self.steps = [self._ode_if_deterministic(s, i) for i, s in enumerate(self.steps)]
        if self.rules:
            self.rules = {lane: [tuple(self._ode_if_deterministic(spec, i) for spec in rule)
                                 for i, rule in enumerate(per_step)]
                          for lane, per_step in self.rules.items()}
        for lane, per_step in (self.rules or {}).items():
            if len(per_step) != len(self.steps):
                raise ValueError(f"rules of lane {lane} cover {len(per_step)} steps, the plan has {len(self.steps)}")
            for i, rule in enumerate(per_step):
                for spec in rule:
                    if spec.lane is not None and spec.lane not in self.rules and spec.lane != 0:
                        raise ValueError(f"rule at lane {lane}, step {i} sends children to undefined lane {spec.lane}")
                    ref = self.steps[i]
                    if spec.sde and not (ref.sde and ref.noise_level == spec.noise_level
                                         and ref.sde_kind == spec.sde_kind):
                        raise ValueError(f"SDE edges at step {i} (lane {lane}) must match steps[{i}] "
                                         "(sde, noise_level, sde_kind): the loss recomputes means from steps[i]")

    def _ode_if_deterministic(self, spec: StepSpec, i: int) -> StepSpec:
        """``spec`` as one ODE child where its SDE would have std 0 (else ``spec`` unchanged)."""
        if spec.sde and sde_kind(spec.sde_kind).deterministic_at(float(self.sigmas[i + 1]), spec.noise_level):
            return dataclasses.replace(spec, sde=False, train=False, branch=1, branch_noise="iid")
        return spec

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def is_program(self) -> bool:
        """True for a tree program (per-lane rules), False for one spec per step."""
        return self.rules is not None

    def rule(self, lane: int, i: int) -> Rule:
        """Child groups of a lane-``lane`` node at grid index ``i`` (empty: the node ends there)."""
        if self.rules is not None and lane in self.rules:
            return tuple(self.rules[lane][i])
        if lane == 0:
            return (self.steps[i],)
        raise KeyError(f"the plan has no rules for lane {lane}")

    def all_specs(self) -> list[StepSpec]:
        specs = list(self.steps)
        for per_step in (self.rules or {}).values():
            for rule in per_step:
                specs.extend(rule)
        return specs

    def walk(self, trees: int = 1) -> list[dict]:
        """Node counts per depth without sampling: ``[{(lane, grid index): count}, ...]`` from depth 0
        until no node is left to step."""
        t = self.num_steps
        out = [{(0, 0): trees}]
        while True:
            nxt: dict = {}
            for (lane, i), n in out[-1].items():
                if i >= t:
                    continue
                for spec in self.rule(lane, i):
                    key = (lane if spec.lane is None else spec.lane, min(i + spec.stride, t))
                    nxt[key] = nxt.get(key, 0) + n * spec.branch
            if not nxt:
                return out
            out.append(nxt)

    @property
    def leaves_per_tree(self) -> int:
        """Nodes reaching sigma = 0 (grid index T) per root."""
        if not self.is_program and all(s.stride == 1 for s in self.steps):
            return math.prod(s.branch for s in self.steps)
        t = self.num_steps
        return sum(n for level in self.walk(1) for (lane, i), n in level.items() if i >= t)

    def nodes_per_depth(self, trees: int = 1) -> list[int]:
        """Nodes at depths 0..D for ``trees`` roots (D = T for plans without strides)."""
        return [sum(level.values()) for level in self.walk(trees)]

    def nfe(self, trees: int = 1) -> int:
        """Model evaluations of one rollout (one per node that takes a step), before CFG doubling."""
        t = self.num_steps
        return sum(n for level in self.walk(trees) for (lane, i), n in level.items()
                   if i < t and self.rule(lane, i))

    def trained_steps(self) -> list[int]:
        return [i for i, s in enumerate(self.steps) if s.sde and s.train]
