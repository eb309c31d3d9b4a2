"""Data parallelism over accelerate's processes, with the statistics of the whole iteration.

An iteration's trees (prompts x trees_per_prompt, prompt-major) are split into contiguous shards,
one per rank, so a prompt's group may span ranks (Flow-GRPO's distributed k-repeat sampler).
Every tree draws its noise from its own stream (:mod:`flowgrpo.samplers.noise`), so a rank's
trees are exactly those a 1-process run would sample. After scoring, each rank contributes its
shard's *structure* (parents, grid positions, lanes, SDE masks, log-probs: no states) and its
leaves' rewards; every rank then holds the whole forest's structure (:class:`ForestView`) and
runs the advantage estimator on it, so group statistics are computed over the full group, the
same numbers on every rank. Each rank trains on its own transitions; gradients are summed over
ranks once per optimizer step, with every row weighted by 1 / (rows in the global minibatch), so
the update equals the 1-process update over the same samples up to float rounding.

Why not DDP's wrapper: a rank's work per optimizer step is uneven (groups span ranks, NaN rewards
and zero-std groups drop edges, BranchGRPO prunes), and DDP's per-backward bucketing needs every
rank to run the same number of backward passes. One all-reduce of the flat gradient per step is
DDP's arithmetic without that constraint (and, for LoRA-sized gradients, without a measurable
cost). A sharded denoiser (FSDP) reduces its gradients inside backward instead, with ranks kept in
lock-step (:mod:`flowgrpo.trainer.engines`).

With context parallelism (``dist.context_parallel=N``, :mod:`flowgrpo.trainer.context_parallel`)
the processes form groups of N consecutive ranks that hold the same trees and split each video's
tokens inside the transformer. Data parallelism then runs over the groups: :attr:`DataParallel.world`
is the number of groups and :attr:`DataParallel.rank` this process's group, every collective of this
class keeps one copy per group (its first rank's, the group's *leader*), and only the leaders score
rewards. Gradients are the exception: each rank's backward holds its tokens' share of the gradient,
so :meth:`DataParallel.sum_gradients` sums over every process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from ..samplers.forest import Level, Rollout


class DataParallel:
    """The process group as the trainer sees it (one per run; a no-op in a 1-process run).

    Args:
        accelerator: the run's :class:`accelerate.Accelerator`.
        context_parallel: processes per context-parallel group (``dist.context_parallel``; 1: none);
            it divides the number of processes (:func:`~flowgrpo.trainer.context_parallel.check_degree`).
    """

    def __init__(self, accelerator, context_parallel: int = 1):
        self.accelerator = accelerator
        self.processes = accelerator.num_processes
        self.context_parallel = int(context_parallel)
        #: data-parallel groups, and this process's group (each group: context_parallel consecutive ranks)
        self.world = self.processes // self.context_parallel
        self.rank = accelerator.process_index // self.context_parallel
        #: the first rank of its group: the one that scores rewards, and whose values collectives keep
        self.is_leader = accelerator.process_index % self.context_parallel == 0
        self.is_main = accelerator.is_main_process
        #: every rank must roll out the same number of trees (a sharded model runs in lock-step)
        self.equal_shards = False

    # ------------------------------------------------------------------ sharding
    def tree_shard(self, num_trees: int) -> range:
        """The contiguous global tree ids this rank (its context-parallel group) rolls out (balanced to
        within one tree)."""
        if num_trees < self.world:
            who = "processes" if self.context_parallel == 1 else \
                f"context-parallel groups (dist.context_parallel={self.context_parallel})"
            raise ConfigError(f"an iteration has {num_trees} trees (data.prompts_per_iteration x "
                              f"data.trees_per_prompt) but the run has {self.world} {who}: "
                              "every process needs at least one tree")
        if self.equal_shards and num_trees % self.world:
            raise ConfigError(f"a sharded model (FSDP) needs the same number of trees on every process: an iteration "
                              f"has {num_trees} trees (data.prompts_per_iteration x data.trees_per_prompt), which "
                              f"{self.world} processes do not divide")
        return range(self.rank * num_trees // self.world, (self.rank + 1) * num_trees // self.world)

    # ------------------------------------------------------------------ collectives
    def gather(self, obj) -> list:
        """``obj`` of every data-parallel rank (each group's leader), in rank order (picklable objects;
        CPU tensors)."""
        if self.processes == 1:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])[::self.context_parallel]

    def broadcast(self, obj):
        """The main process's ``obj`` on every rank."""
        if self.processes == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj])[0]

    def cat(self, t: Tensor) -> Tensor:
        """Rows of ``t`` [n_r, ...] of every rank, concatenated in rank order (on the CPU)."""
        if self.processes == 1:
            return t
        return torch.cat([p for p in self.gather(t.detach().cpu())])

    def sum_scalar(self, value: float) -> float:
        """Sum of a number over ranks."""
        if self.processes == 1:
            return value
        return float(sum(self.gather(float(value))))

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Replace every parameter's gradient by its sum over ranks (one flat all-reduce).

        A parameter without a gradient on this rank (no rows in the minibatch) contributes zeros. Every
        process contributes, the ranks of a context-parallel group too: each holds the share of the
        gradient that flowed through its own tokens, and the shares add up to the group's gradient."""
        if self.processes == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        flat = self.accelerator.reduce(flat, reduction="sum")
        start = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[start:start + n].view_as(p).to(p.dtype)
            start += n

    def barrier(self) -> None:
        if self.processes > 1:
            self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------ the whole forest
    def forest_view(self, rollout: Rollout) -> "ForestView":
        """Every rank's shard structure combined into the iteration's forest (see :class:`ForestView`)."""
        if self.processes == 1:
            return ForestView(rollout, [0] * len(rollout.levels), [len(lv) for lv in rollout.levels],
                              torch.arange(rollout.num_leaves), self)
        mine = [_level_structure(lv) for lv in rollout.levels]
        shards = self.gather(mine)
        if len({len(s) for s in shards}) != 1:
            raise RuntimeError("ranks rolled out forests of different depths: the plan must be the same on every rank")
        levels, level_starts = [], []  # level_starts[d][r]: first node of rank r in depth d
        for d in range(len(mine)):
            parts, starts, start = [], [], 0
            for r, shard in enumerate(shards):
                part = dict(shard[d])
                if d > 0:  # a rank's parent indices point into its own part of the previous level
                    part["parent"] = part["parent"] + level_starts[d - 1][r]
                starts.append(start)
                start += len(part["parent"])
                parts.append(part)
            level_starts.append(starts)
            levels.append(_merge_levels(parts))
        offsets = [starts[self.rank] for starts in level_starts]
        whole = Rollout(plan=rollout.plan, levels=levels, prompts=rollout.prompts, tree_prompt=rollout.tree_prompt,
                        tree_group=rollout.tree_group, nfe=int(self.sum_scalar(rollout.nfe)))
        # where this rank's leaves sit among the whole forest's (leaves are numbered depth by depth)
        g_depth, g_node = whole.leaf_depth, whole.leaf_node
        key = g_depth * (max(len(lv) for lv in levels) + 1) + g_node
        order = torch.argsort(key)
        off = torch.tensor(offsets, dtype=torch.long)
        mine_key = rollout.leaf_depth * (max(len(lv) for lv in levels) + 1) + rollout.leaf_node + off[rollout.leaf_depth]
        local_leaves = order[torch.searchsorted(key[order], mine_key)]
        return ForestView(whole, offsets, [len(lv) for lv in rollout.levels], local_leaves, self)


