"""``loss.objective=awm``: Advantage Weighted Matching (Xue et al. 2025).

The pretraining flow-matching loss, read as a log-likelihood surrogate of a clean sample x0 at a
time t with noise eps (:mod:`.forward_rows`),

    l_theta(x0, t, eps) = -w(t) * mean((v_theta(x_t, t) - (eps - x0))^2),

enters a PPO objective with the old policy (the weights that drew the rollout):

    rho = exp(l_theta - l_old),   L_row = max(-A rho, -A clip(rho, 1 - eps_clip, 1 + eps_clip))
          + kl_beta * KL + ema_kl_beta * mean((v_theta - v_ema)^2),

with KL = mean((v_theta - v_ref)^2) to the frozen base model, optionally divided by 2 sigma_t^2,
sigma_t = a sqrt(t / (1 - t)) (the Flow-GRPO SDE's noise scale at t; a = ``kl_noise_level``, the
authors' 0.7). Both KL terms are :class:`~.terms.kl.VelocityKL`. ``ratio_mode=mean`` clips
the ratio of the sample's mean surrogate over its times instead of each (sample, t) ratio; the
update loop then keeps each sample's rows in one micro-batch (:meth:`AWMObjective.micro_batch_key`),
so the mean is over all of its times whatever ``train.micro_batch`` (a micro-batch holds whole
samples: K rows where K > ``train.micro_batch``).

Authors' defaults (SD3.5, GenEval): K = 6 times per sample, one from each of 6 strata of the
rollout's grid indices [1, 0.9 T) (t = 1 and the nearly clean end are never trained); the generalised
Huber surrogate l = -t ((err + 1e-10)^0.25 - 1e-10^0.25) / 0.25; advantages clipped to +-5 and divided
by 5; clip range 1; KL 1e-3 to the base and weight 1 on a KL to a lagging copy whose decay is
min(0.001 n, 0.3) after n optimizer steps. Times may also be logit-normal with shift, uniform, or K of
the grid times. The authors draw one set of times per micro-batch; here every sample draws its own
(from its own stream), so the rows do not depend on how they are batched.

As in the authors' code, the samples of a group without reward spread train too (advantage 0: no
policy term, but they count in the step's mean and carry both KL terms); ``rows=signal`` drops them.

The old policy is the trained weights at the start of the update; while no optimizer step has been
taken since (one minibatch per iteration, the authors' setting), l_old equals l_theta without its
gradient and its forward is skipped: the ratio is exactly 1 and the gradient is -A grad(l).
"""

from __future__ import annotations

import torch

from .base import MicroLoss, Objective, UpdateContext, idle_inputs
from .forward_rows import (SampleRows, build_sample_rows, grid_strata_times, logit_normal_times, per_row_mean,
                           rollout_times, uniform_times)
from .old_policy import DecaySchedule, OldPolicy, old_policy_home
from .terms.kl import KLOptions, VelocityKL
from .terms.norm_guard import NormGuard


def time_sampler(opt, sigmas: torch.Tensor):
    """The time sampler an AWM / DGPO options object selects (``time_sampler`` and its parameters)."""
    if opt.time_sampler == "logit_normal":
        return logit_normal_times(opt.logit_mean, opt.logit_std, opt.time_shift)
    if opt.time_sampler == "uniform":
        return uniform_times()
    if opt.time_sampler == "grid_strata":
        return grid_strata_times(sigmas)
    return rollout_times(sigmas, getattr(opt, "time_fraction", 1.0))


def fm_log_likelihood(v: torch.Tensor, target: torch.Tensor, t: torch.Tensor, weighting: str = "ghuber",
                      power: float = 0.25) -> torch.Tensor:
    """AWM's surrogate l = -w(t) f(err) per row [R], err = mean((v - target)^2) over non-batch dims.

    ``weighting``: ghuber (w = t, f = ((err + 1e-10)^p - 1e-10^p) / p) | uniform (w = 1, f = err) |
    t (w = t) | t2 (w = t^2). Computed in float64, as the authors do (the ghuber power of a tiny
    error is ill-conditioned in float32)."""
    err = per_row_mean((v.double() - target.double()) ** 2)
    t = t.to(err)
    if weighting == "ghuber":
        delta = 1e-10
        return (-t * ((err + delta) ** power - delta**power) / power).to(v.dtype)
    if weighting == "uniform":
        return (-err).to(v.dtype)
    if weighting == "t":
        return (-t * err).to(v.dtype)
    if weighting == "t2":
        return (-(t**2) * err).to(v.dtype)
    raise ValueError(f"unknown awm weighting {weighting!r}; valid: ghuber, uniform, t, t2")


