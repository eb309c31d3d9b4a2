"""The objective protocol: what the update stage asks of every training objective.

An iteration is three stages (:mod:`flowgrpo.trainer.trainer`):

* **collect** -- the sampler rolls out a forest and the rewards score its leaves (:class:`Collected`);
* **credit** -- an advantage estimator turns the whole iteration's rewards into advantages, which
  also decide which edges and leaves carry signal (:class:`Credit`);
* **update** -- one objective turns (collected, credit) into training *rows* and a loss per
  micro-batch of rows; the shared loop (:mod:`flowgrpo.trainer.update_loop`) owns epochs,
  minibatches, gradient accumulation, the optimizer step and data parallelism.

The one weighting rule, written once in the loop: an objective's :meth:`Objective.micro_loss` is a
**mean over the micro-batch's rows**; the loop multiplies it by ``rows in the micro-batch / rows of
the minibatch on all ranks`` and sums the gradients over ranks, so a minibatch's step is the mean
over its rows whatever the micro-batch size and the number of processes. Every row belongs to one
tree (``rows.tree``, a global tree id): minibatches are drawn over trees.

Objectives:

* ``grpo`` (:mod:`.grpo`) -- the clipped likelihood-ratio loss on SDE transitions (Flow-GRPO and
  every tree / window variant), with KL, GRPO-Guard, TempFlow weights, SFT and anchor terms;
* ``nft``, ``awm``, ``dgpo`` (:mod:`.nft`, :mod:`.awm`, :mod:`.dgpo`) -- forward-process objectives
  that train on noised copies of the rollout's clean samples (:mod:`.forward_rows`) and need no
  log-probabilities.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor


class Rows(Protocol):
    """A set of training rows: any batch type with these fields and ``select``."""

    tree: Tensor  # [R] long, global tree id of every row (minibatches are drawn over trees)
    step: Tensor  # [R] long, plan step / timestep slot of every row (micro-batches are ordered by it)

    def __len__(self) -> int: ...

    def select(self, idx: Tensor) -> "Rows": ...


@dataclass
class Collected:
    """The collect stage's output: one iteration's rollout and rewards.

    Attributes:
        iteration: the outer iteration n.
        plan: the sampling plan of the iteration.
        cond: prompt encodings, one row per prompt of the iteration.
        rollout: this rank's shard of the forest (global tree ids).
        images: decoded leaves of this rank, [L_local, 3, H, W] (videos [L_local, F, 3, H, W]) in [0, 1].
        view: the whole iteration's forest as every rank sees it
            (:class:`~flowgrpo.trainer.data_parallel.ForestView`).
        rewards: reward name -> [L_whole] float (NaN where a reward failed), whole forest's leaf order.
        components: named reward components [L_whole] for logging.
        seconds: wall-clock of sampling (the rollout's model calls and steps).
        collect_seconds: wall-clock of the whole collect stage: sampling, decoding and the scoring
            that was not overlapped with sampling (``reward.waves``).
        prompt_keys: the curriculum key of each prompt row (:class:`~flowgrpo.data.PromptBatch`).
    """

    iteration: int
    plan: Any
    cond: Any
    rollout: Any
    images: Tensor
    view: Any
    rewards: dict[str, Tensor]
    components: dict[str, Tensor]
    seconds: float = 0.0
    collect_seconds: float = 0.0
    prompt_keys: list[str] = field(default_factory=list)


@dataclass
class Credit:
    """The credit stage's output: the one record of what trains this iteration.

    Transition objectives (GRPO, Flow-DPPO) read ``edge_masks`` and ``steps``; forward-process
    objectives (DiffusionNFT, AWM, DGPO, Diffusion-DPO), which train on the leaves' clean samples,
    read :meth:`trained_leaves`. Both views come from the same estimator mask and the same strategy
    pruning, decided here once.

    Attributes:
        advantages: the estimator's :class:`~flowgrpo.advantages.AdvantageResult` (whole forest).
        edge_masks: per depth, [N_d(whole)] bool edges that may train (None: all), leaves with
            signal below them and strategy pruning applied.
        pruned_edges: edges removed by strategy pruning (None: the strategy does not prune).
        steps: the plan steps whose SDE transitions train this iteration (likelihood objectives).
        leaf_valid: [L(whole)] bool leaves whose every reward is finite (None: all of them).
        leaf_kept: [L(whole)] bool leaves kept by the strategy's pruning (None: all of them).
    """

    advantages: Any
    edge_masks: list[Tensor | None]
    pruned_edges: int | None
    steps: list[int]
    leaf_valid: Tensor | None = None
    leaf_kept: Tensor | None = None

    def trained_leaves(self, only_signal: bool = False) -> Tensor:
        """[L(whole)] bool, the leaves whose clean samples train a forward-process objective: every
        leaf with finite rewards (the authors' row set: a group without reward spread still carries
        its regularisers at advantage 0), or with ``only_signal`` only the estimator's
        ``leaf_mask`` (valid reward, group with spread); pruned leaves never."""
        keep = torch.ones(len(self.advantages.leaf_mask), dtype=torch.bool)
        for mask in (self.advantages.leaf_mask if only_signal else self.leaf_valid, self.leaf_kept):
            if mask is not None:
                keep &= mask.cpu().bool()
        return keep


@dataclass
class UpdateContext:
    """Everything an objective may read during one update (built by the trainer per iteration).

    Attributes:
        cfg: the run's :class:`~flowgrpo.config.RunConfig`.
        policy: the policy being trained (unwrapped).
        collected, credit: this iteration's stages.
        device, dtype: where and in which dtype the model runs.
        dp: the :class:`~flowgrpo.trainer.data_parallel.DataParallel` helper (world, gather, cat).
        rng: the update's numpy generator (the same draws on every rank).
        autocast: a context-manager factory for the model's mixed precision.
        lockstep: whether every rank must make the same model calls (sharded weights, FSDP).
    """

    cfg: Any
    policy: Any
    collected: Collected
    credit: Credit
    device: torch.device
    dtype: torch.dtype
    dp: Any
    rng: np.random.Generator
    autocast: Any
    lockstep: bool = False


@dataclass
class MicroLoss:
    """One micro-batch's loss and diagnostics.

    Attributes:
        loss: scalar, the mean over the micro-batch's rows of the objective (with its extra terms).
        stats: per-row diagnostics, name -> [m] (the collector pools them over all rows).
        record: objective-specific data for its own statistics collector (e.g. the GRPO op's output).
    """

    loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)
    record: Any = None


class StatsCollector:
    """Pools micro-batch results into flat metrics: the row-weighted mean loss and the mean of every
    per-row statistic (over all rows of all ranks), plus the mean gradient norm of the steps."""

    def __init__(self, rows: int):
        self.rows_total = rows
        self.loss: list[Tensor] = []
        self.stats: dict[str, list[Tensor]] = {}
        self.rows = 0
        self.grad_norms: list[float] = []
        self.extra: dict[str, list[Tensor]] = {}

    def add(self, micro: MicroLoss, rows: Rows) -> None:
        self.loss.append(micro.loss.detach().float().reshape(1).cpu() * len(rows))
        self.rows += len(rows)
        for k, v in micro.stats.items():
            self.stats.setdefault(k, []).append(v.detach().float().reshape(-1).cpu())

    def add_extra(self, name: str, value: Tensor) -> None:
        """A minibatch-level term (e.g. the anchor loss), one value per minibatch and rank."""
        self.extra.setdefault(name, []).append(value.detach().float().reshape(1).cpu())

    def finish(self, dp=None) -> dict[str, float]:
        def cat(parts: list[Tensor]) -> Tensor:
            t = torch.cat(parts) if parts else torch.zeros(0)
            return dp.cat(t) if dp is not None else t

        loss = cat(self.loss)
        rows = int(dp.sum_scalar(self.rows)) if dp is not None else self.rows
        out = {"loss": float(loss.sum()) / rows if rows else 0.0,
               "grad_norm": float(np.mean(self.grad_norms)) if self.grad_norms else 0.0,
               "rows": int(dp.sum_scalar(self.rows_total)) if dp is not None else self.rows_total}
        for k in _agreed_keys(self.stats, dp):
            v = cat(self.stats.get(k, []))
            out[k] = float(v.mean()) if len(v) else 0.0
        for k in _agreed_keys(self.extra, dp):
            v = cat(self.extra.get(k, []))
            if dp is not None and len(v):  # each rank holds its share of every minibatch's term
                v = v.view(dp.world, -1).sum(0)
            out[k] = float(v.mean()) if len(v) else 0.0
        return out


def _agreed_keys(named: dict, dp=None) -> list[str]:
    """The names of ``named`` on every rank, in one order (each is pooled with a collective, which every
    rank must make: a rank without rows has no per-row statistics while the others have some)."""
    if dp is None:
        return list(named)
    return list(dict.fromkeys(k for keys in dp.gather(list(named)) for k in keys))


class Objective(ABC):
    """A training objective: rows from an iteration, a loss per micro-batch, hooks around steps.

    Subclasses set :attr:`name`, implement :meth:`rows` and :meth:`micro_loss`, and override the
    hooks they need. State that must survive a resume (an old policy, an EMA reference) goes
    through :meth:`state_dict` / :meth:`load_state_dict` and is checkpointed with the trainer.
    """

    name: str = ""
    #: whether the frozen base model must be kept (KL terms): the trainer snapshots it once
    needs_reference: bool = False
    #: lagging copies of the trainable weights it keeps (old policy, EMA reference: objectives.old_policy);
    #: a full fine-tune's are whole weight copies, which the memory model counts
    lagging_copies: int = 0

    def setup(self, policy) -> None:
        """Called once after the policy is on its device and prepared by the weight engine."""

    def rollout_weights(self, policy) -> contextlib.AbstractContextManager:
        """Context in which the collect stage rolls out (default: the live weights)."""
        return contextlib.nullcontext()

    @abstractmethod
    def rows(self, ctx: UpdateContext) -> Rows | None:
        """This rank's training rows for the iteration (None or empty: nothing to train here)."""

    def begin_minibatch(self, ctx: UpdateContext, rows: Rows, passes: int) -> int:
        """Called before a minibatch's micro-batches with this rank's rows of it; ``passes`` is the
        most micro-batches any rank runs for it. Returns the model calls without gradient it made
        (lock-step engines pad the others). Default: nothing."""
        return 0

    def micro_batch_key(self) -> str | None:
        """The name of a rows attribute (e.g. ``"leaf"``) whose equal values the update loop keeps in
        one micro-batch: rows are ordered by it and micro-batches hold whole runs of it (more than
        ``train.micro_batch`` rows where one run is longer). Default None: rows split freely, ordered by step."""
        return None

    @abstractmethod
    def micro_loss(self, ctx: UpdateContext, rows: Rows) -> MicroLoss:
        """The loss of one micro-batch (a mean over its rows), with gradients."""

    def minibatch_terms(self, ctx: UpdateContext) -> dict[str, Tensor]:
        """Extra loss terms once per minibatch (already weighted for this rank's share). Default: none."""
        return {}

    def idle_pass(self, ctx: UpdateContext) -> Tensor:
        """The model calls of one micro-batch on one dummy row, as a loss whose gradient is zero
        (sharded engines need every rank in every forward and backward)."""
        policy = ctx.policy
        x, sigma, c = idle_inputs(ctx)
        with ctx.autocast():
            v = policy.velocity(x, sigma, c).float()
        if self.needs_reference:
            policy.reference_velocity(x, sigma, c)
        return v.sum() * 0.0

    def after_step(self, ctx: UpdateContext) -> None:
        """After every optimizer step."""

    def after_update(self, ctx: UpdateContext) -> dict[str, float]:
        """After the iteration's update (every epoch done); returns extra metrics."""
        return {}

    def new_collector(self, rows: Rows | None) -> StatsCollector:
        """The statistics collector of one update."""
        return StatsCollector(len(rows) if rows is not None else 0)

    def state_dict(self) -> dict:
        """Objective state for checkpoints (whole tensors)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (missing keys: keep the fresh state)."""


def idle_inputs(ctx: UpdateContext, rows: int = 1) -> tuple[Tensor, Tensor, object]:
    """Dummy model inputs of an idle pass (:meth:`Objective.idle_pass`): ``rows`` zero latents
    [rows, *latent_shape] at t = 0.5 [rows], with the first prompt's conditioning. Their values never
    reach a gradient: the pass only keeps a sharded engine's collectives in step."""
    x = torch.zeros(rows, *ctx.policy.latent_shape, device=ctx.device, dtype=ctx.dtype)
    t = torch.full((rows,), 0.5)
    return x, t, ctx.collected.cond.index(torch.zeros(rows, dtype=torch.long))
