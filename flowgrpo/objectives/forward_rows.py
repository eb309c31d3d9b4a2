"""Training rows of the forward-process objectives: noised copies of the rollout's clean samples.

A forward-process objective (DiffusionNFT, AWM, DGPO) never replays the rollout's transitions. It
takes each clean sample x0 (a leaf of the rollout, drawn by any solver), picks training times t,
draws fresh noise eps and trains on the forward (noising) process

    x_t = (1 - t) * x0 + t * eps,        target velocity u = eps - x0,

in the flow-matching convention of diffusers (t = sigma, 1 = noise). One row is one (leaf, t) pair.
The times and the noise of a leaf come from its own generator, seeded by (train.seed, iteration,
global leaf id) (:mod:`flowgrpo.seeds`), so a row is the same whichever rank holds the leaf and
however the rows are batched: data-parallel runs make the 1-process update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from ..seeds import FORWARD_ROWS, derive_seed

#: ``(n, generator) -> t [n]`` in (0, 1): a leaf's training times, drawn from its own generator
TimeSampler = Callable[[int, torch.Generator], Tensor]


@dataclass
class SampleRows:
    """Rows (leaf, t) of a forward-process update.

    Attributes:
        x0: [R, ...] clean samples (the rollout's leaves, model dtype, on the model's device).
        noise: [R, ...] float32 standard normal noise of each row.
        t: [R] float32 training times in (0, 1) (sigma units).
        prompt: [R] long row into the iteration's conditioning.
        tree: [R] long global tree id.
        group: [R] long global group id (the leaves that share a prompt).
        leaf: [R] long global leaf id (position in the whole forest's leaf order).
        advantage: [R] float32 the leaf's advantage (clipped by the estimator).
        step: [R] long timestep slot k of the row within its leaf (0..K-1), for ordering and stats.
    """

    x0: Tensor
    noise: Tensor
    t: Tensor
    prompt: Tensor
    tree: Tensor
    group: Tensor
    leaf: Tensor
    advantage: Tensor
    step: Tensor

    def __len__(self) -> int:
        return self.t.shape[0]

    def select(self, idx: Tensor) -> "SampleRows":
        dev = self.x0.device
        return SampleRows(x0=self.x0[idx.to(dev)], noise=self.noise[idx.to(self.noise.device)],
                          **{k: getattr(self, k)[idx] for k in ("t", "prompt", "tree", "group", "leaf", "advantage",
                                                               "step")})

    def noised(self, dtype: torch.dtype | None = None) -> Tensor:
        """x_t = (1 - t) x0 + t eps, [R, ...] float32 (or ``dtype``)."""
        t = self.t.to(self.noise.device).view(-1, *([1] * (self.noise.ndim - 1)))
        x_t = (1 - t) * self.x0.float() + t * self.noise
        return x_t if dtype is None else x_t.to(dtype)

    def target(self) -> Tensor:
        """u = eps - x0, [R, ...] float32."""
        return self.noise - self.x0.float()


def build_sample_rows(collected, credit, seed: int, times: TimeSampler, per_leaf: int,
                      only_signal: bool = False) -> SampleRows | None:
    """This rank's rows: ``per_leaf`` times per leaf (from ``times``) with fresh noise.

    Args:
        collected: the iteration's :class:`~flowgrpo.objectives.base.Collected` (local leaves).
        credit: its :class:`~flowgrpo.objectives.base.Credit`: the leaf advantages and which
            leaves train (:meth:`~flowgrpo.objectives.base.Credit.trained_leaves`).
        seed: ``train.seed``.
        times: draws a leaf's ``per_leaf`` times from the leaf's generator.
        per_leaf: K, rows per leaf (a grid sampler on a grid of fewer times gives all of them).
        only_signal: keep only leaves in the estimator's mask (valid reward, group with signal);
            otherwise (the authors' row set) every leaf with a finite reward, advantage 0 where the
            group has no spread (the objectives' ``rows`` option). Pruned leaves never train.
    Returns None when no leaf is kept.
    """
    ro, view, adv = collected.rollout, collected.view, credit.advantages
    leaves = ro.leaves
    glob = view.local_leaves.cpu()
    keep = credit.trained_leaves(only_signal)[glob]
    idx = keep.nonzero(as_tuple=True)[0]
    if len(idx) == 0:
        return None
    x0 = leaves.x[idx.to(leaves.x.device)]
    tree = ro.leaf_tree[idx]
    gids = glob[idx]
    shape = tuple(x0.shape[1:])
    ts, noises = [], []
    for g in gids.tolist():
        gen = torch.Generator().manual_seed(derive_seed(seed, collected.iteration, FORWARD_ROWS, g))
        t = times(per_leaf, gen).float()
        ts.append(t)
        noises.append(torch.randn((len(t), *shape), generator=gen))
    k = len(ts[0])  # a grid sampler gives at most the grid's times (fewer than per_leaf on a short grid)
    rep = lambda v: v.repeat_interleave(k)  # noqa: E731  (leaf-major rows: leaf j's K rows are adjacent)
    advantage = torch.nan_to_num(adv.leaf_advantages.float().cpu()[gids], nan=0.0)
    return SampleRows(
        x0=x0.repeat_interleave(k, dim=0),
        noise=torch.cat(noises).to(x0.device),
        t=torch.cat(ts),
        prompt=rep(ro.tree_prompt[tree]),
        tree=rep(tree),
        group=rep(ro.tree_group[tree]),
        leaf=rep(gids),
        advantage=rep(advantage),
        step=torch.arange(k).repeat(len(idx)),
    )


def rollout_times(sigmas: Tensor, fraction: float = 1.0) -> TimeSampler:
    """Times from a rollout's grid: K of the first ceil(fraction T) grid times sigma_0.. (all of them
    when K is that many, in order; else a random subset of K, sorted), as DiffusionNFT (fraction 1) and
    DGPO (0.7) train on the rollout's own timesteps."""
    grid = sigmas[:-1].float().cpu()
    grid = grid[:max(1, math.ceil(fraction * len(grid) - 1e-9))]

    def draw(k: int, gen: torch.Generator) -> Tensor:
        if k >= len(grid):
            return grid.clone()
        pick = torch.randperm(len(grid), generator=gen)[:k].sort().values
        return grid[pick]

    return draw


def grid_strata_times(sigmas: Tensor, fraction: float = 0.9, first: int = 1) -> TimeSampler:
    """One grid time from each of K strata of the grid indices [first, floor(fraction T)): boundaries
    linspace(first, floor(fraction T), K + 1) cast down, an index drawn uniformly in each stratum
    (AWM's 'discrete_wo_init': t = 1 and the last, nearly clean, times are never trained)."""
    grid = sigmas[:-1].float().cpu()
    hi = max(int(len(grid) * fraction), first + 1)

    def draw(k: int, gen: torch.Generator) -> Tensor:
        bounds = torch.linspace(first, hi, k + 1).long()
        lo, width = bounds[:-1], (bounds[1:] - bounds[:-1]).clamp(min=1)
        idx = lo + (torch.rand(k, generator=gen) * width).long()
        return grid[idx.clamp(max=len(grid) - 1)]

    return draw


def logit_normal_times(mean: float = 0.0, std: float = 1.0, shift: float = 1.0, eps: float = 1e-3) -> TimeSampler:
    """t = shift(sigmoid(mean + std * n)), n ~ N(0, 1), with the timestep shift
    s t / (1 + (s - 1) t), clamped to [eps, 1 - eps] (SD3's training distribution)."""

    def draw(k: int, gen: torch.Generator) -> Tensor:
        t = torch.sigmoid(mean + std * torch.randn(k, generator=gen))
        t = shift * t / (1 + (shift - 1) * t)
        return t.clamp(eps, 1 - eps)

    return draw


def uniform_times(lo: float = 1e-3, hi: float = 1 - 1e-3) -> TimeSampler:
    """t ~ U(lo, hi)."""

    def draw(k: int, gen: torch.Generator) -> Tensor:
        return lo + (hi - lo) * torch.rand(k, generator=gen)

    return draw


@dataclass(frozen=True)
class TrainedForward:
    """One micro-batch's forward with gradients (:func:`trained_forward`): the prompts' conditioning
    ``cond``, the noised inputs ``x_in`` [m, ...] in the model's dtype, the flow-matching target ``u``
    [m, ...] and the trained velocity ``v`` [m, ...] (float32), all on the model's device."""

    cond: object
    x_in: Tensor
    u: Tensor
    v: Tensor


def trained_forward(ctx, rows: SampleRows, guidance: float) -> TrainedForward:
    """The trained policy's velocity on ``rows`` at ``guidance``, with gradients, and what it was computed
    from (the opening of every forward objective's micro-batch loss); ``ctx`` the update's
    :class:`~flowgrpo.objectives.base.UpdateContext`."""
    cond = ctx.collected.cond.index(rows.prompt)
    x_in = rows.noised(ctx.dtype).to(ctx.device)
    with ctx.autocast():
        v = ctx.policy.velocity(x_in, rows.t, cond, guidance).float()
    return TrainedForward(cond, x_in, rows.target().to(ctx.device), v)


def first_pass_velocities(ctx, rows: SampleRows | None, micro: int, reference: Callable,
                          guidance: float) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """The pass without gradients of a two-pass objective (dgpo's margins, crd's centres): for each
    micro-batch of at most ``micro`` rows, in row order, (target u [m, ...], the reference's velocity
    [m, ...], the trained velocity at ``guidance`` [m, ...]), float32 on the model's device.
    ``reference(policy, x, t, cond)`` is the objective's reference velocity; ``ctx`` the update's
    :class:`~flowgrpo.objectives.base.UpdateContext`."""
    if rows is None:
        return
    for part in torch.split(torch.arange(len(rows)), micro):
        m = rows.select(part)
        cond = ctx.collected.cond.index(m.prompt)
        x_in = m.noised(ctx.dtype).to(ctx.device)
        with torch.no_grad(), ctx.autocast():
            v_ref = reference(ctx.policy, x_in, m.t, cond).float()
            v = ctx.policy.velocity(x_in, m.t, cond, guidance).float()
        yield m.target().to(ctx.device), v_ref, v


def per_row_mean(x: Tensor) -> Tensor:
    """[R, ...] -> [R]: the mean over every non-batch dimension."""
    return x.flatten(1).mean(1)
