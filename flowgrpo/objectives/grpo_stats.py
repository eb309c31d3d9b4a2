"""Diagnostics of one GRPO update: pooled and per timestep.

The ratio's spread and the clip fractions depend strongly on the noise level of a step (GRPO-Guard's
observation: low-noise steps have ratios shifted and spread by 1/s), so besides the pooled values the
update reports them per plan step, logged as ``ratio_mean/step_03`` and so on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..ops import GRPOLossOutput
from .base import MicroLoss


@dataclass
class StepStats:
    """Diagnostics of the transitions of one plan step."""

    transitions: int
    ratio_mean: float
    ratio_std: float
    clipfrac: float


@dataclass
class UpdateStats:
    """What a GRPO update reports (every inner epoch and minibatch pooled).

    Attributes:
        loss: mean over transitions of the micro-batch losses (policy surrogate + KL + SFT terms),
            each micro-batch weighted by its rows (so it does not depend on how rows are batched).
        ratio_mean, ratio_std: importance ratio over all transitions used.
        approx_kl: 0.5 * mean((logp - logp_old)^2), the policy's drift from the rollout.
        clipfrac_high, clipfrac_low: fractions of rows with r > 1 + eps, r < 1 - eps.
        kl: mean KL term against the reference model (0 without it).
        grad_norm: mean gradient norm before clipping, over optimizer steps.
        onpolicy_ratio_maxdev: max |r - 1| of the first micro-batch (0 up to rounding on-policy).
        transitions: transitions in the update's batch.
        anchor_loss: mean anchor term (None when off).
        per_step: plan step -> :class:`StepStats`.
    """

    loss: float
    ratio_mean: float
    ratio_std: float
    approx_kl: float
    clipfrac_high: float
    clipfrac_low: float
    kl: float
    grad_norm: float
    onpolicy_ratio_maxdev: float
    transitions: int
    anchor_loss: float | None = None
    per_step: dict[int, StepStats] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Flat ``name -> number`` for the metrics log (per-step values as ``name/step_XX``)."""
        out = {k: getattr(self, k) for k in ("loss", "ratio_mean", "ratio_std", "approx_kl", "clipfrac_high",
                                              "clipfrac_low", "kl", "grad_norm", "onpolicy_ratio_maxdev",
                                              "transitions")}
        if self.anchor_loss is not None:
            out["anchor_loss"] = self.anchor_loss
        for s, st in sorted(self.per_step.items()):
            out[f"ratio_mean/step_{s:02d}"] = st.ratio_mean
            out[f"ratio_std/step_{s:02d}"] = st.ratio_std
            out[f"clipfrac/step_{s:02d}"] = st.clipfrac
        return out


class UpdateStatsCollector:
    """Accumulates micro-batch results into an :class:`UpdateStats`."""

    def __init__(self, transitions: int):
        self.transitions = transitions
        self.ratio: list[Tensor] = []
        self.dlogp: list[Tensor] = []
        self.high: list[Tensor] = []
        self.low: list[Tensor] = []
        self.kl: list[Tensor] = []
        self.step: list[Tensor] = []
        self.loss: list[Tensor] = []  # micro-batch loss x rows
        self.rows = 0
        self.anchor: list[Tensor] = []
        self.grad_norms: list[float] = []
        self.first_dev: float | None = None

    def add(self, micro: MicroLoss, rows) -> None:
        """One micro-batch: its :class:`MicroLoss` (``record`` is the loss op's output) and its
        transitions (``log_prob_old`` [m], plan ``step`` [m])."""
        out: GRPOLossOutput = micro.record
        self.ratio.append(out.ratio)
        self.dlogp.append(out.logp - rows.log_prob_old)
        self.high.append(out.clipped_high.float())
        self.low.append(out.clipped_low.float())
        self.kl.append(out.kl)
        self.step.append(rows.step)
        self.loss.append(micro.loss.detach().reshape(1) * len(rows.step))
        self.rows += len(rows.step)
        if self.first_dev is None:
            self.first_dev = float((out.ratio - 1).abs().max())

    def add_extra(self, name: str, value: Tensor) -> None:
        """The anchor term of a minibatch (the only minibatch-level GRPO term)."""
        self.anchor.append(value.detach().reshape(1))

    def finish(self, dp=None) -> dict[str, float]:
        """The pooled metrics (see :meth:`UpdateStats.metrics`)."""
        return self.finish_stats(dp).metrics()

    def finish_stats(self, dp=None) -> UpdateStats:
        """The pooled statistics; with ``dp`` (a :class:`~flowgrpo.trainer.data_parallel.DataParallel`)
        they pool every rank's rows, so every rank reports the same numbers."""
        def cat(parts: list[Tensor], dtype=torch.float32) -> Tensor:
            t = torch.cat([p.detach().float().cpu() for p in parts]) if parts else torch.zeros(0)
            t = t.to(dtype)
            return dp.cat(t) if dp is not None else t

        ratio, dlogp = cat(self.ratio), cat(self.dlogp)
        high, low, step = cat(self.high), cat(self.low), cat(self.step, torch.long)
        loss_sum, rows = float(cat(self.loss).sum()), int(len(step))
        first = [self.first_dev] if dp is None else dp.gather(self.first_dev)
        first = [f for f in first if f is not None]
        anchor = cat(self.anchor)
        transitions = self.transitions if dp is None else int(dp.sum_scalar(self.transitions))
        if dp is not None and len(anchor):  # each rank holds its share of every minibatch's anchor term
            anchor = anchor.view(dp.world, -1).sum(0)
        per_step = {}
        for s in step.unique().tolist():
            m = step == s
            r = ratio[m]
            per_step[int(s)] = StepStats(transitions=int(m.sum()), ratio_mean=float(r.mean()),
                                         ratio_std=float(r.std()) if len(r) > 1 else 0.0,
                                         clipfrac=float((high[m] + low[m]).mean()))
        if rows == 0:
            return UpdateStats(loss=0.0, ratio_mean=1.0, ratio_std=0.0, approx_kl=0.0, clipfrac_high=0.0,
                               clipfrac_low=0.0, kl=0.0, grad_norm=float(np.mean(self.grad_norms)) if self.grad_norms
                               else 0.0, onpolicy_ratio_maxdev=0.0, transitions=transitions)
        return UpdateStats(
            loss=loss_sum / rows,
            ratio_mean=float(ratio.mean()),
            ratio_std=float(ratio.std()) if len(ratio) > 1 else 0.0,
            approx_kl=float(0.5 * (dlogp**2).mean()),
            clipfrac_high=float(high.mean()),
            clipfrac_low=float(low.mean()),
            kl=float(cat(self.kl).mean()),
            grad_norm=float(np.mean(self.grad_norms)) if self.grad_norms else 0.0,
            onpolicy_ratio_maxdev=max(first) if first else 0.0,
            transitions=transitions,
            anchor_loss=float(anchor.mean()) if len(anchor) else None,
            per_step=per_step,
        )