_OPTIONAL = ("std", "log_prob", "pos", "lane", "sde", "train")


def _level_structure(lv: Level) -> dict:
    """The CPU tensors of a level that credit assignment reads (no states); ``has_sde`` stands for ``mean``."""
    out = {k: None if getattr(lv, k) is None else getattr(lv, k).cpu() for k in ("parent", "tree", *_OPTIONAL)}
    out["has_sde"] = lv.mean is not None
    return out


def _merge_levels(parts: list[dict]) -> Level:
    """One global level from the ranks' parts (in rank order). States (and ``mean``) are [N, 0]
    placeholders. Every tree follows the same plan, so the parts have the same fields set."""
    if len({(p["has_sde"], *(p[k] is None for k in _OPTIONAL)) for p in parts}) != 1:
        raise RuntimeError("ranks rolled out levels of different structure: the plan must be the same on every rank")
    placeholder = torch.zeros(sum(len(p["parent"]) for p in parts), 0)
    fields = {k: None if parts[0][k] is None else torch.cat([p[k] for p in parts]) for k in ("parent", "tree", *_OPTIONAL)}
    return Level(x=placeholder, mean=placeholder if parts[0]["has_sde"] else None, **fields)


@dataclass
class ForestView:
    """The iteration's whole forest as every rank sees it, and this rank's place in it.

    Attributes:
        whole: the whole forest (structure only outside a 1-process run: states are [N_d, 0]).
        offsets, sizes: per depth, where this rank's nodes start in ``whole`` and how many it has.
        local_leaves: [L_local] long, the position of each of this rank's leaves among ``whole``'s.
    """

    whole: Rollout
    offsets: list[int]
    sizes: list[int]
    local_leaves: Tensor
    dp: DataParallel

    def local(self, depth: int, values: Tensor | None) -> Tensor | None:
        """This rank's rows of a per-node tensor ``values`` [N_depth(whole), ...]."""
        if values is None:
            return None
        return values[self.offsets[depth]:self.offsets[depth] + self.sizes[depth]]

    def gather_leaf_values(self, values: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per-leaf tensors [L_local] of every rank -> [L_whole] in the whole forest's leaf order.

        The leaders' values: a context-parallel rank that is not its group's leader may pass ``{}``
        (it scored nothing) and receives its leader's."""
        if self.dp.processes == 1:
            return values
        pos = self.dp.cat(self.local_leaves)
        shards = self.dp.gather({name: v.float().cpu() for name, v in values.items()})  # one collective
        out = {}
        for name in shards[0]:
            allv = torch.cat([shard[name] for shard in shards])
            full = torch.empty(self.whole.num_leaves, dtype=allv.dtype)
            full[pos] = allv
            out[name] = full
        return out