def ppo_clip_loss(log_ratio: torch.Tensor, adv: torch.Tensor, clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) per row and the clipped mask, rho = exp(log_ratio)."""
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


class AWMObjective(Objective):
    """AWM with ``loss.awm`` options (:class:`~flowgrpo.objectives.options.AWMOptions`)."""

    name = "awm"

    def __init__(self, cfg):
        self.opt = cfg.loss.awm
        self.seed = cfg.train.seed
        self.kl = VelocityKL.from_config(self.opt)
        # the lagging copy's KL: no sigma weighting (the authors' ema KL is a plain mean square)
        self.ema_kl = VelocityKL(KLOptions(kl_beta=self.opt.ema_kl_beta), reference="ema")
        self.norm_guard = NormGuard.from_config(self.opt)
        self.needs_reference = "base" in self.kl.references | self.norm_guard.references
        self.old: OldPolicy | None = None
        self.ema: OldPolicy | None = None
        self.old_home = old_policy_home(cfg.train)  # train.old_policy_device
        self.lagging_copies = 1 + int(self.ema_kl.active)  # the rollout's weights, and the EMA reference
        self.schedule = DecaySchedule(0, self.opt.ema_decay_rate, self.opt.ema_decay_cap)
        self._policy = None
        self._steps = 0  # optimizer steps of this update (the old weights differ from the live ones after one)
        self.steps = 0  # optimizer steps of the run: the lagging copy's decay clock

    def setup(self, policy) -> None:
        self._policy = policy
        if self.ema_kl.active:
            self.ema = OldPolicy(policy, self.old_home)

    def rows(self, ctx: UpdateContext) -> SampleRows | None:
        self.old = OldPolicy(ctx.policy, self.old_home)  # the weights that drew this rollout
        self._steps = 0
        sampler = time_sampler(self.opt, ctx.collected.plan.sigmas)
        return build_sample_rows(ctx.collected, ctx.credit, self.seed, sampler, self.opt.timesteps,
                                 only_signal=self.opt.rows == "signal")

    def micro_batch_key(self) -> str | None:
        # ratio_mode=mean: a sample's ratio is the mean over its rows in the micro-batch, so all of them must be there
        return "leaf" if self.opt.ratio_mode == "mean" else None

    def micro_loss(self, ctx: UpdateContext, rows: SampleRows) -> MicroLoss:
        o, policy = self.opt, ctx.policy
        cond = ctx.collected.cond.index(rows.prompt)
        x_in = rows.noised(ctx.dtype).to(ctx.device)
        target = rows.target().to(ctx.device)
        t = rows.t.to(ctx.device)
        with ctx.autocast():
            v_old = None
            if self._steps > 0:  # the old weights differ from the live ones only after a step
                v_old = self.old.velocity(policy, x_in, rows.t, cond, o.train_guidance).float()
            v_ema = self.ema.velocity(policy, x_in, rows.t, cond, o.train_guidance).float() if self.ema else None
            v = policy.velocity(x_in, rows.t, cond, o.train_guidance).float()
        ll = fm_log_likelihood(v, target, t, o.weighting, o.ghuber_power)
        ll_old = ll.detach() if v_old is None else fm_log_likelihood(v_old, target, t, o.weighting, o.ghuber_power)
        adv = rows.advantage.to(ll.device).clamp(-o.adv_clip, o.adv_clip) / o.adv_clip
        log_ratio = ll - ll_old
        if o.ratio_mode == "mean":  # one ratio per sample: the mean of its rows' surrogates (all in this micro-batch)
            leaf, inv = torch.unique(rows.leaf, return_inverse=True)
            inv = inv.to(ll.device)
            n = torch.zeros(len(leaf), device=ll.device).index_add_(0, inv, torch.ones_like(ll))
            mean_lr = torch.zeros(len(leaf), device=ll.device).index_add(0, inv, log_ratio) / n
            log_ratio = mean_lr[inv]
        loss, clipped = ppo_clip_loss(log_ratio, adv, o.clip_range)
        stats = {"ratio": torch.exp(log_ratio).detach(), "clipfrac": clipped.float(), "fm_loss": -ll.detach()}
        if self.needs_reference:
            v_ref = policy.reference_velocity(x_in, rows.t, cond, o.train_guidance).float()
            if self.kl.active:
                term, kl = self.kl.value(v, v_ref, t)
                loss = loss + term
                stats["kl"] = kl.detach()
            if self.norm_guard.active:
                term, stats["norm_ratio"] = self.norm_guard.value(v, v_ref)
                loss = loss + term
        if v_ema is not None:
            term, ema_kl = self.ema_kl.value(v, v_ema, t)
            loss = loss + term
            stats["ema_kl"] = ema_kl.detach()
        return MicroLoss(loss=loss.mean(), stats=stats)

    def idle_pass(self, ctx: UpdateContext) -> torch.Tensor:
        policy, o = ctx.policy, self.opt
        x, t, c = idle_inputs(ctx)
        with ctx.autocast():
            if self._steps > 0:
                self.old.velocity(policy, x, t, c, o.train_guidance)
            if self.ema is not None:
                self.ema.velocity(policy, x, t, c, o.train_guidance)
            v = policy.velocity(x, t, c, o.train_guidance).float()
        if self.needs_reference:
            policy.reference_velocity(x, t, c, o.train_guidance)
        return v.sum() * 0.0

    def after_step(self, ctx: UpdateContext) -> None:
        self._steps += 1
        self.steps += 1

    def after_update(self, ctx: UpdateContext) -> dict[str, float]:
        if self.ema is None:
            return {}
        decay = self.schedule(self.steps)  # once per iteration, as the authors update their "ema" adapter
        self.ema.move_toward(ctx.policy, decay)
        return {"awm_ema_decay": decay}

    def state_dict(self) -> dict:
        return {"ema": self.ema.state_dict(), "steps": self.steps} if self.ema is not None else {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state.get("steps", 0))
        if "ema" in state and self.ema is not None:
            self.ema.load_state_dict(state["ema"], self._policy)


def build_awm(cfg, device=None) -> AWMObjective:
    """Factory of ``loss.objective=awm`` from a :class:`~flowgrpo.config.RunConfig`."""
    return AWMObjective(cfg)
