"""The anchor term: keep the policy equal to the base model on the steps the policy gradient skips.

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

import numpy as np
import torch
from torch import Tensor


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
