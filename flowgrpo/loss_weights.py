"""Per-transition loss weights w_j (DESIGN §5): GRPO-Guard reweighting and TempFlow weighting.

Both are functions of the plan step a transition belongs to, so they are computed per step and
gathered to rows; with both options on the weights multiply.

* **GRPO-Guard gradient reweighting** (``loss.guard_reweight``): delta_t proportional to 1 / |Delta_t|
  (Delta_t = sigma' - sigma of the step), normalised to mean 1 over the distinct steps trained in
  this update. The SDE mean depends on the velocity through a factor proportional to Delta_t, so the
  policy gradient of a step scales with |Delta_t|; the weight equalises it across noise levels
  (together with the ratio normalisation ``loss.guard``, which equalises the ratio's spread).
* **TempFlow-GRPO noise-aware weighting** (``loss.tempflow_weight``): w_t proportional to
  sigma_t * sqrt(-Delta_t), the std of the step's transition, normalised to mean 1 over **all** steps
  of the schedule (so the overall loss scale does not depend on which steps are trained). Steps that
  are ODE in the plan are weighed with the noise level / SDE kind of the plan's SDE steps. The
  reference implementation instead multiplies by hand-set constants (1.73 for FLUX, 2.25 for
  SD3.5) chosen to bring the average weight near 1; normalising computes that constant exactly
  for any grid.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _reference_spec(plan):
    """(noise_level, sde_kind) used to weigh steps: each SDE step's own, ODE steps the first SDE step's."""
    for s in plan.steps:
        if s.sde:
            return s.noise_level, s.sde_kind
    return 0.7, "flow_grpo"


def step_sigma_t(plan) -> Tensor:
    """sigma_t [T] of every plan step (the SDE diffusion coefficient, DESIGN §3), float64."""
    from flowgrpo.samplers.steps import sde_sigma_t

    sig = plan.sigmas.double()
    ref_a, ref_kind = _reference_spec(plan)
    out = torch.empty(plan.num_steps, dtype=torch.float64)
    for i, spec in enumerate(plan.steps):
        a, kind = (spec.noise_level, spec.sde_kind) if spec.sde else (ref_a, ref_kind)
        s, sn = sig[i:i + 1], sig[i + 1:i + 2]
        if kind == "cps":
            out[i] = float(sn) * math.sin(a * math.pi / 2)
        else:
            out[i] = sde_sigma_t(s, sn, a, kind, sig[1:2])[0]
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
    """TempFlow w [T] (float32): sigma_t * sqrt(-Delta_t) normalised to mean 1 over all plan steps."""
    sig = plan.sigmas.double()
    raw = step_sigma_t(plan) * torch.sqrt((sig[:-1] - sig[1:]).clamp(min=0))
    mean = raw.mean()
    return (raw / mean).float() if mean > 0 else torch.ones(plan.num_steps)


def transition_weights(batch, plan, loss_cfg) -> Tensor:
    """Weights [M] for the transitions of ``batch`` (ones unless a weighting option is on)."""
    w = torch.ones(len(batch))
    step = batch.step.long().cpu()
    if getattr(loss_cfg, "guard_reweight", False):
        w = w * guard_step_weights(plan, step.unique().tolist())[step]
    if getattr(loss_cfg, "tempflow_weight", False):
        w = w * tempflow_step_weights(plan)[step]
    return w
