"""Per-transition loss weights w_j, which multiply each transition's clipped surrogate in the GRPO
loss: GRPO-Guard reweighting and TempFlow weighting.

Both are functions of the plan step a transition belongs to, so they are computed per step and
gathered to rows; with both options on the weights multiply.

* **GRPO-Guard gradient reweighting** (``loss.grpo.guard_reweight``): delta_t proportional to 1 / |Delta_t|
  (Delta_t = sigma' - sigma of the step), normalised to mean 1 over the distinct steps trained in
  this update by any process (:func:`iteration_trained_steps`), so that the weights do not depend on
  how the rows are split across processes. The SDE mean depends on the velocity through a factor proportional to Delta_t, so the
  policy gradient of a step scales with |Delta_t|; the weight equalises it across noise levels
  (together with the ratio normalisation ``loss.grpo.guard``, which equalises the ratio's spread).
* **TempFlow-GRPO noise-aware weighting** (``loss.grpo.tempflow_weight``): w_t proportional to the std of
  the step's transition (sigma_t * sqrt(-Delta_t) for the Flow-GRPO and DanceGRPO kinds), normalised to mean 1 over **all** steps
  of the schedule (so the overall loss scale does not depend on which steps are trained). Steps that
  are ODE in the plan are weighed with the noise level / SDE kind of the plan's SDE steps. The
  reference implementation instead multiplies by hand-set constants (1.73 for FLUX, 2.25 for
  SD3.5) chosen to bring the average weight near 1; normalising computes that constant exactly
  for any grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...fields import help_field as _f
from ...samplers.sde import DEFAULT_NOISE_LEVEL, sde_kind
from .base import LossTerm


@dataclass
class StepWeightOptions:
    guard_reweight: bool = _f(False, "GRPO-Guard per-step gradient reweighting (weight proportional to 1/|dt|, mean 1)")
    tempflow_weight: bool = _f(False, "TempFlow noise-aware weighting (weight proportional to the transition std, mean 1)")


def _reference_spec(plan) -> tuple[float, str]:
    """(noise_level, sde_kind) used to weigh ODE steps: the first SDE step's (the default a otherwise)."""
    for spec in plan.steps:
        if spec.sde:
            return spec.noise_level, spec.sde_kind
    return DEFAULT_NOISE_LEVEL, "flow_grpo"


def step_transition_std(plan) -> Tensor:
    """The transition std [T] of every plan step (float64), from its SDE kind (Flow-GRPO:
    s = sigma_t * sqrt(-Delta) with sigma_t = a * sqrt(sigma / (1 - sigma)); DanceGRPO: eta * sqrt(-Delta);
    CPS: sigma' * sin(a * pi / 2)).

    SDE steps use their own noise level and kind; ODE steps the plan's first SDE step's."""
    sig = plan.sigmas.double()
    ref_a, ref_kind = _reference_spec(plan)
    out = torch.empty(plan.num_steps, dtype=torch.float64)
    for i, spec in enumerate(plan.steps):
        a, kind = (spec.noise_level, spec.sde_kind) if spec.sde else (ref_a, ref_kind)
        out[i] = sde_kind(kind).std(sig[i:i + 1], sig[i + 1:i + 2], a, sig[1:2])[0]
    return out


def guard_step_weights(plan, steps: list[int]) -> Tensor:
    """GRPO-Guard delta [T] (float32): 1 / |Delta_t| normalised to mean 1 over ``steps`` (other entries 0)."""
    sig = plan.sigmas.double()
    inv = 1.0 / (sig[:-1] - sig[1:]).abs()
    w = torch.zeros(plan.num_steps, dtype=torch.float64)
    if steps:
        idx = torch.as_tensor(sorted(set(steps)), dtype=torch.long)
        w[idx] = inv[idx] / inv[idx].mean()
    return w.float()


def tempflow_step_weights(plan) -> Tensor:
    """TempFlow w [T] (float32): the transition std (sigma_t * sqrt(-Delta_t) for the Flow-GRPO and
    DanceGRPO kinds) normalised to mean 1 over all plan steps."""
    raw = step_transition_std(plan)
    mean = raw.mean()
    return (raw / mean).float() if mean > 0 else torch.ones(plan.num_steps)


def transition_weights(batch, plan, loss_cfg, trained_steps: list[int] | None = None) -> Tensor:
    """Weights [M] for the transitions of ``batch`` (ones unless a weighting option of ``loss_cfg``, a
    :class:`StepWeightOptions` or any object with its fields, is on).

    ``trained_steps``: the plan steps trained in this update on every rank, over which the GRPO-Guard
    weights are normalised (default: the steps of ``batch``). Under several processes a rank's batch
    may lack a step that another rank trains: pass the whole iteration's steps
    (:func:`iteration_trained_steps`), so that a row's weight does not depend on the rank it is on."""
    w = torch.ones(len(batch))
    step = batch.step.long().cpu()
    if loss_cfg.guard_reweight:
        steps = step.unique().tolist() if trained_steps is None else list(trained_steps)
        missing = set(step.unique().tolist()) - set(steps)
        if missing:
            raise ValueError(f"the batch has rows at plan steps {sorted(missing)} outside trained_steps {steps}")
        w = w * guard_step_weights(plan, steps)[step]
    if loss_cfg.tempflow_weight:
        w = w * tempflow_step_weights(plan)[step]
    return w


def iteration_trained_steps(forest, edge_advantages, steps: list[int], edge_masks) -> list[int]:
    """The plan steps among ``steps`` at which the whole iteration trains at least one transition.

    Args:
        forest: the whole iteration's forest (``ForestView.whole``: on several processes every rank
            holds its structure, with [N, 0] states, so this costs no model-sized memory).
        edge_advantages, edge_masks: per depth, [N_d(whole)] (the credit stage's).
        steps: the credit stage's selected steps (``Credit.steps``).

    Returns the same sorted list on every rank: the distinct steps of the 1-process batch. Steps that
    are selected but whose edges are all masked (no signal, backward-only pruning) are left out."""
    batch = forest.transitions(edge_advantages, steps, edge_masks, allow_empty=True)
    return sorted(set(batch.step.tolist()))


class StepWeights(LossTerm):
    """Per-transition weights [M] of the GRPO surrogate (:func:`transition_weights`); ones when inactive."""

    name = "step_weights"
    Options = StepWeightOptions

    @property
    def active(self) -> bool:
        return self.opt.guard_reweight or self.opt.tempflow_weight

    def value(self, batch, plan, trained_steps: list[int] | None = None) -> Tensor:
        """:func:`transition_weights` of ``batch`` under this term's options."""
        return transition_weights(batch, plan, self.opt, trained_steps)
