"""Tree strategies: BranchGRPO (+Mix), Dynamic-TreeRPO, TempFlow-GRPO and G2RPO (DESIGN §1, §4, §6).

Every strategy here samples a forest whose trees share prefixes: a node's velocity is computed
once for all its children, and all nodes of one depth share one model call (see
:class:`~flowgrpo.samplers.rollout.ForestSampler`). They pair with the tree advantage estimators of
:mod:`flowgrpo.tree_advantages` (``advantage.estimator``): ``branch_grpo`` for BranchGRPO and
Dynamic-TreeRPO, ``tempflow`` for TempFlow-GRPO, ``g2rpo`` for G2RPO.

Option defaults are the papers' where they do not depend on T (DESIGN §6); the shapes presets
(``flowgrpo/presets/*.yaml``) set smaller values for its 10-step rollouts. Forward cost per tree
(model evaluations, before CFG doubling) is ``plan.nfe(1)``; for example

* BranchGRPO, T = 20, K = 2 at steps (0, 3, 6, 9): 16 leaves for 203 evaluations (16 chains: 320);
* TempFlow-GRPO with every step branching: T + K * sum_k (T - 1 - k);
* G2RPO: M + G * sum_{k < M} (1 + sum_lambda (ceil((T - 1 - k) / lambda) - 1)).
"""

from __future__ import annotations

from abc import abstractmethod

import math

import torch

from flowgrpo.errors import ConfigError

from .plan import BRANCH_NOISE, SamplingPlan, StepSpec
from .strategies import STRATEGIES, Strategy

WIDTH_PRUNE = ("none", "top", "top_bottom")


def _int_list(value, name: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"strategy option '{name}' must be a list of integers, got {value!r}")
    return sorted(set(int(v) for v in value))


