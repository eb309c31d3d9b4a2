"""The rollout forest's data structure: :class:`Rollout` (the sampled forest, by depth :class:`Level` s)
and :class:`TransitionBatch` (its SDE transitions, flattened for the loss). One tree per (prompt,
initial noise); a chain is a tree with branching 1. The sampler that builds a :class:`Rollout` is
:class:`~flowgrpo.samplers.forest_sampler.ForestSampler`.

Storage is by depth (number of edges from the root), so that every node of one depth across the
whole forest is one batch: ``levels[d].x`` holds the states of all nodes at depth d ([N_d, ...]) and
``levels[d].parent`` indexes their parents in depth d - 1. The edge into a node (its transition) is
stored on the child: mean mu_old, std s and logp_old for SDE edges.

Nodes of one depth need not do the same thing (a tree program, see
:class:`~flowgrpo.samplers.plan.SamplingPlan`): each node records its grid index ``pos`` (its sigma
is ``plan.sigmas[pos]``) and its ``lane`` (role in the plan), and the ``sde`` mask says which edges
into a depth are stochastic. In a chain or a uniformly branching tree pos = depth for every node.
**Leaves** are the nodes at grid index T (sigma = 0), whatever their depth: G2RPO's coarse ODE
completions reach sigma = 0 in fewer edges than its fine ones. Leaves are numbered depth by depth,
in level order; in a chain or a uniform tree they are exactly the last level.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .plan import SamplingPlan


@dataclass
class Level:
    """All nodes at one depth.

    Attributes:
        x: node states [N_d, ...] float32.
        parent: [N_d] long index into the previous level (-1 at depth 0).
        tree: [N_d] long tree id of each node.
        mean, std, log_prob: the SDE edge into each node ([N_d, ...], [N_d], [N_d]); None when no
            edge into this depth is SDE. Rows of ODE edges in a mixed depth hold mean = x, std = 0,
            log_prob = 0 and are excluded by ``sde``.
        pos: [N_d] long grid index of each node (None: every node at grid index d).
        lane: [N_d] long lane of each node in the plan's rules (None: all lane 0).
        sde: [N_d] bool, edges into the node that are SDE (None: all of them when ``mean`` is set).
        train: [N_d] bool, SDE edges whose spec has ``train`` (None: every SDE edge).
    """

    x: Tensor
    parent: Tensor
    tree: Tensor
    mean: Tensor | None = None
    std: Tensor | None = None
    log_prob: Tensor | None = None
    pos: Tensor | None = None
    lane: Tensor | None = None
    sde: Tensor | None = None
    train: Tensor | None = None

    def __len__(self) -> int:
        return self.x.shape[0]

    def sde_mask(self) -> Tensor:
        """[N_d] bool: which edges into this depth are SDE (all False at the root)."""
        if self.mean is None:
            return torch.zeros(len(self), dtype=torch.bool, device=self.x.device)
        return self.sde if self.sde is not None else torch.ones(len(self), dtype=torch.bool, device=self.x.device)

    def train_mask(self) -> Tensor:
        """[N_d] bool: SDE edges into this depth that may enter the loss."""
        m = self.sde_mask()
        return m if self.train is None else m & self.train


@dataclass
class TransitionBatch:
    """A flat set of M SDE transitions ready for the loss.

    sample [M, ...] (parent x_sigma), prev_sample [M, ...] (child x_sigma'), mean_old [M, ...],
    std [M], log_prob_old [M], sigma / sigma_next [M], step [M] (grid index of the parent, i.e. the
    plan step), tree [M], prompt [M] (row into the rollout's conditioning), advantages [M], node [M]
    (index of the child within its level), depth [M] (the child's depth; node and depth locate the
    child in ``rollout.levels``), row [M] (optional: each transition's position in the batch it was
    selected from, so that per-row arrays computed once for the whole batch can be looked up).
    """

    sample: Tensor
    prev_sample: Tensor
    mean_old: Tensor
    std: Tensor
    log_prob_old: Tensor
    sigma: Tensor
    sigma_next: Tensor
    step: Tensor
    tree: Tensor
    prompt: Tensor
    advantages: Tensor
    node: Tensor
    depth: Tensor | None = None
    row: Tensor | None = None

    def __len__(self) -> int:
        return self.sample.shape[0]

    def select(self, idx: Tensor) -> "TransitionBatch":
        return TransitionBatch(**{k: None if getattr(self, k) is None else getattr(self, k)[idx]
                                  for k in self.__dataclass_fields__})


@dataclass
class Rollout:
    """The product of a sampler: a forest of transitions plus what is needed to score and train it.

    ``tree_prompt[t]`` is the prompt row of tree t and ``tree_group[t]`` its GRPO group.
    """

    plan: SamplingPlan
    levels: list[Level]
    prompts: list[str]
    tree_prompt: Tensor
    tree_group: Tensor
    nfe: int = 0
    _leaf_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ node attributes
    def node_pos(self, depth: int) -> Tensor:
        """[N_depth] long grid index of the nodes at ``depth`` (on the CPU)."""
        lv = self.levels[depth]
        if lv.pos is None:
            return torch.full((len(lv),), depth, dtype=torch.long)
        return lv.pos.cpu()

    def node_lane(self, depth: int) -> Tensor:
        """[N_depth] long lane of the nodes at ``depth`` (on the CPU)."""
        lv = self.levels[depth]
        if lv.lane is None:
            return torch.zeros(len(lv), dtype=torch.long)
        return lv.lane.cpu()

    def _leaf_index(self) -> tuple[Tensor, Tensor]:
        if "index" not in self._leaf_cache:
            t = self.plan.num_steps
            depths, nodes = [], []
            for d in range(len(self.levels)):
                idx = (self.node_pos(d) >= t).nonzero(as_tuple=True)[0]
                depths.append(torch.full((len(idx),), d, dtype=torch.long))
                nodes.append(idx)
            self._leaf_cache["index"] = (torch.cat(depths), torch.cat(nodes))
        return self._leaf_cache["index"]

    @property
    def leaf_depth(self) -> Tensor:
        """[L] long depth of each leaf."""
        return self._leaf_index()[0]

    @property
    def leaf_node(self) -> Tensor:
        """[L] long index of each leaf within its level."""
        return self._leaf_index()[1]

    def _leaves_are_last_level(self) -> bool:
        depth, node = self._leaf_index()
        last = len(self.levels) - 1
        return len(depth) == len(self.levels[-1]) and bool((depth == last).all())

    @property
    def leaves(self) -> Level:
        """The leaves as one :class:`Level` (x, tree, pos, lane; ``parent`` indexes each leaf's own
        parent level). In a chain or a uniform tree this is ``levels[-1]`` itself."""
        if self._leaves_are_last_level():
            return self.levels[-1]
        if "level" not in self._leaf_cache:
            depth, node = self._leaf_index()
            parts = {k: [] for k in ("x", "parent", "tree", "pos", "lane")}
            for d in depth.unique().tolist():
                sel = node[depth == d]
                lv = self.levels[d]
                dev_sel = sel.to(lv.x.device)
                parts["x"].append(lv.x[dev_sel])
                parts["parent"].append(lv.parent[dev_sel])
                parts["tree"].append(lv.tree[dev_sel])
                parts["pos"].append(self.node_pos(d)[sel])
                parts["lane"].append(self.node_lane(d)[sel])
            self._leaf_cache["level"] = Level(**{k: torch.cat(v) for k, v in parts.items()})
        return self._leaf_cache["level"]

    @property
    def num_leaves(self) -> int:
        return len(self.leaf_depth)

    @property
    def leaf_tree(self) -> Tensor:
        """[L] long tree id of each leaf (on the CPU)."""
        return self.leaves.tree.cpu()

    @property
    def leaf_lane(self) -> Tensor:
        """[L] long lane of each leaf (G2RPO: which ODE granularity completed it)."""
        lane = self.leaves.lane
        return lane.cpu() if lane is not None else torch.zeros(self.num_leaves, dtype=torch.long)

    @property
    def leaf_prompts(self) -> list[str]:
        return [self.prompts[i] for i in self.tree_prompt[self.leaf_tree].tolist()]

    @property
    def leaf_groups(self) -> Tensor:
        return self.tree_group[self.leaf_tree]

    # ------------------------------------------------------------------ tree queries
    def descendant_leaves(self, depth: int) -> Tensor:
        """[N_leaves] long: the node at ``depth`` that each leaf descends from (-1 for leaves
        shallower than ``depth``)."""
        leaf_depth, node = self._leaf_index()
        idx = node.clone()
        cur = leaf_depth.clone()
        for d in range(len(self.levels) - 1, depth, -1):
            m = cur == d
            if m.any():
                idx[m] = self.levels[d].parent.cpu()[idx[m]]
                cur[m] = d - 1
        return torch.where(cur == depth, idx, torch.full_like(idx, -1))

    def mean_over_descendants(self, leaf_values: Tensor, depth: int, leaf_mask: Tensor | None = None) -> Tensor:
        """Average a per-leaf value [N_leaves] over each depth-``depth`` node's descendant leaves.

        Nodes without (unmasked) leaves get 0. Returns [N_depth] float32.
        """
        anc = self.descendant_leaves(depth)
        n = len(self.levels[depth])
        mask = torch.ones(self.num_leaves) if leaf_mask is None else leaf_mask.float().cpu()
        mask = torch.where(anc >= 0, mask, torch.zeros_like(mask))
        vals = torch.where(mask > 0, leaf_values.float().cpu(), torch.zeros(self.num_leaves))
        a = anc.clamp(min=0)
        tot = torch.zeros(n).index_add_(0, a, vals * mask)
        cnt = torch.zeros(n).index_add_(0, a, mask)
        return torch.where(cnt > 0, tot / cnt.clamp(min=1), torch.zeros_like(tot))

    def cumulative_log_prob(self) -> list[Tensor]:
        """Per depth, [N_d] float32: the sum of the SDE edges' log-probs from the root to each node
        (ODE edges contribute 0: they are deterministic). On the CPU."""
        out = [torch.zeros(len(self.levels[0]))]
        for d in range(1, len(self.levels)):
            lv = self.levels[d]
            lp = torch.zeros(len(lv))
            if lv.log_prob is not None:
                lp = torch.where(lv.sde_mask().cpu(), lv.log_prob.float().cpu(), lp)
            out.append(out[-1][lv.parent.cpu()] + lp)
        return out

    def transitions(self, edge_advantages: list[Tensor | None], steps: list[int] | None = None,
                    edge_masks: list[Tensor | None] | None = None, allow_empty: bool = False) -> TransitionBatch:
        """Flatten the trainable SDE edges that start at the given plan steps (grid indices;
        default: all trained steps). ``allow_empty``: return a batch with no rows instead of raising
        when nothing is trainable (a data-parallel shard whose trees all lost their signal).

        ``edge_advantages[d]`` is [N_d] for the edges into depth d (index 0 unused);
        ``edge_masks[d]`` [N_d] bool, if given, keeps only those edges (e.g. edges whose leaves
        all had NaN rewards or zero-std groups carry no signal and are left out). Rows come depth by
        depth, in level order.
        """
        steps = self.plan.trained_steps() if steps is None else steps
        wanted = torch.zeros(self.plan.num_steps + 1, dtype=torch.bool)
        wanted[torch.as_tensor(sorted(set(steps)), dtype=torch.long)] = True
        sig = self.plan.sigmas
        parts: dict[str, list[Tensor]] = {k: [] for k in TransitionBatch.__dataclass_fields__ if k != "row"}
        for d in range(1, len(self.levels)):
            child, parent = self.levels[d], self.levels[d - 1]
            if child.mean is None:
                continue
            par_pos = self.node_pos(d - 1)[child.parent.cpu()]
            keep = child.train_mask().cpu() & wanted[par_pos]
            if edge_masks is not None and edge_masks[d] is not None:
                keep = keep & edge_masks[d].cpu().bool()
            if not keep.any():
                continue
            rows = keep.nonzero(as_tuple=True)[0]
            dev_rows = rows.to(child.x.device)
            pidx = child.parent[dev_rows]
            n = len(rows)
            parts["sample"].append(parent.x[pidx])
            parts["prev_sample"].append(child.x[dev_rows])
            parts["mean_old"].append(child.mean[dev_rows])
            parts["std"].append(child.std[dev_rows])
            parts["log_prob_old"].append(child.log_prob[dev_rows])
            parts["sigma"].append(sig[par_pos[rows]])
            parts["sigma_next"].append(sig[self.node_pos(d)[rows]])
            parts["step"].append(par_pos[rows])
            parts["tree"].append(child.tree.cpu()[rows])
            parts["prompt"].append(self.tree_prompt[child.tree.cpu()[rows]])
            parts["advantages"].append(edge_advantages[d].float().cpu()[rows])
            parts["node"].append(rows)
            parts["depth"].append(torch.full((n,), d, dtype=torch.long))
        if not parts["sample"]:
            if not allow_empty:
                raise ValueError("the rollout has no trainable SDE transitions in the requested steps")
            return self._empty_transitions()
        return TransitionBatch(**{k: torch.cat(v) for k, v in parts.items()})

    def _empty_transitions(self) -> TransitionBatch:
        """A :class:`TransitionBatch` with zero rows (state dims and devices of this forest)."""
        x = self.levels[0].x[:0]
        idx = torch.zeros(0, dtype=torch.long)
        flt = torch.zeros(0)
        return TransitionBatch(sample=x, prev_sample=x, mean_old=x, std=x.new_zeros(0), log_prob_old=x.new_zeros(0),
                               sigma=flt, sigma_next=flt, step=idx, tree=idx, prompt=idx, advantages=flt, node=idx,
                               depth=idx)


_LEVEL_FIELDS = ("x", "tree", "mean", "std", "log_prob", "pos", "lane", "sde", "train")


def concat_rollouts(parts: list[Rollout]) -> tuple[Rollout, list[Tensor]]:
    """One rollout from rollouts of consecutive, disjoint tree ranges of one iteration (the same plan,
    prompts and trees per prompt: e.g. :class:`~flowgrpo.samplers.forest_sampler.ForestSampler` waves).

    Each depth holds the parts' nodes in part order; parent indices are shifted into the merged
    previous depth. Returns the rollout and, per part, the positions [L_part] of its leaves among
    the merged rollout's leaves (leaves are numbered depth by depth, so a part's leaves need not be
    contiguous when leaves sit at several depths).
    """
    if not parts:
        raise ValueError("concat_rollouts needs at least one rollout")
    first = parts[0]
    if len({len(p.levels) for p in parts}) != 1:
        raise ValueError("rollouts of one plan have the same depth; got " + str([len(p.levels) for p in parts]))
    levels, offsets = [], [[0] * len(parts)]  # offsets[d][k]: first node of part k at depth d
    for d in range(len(first.levels)):
        lvs = [p.levels[d] for p in parts]
        starts = [sum(len(lv) for lv in lvs[:k]) for k in range(len(parts))]
        fields = {}
        for name in _LEVEL_FIELDS:
            vals = [getattr(lv, name) for lv in lvs]
            if any((v is None) != (vals[0] is None) for v in vals):
                raise ValueError(f"rollouts differ in whether depth {d} has {name!r}")
            fields[name] = None if vals[0] is None else torch.cat(vals)
        if d == 0:
            fields["parent"] = torch.cat([lv.parent for lv in lvs])
        else:
            fields["parent"] = torch.cat([lv.parent + offsets[-1][k] for k, lv in enumerate(lvs)])
        offsets.append(starts)
        levels.append(Level(**fields))
    merged = Rollout(plan=first.plan, levels=levels, prompts=first.prompts, tree_prompt=first.tree_prompt,
                     tree_group=first.tree_group, nfe=sum(p.nfe for p in parts))
    width = max(len(lv) for lv in levels) + 1
    key = merged.leaf_depth * width + merged.leaf_node  # increasing: leaves are in (depth, node) order
    positions = []
    for k, p in enumerate(parts):
        start = torch.tensor([offsets[d + 1][k] for d in range(len(levels))], dtype=torch.long)
        mine = p.leaf_depth * width + p.leaf_node + start[p.leaf_depth]
        positions.append(torch.searchsorted(key, mine))
    return merged, positions
