"""``loss.objective=crd``: Centered Reward Distillation (arXiv 2603.14128), on the forward process.

The model's implicit reward of a clean sample x0 at time t is how much better the trained velocity v
predicts the flow-matching target u = eps - x0 on x_t = (1 - t) x0 + t eps (:mod:`.forward_rows`)
than a reference velocity v_o does (the lagging "old" policy, or the frozen base model):

    r_theta = -( mean_D((v - u)^2) / w - mean_D((v_o - u)^2) / w_o ),   w = max(mean_D|v - u|, 1e-5)

(w, w_o detached: the adaptive weights; ``adaptive_weights=false`` sets them to 1). The external
reward is the advantage mapped to [0, 1], a = clip(clip(A, -A_max, A_max) / A_max / 2 + 1/2, 0, 1).
Both are centred within the prompt's group at the same training time, which removes the unknown
per-prompt normaliser the implicit reward carries, and matched:

    L_row = A_max / beta * [ 1/2 ell(beta (r - sg[r+]), a - a+) + 1/2 ell(beta (r - sg[r-]), a - a-) ],

ell(x, y) = (x - y)^2 (mse) or BCE-with-logits(x, sigmoid(y)) (bce), the centres r+-, a+- weighted
means over the (group, time) set with weights softmax(+-a / tau) (``weight_temp`` tau > 0), uniform
(tau < 0: then both halves are one, the plain group mean), or only the set's A > 0 / A < 0 members
(tau = 0). The centre r+- carries no gradient, so each row's loss involves the others only through
numbers: two passes per minibatch make it exact over any micro-batching and any number of ranks (as
:mod:`.dgpo`). The first, without gradients, computes every row's r_theta and the old reference's
error and gathers the centres over all ranks; the second trains.

A KL to the base model *with classifier-free guidance* (scale ``kl_cfg``) anchors the policy, whose
own training passes run at guidance 1:

    + kl_beta * c(a) * mean_D((v - sg[v_base^cfg])^2),   c(a) = c0 + a (1 - c0),  c0 = kl_floor / kl_beta

(``reward_adaptive_kl``; c = 1 otherwise): the KL is weak on bad samples and full on good ones.

Two lagging copies of the trained weights (:mod:`.old_policy`) move after each iteration with the
optimizer steps n so far: the old policy (implicit-reward reference) with d(n) = min(0.25 + 0.005 n,
0.999), and the sampling policy, which draws the rollouts, with 0 for n < 75 then min(0.0075 (n - 75),
0.999): the sampler is decoupled from the moving reference. Defaults are Flow-Factory's (the paper's
OCR settings, its Table 3).

Deviations from Flow-Factory's trainer (X-GenGroup/Flow-Factory, commit a0b2bc5, trainers/crd.py):
the centring there runs over the gathered micro-batch (8 samples a GPU, which need not be one prompt's
group nor one time on every GPU); here it is within each prompt's group at each training time, as the
paper's derivation states. One set of training times is drawn per iteration for every sample (their
per-batch stratified draw), so a group's rows share their times. The hard-selection mode (tau = 0)
splits on the sign of A; theirs compares the [0, 1] value with 0, which keeps every sample with A >
-A_max in the positive set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..fields import help_field as _f
from ..seeds import FORWARD_ROWS, derive_seed
from .base import MicroLoss, Objective, UpdateContext, idle_inputs
from .forward_rows import (SampleRows, build_sample_rows, first_pass_velocities, per_row_mean, rollout_times,
                           trained_forward)
from .nft import nft_optimality
from .old_policy import DecaySchedule, OldPolicy, old_policy_home
from .terms.base import term_field
from .terms.kl import KLOptions, VelocityKL
from .terms.norm_guard import NormGuard, NormGuardOptions


@dataclass
class CRDOptions:
    """``loss.crd.*`` (defaults: Flow-Factory's CRD recipe for SD3.5, the paper's OCR settings)."""

    beta: float = _f(1.0, "beta: scale of the implicit reward matched to the centred external reward (the authors: 1)", gt=0.0)
    loss_type: Literal["mse", "bce"] = _f("mse", "the matching loss: mse (beta (r - r_centre) - (a - a_centre))^2 | bce (BCE-with-logits of beta (r - r_centre) against sigmoid(a - a_centre))")
    weight_temp: float = _f(-1.0, "tau of the centring weights within a (group, time) set: < 0 uniform (the plain mean, the authors' default) | 0 the A > 0 and A < 0 members for the two halves | > 0 softmax(+-a / tau)")
    implicit_reference: Literal["old", "base"] = _f("old", "the reference of the implicit reward: old (the lagging old policy, the authors) | base (the frozen base model)")
    adaptive_weights: bool = _f(True, "divide each squared error of the implicit reward by its detached mean absolute error (floor 1e-5), as the authors' adaptive_logp")
    adv_clip: float = _f(5.0, "A_max: advantages are clipped to +-A_max and mapped to a = A / A_max / 2 + 1/2 in [0, 1]; the loss is scaled by A_max / beta", gt=0.0)
    kl_beta: float = term_field(KLOptions, "kl_beta", 0.1, "the authors: 0.1, to the base model with CFG kl_cfg")
    kl_cfg: float = _f(4.5, "classifier-free guidance scale of the base model's velocity in the KL (the authors: 4.5; 1: unguided)", ge=1.0)
    reward_adaptive_kl: bool = _f(True, "scale each row's KL by c0 + a (1 - c0), c0 = kl_floor / kl_beta: weak on bad samples, full on good ones (the authors)")
    kl_floor: float = _f(1e-4, "the KL weight of a sample with a = 0 under reward_adaptive_kl (the authors hard-code 1e-4)", ge=0.0)
    old_decay_flat: int = _f(0, "old policy (implicit-reward reference) decay d(n) = start for n < flat, else min(start + (n - flat) rate, cap), n = optimizer steps so far: flat", ge=0)
    old_decay_start: float = _f(0.25, "old policy decay: start (the authors: 0.25)", ge=0.0, lt=1.0)
    old_decay_rate: float = _f(0.005, "old policy decay: rate per optimizer step (the authors: 0.005)", ge=0.0)
    old_decay_cap: float = _f(0.999, "old policy decay: cap (the authors: 0.999)", ge=0.0, lt=1.0)
    rollout_decay_flat: int = _f(75, "rollout policy (the lagging copy that draws the rollouts) decay, the same form as old_decay_*: flat (the authors: 75)", ge=0)
    rollout_decay_start: float = _f(0.0, "rollout policy decay: start (0: a copy of the trained weights)", ge=0.0, lt=1.0)
    rollout_decay_rate: float = _f(0.0075, "rollout policy decay: rate per optimizer step (the authors: 0.0075)", ge=0.0)
    rollout_decay_cap: float = _f(0.999, "rollout policy decay: cap (the authors: 0.999)", ge=0.0, lt=1.0)
    timesteps: int = _f(0, "training times per sample, one set for every sample of the iteration, drawn from the first time_fraction of the rollout's grid (0: all of them)", ge=0)
    time_fraction: float = _f(0.99, "the first fraction of the rollout's grid the training times come from (the authors: 0.99)", gt=0.0, le=1.0)
    rows: Literal["all", "signal"] = _f("all", "which samples train: all (the authors: a group without reward spread has a - a_centre = 0 and pulls its implicit rewards together) | signal (only groups with reward spread)")
    train_guidance: float = _f(1.0, "guidance scale of the trained and old policies' passes (1: CFG-free, as the authors)", gt=0.0)
    norm_guard_beta: float = term_field(NormGuardOptions, "norm_guard_beta")
    norm_guard_margin: float = term_field(NormGuardOptions, "norm_guard_margin")


def crd_centres(a: torch.Tensor, r: torch.Tensor, key: torch.Tensor, temp: float) -> tuple[torch.Tensor, ...]:
    """The centres (a+, r+, a-, r-), each [N], of every row's set (rows with equal ``key`` [N], long),
    from the external rewards a [N] in [0, 1] and implicit rewards r [N]: weighted means with
    softmax(+a / temp) and softmax(-a / temp) (temp > 0), the plain mean (temp < 0), or the members
    with a > 1/2 and a < 1/2 (temp = 0; the plain mean where a set has none)."""
    out = [torch.empty_like(r) for _ in range(4)]
    for k in torch.unique(key):
        m = key == k
        ak, rk = a[m], r[m]
        for j, sign in ((0, 1.0), (2, -1.0)):
            if temp < 0:
                p = torch.full_like(ak, 1.0 / len(ak))
            elif temp == 0:
                pick = (ak > 0.5) if sign > 0 else (ak < 0.5)
                p = pick.to(ak) / pick.sum() if pick.any() else torch.full_like(ak, 1.0 / len(ak))
            else:
                p = torch.softmax(sign * ak / temp, dim=0)
            out[j][m] = (p * ak).sum()
            out[j + 1][m] = (p * rk).sum()
    return tuple(out)


def crd_row_loss(r: torch.Tensor, a: torch.Tensor, centres: tuple[torch.Tensor, ...], beta: float,
                 loss_type: str) -> torch.Tensor:
    """The matching loss per row [R] (before the A_max / beta scale) of implicit rewards r [R] (with
    gradient), external rewards a [R] and the detached centres (a+, r+, a-, r-) [R] each."""
    a_pos, r_pos, a_neg, r_neg = (c.to(r) for c in centres)
    a = a.to(r)
    halves = []
    for a_c, r_c in ((a_pos, r_pos), (a_neg, r_neg)):
        x, y = beta * (r - r_c.detach()), a - a_c
        if loss_type == "bce":
            halves.append(F.binary_cross_entropy_with_logits(x, torch.sigmoid(y), reduction="none"))
        else:
            halves.append((x - y) ** 2)
    return 0.5 * (halves[0] + halves[1])


def weighted_error(v: torch.Tensor, u: torch.Tensor, adaptive: bool) -> torch.Tensor:
    """mean_D((v - u)^2) / w per row [R], w = max(mean_D|v - u|, 1e-5) detached (1 without ``adaptive``)."""
    err = per_row_mean((v - u) ** 2)
    if not adaptive:
        return err
    with torch.no_grad():
        w = per_row_mean((v - u).abs()).clamp(min=1e-5)
    return err / w


class CRDObjective(Objective):
    """CRD with ``loss.crd`` options (:class:`CRDOptions`)."""

    name = "crd"

    def __init__(self, cfg):
        self.opt = o = cfg.loss.crd
        self.seed, self.micro = cfg.train.seed, cfg.train.micro_batch
        self.kl, self.norm_guard = VelocityKL.from_config(o), NormGuard.from_config(o)
        self.needs_reference = bool(self.kl.references | self.norm_guard.references) or o.implicit_reference == "base"
        self.old_schedule = DecaySchedule(o.old_decay_flat, o.old_decay_rate, o.old_decay_cap, o.old_decay_start)
        self.sampling_schedule = DecaySchedule(o.rollout_decay_flat, o.rollout_decay_rate, o.rollout_decay_cap,
                                               o.rollout_decay_start)
        self.old: OldPolicy | None = None
        self.sampling: OldPolicy | None = None
        self.old_home = old_policy_home(cfg.train)  # train.old_policy_device
        self.lagging_copies = 2
        self._policy, self._uncond = None, None
        self.steps = 0  # optimizer steps of the run: both copies' decay clock
        self._row: dict = {}

    def setup(self, policy) -> None:
        self._policy = policy
        self.old, self.sampling = OldPolicy(policy, self.old_home), OldPolicy(policy, self.old_home)
        if self.kl.active and self.opt.kl_cfg != 1.0:  # the empty prompt, for the KL's guided base velocity
            self._uncond = policy.encode_prompts([""])

    def rollout_weights(self, policy):
        """The rollouts are drawn by the sampling policy, not the trained weights."""
        return self.sampling.active(policy)

    def rows(self, ctx: UpdateContext) -> SampleRows | None:
        o, plan = self.opt, ctx.collected.plan
        draw = rollout_times(plan.sigmas, o.time_fraction)
        gen = torch.Generator().manual_seed(derive_seed(self.seed, ctx.collected.iteration, FORWARD_ROWS))
        shared = draw(o.timesteps or plan.num_steps, gen)  # one set for every sample: a group's rows share times
        rows = build_sample_rows(ctx.collected, ctx.credit, self.seed, lambda k, g: shared.clone(), len(shared),
                                 only_signal=o.rows == "signal")
        if rows is not None:  # minibatches are drawn over this key: a group is never split
            rows.tree = rows.group.clone()
        return rows

    def _guided(self, cond):
        """``cond`` with the empty prompt's encoding for the KL's guided pass (a sampler at guidance 1
        encodes none)."""
        if self._uncond is None or not dataclasses.is_dataclass(cond) or cond.uncond is not None:
            return cond
        return dataclasses.replace(cond, uncond=self._uncond.tensors)

    def _implicit_reference(self, policy, x, t, cond):
        g = self.opt.train_guidance
        if self.opt.implicit_reference == "base":
            return policy.reference_velocity(x, t, cond, g)
        return self.old.velocity(policy, x, t, cond, g)

    @torch.no_grad()
    def begin_minibatch(self, ctx: UpdateContext, rows: SampleRows, passes: int) -> int:
        """The first pass: every row's implicit reward and old error without gradients, then the
        centres of every (group, time) set over all ranks."""
        o, dp = self.opt, ctx.dp
        r_parts, e_parts, calls = [], [], 0
        for u, v_o, v in first_pass_velocities(ctx, rows, self.micro, self._implicit_reference, o.train_guidance):
            e_old = weighted_error(v_o.double(), u.double(), o.adaptive_weights)
            r_parts.append((e_old - weighted_error(v.double(), u.double(), o.adaptive_weights)).cpu())
            e_parts.append(e_old.cpu())
            calls += 1
        if ctx.lockstep:  # a sharded denoiser needs every rank in every forward
            for _ in range(passes - calls):
                self._dummy_forwards(ctx)
        empty = torch.zeros(0, dtype=torch.long)
        n = len(rows) if rows is not None else 0
        r = torch.cat(r_parts) if r_parts else torch.zeros(0, dtype=torch.float64)
        e_old = torch.cat(e_parts) if e_parts else r
        leaf, step, grp = (rows.leaf, rows.step, rows.group) if n else (empty, empty, empty)
        a = nft_optimality(rows.advantage, o.adv_clip).double() if n else r
        local = (leaf, step)
        if dp.world > 1:  # the whole minibatch's rows from every rank
            leaf, step, grp, r, a = (dp.cat(t) for t in (leaf, step, grp, r, a))
        key = torch.unique(torch.stack([grp, step], 1), dim=0, return_inverse=True)[1] if len(r) else empty
        centres = crd_centres(a, r, key, o.weight_temp)
        where = {(int(lf), int(k)): i for i, (lf, k) in enumerate(zip(leaf.tolist(), step.tolist()))}
        self._row = {}
        for j, (lf, k) in enumerate(zip(*(x.tolist() for x in local))):
            i = where[(lf, k)]
            self._row[(lf, k)] = (float(e_old[j]), *(float(c[i]) for c in centres))
        self._r_mean = float(r.mean()) if len(r) else 0.0
        return calls

    def _dummy_forwards(self, ctx: UpdateContext) -> None:
        x, t, c = idle_inputs(ctx)
        with ctx.autocast():
            self._implicit_reference(ctx.policy, x, t, c)
            ctx.policy.velocity(x, t, c, self.opt.train_guidance)

    def micro_loss(self, ctx: UpdateContext, rows: SampleRows) -> MicroLoss:
        o, policy = self.opt, ctx.policy
        f = trained_forward(ctx, rows, o.train_guidance)
        cond, x_in, u, v = f.cond, f.x_in, f.u, f.v
        saved = torch.tensor([self._row[(int(lf), int(k))] for lf, k in zip(rows.leaf.tolist(), rows.step.tolist())],
                             dtype=torch.float64, device=v.device)
        r = saved[:, 0].to(v.dtype) - weighted_error(v, u, o.adaptive_weights)
        a = nft_optimality(rows.advantage, o.adv_clip).to(v.device)
        match = crd_row_loss(r, a, tuple(saved[:, j] for j in range(1, 5)), o.beta, o.loss_type)
        loss = match * o.adv_clip / max(o.beta, 1e-8)
        stats = {"crd_match": match.detach(), "crd_r": r.detach(), "crd_r_mean": torch.full_like(r, self._r_mean).detach()}
        t = rows.t.to(v.device)
        if self.kl.active:
            v_base = policy.reference_velocity(x_in, rows.t, self._guided(cond), o.kl_cfg).float()
            term, kl = self.kl.value(v, v_base, t)
            if o.reward_adaptive_kl:
                c0 = o.kl_floor / max(o.kl_beta, 1e-8)
                term = term * (c0 + a * (1 - c0))
            loss = loss + term
            stats["kl"] = kl.detach()
        if self.norm_guard.active:  # the base model at the policy's own guidance, not the KL's
            v_ref = v_base if self.kl.active and o.kl_cfg == o.train_guidance else \
                policy.reference_velocity(x_in, rows.t, cond, o.train_guidance).float()
            term, stats["norm_ratio"] = self.norm_guard.value(v, v_ref)
            loss = loss + term
        return MicroLoss(loss=loss.mean(), stats=stats)

    def idle_pass(self, ctx: UpdateContext) -> torch.Tensor:
        policy, o = ctx.policy, self.opt
        x, t, c = idle_inputs(ctx)
        with ctx.autocast():
            v = policy.velocity(x, t, c, o.train_guidance).float()
        if self.kl.active:
            policy.reference_velocity(x, t, self._guided(c), o.kl_cfg)
        if self.norm_guard.active and not (self.kl.active and o.kl_cfg == o.train_guidance):
            policy.reference_velocity(x, t, c, o.train_guidance)
        return v.sum() * 0.0

    def after_step(self, ctx: UpdateContext) -> None:
        self.steps += 1

    def after_update(self, ctx: UpdateContext) -> dict[str, float]:
        # once per iteration, as the authors: the old policy first, then the sampling policy
        d_old, d_sampling = self.old_schedule(self.steps), self.sampling_schedule(self.steps)
        self.old.move_toward(ctx.policy, d_old)
        self.sampling.move_toward(ctx.policy, d_sampling)
        return {"crd_old_decay": d_old, "crd_rollout_decay": d_sampling}

    def state_dict(self) -> dict:
        if self.old is None:
            return {"steps": self.steps}
        return {"old": self.old.state_dict(), "sampling": self.sampling.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state.get("steps", 0))
        for name in ("old", "sampling"):
            if name in state and getattr(self, name) is not None:
                getattr(self, name).load_state_dict(state[name], self._policy)


def build_crd(cfg, device=None) -> CRDObjective:
    """Factory of ``loss.objective=crd`` from a :class:`~flowgrpo.config.RunConfig`."""
    return CRDObjective(cfg)
