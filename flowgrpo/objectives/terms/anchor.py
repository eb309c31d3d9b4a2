"""Anchor terms: keep the policy equal to the base model where the policy loss should not act.

* :class:`ODEAnchor` (GRPO's ``loss.grpo.anchor_beta``): on the rollout's untrained ODE steps.
* :class:`LowNoiseAnchor` (DiffusionNFT's ``loss.nft.policy_min_t``): on the forward-process rows at
  low-noise times, which then train the anchor instead of the policy loss.

The ODE anchor, in detail:

Strategies that explore and train only some steps (a MixGRPO window, TempFlow branch points) leave
the other steps as deterministic ODE steps without a log-prob, so no policy-gradient signal reaches
the model at those noise levels. With full fine-tuning every weight serves every noise level, and
the noise in each update then drifts the model where nothing holds it: on the shapes world the
low-sigma steps, which draw the glyphs, degrade after a few hundred updates while the trained
high-sigma steps keep improving. The anchor term is a squared velocity distance to the frozen base
model on the rollout's own ODE states,

    L_anchor = weight * mean_{nodes, dims} (v_theta(x, sigma) - v_ref(x, sigma))^2,

evaluated on ``num_steps`` randomly chosen ODE depths per update. It is zero at the start, costs
one extra forward/backward and one reference forward per chosen depth, and leaves the trained
steps to the GRPO loss (and its optional KL term).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...fields import help_field as _f
from .base import LossTerm


@dataclass
class AnchorOptions:
    anchor_beta: float = _f(0.0, "weight of the anchor term: mean (v_theta - v_ref)^2 against the frozen base model on the rollout's ODE (untrained) steps; holds full fine-tuning where no policy gradient reaches (flowgrpo.objectives.terms.anchor)", ge=0.0)
    anchor_steps: int = _f(2, "ODE depths per update on which the anchor term is evaluated")


@dataclass
class LowNoiseAnchorOptions:
    policy_min_t: float = _f(0.0, "rows at times t below this train only mean((v - v_ref)^2) to the base model instead of the policy loss, with weight anchor_beta + kl_beta (the KL term applies to every row): low-noise detail stays the base model's (0: every row trains the policy loss, as the authors; needs anchor_beta > 0 or kl_beta > 0)", ge=0.0, lt=1.0)
    anchor_beta: float = _f(1.0, "weight of the low-noise anchor (rows with t < policy_min_t), added to kl_beta on those rows", ge=0.0)


def ode_depths(rollout, plan) -> list[int]:
    """Depths d whose every node takes an ODE (untrained) step from grid index ``pos < T``."""
    out = []
    for d, lv in enumerate(rollout.levels):
        pos = lv.pos if lv.pos is not None else torch.full((len(lv.x),), d, dtype=torch.long)
        lane = lv.lane if lv.lane is not None else torch.zeros_like(pos)
        if bool((pos >= plan.num_steps).any()):
            continue
        keys = {(int(p), int(ln)) for p, ln in zip(pos.tolist(), lane.tolist())}
        rules = [plan.rule(ln, p) for p, ln in keys]
        if rules and all(r and not any(s.sde for s in r) for r in rules):
            out.append(d)
    return out


def ode_anchor_loss(policy, rollout, plan, cond, weight: float, num_steps: int,
                    rng: np.random.Generator, level_sizes: list[int] | None = None) -> Tensor | None:
    """``weight * mean((v_theta - v_ref)^2)`` over ``num_steps`` random ODE depths of ``rollout``
    (states [N_d, ...] at sigma = plan.sigmas[pos]); None when the rollout has no ODE depth.

    ``level_sizes``: nodes per depth of the whole iteration's forest when ``rollout`` is one
    data-parallel shard of it; each depth's mean is then weighted by this shard's share of the
    depth, so the shards' terms sum to the whole forest's. The depths chosen depend only on the plan
    and ``rng``, so every shard picks the same ones."""
    depths = ode_depths(rollout, plan)
    if weight <= 0 or not depths or num_steps < 1:
        return None
    chosen = sorted(rng.choice(depths, size=min(num_steps, len(depths)), replace=False).tolist())
    total = None
    for d in chosen:
        lv = rollout.levels[d]
        pos = lv.pos if lv.pos is not None else torch.full((len(lv.x),), d, dtype=torch.long)
        sigma = plan.sigmas[pos.cpu()].to(lv.x.device, torch.float32)
        rows = rollout.tree_prompt[lv.tree.cpu()].to(lv.x.device)
        c = cond.index(rows)
        v = policy.velocity(lv.x, sigma, c).float()
        with torch.no_grad():
            v_ref = policy.reference_velocity(lv.x, sigma, c).float()
        term = ((v - v_ref) ** 2).mean()
        if level_sizes is not None:
            term = term * (len(lv.x) / level_sizes[d])
        total = term if total is None else total + term
    return weight * total / len(chosen)


class ODEAnchor(LossTerm):
    """GRPO's minibatch-level anchor to the base model on the rollout's ODE depths (:func:`ode_anchor_loss`)."""

    name = "anchor"
    Options = AnchorOptions

    @property
    def active(self) -> bool:
        return self.opt.anchor_beta > 0

    @property
    def references(self) -> frozenset[str]:
        return frozenset({"base"}) if self.active else frozenset()

    def value(self, policy, rollout, plan, cond, rng: np.random.Generator,
              level_sizes: list[int] | None = None) -> Tensor | None:
        """:func:`ode_anchor_loss` with this term's weight and depth count (None: no ODE depth)."""
        return ode_anchor_loss(policy, rollout, plan, cond, self.opt.anchor_beta, self.opt.anchor_steps, rng,
                               level_sizes)


class LowNoiseAnchor(LossTerm):
    """Rows at t < ``policy_min_t`` train ``anchor_beta * KL`` to the base model instead of the policy loss."""

    name = "low_noise_anchor"
    Options = LowNoiseAnchorOptions

    @property
    def active(self) -> bool:
        return self.opt.policy_min_t > 0

    @property
    def references(self) -> frozenset[str]:
        return frozenset({"base"}) if self.active and self.opt.anchor_beta > 0 else frozenset()

    def value(self, loss: Tensor, kl: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """(per-row loss [R] with the low rows' ``loss`` replaced by anchor_beta * kl, the low-row mask
        [R] float) for the policy loss [R], the rows' KL to the base model [R] and times t [R]."""
        low = t.to(loss.device) < self.opt.policy_min_t
        return torch.where(low, self.opt.anchor_beta * kl, loss), low.float()
