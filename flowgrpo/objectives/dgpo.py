"""``loss.objective=dgpo``: Direct Group Preference Optimization (Luo et al., ICLR 2026).

A prompt's group is split by advantage into a positive set G+ (A > 0) and a negative set G- (A < 0).
Each sample i is noised at K times (:mod:`.forward_rows`); at its k-th time its implicit reward is
DPO's, a denoising-loss difference to the DPO reference,

    d_ik = mean((v_theta(x_t) - u)^2) - mean((v_ref(x_t) - u)^2),     r_ik = -beta_DPO d_ik,

and a set's reward at slot k is the advantage-weighted sum R_k(G) = sum_{i in G} w_i r_ik,
w_i = |A_i| / K_g (K_g the group's size). The loss of a group at slot k is the group-level
Bradley-Terry likelihood; the step averages it over slots as the authors' code does (one sigmoid per
timestep, not one of the margin averaged over the timesteps):

    L_gk = -log sigmoid(R_k(G+) - R_k(G-)),    L = mean_{g,k} L_gk + kl_beta mean((v_theta - v_base)^2).

L_gk couples every sample of a group, which the micro-batch loop cannot hold at once. Two passes per
minibatch make it exact: first, without gradients, every row's d is computed and the (group, slot)
margins Delta_gk are gathered over all ranks; then each row's loss is linear in its own error with a
detached coefficient. dL_gk/dd_ik = beta sigmoid(-Delta_gk) s_i w_i (:func:`dgpo_coefficients`);
like the authors' code the update uses sigmoid(-Delta_gk) A_i per row, averaged over rows, i.e. the
same direction without the constant beta / K_g (beta only sharpens the sigmoid).

As in the authors' code, training times are K draws from the first 70 % of the rollout's grid (the
high-noise steps; ``time_fraction``), every sample drawing its own times and noise (the authors share
one noise per group and one set of times per step; slot k is the sample's k-th time). Samples of a
group without reward spread train too (``rows=all``): no DPO term, but they count in the mean and
carry the KL. Minibatches are drawn over groups (``train.minibatches`` never splits a group). Not
implemented: the authors' one-sided ratio clip against the EMA (their ``clip_range``).

The DPO reference is the frozen base model, or (``reference=ema``) an EMA of the trained weights
that moves after the run's optimizer step n (from 0) with decay min(ema_decay, ema_decay_rate n);
the KL always goes to the base model. As in the authors' code, the rollouts switch to the EMA after
``ema_rollouts_after`` optimizer steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import MicroLoss, Objective, UpdateContext, idle_inputs
from .forward_rows import (SampleRows, build_sample_rows, first_pass_velocities, per_row_mean,
                           trained_forward)
from .old_policy import DecaySchedule, OldPolicy, old_policy_home
from .terms.kl import VelocityKL
from .terms.norm_guard import NormGuard


def _set_weights(adv: torch.Tensor, group: torch.Tensor):
    """(group index [N], groups G, sign s [N], weight w [N]) of samples with advantages [N]:
    s = +1 in G+ (A > 0), -1 in G- (A < 0), 0 otherwise; w = |A| / K, K = the group's size."""
    ids, inv = torch.unique(group, return_inverse=True)
    a = adv.abs()
    size = torch.zeros(len(ids), dtype=a.dtype).index_add(0, inv, torch.ones_like(a))
    s = (adv > 0).to(a.dtype) - (adv < 0).to(a.dtype)
    return inv, len(ids), s, a / size[inv]


