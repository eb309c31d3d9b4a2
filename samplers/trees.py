"""Tree strategies with shared prefixes: BranchGRPO (+Mix) and Dynamic-TreeRPO.

Every strategy here samples a forest whose trees share prefixes: a node's velocity is computed
once for all its children, and all nodes of one depth share one model call (see
:class:`~flowgrpo.samplers.forest_sampler.ForestSampler`). They pair with the ``branch_grpo`` advantage
estimator (:mod:`flowgrpo.advantages.trees`, ``advantage.estimator``). TempFlow-GRPO and G2RPO,
whose trees branch off an ODE main chain, are in :mod:`.branch_points`.

Option defaults are the papers' where they do not depend on T; the shapes presets
(``flowgrpo/presets/*.yaml``) set smaller values for its 10-step rollouts. Forward cost per tree
(model evaluations, before CFG doubling) is ``plan.nfe(1)``; BranchGRPO with T = 20 and K = 2 at
steps (0, 3, 6, 9) has 16 leaves for 203 evaluations (16 chains: 320).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from flowgrpo.fields import help_field

from .plan import PlanMeta, SamplingPlan, StepSpec
from .strategy_base import (Pruning, Strategy, StrategyOptions, WindowOptions, check_float, check_int, check_steps,
                            ode, sliding_start)


@dataclass
class BranchOptions(StrategyOptions):
    splits: list = help_field([0, 3, 6, 9], "steps at which every node gets `branch` SDE children")
    branch: int = help_field(2, "children K per node at a split step")
    branch_noise: Literal["iid", "shared", "scaled"] = help_field(
        "shared", "noise of siblings: shared (marginal-preserving, correlated), scaled (reference code: c * eta), iid")
    branch_noise_scale: float = help_field(4.0, "c of the shared/scaled branching noise")
    width_prune: Literal["none", "top", "top_bottom"] = help_field(
        "none", "backward-only pruning after the last split: top (best width_keep of each parent's children) | top_bottom (best and worst width_keep/2 of a tree)")
    width_keep: float = help_field(0.5, "fraction of the last split's children kept by width pruning")
    depth_prune: int = help_field(0, "steps excluded from the gradient by the depth-pruning window (0 = off)")
    depth_prune_every: int = help_field(30, "iterations between moves of the depth-pruning window")

    def check(self, num_steps: int) -> None:
        self.splits = check_steps(self.splits, "splits", num_steps)
        check_int(self.branch, "branch", 2)
        check_float(self.branch_noise_scale, "branch_noise_scale")
        check_float(self.width_keep, "width_keep", 0.0, 1.0, open_lo=True)
        check_int(self.depth_prune, "depth_prune", 0, num_steps)
        check_int(self.depth_prune_every, "depth_prune_every", 1)


class BranchGRPOStrategy(Strategy):
    """BranchGRPO: every step SDE; at the split steps every node gets K children.

    Options (defaults: the BranchGRPO paper's settings for FLUX at T = 20, with its pruning variants off):

    * ``splits`` [0, 3, 6, 9] and ``branch`` K = 2 (T = 20: 16 leaves per tree);
    * ``branch_noise`` "shared": the marginal-preserving branching noise
      xi_b = (xi_0 + c * eta_b) / sqrt(1 + c^2), ``branch_noise_scale`` c = 4. "scaled" is the
      reference code's variant (independent noise scaled by c, which changes each child's marginal
      to N(0, c^2) while its log-prob still scores N(0, 1)); "iid" plain independent children.
    * the reward fusion temperature is the estimator's ``advantage.fusion_beta``.
    * width pruning after the last split (backward only): ``width_prune`` "none" | "top" (keep the
      best ``width_keep`` = 0.5 of each last-split parent's children, by advantage, with everything
      below them) | "top_bottom" (keep the best width_keep / 2 and the worst width_keep / 2 of a tree's
      last-split children: best 25 % + worst 25 %). The split edges themselves always train.
    * depth pruning (backward only): ``depth_prune`` w (0 = off; the paper: 4) steps excluded from the
      gradient, a window that starts at the last w steps and moves one step earlier every
      ``depth_prune_every`` (30) iterations until it reaches the step after the last split (split
      steps and the steps before them are never pruned).

    Pruning only removes edges from the loss: the rollout, its rewards and its advantages are those
    of the full tree.
    """

    Options = BranchOptions

    @property
    def splits(self) -> list[int]:
        return self.options.splits

    @property
    def last_split(self) -> int:
        return self.splits[-1]

    def split_spec(self) -> StepSpec:
        o = self.options
        return self.sde(branch=o.branch, branch_noise=o.branch_noise, branch_noise_scale=float(o.branch_noise_scale))

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
        meta = PlanMeta(splits=list(self.splits), branch=self.options.branch,
                        depth_pruned_steps=self.depth_pruned_steps(iteration), **self.window_meta(iteration))
        return SamplingPlan(self.sigmas(), steps, meta=meta)

    def window_meta(self, iteration: int) -> dict:
        return {}

    # ---------------------------------------------------------------- pruning (backward only)
    def depth_pruned_steps(self, iteration: int) -> list[int]:
        """Grid steps whose edges are left out of the gradient at ``iteration``."""
        w, t = self.options.depth_prune, self.cfg.num_steps
        if w == 0:
            return []
        lo = self.last_split + 1  # the window never reaches the split steps
        start = max(t - w - iteration // self.options.depth_prune_every, lo)
        return list(range(start, min(start + w, t)))

    def pruning(self, rollout, advantages, iteration: int) -> Pruning:
        """Depth pruning (a sliding window of grid steps) and width pruning (children of the last
        split by advantage), as edge masks, and width pruning's leaves."""
        width = self.width_masks(rollout, advantages)
        pruned_steps = self.depth_pruned_steps(iteration)
        if width is None and not pruned_steps:
            return Pruning()
        n_levels = len(rollout.levels)
        masks: list = [None] * n_levels if width is None else list(width)
        if pruned_steps:
            ps = torch.tensor(pruned_steps, dtype=torch.long)
            for d in range(1, n_levels):
                par_pos = rollout.node_pos(d - 1)[rollout.levels[d].parent.cpu()]
                keep = ~torch.isin(par_pos, ps)
                if not keep.all():
                    masks[d] = keep if masks[d] is None else masks[d] & keep
        return Pruning(edges=masks, leaves=None if width is None else self.leaves_below(rollout, width))

    def width_masks(self, rollout, advantages) -> list | None:
        """Width pruning alone: per depth, [N_d] bool edges below the last split's kept children
        (None at a depth where every edge stays; None overall when width pruning is off)."""
        if self.options.width_prune == "none":
            return None
        n_levels = len(rollout.levels)
        masks: list = [None] * n_levels
        d0 = self.last_split + 1  # depth of the last split's children (pos = depth in these trees)
        if d0 < n_levels:
            keep = self.width_keep_mask(rollout, advantages.edge_advantages[d0].cpu(), d0)
            for d in range(d0 + 1, n_levels):
                keep = keep[rollout.levels[d].parent.cpu()]
                masks[d] = keep
        return masks

    @staticmethod
    def leaves_below(rollout, width: list) -> torch.Tensor:
        """[L] bool: the leaves whose edge at their own depth survives the width masks ``width``."""
        keep = torch.ones(rollout.num_leaves, dtype=torch.bool)
        depth, node = rollout.leaf_depth.cpu(), rollout.leaf_node.cpu()
        for d, m in enumerate(width):
            if m is not None:
                at = depth == d
                keep[at] = m.cpu().bool()[node[at]]
        return keep

    def width_keep_mask(self, rollout, adv: torch.Tensor, depth: int) -> torch.Tensor:
        """[N_depth] bool: the last split's children kept by width pruning."""
        o = self.options
        lv = rollout.levels[depth]
        if o.width_prune == "top":
            groups = lv.parent.cpu()
            frac_hi, frac_lo = float(o.width_keep), 0.0
        else:
            groups = lv.tree.cpu()
            frac_hi = frac_lo = float(o.width_keep) / 2
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