def _check_int(options: dict, key: str, lo: int, hi: int | None = None) -> int:
    v = options[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ConfigError(f"strategy option '{key}' must be an integer {rng}, got {v!r}")
    return v


def _check_float(options: dict, key: str, lo: float = 0.0, hi: float | None = None, open_lo: bool = False) -> float:
    v = options[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if ok:
        ok = (v > lo if open_lo else v >= lo) and (hi is None or v <= hi)
    if not ok:
        raise ConfigError(f"strategy option '{key}' must be a number {'>' if open_lo else '>='} {lo}"
                          f"{'' if hi is None else f' and <= {hi}'}, got {v!r}")
    return float(v)


def ode(**kw) -> StepSpec:
    return StepSpec(sde=False, solver="euler", **kw)


def sliding_start(iteration: int, start: int, every: int, stride: int, last: int) -> int:
    """MixGRPO-style progressive window: ``start`` moved by ``stride`` every ``every`` iterations
    (0 = frozen), clamped to ``last``."""
    if every <= 0:
        return min(start, last)
    return min(start + (iteration // every) * stride, last)


# ============================================================================ BranchGRPO


@STRATEGIES.register("branch_grpo")
class BranchGRPOStrategy(Strategy):
    """BranchGRPO: every step SDE; at the split steps every node gets K children.

    Options (DESIGN §6 defaults):

    * ``splits`` [0, 3, 6, 9] and ``branch`` K = 2 (T = 20: 16 leaves per tree);
    * ``branch_noise`` "shared": the marginal-preserving branching noise
      xi_b = (xi_0 + c * eta_b) / sqrt(1 + c^2), ``branch_noise_scale`` c = 4. "scaled" is the
      reference code's variant (independent noise scaled by c, which changes each child's marginal
      to N(0, c^2) while its log-prob still scores N(0, 1)); "iid" plain independent children.
    * ``fusion_beta`` beta of the reward fusion r(n) = sum_l softmax(beta * log p(l | n)) r_l, read by
      the ``branch_grpo`` estimator (0: plain mean, the reference code's default; 1: path probability).
    * width pruning after the last split (backward only): ``width_prune`` "none" | "top" (keep the
      best ``width_keep`` = 0.5 of each last-split parent's children, by advantage, with everything
      below them) | "top_bottom" (keep the best width_keep / 2 and the worst width_keep / 2 of a tree's
      last-split children: best 25 % + worst 25 %). The split edges themselves always train.
    * depth pruning (backward only): ``depth_prune`` w (0 = off; DESIGN: 4) steps excluded from the
      gradient, a window that starts at the last w steps and moves one step earlier every
      ``depth_prune_every`` (30) iterations until it reaches the step after the last split (split
      steps and the steps before them are never pruned).

    Pruning only removes edges from the loss: the rollout, its rewards and its advantages are those
    of the full tree.
    """

    OPTIONS = {"splits": [0, 3, 6, 9], "branch": 2, "branch_noise": "shared", "branch_noise_scale": 4.0,
               "fusion_beta": 0.0, "width_prune": "none", "width_keep": 0.5, "depth_prune": 0,
               "depth_prune_every": 30}

    def __init__(self, sampler_cfg, options: dict | None = None):
        super().__init__(sampler_cfg, options)
        self._validate()

    def _validate(self) -> None:
        o, t = self.options, self.cfg.num_steps
        self.splits = _int_list(o["splits"], "splits")
        if not self.splits or self.splits[0] < 0 or self.splits[-1] > t - 1:
            raise ConfigError(f"strategy option 'splits' must be non-empty steps in 0..{t - 1}, got {o['splits']!r}")
        _check_int(o, "branch", 2)
        if o["branch_noise"] not in BRANCH_NOISE:
            raise ConfigError(f"strategy option 'branch_noise' = {o['branch_noise']!r} is not one of: "
                              f"{', '.join(BRANCH_NOISE)}")
        _check_float(o, "branch_noise_scale")
        _check_float(o, "fusion_beta")
        if o["width_prune"] not in WIDTH_PRUNE:
            raise ConfigError(f"strategy option 'width_prune' = {o['width_prune']!r} is not one of: "
                              f"{', '.join(WIDTH_PRUNE)}")
        _check_float(o, "width_keep", 0.0, 1.0, open_lo=True)
        _check_int(o, "depth_prune", 0, t)
        _check_int(o, "depth_prune_every", 1)

    @property
    def last_split(self) -> int:
        return self.splits[-1]

    def split_spec(self) -> StepSpec:
        o = self.options
        return self.sde(branch=int(o["branch"]), branch_noise=o["branch_noise"],
                        branch_noise_scale=float(o["branch_noise_scale"]))

    def sde_steps(self, iteration: int) -> set[int]:
        return set(range(self.cfg.num_steps))

    def plan(self, iteration: int) -> SamplingPlan:
        sde_steps = self.sde_steps(iteration)
        steps = []
        for i in range(self.cfg.num_steps):
            if i in self.splits:
                steps.append(self.split_spec())
            elif i in sde_steps:
                steps.append(self.sde())
            else:
                steps.append(ode())
        info = {"splits": list(self.splits), "branch": int(self.options["branch"]),
                "fusion_beta": float(self.options["fusion_beta"]),
                "depth_pruned_steps": self.depth_pruned_steps(iteration)}
        return SamplingPlan(self.sigmas(), steps, info=info)

    # ---------------------------------------------------------------- pruning (backward only)
    def depth_pruned_steps(self, iteration: int) -> list[int]:
        """Grid steps whose edges are left out of the gradient at ``iteration``."""
        w, t = int(self.options["depth_prune"]), self.cfg.num_steps
        if w == 0:
            return []
        lo = self.last_split + 1  # the window never reaches the split steps
        start = max(t - w - iteration // int(self.options["depth_prune_every"]), lo)
        return list(range(start, min(start + w, t)))

    def edge_train_masks(self, rollout, advantages, iteration: int) -> list | None:
        o = self.options
        pruned_steps = self.depth_pruned_steps(iteration)
        if o["width_prune"] == "none" and not pruned_steps:
            return None
        n_levels = len(rollout.levels)
        masks: list = [None] * n_levels
        if pruned_steps:
            ps = torch.tensor(pruned_steps, dtype=torch.long)
            for d in range(1, n_levels):
                par_pos = rollout.node_pos(d - 1)[rollout.levels[d].parent.cpu()]
                keep = ~torch.isin(par_pos, ps)
                if not keep.all():
                    masks[d] = keep
        if o["width_prune"] != "none":
            d0 = self.last_split + 1  # depth of the last split's children (pos = depth in these trees)
            if d0 < n_levels:
                keep = self.width_keep_mask(rollout, advantages.edge_advantages[d0].cpu(), d0)
                for d in range(d0 + 1, n_levels):
                    keep = keep[rollout.levels[d].parent.cpu()]
                    masks[d] = keep if masks[d] is None else masks[d] & keep
        rollout.info["pruned_edges"] = int(sum(int((~m).sum()) for m in masks if m is not None))
        return masks

    def width_keep_mask(self, rollout, adv: torch.Tensor, depth: int) -> torch.Tensor:
        """[N_depth] bool: the last split's children kept by width pruning."""
        o = self.options
        lv = rollout.levels[depth]
        if o["width_prune"] == "top":
            groups = lv.parent.cpu()
            frac_hi, frac_lo = float(o["width_keep"]), 0.0
        else:
            groups = lv.tree.cpu()
            frac_hi = frac_lo = float(o["width_keep"]) / 2
        keep = torch.zeros(len(lv), dtype=torch.bool)
        for g in groups.unique().tolist():
            idx = (groups == g).nonzero(as_tuple=True)[0]
            order = idx[torch.argsort(adv[idx], descending=True, stable=True)]
            n = len(order)
            n_hi = max(1, int(math.floor(n * frac_hi + 1e-9)))
            n_lo = int(math.floor(n * frac_lo + 1e-9))
            if frac_lo > 0:
                n_lo = max(1, n_lo)
            keep[order[:n_hi]] = True
            if n_lo:
                keep[order[n - n_lo:]] = True
        return keep


@STRATEGIES.register("branch_grpo_mix")
class BranchGRPOMixStrategy(BranchGRPOStrategy):
    """BranchGRPO-Mix: SDE only at the split steps plus a sliding window of ``window`` (4) steps;
    Euler ODE elsewhere.

    The window starts at ``window_start`` (0) and moves by ``window_stride`` (1) every
    ``window_every`` (25; 0 = frozen) iterations, up to T - w, as MixGRPO's progressive window. The
    split steps stay SDE wherever the window is (a split needs noise to make its children differ).
    Paper (FLUX): 148 s per iteration against BranchGRPO's 493 s.
    """

    OPTIONS = {**BranchGRPOStrategy.OPTIONS, "window": 4, "window_start": 0, "window_every": 25, "window_stride": 1}

    def _validate(self) -> None:
        super()._validate()
        t = self.cfg.num_steps
        _check_int(self.options, "window", 1, t)
        _check_int(self.options, "window_start", 0, t - self.options["window"])
        _check_int(self.options, "window_every", 0)
        _check_int(self.options, "window_stride", 1)

    def window_start(self, iteration: int) -> int:
        o = self.options
        return sliding_start(iteration, o["window_start"], o["window_every"], o["window_stride"],
                             self.cfg.num_steps - o["window"])

    def sde_steps(self, iteration: int) -> set[int]:
        l0 = self.window_start(iteration)
        return set(self.splits) | set(range(l0, l0 + self.options["window"]))

    def plan(self, iteration: int) -> SamplingPlan:
        plan = super().plan(iteration)
        plan.info.update(window_start=self.window_start(iteration), window=self.options["window"])
        return plan


# ============================================================================ Dynamic-TreeRPO


@STRATEGIES.register("tree_rpo")
class DynamicTreeRPOStrategy(Strategy):
    """Dynamic-TreeRPO: a ``branch``-ary (binary) tree over a sliding window; ODE outside it.

    **No public code exists**: this is implemented from the paper's description (arXiv 2509.23352)
    as summarised in DESIGN §6; the exact formulas below are our reading of it.

    * Sampling: Euler ODE before the window (one shared chain per tree), SDE with ``branch`` (2)
      children at each of the ``window`` (4: a binary tree of depth 4, 16 leaves) window steps, Euler
      ODE after it. The window starts at ``start`` and moves by ``stride`` every ``shift_every``
      iterations (progressive, as MixGRPO's; 0 = frozen), up to T - w.
    * Per-depth noise: the noise level grows linearly with the tree depth j = 0..w-1 inside the window,
      a_j = a * (1 + ``noise_growth`` * j) (a = ``sampler.noise_level``; beta = 0.25 by default).
    * Reward-adaptive clip bound (``clip_range`` hook): eps = eps_0 * (1 + ``clip_adapt`` * (1 - q)),
      q = the iteration's mean reward clamped to [0, 1]; a low reward widens the trust region
      (exploration), a high one narrows it back to eps_0. Stateless, so resume stays exact.
    * SFT term (``auxiliary_loss`` hook; LayerTuning-RL): for each tree, the path to its best leaf
      (highest reward) is the target; every SDE edge on it adds ``sft_weight`` (lambda) times its
      negative log-likelihood under the current policy, mean_dims((x' - mu_theta)^2) / (2 s^2),
      which pulls each step's prediction toward the best path's next state. Averaged over the
      update's transitions, like the policy loss.
    * Advantages: pair with the ``branch_grpo`` estimator (per-depth normalisation inside each tree);
      ``fusion_beta`` is its fusion temperature.
    """

    OPTIONS = {"window": 4, "branch": 2, "start": 0, "shift_every": 25, "stride": 1, "noise_growth": 0.25,
               "clip_adapt": 1.0, "sft_weight": 0.1, "fusion_beta": 0.0}

    def __init__(self, sampler_cfg, options: dict | None = None):
        super().__init__(sampler_cfg, options)
        o, t = self.options, self.cfg.num_steps
        _check_int(o, "window", 1, t)
        _check_int(o, "branch", 2)
        _check_int(o, "start", 0, t - o["window"])
        _check_int(o, "shift_every", 0)
        _check_int(o, "stride", 1)
        for key in ("noise_growth", "clip_adapt", "sft_weight", "fusion_beta"):
            _check_float(o, key)

    def window_start(self, iteration: int) -> int:
        o = self.options
        return sliding_start(iteration, o["start"], o["shift_every"], o["stride"], self.cfg.num_steps - o["window"])

    def noise_levels(self) -> list[float]:
        a, beta = float(self.cfg.noise_level), float(self.options["noise_growth"])
        return [a * (1.0 + beta * j) for j in range(self.options["window"])]

    def plan(self, iteration: int) -> SamplingPlan:
        l0, w = self.window_start(iteration), self.options["window"]
        levels = self.noise_levels()
        steps = []
        for i in range(self.cfg.num_steps):
            if l0 <= i < l0 + w:
                steps.append(StepSpec(sde=True, branch=int(self.options["branch"]), noise_level=levels[i - l0],
                                      sde_kind=self.cfg.sde_kind))
            else:
                steps.append(ode())
        info = {"window_start": l0, "window": w, "noise_levels": levels,
                "fusion_beta": float(self.options["fusion_beta"])}
        return SamplingPlan(self.sigmas(), steps, info=info)

    # ---------------------------------------------------------------- hooks
    def clip_range(self, iteration: int, default: float, rewards=None) -> float:
        if not rewards:
            return default
        means = []
        for r in rewards.values():
            r = r.float()
            fin = torch.isfinite(r)
            if fin.any():
                means.append(float(r[fin].mean()))
        if not means:
            return default
        q = min(max(sum(means) / len(means), 0.0), 1.0)
        return default * (1.0 + float(self.options["clip_adapt"]) * (1.0 - q))

    def edge_train_masks(self, rollout, advantages, iteration: int) -> list | None:
        """Prunes nothing; records each tree's best path (``rollout.info["best_path"]``) for the SFT term."""
        if float(self.options["sft_weight"]) > 0:
            rollout.info["best_path"] = best_paths(rollout, advantages.leaf_advantages, advantages.leaf_mask)
        return None

    def auxiliary_loss(self, policy, batch, velocity, mean, plan, rollout):
        lam = float(self.options["sft_weight"])
        if lam <= 0 or rollout is None or "best_path" not in rollout.info or batch.depth is None:
            return None
        best = rollout.info["best_path"]
        on = torch.zeros(len(batch), dtype=torch.bool)
        for d in batch.depth.unique().tolist():
            rows = (batch.depth == d).nonzero(as_tuple=True)[0]
            on[rows] = best[d][batch.node[rows]]
        if not on.any():
            return None
        rows = on.nonzero(as_tuple=True)[0].to(mean.device)
        x_next = batch.prev_sample[rows.cpu()].to(mean.device).float()
        s = batch.std[rows.cpu()].to(mean.device).float().view(-1, *([1] * (mean.ndim - 1)))
        nll = (((x_next - mean[rows]) ** 2) / (2 * s**2)).flatten(1).mean(1)
        return lam * nll.sum() / len(batch)


def best_paths(rollout, leaf_values: torch.Tensor, leaf_mask: torch.Tensor) -> list[torch.Tensor]:
    """Per depth, [N_d] bool: the nodes on the path from each tree's root to its best leaf (highest
    ``leaf_values`` among ``leaf_mask``). Trees without a masked-in leaf have no best path."""
    vals = torch.where(leaf_mask.bool().cpu(), leaf_values.float().cpu(), torch.full((rollout.num_leaves,), -math.inf))
    trees = rollout.leaf_tree
    n_trees = len(rollout.tree_prompt)
    best = torch.full((n_trees,), -math.inf).scatter_reduce(0, trees, vals, reduce="amax")
    is_best = (vals == best[trees]) & torch.isfinite(vals)
    chosen = torch.zeros(n_trees, dtype=torch.bool)
    on = [torch.zeros(len(lv), dtype=torch.bool) for lv in rollout.levels]
    depth, node = rollout.leaf_depth, rollout.leaf_node
    for j in is_best.nonzero(as_tuple=True)[0].tolist():  # the first best leaf of each tree
        t = int(trees[j])
        if chosen[t]:
            continue
        chosen[t] = True
        d, n = int(depth[j]), int(node[j])
        while d >= 0:
            on[d][n] = True
            n = int(rollout.levels[d].parent[n]) if d > 0 else -1
            d -= 1
    return on


# ============================================================================ TempFlow-GRPO and G2RPO


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
        sde = self.sde(branch=int(self.options["branch"]), lane=1)
        steps, main = [], []
        for i in range(t):
            if i in k_steps:
                steps.append(sde)
                main.append(((ode(),) if i < last else ()) + (sde,))
            else:
                steps.append(ode())
                main.append((ode(),) if i < last else ())
        rules = {0: main, **self.child_rules()}
        return SamplingPlan(self.sigmas(), steps, info=self.info(), rules=rules)

    def info(self) -> dict:
        return {"branch_steps": self.branch_steps(), "branch": int(self.options["branch"])}


@STRATEGIES.register("tempflow_grpo")
class TempFlowGRPOStrategy(_BranchPointStrategy):
    """TempFlow-GRPO: ODE main chain; at each branch step k, ``branch`` K (6) one-step SDE children
    continue by Euler ODE to the end. Each branch point's K children form a GRPO group (``tempflow``
    estimator) and their ODE completions' rewards are credited to the SDE edges.

    ``branch_steps`` (None = every step 0..T-1, DESIGN's cost-formula case) bounds the cost: the
    forward cost per tree is (k_last + 1) + K * sum_k (T - 1 - k), i.e. T + K * sum_k (T - 1 - k) when
    every step branches. Seed groups in the paper: 4 initial noises x 6 branches
    (``data.group_size`` = 4 trees per prompt). The noise-aware loss weight is ``loss.tempflow_weight``.
    """

    OPTIONS = {"branch": 6, "branch_steps": None}

    def __init__(self, sampler_cfg, options: dict | None = None):
        super().__init__(sampler_cfg, options)
        t = self.cfg.num_steps
        _check_int(self.options, "branch", 2)
        bs = self.options["branch_steps"]
        self._steps = list(range(t)) if bs is None else _int_list(bs, "branch_steps")
        if not self._steps or self._steps[0] < 0 or self._steps[-1] > t - 1:
            raise ConfigError(f"strategy option 'branch_steps' must be non-empty steps in 0..{t - 1}, got {bs!r}")

    def branch_steps(self) -> list[int]:
        return list(self._steps)

    def child_rules(self) -> dict:
        return {1: [(ode(),)] * self.cfg.num_steps}

    def nfe_formula(self) -> int:
        t, k = self.cfg.num_steps, int(self.options["branch"])
        return self._steps[-1] + 1 + k * sum(t - 1 - s for s in self._steps)


@STRATEGIES.register("g2rpo")
class G2RPOStrategy(_BranchPointStrategy):
    """G2RPO (Granular-GRPO): ``branch`` G (12) one-step SDE children at each of the first
    ``first_steps`` M (8; of T = 16) steps of an ODE main chain, each completed by Euler ODE at every
    granularity lambda in ``granularities`` (1, 2): the remaining sigma grid subsampled with stride
    lambda (the last step lands on sigma = 0). The completions share the child's first model call;
    lane 2 + j holds granularity j (``plan.info["granularities"]`` maps lane -> lambda). The ``g2rpo``
    estimator z-scores each granularity's rewards among the siblings and sums them: A = sum_l A^l.
    """

    OPTIONS = {"branch": 12, "first_steps": 8, "granularities": [1, 2]}

    def __init__(self, sampler_cfg, options: dict | None = None):
        super().__init__(sampler_cfg, options)
        t = self.cfg.num_steps
        _check_int(self.options, "branch", 2)
        _check_int(self.options, "first_steps", 1, t)
        self.lambdas = _int_list(self.options["granularities"], "granularities")
        if not self.lambdas or self.lambdas[0] < 1:
            raise ConfigError(f"strategy option 'granularities' must be integers >= 1, got "
                              f"{self.options['granularities']!r}")

    def branch_steps(self) -> list[int]:
        return list(range(int(self.options["first_steps"])))

    def child_rules(self) -> dict:
        t = self.cfg.num_steps
        split = tuple(ode(stride=lam, lane=2 + j) for j, lam in enumerate(self.lambdas))
        rules = {1: [split] * t}
        for j, lam in enumerate(self.lambdas):
            rules[2 + j] = [(ode(stride=lam),)] * t
        return rules

    def info(self) -> dict:
        return {**super().info(), "granularities": {2 + j: lam for j, lam in enumerate(self.lambdas)}}

    def nfe_formula(self) -> int:
        t, g = self.cfg.num_steps, int(self.options["branch"])
        total = len(self.branch_steps())
        for k in self.branch_steps():
            rem = t - 1 - k
            if rem > 0:
                total += g * (1 + sum(math.ceil(rem / lam) - 1 for lam in self.lambdas))
        return total
