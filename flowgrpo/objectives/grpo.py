"""``loss.objective=grpo``: the clipped likelihood-ratio loss on the rollout's SDE transitions.

Rows are the trained SDE transitions (:class:`~flowgrpo.samplers.forest.TransitionBatch`) of the
credit stage's selected steps and edges. Per micro-batch the model is re-run on the stored states,
the sampler layer turns the velocity into the transitions' means
(:func:`~flowgrpo.samplers.recompute.transition_means`), and the GRPO op (:mod:`flowgrpo.ops`,
fused or reference) gives the clipped surrogate with optional KL to the reference and GRPO-Guard
ratio normalisation. The objective composes the loss terms of :mod:`.terms`: the clip schedule,
per-row weights (GRPO-Guard reweighting, TempFlow), the best-path SFT term and the minibatch-level
anchor term, so the trainer knows none of them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..ops import grpo_loss, grpo_loss_ref
from ..samplers.recompute import transition_log_prob_std, transition_means, transition_sigma_t
from .base import MicroLoss, Objective, UpdateContext
from .grpo_stats import UpdateStatsCollector
from .lora_fold import lora_folded
from .terms.anchor import ODEAnchor
from .terms.clip_schedule import ClipSchedule
from .terms.sft import BestPathSFT, best_paths
from .terms.step_weights import StepWeights, iteration_trained_steps


class GRPOObjective(Objective):
    """Flow-GRPO's objective and every variant's loss options (``loss.grpo.*``).

    Args:
        opt: the run's ``loss.grpo`` (:class:`~flowgrpo.objectives.options.GRPOOptions`).
        device: where the model runs (to build the fused op ahead of the first timed iteration).
    """

    name = "grpo"

    def __init__(self, opt, device=None):
        self.cfg = opt
        refs = self._compose_terms(opt)
        self.needs_reference = opt.kl_beta > 0 or "base" in refs
        if opt.backend == "reference":
            self.loss_fn = grpo_loss_ref
        elif opt.backend == "fused":
            self.loss_fn = functools.partial(grpo_loss, backend="fused")
        else:  # auto: the fused op where a kernel is built, else the reference (one warning)
            self.loss_fn = grpo_loss
        if opt.backend != "reference" and device is not None:
            # build/load the extension now, not inside the first (timed) iteration: a first JIT build
            # takes ~20 s, which would otherwise be charged to the training clock
            from ..ops import fused_available

            fused_available(device)

    def _compose_terms(self, opt) -> frozenset[str]:
        """The loss terms set by ``opt``'s fields of their names (a term whose keys ``opt`` lacks keeps
        its inactive default); returns the models they evaluate besides the trained one."""
        self.clip, self.weights = ClipSchedule.from_config(opt), StepWeights.from_config(opt)
        self.sft, self.anchor = BestPathSFT.from_config(opt), ODEAnchor.from_config(opt)
        self._it: dict = {}
        return frozenset().union(*(t.references for t in (self.clip, self.weights, self.sft, self.anchor)))

    # ------------------------------------------------------------------ rows
    def rows(self, ctx: UpdateContext):
        col, cr = ctx.collected, ctx.credit
        adv, view = cr.advantages, col.view
        self._it = {}
        if not adv.leaf_mask.any():
            return None
        batch = col.rollout.transitions([view.local(d, a) for d, a in enumerate(adv.edge_advantages)], cr.steps,
                                        [view.local(d, m) for d, m in enumerate(cr.edge_masks)],
                                        allow_empty=ctx.dp.world > 1)
        plan = col.plan
        it = self._it
        it["clip"] = self.clip.value(col.rewards)
        steps = None  # one process: the batch's own steps are the iteration's
        if self.weights.opt.guard_reweight and ctx.dp.world > 1:  # normalise over every rank's steps
            steps = iteration_trained_steps(view.whole, adv.edge_advantages, cr.steps, cr.edge_masks)
        it["weights"] = self.weights.value(batch, plan, steps)
        it["logp_std"] = transition_log_prob_std(batch, plan)
        it["best"] = None
        if self.sft.active:
            best = best_paths(view.whole, adv.leaf_advantages, adv.leaf_mask)
            it["best"] = [view.local(d, b) for d, b in enumerate(best)]
        it["level_sizes"] = [len(lv) for lv in view.whole.levels] if ctx.dp.world > 1 else None
        it["rows"] = len(batch)
        # rows carry their index into the iteration's batch, for the per-row weights above
        return dataclasses.replace(batch, row=torch.arange(len(batch)))

    def new_collector(self, rows):
        return UpdateStatsCollector(len(rows) if rows is not None else 0)

    # ------------------------------------------------------------------ loss
    def micro_loss(self, ctx: UpdateContext, mb) -> MicroLoss:
        cfg, it, policy, plan = self.cfg, self._it, ctx.policy, ctx.collected.plan
        cond = ctx.collected.cond.index(mb.prompt)
        x = mb.sample.to(ctx.device)
        with ctx.autocast(), lora_folded(self._denoiser(policy), ctx.cfg.train.fold_lora):
            v = policy.velocity(x.to(ctx.dtype), mb.sigma, cond).float()
        mean = transition_means(mb, v, plan)
        mean_ref, kl_sigma = None, None
        if cfg.kl_beta > 0:
            ref = it.get("mean_ref")
            if ref is not None and bool(it["ref_done"][mb.row].all()):
                mean_ref = ref[mb.row.to(ref.device)]
            else:
                mean_ref = self._reference_means(ctx, mb)
            kl_sigma = mb.std if cfg.kl_sigma == "transition_std" else transition_sigma_t(mb, plan)
        # a TransitionBatch keeps its latents on the rollout's device and its per-row metadata
        # (advantages, steps, sigmas) on the CPU; the loss takes every operand where the means are
        dev = mean.device
        out = self.loss_fn(mb.prev_sample.to(dev), mean, mb.mean_old.to(dev), it["logp_std"][mb.row].to(dev),
                           mb.log_prob_old.to(dev), mb.advantages.to(dev), it["weights"][mb.row].to(dev),
                           clip_range=it["clip"], guard=cfg.guard, mean_ref=mean_ref,
                           kl_sigma=None if kl_sigma is None else kl_sigma.to(dev), beta=cfg.kl_beta)
        loss = out.loss
        if it["best"] is not None:
            sft = self.sft.value(mb, mean, it["best"])
            if sft is not None:
                loss = loss + sft
        return MicroLoss(loss=loss, record=out)

    @staticmethod
    def _denoiser(policy):
        try:
            return policy.denoiser
        except Exception:  # a policy without a transformer submodule: nothing to fold
            return None

    def _reference_means(self, ctx: UpdateContext, rows) -> torch.Tensor:
        """mu_ref [m, ...] float32 of ``rows`` under the frozen base model (no gradient)."""
        cond = ctx.collected.cond.index(rows.prompt)
        x = rows.sample.to(ctx.device).to(ctx.dtype)
        v_ref = ctx.policy.reference_velocity(x, rows.sigma, cond).float()
        return transition_means(rows, v_ref, ctx.collected.plan).detach()

    def begin_minibatch(self, ctx: UpdateContext, rows, passes: int) -> int:
        """With ``loss.grpo.batched_reference`` (and kl_beta > 0, not lock-step): the reference means of the
        minibatch's rows not yet computed this iteration, in no-grad batches of ``train.micro_batch``
        rows, which every inner epoch then reuses (the base model is frozen): epochs after the first
        make no reference call. (Larger batches than the update's own were slower on a 2-core CPU:
        their activations leave the caches.) Returns the model calls made."""
        if self.cfg.kl_beta <= 0 or not self.cfg.batched_reference or ctx.lockstep or rows is None or not len(rows):
            return 0
        it = self._it
        if "mean_ref" not in it:
            it["mean_ref"] = torch.empty(it["rows"], *rows.sample.shape[1:], device=ctx.device)
            it["ref_done"] = torch.zeros(it["rows"], dtype=torch.bool)
        todo = rows.select((~it["ref_done"][rows.row]).nonzero(as_tuple=True)[0])
        calls = 0
        for part in torch.split(torch.arange(len(todo)), ctx.cfg.train.micro_batch) if len(todo) else ():
            chunk = todo.select(part)
            it["mean_ref"][chunk.row.to(ctx.device)] = self._reference_means(ctx, chunk)
            it["ref_done"][chunk.row] = True
            calls += 1
        return calls

    def minibatch_terms(self, ctx: UpdateContext) -> dict:
        if not self.anchor.active:
            return {}
        col = ctx.collected
        anchor = self.anchor.value(ctx.policy, col.rollout, col.plan, col.cond, ctx.rng, self._it.get("level_sizes"))
        return {} if anchor is None else {"anchor_loss": anchor}

    def after_update(self, ctx: UpdateContext) -> dict[str, float]:
        return {"clip_range": self._it["clip"]} if "clip" in self._it else {}


def build_grpo(cfg, device=None) -> GRPOObjective:
    """Factory of ``loss.objective=grpo`` from a :class:`~flowgrpo.config.RunConfig`."""
    return GRPOObjective(cfg.loss.grpo, device)