def dgpo_group_loss(d: torch.Tensor, adv: torch.Tensor, group: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group losses -log sigmoid(R(G+) - R(G-)) [G] and margins [G] from per-sample d [N],
    advantages [N] and group ids [N]; groups are the unique ids in sorted order."""
    inv, n, s, w = _set_weights(adv.to(d.dtype), group)
    margin = torch.zeros(n, dtype=d.dtype).index_add(0, inv, -beta * s * w * d)
    return -F.logsigmoid(margin), margin


def dgpo_coefficients(d: torch.Tensor, adv: torch.Tensor, group: torch.Tensor, beta: float) -> torch.Tensor:
    """d(mean_g L_g) / d d_i [N] for per-sample d [N] (float64): beta sigmoid(-Delta_g) s_i w_i / G."""
    inv, n, s, w = _set_weights(adv.to(d.dtype), group)
    _, margin = dgpo_group_loss(d, adv, group, beta)
    return beta * torch.sigmoid(-margin[inv]) * s * w / max(n, 1)


class DGPOObjective(Objective):
    """DGPO with ``loss.dgpo`` options (:class:`~flowgrpo.objectives.options.DGPOOptions`)."""

    name = "dgpo"

    def __init__(self, cfg):
        self.opt = cfg.loss.dgpo
        self.seed = cfg.train.seed
        self.micro = cfg.train.micro_batch
        # the base model serves the KL, and the DPO reference unless that is the EMA
        self.kl = VelocityKL.from_config(self.opt)  # always to the base model, as the authors
        self.norm_guard = NormGuard.from_config(self.opt)  # to the base model, as the KL
        self.needs_reference = ("base" in self.kl.references | self.norm_guard.references
                                or self.opt.reference == "frozen")
        self.keeps_ema = self.opt.reference == "ema" or self.opt.ema_rollouts_after >= 0
        self.schedule = DecaySchedule(0, self.opt.ema_decay_rate, self.opt.ema_decay)
        self.ema: OldPolicy | None = None
        self.old_home = old_policy_home(cfg.train)  # train.old_policy_device
        self.lagging_copies = int(self.keeps_ema)
        self._policy = None
        self.steps = 0  # optimizer steps of the run: the EMA's decay clock and the rollout switch
        self._coef: dict = {}

    def setup(self, policy) -> None:
        self._policy = policy
        if self.keeps_ema:
            self.ema = OldPolicy(policy, self.old_home)

    def rollout_weights(self, policy):
        """The authors roll out with the EMA after ``ema_rollouts_after`` optimizer steps."""
        after = self.opt.ema_rollouts_after
        if self.ema is not None and after >= 0 and self.steps > after:
            return self.ema.active(policy)
        return super().rollout_weights(policy)

    def _v_dpo_ref(self, policy, x, t, cond):
        g = self.opt.train_guidance
        if self.opt.reference == "ema":
            return self.ema.velocity(policy, x, t, cond, g)
        return policy.reference_velocity(x, t, cond, g)

    def rows(self, ctx: UpdateContext) -> SampleRows | None:
        from .awm import time_sampler

        rows = build_sample_rows(ctx.collected, ctx.credit, self.seed, time_sampler(self.opt, ctx.collected.plan.sigmas),
                                 self.opt.timesteps, only_signal=self.opt.rows == "signal")
        if rows is not None:  # minibatches are drawn over this key: a group is never split (group ids < tree ids)
            rows.tree = rows.group.clone()
        return rows

    @torch.no_grad()
    def begin_minibatch(self, ctx: UpdateContext, rows: SampleRows, passes: int) -> int:
        """The first pass: every row's d without gradients, the (group, slot) margins over all ranks,
        and each row's coefficient."""
        o, dp = self.opt, ctx.dp
        d_rows, calls = [], 0
        for u, v_ref, v in first_pass_velocities(ctx, rows, self.micro, self._v_dpo_ref, o.train_guidance):
            d_rows.append((per_row_mean((v - u) ** 2) - per_row_mean((v_ref - u) ** 2)).double().cpu())
            calls += 1
        if ctx.lockstep:  # a sharded denoiser needs every rank in every forward
            for _ in range(passes - calls):
                self._dummy_forwards(ctx)
        n = len(rows) if rows is not None else 0
        d = torch.cat(d_rows) if d_rows else torch.zeros(0, dtype=torch.float64)
        empty = torch.zeros(0, dtype=torch.long)
        leaf, step, grp = (rows.leaf, rows.step, rows.group) if n else (empty, empty, empty)
        adv = rows.advantage.double() if n else d
        if dp.world > 1:  # the whole minibatch's rows from every rank
            leaf, step, grp, d, adv = (dp.cat(t) for t in (leaf, step, grp, d, adv))
        # one margin per (group, timestep slot): the authors' sigmoid per timestep
        key = torch.unique(torch.stack([grp, step], 1), dim=0, return_inverse=True)[1] if len(d) else empty
        losses, margin = dgpo_group_loss(d, adv, key, o.beta_dpo)
        # the authors' scaling: row loss sigmoid(-Delta_gk) A_i err_row, averaged over rows (the loop's
        # mean); it is the exact gradient of mean_{g,k} L_gk times G K_g / beta per row count, a learning-rate scale
        coef = torch.sigmoid(-margin[key]) * adv
        self._coef = {(int(lf), int(k)): float(c) for lf, k, c in zip(leaf.tolist(), step.tolist(), coef.tolist())}
        self._group_stats = (losses, margin)
        return calls

    def _dummy_forwards(self, ctx: UpdateContext) -> None:
        policy = ctx.policy
        x, t, c = idle_inputs(ctx)
        with ctx.autocast():
            self._v_dpo_ref(policy, x, t, c)
            policy.velocity(x, t, c, self.opt.train_guidance)

    def micro_loss(self, ctx: UpdateContext, rows: SampleRows) -> MicroLoss:
        o, policy = self.opt, ctx.policy
        f = trained_forward(ctx, rows, o.train_guidance)
        cond, x_in, u, v = f.cond, f.x_in, f.u, f.v
        err = per_row_mean((v - u) ** 2)
        coef = torch.tensor([self._coef.get((int(lf), int(k)), 0.0) for lf, k in zip(rows.leaf.tolist(), rows.step.tolist())],
                            device=err.device, dtype=err.dtype)
        loss = coef * err  # its gradient is the group loss's (see the module docstring)
        losses, margin = self._group_stats
        stats = {"fm_loss": err.detach()}
        if self.kl.active or self.norm_guard.active:  # the base model (the EMA is only the DPO reference)
            with torch.no_grad():
                v_base = policy.reference_velocity(x_in, rows.t, cond, o.train_guidance).float()
            if self.kl.active:  # always to the base model, as the authors
                term, kl = self.kl.value(v, v_base, rows.t)
                loss = loss + term
                stats["kl"] = kl.detach()
            if self.norm_guard.active:
                term, stats["norm_ratio"] = self.norm_guard.value(v, v_base)
                loss = loss + term
        stats["dgpo_group_loss"] = losses.float().mean().expand(len(rows))
        stats["dgpo_margin"] = margin.float().mean().expand(len(rows))
        return MicroLoss(loss=loss.mean(), stats=stats)

    def idle_pass(self, ctx: UpdateContext) -> torch.Tensor:
        policy = ctx.policy
        x = torch.zeros(1, *policy.latent_shape, device=ctx.device, dtype=ctx.dtype)
        t = torch.full((1,), 0.5)
        c = ctx.collected.cond.index(torch.zeros(1, dtype=torch.long))
        with ctx.autocast():
            v = policy.velocity(x, t, c, self.opt.train_guidance).float()
            if self.kl.active or self.norm_guard.active:
                with torch.no_grad():
                    policy.reference_velocity(x, t, c, self.opt.train_guidance)
        return v.sum() * 0.0

    def after_step(self, ctx: UpdateContext) -> None:
        if self.ema is not None:  # decay min(cap, rate n) at the run's n-th step (n from 0), as the authors
            self.ema.move_toward(ctx.policy, self.schedule(self.steps))
        self.steps += 1

    def after_update(self, ctx: UpdateContext) -> dict[str, float]:
        return {"dgpo_ema_decay": self.schedule(max(self.steps - 1, 0))} if self.ema is not None else {}

    def state_dict(self) -> dict:
        out = {"steps": self.steps}
        if self.ema is not None:
            out["ema"] = self.ema.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state.get("steps", 0))
        if "ema" in state and self.ema is not None:
            self.ema.load_state_dict(state["ema"], self._policy)


def build_dgpo(cfg, device=None) -> DGPOObjective:
    """Factory of ``loss.objective=dgpo`` from a :class:`~flowgrpo.config.RunConfig`."""
    return DGPOObjective(cfg)
