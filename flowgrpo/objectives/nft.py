"""``loss.objective=nft``: DiffusionNFT (Zheng et al. 2025), negative-aware fine-tuning on the
forward process.

For every clean sample x0 of the rollout and training time t (the rollout's own grid times), with
fresh noise, x_t = (1 - t) x0 + t eps (:mod:`.forward_rows`). The advantage A of the sample becomes
an optimality probability r = clip(clip(A, -A_max, A_max) / A_max / 2 + 1/2, 0, 1). Two implicit
policies are built from the trained velocity v and the old policy's v_old (an EMA of the trained
weights, :mod:`.old_policy`):

    v+ = beta v + (1 - beta) v_old,        v- = (1 + beta) v_old - beta v,

and their clean-sample predictions x0+- = x_t - t v+- are pulled toward x0, v+ for good samples and
v- for bad ones, with adaptive weights w+- = max(mean|x0+- - x0|, floor) that carry no gradient:

    L_row = A_max / beta * [ r mean((x0+ - x0)^2) / w+ + (1 - r) mean((x0- - x0)^2) / w- ]
            + kl_beta * mean((v - v_ref)^2).

Optionally (``policy_min_t`` > 0) rows at low-noise times train only an anchor
(anchor_beta + kl_beta) * mean((v - v_ref)^2) to the base model instead (the KL term stays on every
row, on top of the anchor): the alignment then happens where the
image's composition is decided, and the fine detail stays the base model's (with full fine-tuning
every time shares the weights, and the policy loss alone lets detail drift into a faint texture).

Pulling v- toward the data for a bad sample pushes v *away* from it (v- moves opposite to v): the
negative samples are used without a likelihood. At theta = old both terms' gradients cancel for
r = 1/2, so a sample with zero advantage only ties the policy to the old one. As in the authors'
code such samples (every sample of a group without reward spread) train: they count in the step's
mean and carry the KL (``rows=all``); ``rows=signal`` drops them.

After each iteration's update the old weights move toward the trained ones with the decay
d(n) = min(max(n - flat, 0) rate, cap), n = optimizer steps taken so far (the authors' three
schedules are (0, 0, 0), (0, 0.001, 0.5) and (75, 0.0075, 0.999)). As in the authors' code, the
rollouts are drawn by the old policy (``sample_with_old``), and advantages are the group-centred
rewards over the iteration's global std (``advantage.std=global`` in the presets).
"""

from __future__ import annotations

import torch

from .base import MicroLoss, Objective, UpdateContext, idle_inputs
from .forward_rows import SampleRows, build_sample_rows, per_row_mean, rollout_times
from .old_policy import DecaySchedule, OldPolicy, old_policy_home
from .terms.anchor import LowNoiseAnchor
from .terms.kl import VelocityKL
from .terms.norm_guard import NormGuard
from .terms.self_guidance import SelfGuidance


def nft_optimality(adv: torch.Tensor, adv_clip: float, mode: str = "all") -> torch.Tensor:
    """The optimality probability r [R] in [0, 1] of advantages [R] (``mode`` as ``loss.nft.adv_mode``)."""
    a = adv.float().clamp(-adv_clip, adv_clip)
    if mode == "positive_only":
        a = a.clamp(min=0)
    elif mode == "negative_only":
        a = a.clamp(max=0)
    elif mode == "binary":  # the authors: A -> sign(A), so r = 1/2 +- 1 / (2 A_max)
        a = torch.sign(a)
    elif mode != "all":
        raise ValueError(f"unknown nft adv_mode {mode!r}; valid: all, positive_only, negative_only, binary")
    return (a / adv_clip / 2 + 0.5).clamp(0, 1)


def nft_policy_loss(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
                    r: torch.Tensor, beta: float, adv_clip: float, floor: float = 1e-5) -> tuple[torch.Tensor, dict]:
    """DiffusionNFT's policy loss per row, [R], and its parts.

    Args:
        v: trained velocity [R, ...] (with gradient); v_old: old-policy velocity [R, ...] (detached here).
        x_t: noised samples [R, ...]; x0: clean samples [R, ...]; t: times [R] in (0, 1).
        r: optimality probabilities [R]; beta: implicit-policy strength; adv_clip: A_max.
        floor: lower bound of the adaptive weights.
    """
    v_old = v_old.detach()
    tt = t.view(-1, *([1] * (v.ndim - 1))).to(v)
    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v
    x0_pos = x_t - tt * v_pos
    x0_neg = x_t - tt * v_neg
    with torch.no_grad():
        w_pos = per_row_mean((x0_pos - x0).abs()).clamp(min=floor)
        w_neg = per_row_mean((x0_neg - x0).abs()).clamp(min=floor)
    pos = per_row_mean((x0_pos - x0) ** 2) / w_pos
    neg = per_row_mean((x0_neg - x0) ** 2) / w_neg
    loss = adv_clip * (r * pos + (1 - r) * neg) / beta
    return loss, {"nft_pos": pos.detach(), "nft_neg": neg.detach()}


