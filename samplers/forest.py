"""The rollout forest: one tree per (prompt, initial noise); a chain is a tree with branching 1.

Storage is by depth, so that every node of one depth across the whole forest is one batch:
``levels[d].x`` holds the states of all nodes at depth d ([N_d, ...]) and ``levels[d].parent``
indexes their parents in depth d - 1. The edge into a node (its transition) is stored on the
child: mean mu_old, std s and logp_old for SDE edges.
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
        mean, std, log_prob: the SDE edge into each node ([N_d, ...], [N_d], [N_d]); None for ODE edges.
    """

    x: Tensor
    parent: Tensor
    tree: Tensor
    mean: Tensor | None = None
    std: Tensor | None = None
    log_prob: Tensor | None = None

    def __len__(self) -> int:
        return self.x.shape[0]


@dataclass
class TransitionBatch:
    """A flat set of M SDE transitions ready for the loss.

    sample [M, ...] (parent x_sigma), prev_sample [M, ...] (child x_sigma'), mean_old [M, ...],
    std [M], log_prob_old [M], sigma / sigma_next [M], step [M] (index in the plan),
    tree [M], prompt [M] (row into the rollout's conditioning), advantages [M], node [M] (index
    of the child within its level).
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

    def __len__(self) -> int:
        return self.sample.shape[0]

    def select(self, idx: Tensor) -> "TransitionBatch":
        return TransitionBatch(**{k: getattr(self, k)[idx] for k in self.__dataclass_fields__})


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
    info: dict = field(default_factory=dict)

    @property
    def leaves(self) -> Level:
        return self.levels[-1]

    @property
    def num_leaves(self) -> int:
        return len(self.levels[-1])

    @property
    def leaf_prompts(self) -> list[str]:
        return [self.prompts[i] for i in self.tree_prompt[self.leaves.tree].tolist()]

    @property
    def leaf_groups(self) -> Tensor:
        return self.tree_group[self.leaves.tree]

    def descendant_leaves(self, depth: int) -> Tensor:
        """[N_leaves] long: the node at ``depth`` that each leaf descends from."""
        idx = torch.arange(self.num_leaves)
        for d in range(len(self.levels) - 1, depth, -1):
            idx = self.levels[d].parent[idx]
        return idx

    def mean_over_descendants(self, leaf_values: Tensor, depth: int, leaf_mask: Tensor | None = None) -> Tensor:
        """Average a per-leaf value [N_leaves] over each depth-``depth`` node's descendant leaves.

        Nodes without (unmasked) leaves get 0. Returns [N_depth] float32.
        """
        anc = self.descendant_leaves(depth)
        n = len(self.levels[depth])
        mask = torch.ones(self.num_leaves) if leaf_mask is None else leaf_mask.float()
        tot = torch.zeros(n).index_add_(0, anc, leaf_values.float() * mask)
        cnt = torch.zeros(n).index_add_(0, anc, mask)
        return torch.where(cnt > 0, tot / cnt.clamp(min=1), torch.zeros_like(tot))

    def transitions(self, edge_advantages: list[Tensor | None], steps: list[int] | None = None,
                    edge_masks: list[Tensor | None] | None = None) -> TransitionBatch:
        """Flatten the trainable SDE edges of the given plan steps (default: all trained steps).

        ``edge_advantages[d]`` is [N_d] for the edges into depth d (index 0 unused);
        ``edge_masks[d]`` [N_d] bool, if given, keeps only those edges (e.g. edges whose leaves
        all had NaN rewards or zero-std groups carry no signal and are left out).
        """
        steps = self.plan.trained_steps() if steps is None else steps
        parts: dict[str, list[Tensor]] = {k: [] for k in TransitionBatch.__dataclass_fields__}
        for i in steps:
            child, parent = self.levels[i + 1], self.levels[i]
            if child.mean is None:
                continue
            n = len(child)
            parts["sample"].append(parent.x[child.parent])
            parts["prev_sample"].append(child.x)
            parts["mean_old"].append(child.mean)
            parts["std"].append(child.std)
            parts["log_prob_old"].append(child.log_prob)
            parts["sigma"].append(self.plan.sigmas[i].expand(n))
            parts["sigma_next"].append(self.plan.sigmas[i + 1].expand(n))
            parts["step"].append(torch.full((n,), i, dtype=torch.long))
            parts["tree"].append(child.tree)
            parts["prompt"].append(self.tree_prompt[child.tree])
            parts["advantages"].append(edge_advantages[i + 1].float())
            parts["node"].append(torch.arange(n))
            if edge_masks is not None and edge_masks[i + 1] is not None:
                keep = edge_masks[i + 1]
                for k in parts:
                    parts[k][-1] = parts[k][-1][keep]
        if not parts["sample"]:
            raise ValueError("the rollout has no trainable SDE transitions in the requested steps")
        return TransitionBatch(**{k: torch.cat(v) for k, v in parts.items()})
