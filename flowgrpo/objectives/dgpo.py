"""``loss.objective=dgpo``: Direct Group Preference Optimization (Luo et al., ICLR 2026).

A prompt's group is split by advantage into a positive set G+ (A > 0) and a negative set G- (A < 0).
Each sample's implicit reward is DPO's, a denoising-loss difference to the reference on noised
copies x_t of the clean sample (:mod:`.forward_rows`),

    d_i = mean_k [ mean((v_theta(x_t) - u)^2) - mean((v_ref(x_t) - u)^2) ],   r_i = -beta_DPO d_i,

and a set's reward is the advantage-weighted sum R(G) = sum_{i in G} w_i r_i, w_i = |A_i| / K (K the
group's size). The loss of a group is the group-level Bradley-Terry likelihood

    L_g = -log sigmoid(R(G+) - R(G-)),      L = mean_g L_g + kl_beta mean((v_theta - v_ref)^2).

L_g couples every sample of a group, which the micro-batch loop cannot hold at once. Two passes per
minibatch make it exact: first, without gradients, every row's d is computed and the groups' margins
Delta_g = R(G+) - R(G-) are gathered over all ranks; then each row's loss is linear in its own error
with a detached coefficient. dL_g/dd_i = beta sigmoid(-Delta_g) s_i w_i (:func:`dgpo_coefficients`);
like the authors' code the update uses sigmoid(-Delta_g) A_i per row, averaged over rows, i.e. the
same direction without the constant beta / K (beta only sharpens the sigmoid).

As in the authors' code, training times are K draws from the first 70 % of the rollout's grid (the
high-noise steps; ``time_fraction``), every sample drawing its own times and noise (the authors share one
noise per group and one set of times per epoch). Not implemented: the authors'
one-sided ratio clip against an EMA copy (their ``clip_range``).

The reference is the frozen base model, or an EMA of the trained weights (``reference=ema``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import MicroLoss, Objective, UpdateContext
from .forward_rows import SampleRows, build_sample_rows, per_row_mean
from .old_policy import OldPolicy


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
        self.needs_reference = self.opt.reference == "frozen"
        self.ema: OldPolicy | None = None
        self._policy = None
        self.steps = 0
        self._coef: dict = {}

    def setup(self, policy) -> None:
        self._policy = policy
        if self.opt.reference == "ema":
            self.ema = OldPolicy(policy)

    def _v_ref(self, policy, x, t, cond):
        g = self.opt.train_guidance
        if self.ema is not None:
            return self.ema.velocity(policy, x, t, cond, g)
        return policy.reference_velocity(x, t, cond, g)

    def rows(self, ctx: UpdateContext) -> SampleRows | None:
        from .awm import time_sampler

        return build_sample_rows(ctx.collected, ctx.credit, self.seed, time_sampler(self.opt, ctx.collected.plan.sigmas),
                                 self.opt.timesteps)

    @torch.no_grad()
    def begin_minibatch(self, ctx: UpdateContext, rows: SampleRows, passes: int) -> int:
        """The first pass: every row's d without gradients, the groups' margins over all ranks, and
        each row's coefficient."""
        o, policy, dp = self.opt, ctx.policy, ctx.dp
        d_rows, calls = [], 0
        for part in torch.split(torch.arange(len(rows)), self.micro) if rows is not None and len(rows) else ():
            m = rows.select(part)
            cond = ctx.collected.cond.index(m.prompt)
            x_in = m.noised(ctx.dtype).to(ctx.device)
            u = m.target().to(ctx.device)
            with ctx.autocast():
                v_ref = self._v_ref(policy, x_in, m.t, cond).float()
                v = policy.velocity(x_in, m.t, cond, o.train_guidance).float()
            d_rows.append((per_row_mean((v - u) ** 2) - per_row_mean((v_ref - u) ** 2)).double().cpu())
            calls += 1
        if ctx.lockstep:  # a sharded denoiser needs every rank in every forward
            for _ in range(passes - calls):
                self._dummy_forwards(ctx)
        n = len(rows) if rows is not None else 0
        d = torch.cat(d_rows) if d_rows else torch.zeros(0, dtype=torch.float64)
        leaf = rows.leaf if n else torch.zeros(0, dtype=torch.long)
        # per-leaf means over the leaf's K rows, then the whole minibatch's leaves from every rank
        ul, inv = torch.unique(leaf, return_inverse=True)
        k = torch.zeros(len(ul), dtype=torch.float64).index_add(0, inv, torch.ones(n, dtype=torch.float64))
        d_leaf = torch.zeros(len(ul), dtype=torch.float64).index_add(0, inv, d) / k.clamp(min=1)
        # a leaf's rows share its advantage and group: any of them gives the leaf's
        adv_leaf = torch.zeros(len(ul), dtype=torch.float64).scatter_(0, inv, rows.advantage.double()) if n else d
        grp_leaf = torch.zeros(len(ul), dtype=torch.long).scatter_(0, inv, rows.group) if n else leaf
        if dp.world > 1:
            ul, d_leaf, adv_leaf, grp_leaf, k = (dp.cat(t) for t in (ul, d_leaf, adv_leaf, grp_leaf, k))
            rows_total = int(dp.sum_scalar(n))
        else:
            rows_total = n
        losses, margin = dgpo_group_loss(d_leaf, adv_leaf, grp_leaf, o.beta_dpo)
        # the authors' scaling: row loss sigmoid(-Delta_g) A_i err_row, averaged over rows (the loop's
        # mean); it is the exact gradient of mean_g L_g times G K / beta per row count, a learning-rate scale
        inv = torch.unique(grp_leaf, return_inverse=True)[1]
        coef_leaf = torch.sigmoid(-margin[inv]) * adv_leaf
        self._coef = {int(lf): float(c) for lf, c in zip(ul.tolist(), coef_leaf.tolist())}
        self._group_stats = (losses, margin)
        return calls

    def _dummy_forwards(self, ctx: UpdateContext) -> None:
        policy = ctx.policy
        x = torch.zeros(1, *policy.latent_shape, device=ctx.device, dtype=ctx.dtype)
        t = torch.full((1,), 0.5)
        c = ctx.collected.cond.index(torch.zeros(1, dtype=torch.long))
        with ctx.autocast():
            self._v_ref(policy, x, t, c)
            policy.velocity(x, t, c, self.opt.train_guidance)

    def micro_loss(self, ctx: UpdateContext, rows: SampleRows) -> MicroLoss:
        o, policy = self.opt, ctx.policy
        cond = ctx.collected.cond.index(rows.prompt)
        x_in = rows.noised(ctx.dtype).to(ctx.device)
        u = rows.target().to(ctx.device)
        with ctx.autocast():
            v = policy.velocity(x_in, rows.t, cond, o.train_guidance).float()
        err = per_row_mean((v - u) ** 2)
        coef = torch.tensor([self._coef.get(int(lf), 0.0) for lf in rows.leaf.tolist()], device=err.device)
        loss = coef * err  # its gradient is the group loss's (see the module docstring)
        losses, margin = self._group_stats
        stats = {"fm_loss": err.detach()}
        if o.kl_beta > 0:
            with torch.no_grad():
                v_ref = self._v_ref(policy, x_in, rows.t, cond).float()
            kl = per_row_mean((v - v_ref) ** 2)
            loss = loss + o.kl_beta * kl
            stats["kl"] = kl.detach()
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
            if self.opt.kl_beta > 0:
                with torch.no_grad():
                    self._v_ref(policy, x, t, c)
        return v.sum() * 0.0

    def after_step(self, ctx: UpdateContext) -> None:
        self.steps += 1
        if self.ema is not None:
            self.ema.move_toward(ctx.policy, self.opt.ema_decay)

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
