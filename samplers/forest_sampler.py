""":class:`ForestSampler`: runs a sampling plan over a forest of trees, one batched model call per
depth (chunked), and returns the :class:`~flowgrpo.samplers.forest.Rollout` (the forest's data
structure lives in :mod:`flowgrpo.samplers.forest`). ``flowgrpo.samplers.rollout`` is this module's
old name and still imports the class."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .lora_merge import lora_merged
from .forest import Level, Rollout
from .noise import TreeNoise
from .plan import SamplingPlan
from .solvers import dpm2_step, lambda_step
from .steps import euler_step, sde_step


class ForestSampler:
    """Runs :class:`SamplingPlan`s with a policy.

    Every node of one depth, across all trees and prompts, is evaluated in one model batch
    (split into chunks of ``max_micro_batch``); a node with K children is evaluated once and its
    velocity reused for all K (shared prefixes are computed once). In a tree program the nodes of
    one depth may sit at different grid indices and take different kinds of step (SDE or ODE, any
    stride): they still share the one model call (per-node sigma), and each (lane, grid index)
    group of nodes then takes its rule's steps.

    Args:
        policy: a :class:`flowgrpo.policies.Policy` (velocity, encode_prompts, latent_shape).
        max_micro_batch: largest model batch (before classifier-free-guidance doubling).
        merge_lora: fold a float32 peft LoRA adapter into the base weights for the rollout's
            duration (:func:`flowgrpo.samplers.lora_merge.lora_merged`; the same chains up to float
            rounding, the weights restored bit for bit afterwards). False: the plain path.
    """

    def __init__(self, policy, max_micro_batch: int = 256, merge_lora: bool = True):
        self.policy = policy
        self.max_micro_batch = max_micro_batch
        self.merge_lora = merge_lora

    def velocity(self, x: Tensor, sigma: float | Tensor, cond, prompt_rows: Tensor) -> Tensor:
        """Velocity for nodes x [N, ...] whose conditioning rows are ``prompt_rows`` [N], chunked."""
        out = []
        for start in range(0, x.shape[0], self.max_micro_batch):
            sl = slice(start, start + self.max_micro_batch)
            xs = x[sl]
            s = torch.as_tensor(sigma, dtype=torch.float32, device=xs.device)
            s = s.expand(xs.shape[0]) if s.ndim == 0 else s[sl]
            out.append(self.policy.velocity(xs.to(self.model_dtype), s, cond.index(prompt_rows[sl])).float())
        return torch.cat(out)

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model takes its latents in (step math itself is float32)."""
        return next(self.policy.parameters()).dtype

    def _denoiser(self):
        try:
            return self.policy.denoiser
        except Exception:  # a policy without a transformer submodule: nothing to fold
            return None

    @torch.no_grad()
    def rollout(self, plan: SamplingPlan, prompts: list[str], trees_per_prompt: int, generator: torch.Generator,
                shared_group_noise: bool = False, cond=None, trees: range | None = None) -> Rollout:
        """See :meth:`_rollout`; with :attr:`merge_lora` the adapter is folded in for its duration."""
        cond = cond if cond is not None else self.policy.encode_prompts(prompts)
        with lora_merged(self._denoiser() if self.merge_lora else None):
            return self._rollout(plan, prompts, trees_per_prompt, generator, shared_group_noise, cond, trees)

    def _rollout(self, plan: SamplingPlan, prompts: list[str], trees_per_prompt: int, generator: torch.Generator,
                 shared_group_noise: bool = False, cond=None, trees: range | None = None) -> Rollout:
        """Sample ``trees_per_prompt`` trees per prompt following ``plan``.

        Tree t (global id, prompt-major: tree t belongs to prompt t // trees_per_prompt) draws all of its
        noise from its own stream (:class:`~flowgrpo.samplers.noise.TreeNoise`), so ``trees``, a
        contiguous range of tree ids (a data-parallel shard; default: all P * G), rolls out exactly
        the trees a whole-forest rollout would have produced for those ids. ``prompts`` and
        ``cond`` are always the whole iteration's.

        Returns a :class:`Rollout` whose leaves are the final samples ([trees * leaves_per_tree, ...]);
        node tree ids are global, and group g of the forest holds the trees of prompt g.
        """
        device = self.policy.device
        cond = cond if cond is not None else self.policy.encode_prompts(prompts)
        num_trees = len(prompts) * trees_per_prompt
        trees = range(num_trees) if trees is None else trees
        if trees.step != 1 or trees.start < 0 or trees.stop > num_trees or len(trees) == 0:
            raise ValueError(f"trees must be a non-empty contiguous range within [0, {num_trees}), got {trees}")
        tree_prompt = torch.arange(len(prompts), device=device).repeat_interleave(trees_per_prompt)
        noise = TreeNoise(generator, num_trees, trees, trees_per_prompt, device)
        x = noise.initial(tuple(self.policy.latent_shape), shared_group_noise)
        n = len(trees)
        levels = [Level(x=x, parent=torch.full((n,), -1, dtype=torch.long, device=device),
                        tree=torch.arange(trees.start, trees.stop, device=device),
                        pos=torch.zeros(n, dtype=torch.long, device=device),
                        lane=torch.zeros(n, dtype=torch.long, device=device))]
        sigmas = plan.sigmas.to(device)
        t_end = plan.num_steps
        nfe = 0
        # multistep ODE history per node of the current depth: (x0_hat at the previous step's start,
        # h of the previous step [N] float64 on the CPU); h = NaN after an SDE step (the next dpm2
        # step is then first order)
        hist = None
        keep_hist = any(not s.sde and s.solver == "dpm2" for s in plan.all_specs())
        while True:
            cur = levels[-1]
            groups = self._node_groups(plan, cur, t_end)
            if not groups:
                break
            act = groups[0][0] if len(groups) == 1 else torch.cat([g[0] for g in groups])
            if len(groups) == 1:
                sigma_act = sigmas[groups[0][1]]
            else:
                sigma_act = sigmas[cur.pos[act]]
            v = self.velocity(cur.x[act], sigma_act, cond, tree_prompt[cur.tree[act]])
            nfe += len(act)
            row = torch.full((len(cur),), -1, dtype=torch.long, device=device)
            row[act] = torch.arange(len(act), device=device)
            parts = []
            for members, i, lane, rule in groups:
                for step in rule:
                    parent = members.repeat_interleave(step.branch) if step.branch > 1 else members
                    xs, vs = cur.x[parent], v[row[parent]]
                    prev_hist = None if hist is None else (hist[0][parent], hist[1][parent.cpu()])
                    nxt = min(i + step.stride, t_end)
                    part = {"parent": parent, "pos": nxt, "lane": lane if step.lane is None else step.lane,
                            "sde": step.sde, "train": step.train}
                    if step.sde:
                        eps = self.branch_noise(step, cur.tree[members], xs, noise)
                        out = sde_step(xs, vs, sigmas[i], sigmas[i + 1], noise_level=step.noise_level,
                                       kind=step.sde_kind, noise=eps, sigma_max=sigmas[1],
                                       log_prob=step.log_prob)
                        part.update(x=out.prev_sample, mean=out.mean, std=out.std, log_prob=out.log_prob)
                        if keep_hist:
                            part["hist"] = (xs, torch.full((len(parent),), math.nan, dtype=torch.float64))
                    elif step.solver == "dpm2":
                        xn, x0_hat, h = dpm2_step(xs, vs, sigmas[i], sigmas[nxt], *(prev_hist or (None, None)))
                        part.update(x=xn, hist=(x0_hat, h))
                    else:
                        xn = euler_step(xs, vs, sigmas[i], sigmas[nxt])
                        part["x"] = xn
                        if keep_hist:
                            part["hist"] = (xs - sigmas[i] * vs,
                                            lambda_step(plan.sigmas[i], plan.sigmas[nxt]).expand(len(xn)))
                    parts.append(part)
            level, hist = self._make_level(parts, cur, keep_hist, device)
            levels.append(level)
        return Rollout(plan=plan, levels=levels, prompts=list(prompts), tree_prompt=tree_prompt.cpu(),
                       tree_group=tree_prompt.cpu().clone(), nfe=nfe)

    @staticmethod
    def _node_groups(plan: SamplingPlan, cur: Level, t_end: int) -> list:
        """The nodes of ``cur`` that take a step, grouped by (grid index, lane):
        ``[(members [n] long, grid index, lane, rule), ...]``. Empty when every node is a leaf or ends."""
        pos, lane = cur.pos, cur.lane
        p0, l0 = int(pos[0]), int(lane[0])
        if bool((pos == p0).all()) and bool((lane == l0).all()):  # chains and uniform trees: one group
            keys = [(p0, l0, None)]
        else:
            code = pos * (int(lane.max()) + 1) + lane
            keys = []
            for c in torch.unique(code).tolist():
                members = (code == c).nonzero(as_tuple=True)[0]
                keys.append((int(pos[members[0]]), int(lane[members[0]]), members))
        groups = []
        for i, ln, members in keys:
            if i >= t_end:
                continue
            rule = plan.rule(ln, i)
            if not rule:
                continue
            if members is None:
                members = torch.arange(len(cur), device=cur.x.device)
            groups.append((members, i, ln, rule))
        return groups

    @staticmethod
    def branch_noise(step, parent_tree: Tensor, like: Tensor, noise: TreeNoise) -> Tensor:
        """Standard-normal-marginal noise for the ``step.branch`` SDE children of each parent node
        ([num_parents * K, ...], siblings adjacent), drawn from the parents' trees' streams
        (``parent_tree`` [num_parents]).

        "iid" (and any step with K = 1): independent N(0, 1). "shared": xi_b = (xi_0 + c * eta_b) /
        sqrt(1 + c^2) with xi_0 drawn once per parent: every child keeps the N(0, 1) marginal (so its
        log-prob is the density it was drawn from) and siblings correlate by 1 / (1 + c^2). "scaled":
        the BranchGRPO reference code's independent noise scaled by c, xi_b = c * eta_b (variance
        c^2: not the density its log-prob scores).
        """
        k = step.branch
        shape = tuple(like.shape[1:])
        child_tree = parent_tree.repeat_interleave(k) if k > 1 else parent_tree
        eta = noise.draw(child_tree, shape)
        if k == 1 or step.branch_noise == "iid":
            return eta.to(like.device)
        c = float(step.branch_noise_scale)
        if step.branch_noise == "scaled":
            return (c * eta).to(like.device)
        xi0 = noise.draw(parent_tree, shape)
        return ((xi0.repeat_interleave(k, dim=0) + c * eta) / math.sqrt(1.0 + c * c)).to(like.device)

    @staticmethod
    def _make_level(parts: list[dict], cur: Level, keep_hist: bool, device) -> tuple[Level, tuple | None]:
        """Concatenate the child groups of one depth into a :class:`Level` (children ordered by parent)."""
        def cat(key, fill=None):
            vals = [p[key] if key in p else fill(p) for p in parts]
            return vals[0] if len(vals) == 1 else torch.cat(vals)

        parent = cat("parent")
        n = len(parent)
        x = cat("x")
        pos = torch.cat([torch.full((len(p["parent"]),), p["pos"], dtype=torch.long, device=device) for p in parts])
        lane = torch.cat([torch.full((len(p["parent"]),), p["lane"], dtype=torch.long, device=device) for p in parts])
        sde = torch.cat([torch.full((len(p["parent"]),), p["sde"], dtype=torch.bool, device=device) for p in parts])
        train = torch.cat([torch.full((len(p["parent"]),), p["sde"] and p["train"], dtype=torch.bool, device=device)
                           for p in parts])
        mean = std = log_prob = None
        if bool(sde.any()):
            mean = cat("mean", lambda p: p["x"])
            std = cat("std", lambda p: torch.zeros(len(p["parent"]), device=device))
            log_prob = cat("log_prob", lambda p: torch.zeros(len(p["parent"]), device=device))
        hist = None
        if keep_hist:
            hist = tuple(parts[0]["hist"][j] if len(parts) == 1 else torch.cat([p["hist"][j] for p in parts])
                         for j in (0, 1))
        if len(parts) > 1:  # keep siblings adjacent, in rule order
            order = torch.sort(parent, stable=True).indices
            parent, x, pos, lane, sde, train = (t[order] for t in (parent, x, pos, lane, sde, train))
            if mean is not None:
                mean, std, log_prob = mean[order], std[order], log_prob[order]
            if hist is not None:
                hist = (hist[0][order], hist[1][order.cpu()])
        all_sde = bool(sde.all())
        level = Level(x=x, parent=parent, tree=cur.tree[parent], mean=mean, std=std, log_prob=log_prob,
                      pos=pos, lane=lane, sde=None if (all_sde or mean is None) else sde,
                      train=None if bool((train == sde).all()) else train)
        assert len(level) == n
        return level, hist