class NFTObjective(Objective):
    """DiffusionNFT with ``loss.nft`` options (:class:`~flowgrpo.objectives.options.NFTOptions`)."""

    name = "nft"

    def __init__(self, cfg):
        self.opt = cfg.loss.nft
        self.seed = cfg.train.seed
        self.kl, self.anchor = VelocityKL.from_config(self.opt), LowNoiseAnchor.from_config(self.opt)
        self.norm_guard = NormGuard.from_config(self.opt)
        self.self_guidance = SelfGuidance.from_config(self.opt, min_t=self.opt.policy_min_t)
        self._uncond = None  # the empty prompt's encoding, for the self-guidance term's unconditional pass
        self.needs_reference = "base" in (self.kl.references | self.anchor.references | self.self_guidance.references
                                          | self.norm_guard.references)
        self.schedule = DecaySchedule(self.opt.decay_flat, self.opt.decay_rate, self.opt.decay_cap)
        self.old: OldPolicy | None = None
        self.old_home = old_policy_home(cfg.train)  # train.old_policy_device
        self.lagging_copies = 1
        self._policy = None
        self.steps = 0  # optimizer steps so far: the decay schedule's clock

    def setup(self, policy) -> None:
        self.old = OldPolicy(policy, self.old_home)
        self._policy = policy
        if self.self_guidance.active:
            self._uncond = policy.encode_prompts([""])

    def _uncond_rows(self, n: int):
        """The empty prompt's conditioning for ``n`` rows (the self-guidance term's unconditional pass)."""
        return self._uncond.index(torch.zeros(n, dtype=torch.long))

    def _uncond_velocity(self, policy, x, t):
        """The self-guidance target's empty-prompt velocity [R, ...] at x [R, ...], t [R]: the old
        policy's or the frozen base's (``loss.nft.self_guidance_uncond``); never differentiated."""
        c = self._uncond_rows(len(x))
        if self.opt.self_guidance_uncond == "base":
            with torch.no_grad():
                return policy.reference_velocity(x, t, c, 1.0).float()
        return self.old.velocity(policy, x, t, c, 1.0).float()

    def rollout_weights(self, policy):
        """The authors roll out with the old policy (``loss.nft.sample_with_old``)."""
        return self.old.active(policy) if self.opt.sample_with_old else super().rollout_weights(policy)

    def rows(self, ctx: UpdateContext) -> SampleRows | None:
        plan = ctx.collected.plan
        k = self.opt.timesteps or plan.num_steps
        return build_sample_rows(ctx.collected, ctx.credit, self.seed, rollout_times(plan.sigmas), k,
                                 only_signal=self.opt.rows == "signal")

    def micro_loss(self, ctx: UpdateContext, rows: SampleRows) -> MicroLoss:
        o, policy = self.opt, ctx.policy
        cond = ctx.collected.cond.index(rows.prompt)
        x_t = rows.noised().to(ctx.device)
        x_in = x_t.to(ctx.dtype)
        with ctx.autocast():  # the old policy first: its weight swap must precede the graph's saved tensors
            v_old = self.old.velocity(policy, x_in, rows.t, cond, o.train_guidance).float()
            if self.self_guidance.active:
                v_old_u = self._uncond_velocity(policy, x_in, rows.t)
            v = policy.velocity(x_in, rows.t, cond, o.train_guidance).float()
        r = nft_optimality(rows.advantage.to(v.device), o.adv_clip, o.adv_mode)
        t = rows.t.to(v.device)
        loss, parts = nft_policy_loss(v, v_old, x_t, rows.x0.float().to(v.device), t, r, o.beta, o.adv_clip,
                                      o.weight_floor)
        stats = {"nft_r": r.detach(), **parts, "v_old_dev": per_row_mean((v - v_old).abs()).detach()}
        if self.self_guidance.active:
            sg_term, stats["self_guidance_gap"] = self.self_guidance.value(v, v_old, v_old_u, t)
            loss = loss + sg_term
        if self.needs_reference:
            v_ref = policy.reference_velocity(x_in, rows.t, cond, o.train_guidance).float()
            kl_term, kl = self.kl.value(v, v_ref, t)
            stats["kl"] = kl.detach()
            if self.anchor.active:  # low-noise rows: the anchor to the base model replaces the NFT loss
                loss, stats["anchor_rows"] = self.anchor.value(loss, kl, t)
            loss = loss + kl_term
            if self.norm_guard.active:
                ng_term, stats["norm_ratio"] = self.norm_guard.value(v, v_ref)
                loss = loss + ng_term
        return MicroLoss(loss=loss.mean(), stats=stats)

    def idle_pass(self, ctx: UpdateContext) -> torch.Tensor:
        policy = ctx.policy
        x, t, c = idle_inputs(ctx)
        with ctx.autocast():
            self.old.velocity(policy, x, t, c, self.opt.train_guidance)
            if self.self_guidance.active:
                self._uncond_velocity(policy, x, t)
            v = policy.velocity(x, t, c, self.opt.train_guidance).float()
        if self.needs_reference:
            policy.reference_velocity(x, t, c, self.opt.train_guidance)
        return v.sum() * 0.0

    def after_step(self, ctx: UpdateContext) -> None:
        self.steps += 1

    def after_update(self, ctx: UpdateContext) -> dict[str, float]:
        # once per iteration, after every inner epoch, with d of the optimizer steps taken so far
        decay = self.schedule(self.steps)
        self.old.move_toward(ctx.policy, decay)
        return {"nft_old_decay": decay}

    def state_dict(self) -> dict:
        return {"old": self.old.state_dict(), "steps": self.steps} if self.old is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if "old" in state and self.old is not None:
            self.old.load_state_dict(state["old"], self._policy)
            self.steps = int(state.get("steps", 0))


def build_nft(cfg, device=None) -> NFTObjective:
    """Factory of ``loss.objective=nft`` from a :class:`~flowgrpo.config.RunConfig`."""
    return NFTObjective(cfg)