@dataclass
class BranchMixOptions(BranchOptions):
    window: int = help_field(4, "width of the SDE window besides the split steps")
    window_start: int = help_field(0, "first window position")
    window_every: int = help_field(25, "iterations between window moves (0 = frozen)")
    window_stride: int = help_field(1, "steps the window moves each time")

    def check(self, num_steps: int) -> None:
        super().check(num_steps)
        check_int(self.window, "window", 1, num_steps)
        check_int(self.window_start, "window_start", 0, num_steps - self.window)
        check_int(self.window_every, "window_every", 0)
        check_int(self.window_stride, "window_stride", 1)


class BranchGRPOMixStrategy(BranchGRPOStrategy):
    """BranchGRPO-Mix: SDE only at the split steps plus a sliding window of ``window`` (4) steps;
    Euler ODE elsewhere.

    The window starts at ``window_start`` (0) and moves by ``window_stride`` (1) every
    ``window_every`` (25; 0 = frozen) iterations, up to T - w, as MixGRPO's progressive window. The
    split steps stay SDE wherever the window is (a split needs noise to make its children differ).
    Paper (FLUX): 148 s per iteration against BranchGRPO's 493 s.
    """

    Options = BranchMixOptions

    def window_start(self, iteration: int) -> int:
        o = self.options
        return sliding_start(iteration, o.window_start, o.window_every, o.window_stride, self.cfg.num_steps - o.window)

    def sde_steps(self, iteration: int) -> set[int]:
        l0 = self.window_start(iteration)
        return set(self.splits) | set(range(l0, l0 + self.options.window))

    def window_meta(self, iteration: int) -> dict:
        return {"window_start": self.window_start(iteration), "window": self.options.window}


