"""User code: a training objective written outside flowgrpo, named by import path
(``loss.objective=my_objective:AdvantageWeightedMatching``).

An objective is a subclass of :class:`flowgrpo.objectives.Objective`: ``rows`` turns one iteration
(the collected rollout and its credit) into training rows, ``micro_loss`` gives the loss of a
micro-batch of rows as a mean over them; the trainer's update loop does the rest (epochs,
minibatches, accumulation, optimizer steps, data parallelism). It is built as ``cls(cfg, device)``.
"""

from __future__ import annotations

import torch

from flowgrpo.objectives import MicroLoss, Objective, UpdateContext
from flowgrpo.objectives.forward_rows import SampleRows, build_sample_rows, per_row_mean, rollout_times


class AdvantageWeightedMatching(Objective):
    """Flow matching on the rollout's own clean samples x0, each weighted by its advantage A:

        x_t = (1 - t) x0 + t eps,    L_row = exp(clamp(A, -2, 2) / temperature) * mean((v(x_t, t) - (eps - x0))^2)

    with t on the rollout's grid (``times_per_sample`` of them per sample) and fresh noise eps. The
    loss is a mean over rows; samples better than their group pull harder (reward-weighted regression
    on the forward process, no log-probabilities needed).
    """

    name = "weighted_matching"

    def __init__(self, cfg, device=None, temperature: float = 1.0, times_per_sample: int = 2):
        self.seed = cfg.train.seed
        self.temperature = temperature
        self.times_per_sample = times_per_sample

    def rows(self, ctx: UpdateContext) -> SampleRows | None:
        times = rollout_times(ctx.collected.plan.sigmas)
        return build_sample_rows(ctx.collected, ctx.credit, self.seed, times, self.times_per_sample)

    def micro_loss(self, ctx: UpdateContext, rows: SampleRows) -> MicroLoss:
        cond = ctx.collected.cond.index(rows.prompt)
        x_t = rows.noised(ctx.dtype).to(ctx.device)
        with ctx.autocast():
            v = ctx.policy.velocity(x_t, rows.t, cond).float()
        err = per_row_mean((v - rows.target().to(ctx.device)) ** 2)             # [R]
        weight = torch.exp(rows.advantage.to(err.device).clamp(-2, 2) / self.temperature)
        return MicroLoss((weight * err).mean(), stats={"fm_error": err.detach(), "row_weight": weight})
