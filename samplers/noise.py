"""Per-tree noise streams: a tree's samples do not depend on which other trees share its batch.

A rollout draws initial noise once per tree and SDE noise at every stochastic step. Drawing it
from one generator for the whole forest would tie tree t's noise to how many nodes came before it
in the batch, so the same tree would get other noise when the forest is split across processes
(or micro-batched differently). Here every tree owns a generator seeded from one draw of the
rollout's generator, made for all ``num_trees`` trees of the iteration whatever the shard, so that
tree t's noise is the same in a 1-process run and on whichever rank holds it in an N-process run.

The trees of one prompt that share their initial noise (DanceGRPO's ``shared_group_noise``) draw it
from a per-prompt stream in the same way, so a prompt's trees split across ranks still start from
one noise.
"""

from __future__ import annotations

import torch
from torch import Tensor

_SEED_RANGE = 2**62


class TreeNoise:
    """Standard-normal noise drawn per tree.

    Args:
        generator: the rollout's generator; exactly two int64 draws of size ``num_trees`` and
            ``num_prompts`` are taken from it, whatever ``trees`` is.
        num_trees: trees in the whole iteration (all ranks together).
        trees: the global ids of the trees this process rolls out (a contiguous range).
        trees_per_prompt: trees per prompt (tree t belongs to prompt t // trees_per_prompt).
        device: where drawn noise is placed (drawing itself is on the CPU, so it is the same on
            every device).
    """

    def __init__(self, generator: torch.Generator, num_trees: int, trees: range, trees_per_prompt: int,
                 device: torch.device | str = "cpu"):
        tree_seeds = torch.randint(0, _SEED_RANGE, (num_trees,), generator=generator, dtype=torch.int64)
        num_prompts = -(-num_trees // trees_per_prompt)
        prompt_seeds = torch.randint(0, _SEED_RANGE, (num_prompts,), generator=generator, dtype=torch.int64)
        self.trees = trees
        self.trees_per_prompt = trees_per_prompt
        self.device = device
        self._gens = {t: torch.Generator().manual_seed(int(tree_seeds[t])) for t in trees}
        self._prompt_seeds = prompt_seeds

    def initial(self, shape: tuple[int, ...], shared_group_noise: bool) -> Tensor:
        """[len(trees), *shape] float32 initial noise, one row per tree in ``trees`` order; with
        ``shared_group_noise`` every tree of a prompt gets that prompt's noise."""
        rows = []
        for t in self.trees:
            if shared_group_noise:
                gen = torch.Generator().manual_seed(int(self._prompt_seeds[t // self.trees_per_prompt]))
            else:
                gen = self._gens[t]
            rows.append(torch.randn(shape, generator=gen, dtype=torch.float32))
        return torch.stack(rows).to(self.device)

    def draw(self, tree_of_row: Tensor, shape: tuple[int, ...]) -> Tensor:
        """[n, *shape] float32 noise for n rows whose tree ids are ``tree_of_row`` [n].

        Rows of one tree must be contiguous (forest levels are tree-major); each tree's rows are
        drawn in one call from that tree's stream, so the draw does not depend on other trees."""
        ids = tree_of_row.cpu()
        if len(ids) == 0:
            return torch.empty((0, *shape), dtype=torch.float32, device=self.device)
        trees, counts = torch.unique_consecutive(ids, return_counts=True)
        if len(torch.unique(trees)) != len(trees):
            raise ValueError("TreeNoise.draw needs the rows of each tree to be contiguous")
        parts = [torch.randn((int(c), *shape), generator=self._gens[int(t)], dtype=torch.float32)
                 for t, c in zip(trees.tolist(), counts.tolist())]
        return torch.cat(parts).to(self.device)