@dataclass
class TreeRPOOptions(WindowOptions):
    branch: int = help_field(2, "children per node inside the window (the tree has branch^window leaves)")
    noise_growth: float = help_field(0.25, "beta: noise level a_j = a * (1 + beta * j) at tree depth j")

    def check(self, num_steps: int) -> None:
        super().check(num_steps)
        check_int(self.shift_every, "shift_every", 0)
        check_int(self.branch, "branch", 2)
        check_float(self.noise_growth, "noise_growth")


class DynamicTreeRPOStrategy(Strategy):
    """Dynamic-TreeRPO: a ``branch``-ary (binary) tree over a sliding window; ODE outside it.

    **No public code exists**: this is implemented from the paper's description (arXiv 2509.23352);
    the exact formulas below are our reading of it.

    * Sampling: Euler ODE before the window (one shared chain per tree), SDE with ``branch`` (2)
      children at each of the ``window`` (4: a binary tree of depth 4, 16 leaves) window steps, Euler
      ODE after it. The window starts at ``start`` and moves by ``stride`` every ``shift_every``
      iterations (progressive, as MixGRPO's; 0 = frozen), up to T - w.
    * Per-depth noise: the noise level grows linearly with the tree depth j = 0..w-1 inside the window,
      a_j = a * (1 + ``noise_growth`` * j) (a = ``sampler.noise_level``; beta = 0.25 by default).
    * The method's loss-side parts live in the loss configuration: the reward-adaptive clip bound
      ``loss.grpo.clip_adapt`` (:mod:`flowgrpo.objectives.terms.clip_schedule`) and the SFT pull toward each tree's best
      path ``loss.grpo.sft_beta`` (:mod:`flowgrpo.objectives.terms.sft`); the ``tree-rpo`` preset sets both.
    * Advantages: pair with the ``branch_grpo`` estimator (per-depth normalisation inside each tree).
    """

    Options = TreeRPOOptions

    def window_start(self, iteration: int) -> int:
        o = self.options
        return sliding_start(iteration, o.start, o.shift_every, o.stride, self.cfg.num_steps - o.window)

    def noise_levels(self) -> list[float]:
        a, beta = float(self.cfg.noise_level), float(self.options.noise_growth)
        return [a * (1.0 + beta * j) for j in range(self.options.window)]

    def plan(self, iteration: int) -> SamplingPlan:
        l0, w = self.window_start(iteration), self.options.window
        levels = self.noise_levels()
        steps = []
        for i in range(self.cfg.num_steps):
            if l0 <= i < l0 + w:
                steps.append(self.sde(branch=self.options.branch, noise_level=levels[i - l0]))
            else:
                steps.append(ode())
        meta = PlanMeta(window_start=l0, window=w, noise_levels=levels, branch=self.options.branch)
        return SamplingPlan(self.sigmas(), steps, meta=meta)
