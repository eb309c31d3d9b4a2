"""The update stage's loop, shared by every objective: epochs x minibatches x micro-batches.

Minibatches are drawn over the trees of every rank (a permutation from the update's generator, the
same on every rank); each rank back-propagates its own rows of a minibatch, each micro-batch's loss
(a mean over its rows, :meth:`~flowgrpo.objectives.base.Objective.micro_loss`) weighted by
``rows in the micro-batch / rows of the minibatch on all ranks`` (an objective may name a key,
:meth:`~flowgrpo.objectives.base.Objective.micro_batch_key`, whose rows a micro-batch never splits);
the engine sums gradients over
ranks and steps once per minibatch, which therefore equals the 1-process step. Lock-step engines
(FSDP) pad a rank's micro-batches with zero-gradient passes up to the busiest rank's count.

Before a step's gradients reach the optimizer, the loss of every micro-batch is checked: a
non-finite loss stops the run (:class:`NonFiniteError`) before the weights, the optimizer state or a
checkpoint can take the NaN.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import UserError
from ..objectives.base import Objective, StatsCollector, UpdateContext


class NonFiniteError(UserError):
    """A loss or gradient norm became NaN or infinite during an update (the run stops before stepping)."""


def _check_finite(value: float, what: str, ctx: UpdateContext) -> None:
    if not math.isfinite(value):
        raise NonFiniteError(
            f"iteration {ctx.collected.iteration}: the {what} is {value} (objective "
            f"{ctx.cfg.loss.objective}); the update was not applied. Lower train.lr or the objective's "
            "step sizes, or check the rewards and the model dtype")


def run_update(ctx: UpdateContext, objective: Objective, engine, idle_pass=None) -> dict[str, float]:
    """Every inner epoch and minibatch of one iteration's update. Returns the pooled metrics
    (empty when no rank has a row to train).

    Args:
        ctx: the iteration's update context (``ctx.rng`` draws the minibatch order).
        objective: builds this rank's rows and each micro-batch's loss.
        engine: the weight engine (backward, accumulate, idle_passes, step).
        idle_pass: ``() -> None`` running one zero-gradient padding pass (default: the objective's).
    """
    tc, dp = ctx.cfg.train, ctx.dp
    # None or empty: no row on this rank. A forward-process objective builds rows from this rank's own
    # leaves, so a rank whose shard holds only groups without signal (e.g. 2 prompts on 2 ranks under
    # rows=signal) has none while others train; it still takes part in every collective and step.
    rows = objective.rows(ctx)
    if rows is not None and not len(rows):
        rows = None
    collect = objective.new_collector(rows)
    n_trees = len(ctx.collected.rollout.tree_prompt)  # tree ids are global
    tree = rows.tree.cpu() if rows is not None else torch.zeros(0, dtype=torch.long)
    rank_rows = torch.bincount(tree, minlength=n_trees)[None]  # [ranks, trees]
    if dp.world > 1:
        rank_rows = torch.stack(dp.gather(rank_rows[0]))
    tree_rows = rank_rows.sum(0)
    trees = tree_rows.nonzero(as_tuple=True)[0]
    if len(trees) == 0:  # no row carries signal on any rank: no update, no training metrics
        return {}
    params = ctx.policy.trainable_parameters()
    key_name = getattr(objective, "micro_batch_key", lambda: None)()  # the same on every rank
    key = getattr(rows, key_name).cpu() if key_name is not None and rows is not None else None

    def pad():
        if idle_pass is not None:
            idle_pass()
        else:
            engine.backward(objective.idle_pass(ctx))

    for _ in range(tc.inner_epochs):
        order = trees[torch.from_numpy(ctx.rng.permutation(len(trees)))]
        for mb_trees in torch.tensor_split(order, tc.minibatches):
            mb_rows = int(tree_rows[mb_trees].sum())  # on every rank
            if mb_rows == 0:
                continue
            mb, mb_key = _minibatch_rows(rows, tree, mb_trees, key)
            parts = _micro_parts(len(mb), tc.micro_batch, mb_key) if mb is not None else []
            if key_name is None:
                micro = (rank_rows[:, mb_trees].sum(1) + tc.micro_batch - 1) // tc.micro_batch
            else:  # whole runs of the key: each rank counts its own micro-batches
                micro = torch.tensor([int(c) for c in dp.gather(len(parts))]) if dp.world > 1 else torch.tensor([len(parts)])
            idle = engine.idle_passes(micro)
            objective.begin_minibatch(ctx, mb, int(micro.max()))
            with engine.accumulate():  # one gradient reduction per step (DeepSpeed)
                for part in parts:
                    m = mb.select(part)
                    out = objective.micro_loss(ctx, m)
                    _check_finite(float(out.loss.detach()), "loss", ctx)
                    engine.backward(out.loss * (len(part) / mb_rows))
                    collect.add(out, m)
                for _ in range(idle):
                    pad()
                for name, term in objective.minibatch_terms(ctx).items():
                    _check_finite(float(term.detach()), name, ctx)
                    engine.backward(term)
                    collect.add_extra(name, term)
            try:
                norm = engine.step(params, tc.max_grad_norm)
            except RuntimeError as exc:  # AdamW's lr / (1 - beta1) past float32's range (train.lr=1e38)
                if "without overflow" not in str(exc):
                    raise
                raise NonFiniteError(f"iteration {ctx.collected.iteration}: the optimizer step overflows float32 "
                                     f"(train.lr={tc.lr:g}); the update was not applied. Lower train.lr") from None
            _check_finite(norm, "gradient norm", ctx)
            collect.grad_norms.append(norm)
            objective.after_step(ctx)
    return _finish(objective, ctx, collect)


def _minibatch_rows(rows, tree: torch.Tensor, mb_trees: torch.Tensor, key: torch.Tensor | None = None):
    """(this rank's rows of the minibatch over the global trees ``mb_trees``, their keys): ordered by
    step (as rolled out), or with a ``key`` [R] by key and by step within it (its keys, else None);
    (None, None) when this rank holds none of them (or no rows at all)."""
    if rows is None:
        return None, None
    idx = torch.isin(tree, mb_trees).nonzero(as_tuple=True)[0]
    if len(idx) == 0:
        return None, None
    idx = idx[torch.argsort(rows.step.cpu()[idx], stable=True)]
    if key is None:
        return rows.select(idx), None
    idx = idx[torch.argsort(key[idx], stable=True)]
    return rows.select(idx), key[idx]


def _micro_parts(n: int, size: int, key: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Row positions [0, n) in micro-batches of ``size`` rows; with ``key`` [n] (runs of equal values)
    each micro-batch holds whole runs, as many as fit in ``size``, at least one."""
    if key is None:
        return list(torch.split(torch.arange(n), size))
    parts, start, cur = [], 0, 0
    for c in torch.unique_consecutive(key, return_counts=True)[1].tolist():
        if cur and cur + c > size:
            parts.append(torch.arange(start, start + cur))
            start, cur = start + cur, 0
        cur += c
    if cur:
        parts.append(torch.arange(start, start + cur))
    return parts


def _finish(objective: Objective, ctx: UpdateContext, collect: StatsCollector) -> dict[str, float]:
    out = collect.finish(ctx.dp if ctx.dp.world > 1 else None)
    out.update(objective.after_update(ctx))
    return out


def update_rng(seed: int, iteration: int) -> np.random.Generator:
    """The update's generator (minibatch order, objective draws): the same on every rank."""
    from ..seeds import UPDATE

    return np.random.default_rng([seed, iteration, UPDATE])
