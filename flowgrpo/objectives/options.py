"""Typed options of GRPO and the forward-process objectives: ``loss.grpo.*``, ``loss.nft.*``,
``loss.awm.*``, ``loss.dgpo.*`` (CRD's, Flow-DPPO's and Diffusion-DPO's sit in their modules).

Defaults are the authors' SD3.5 settings where they carry over to any model; the shapes-world
presets (``diffusion-nft``, ``awm``, ``dgpo``) override what the small world needs. Every field's
help is shown by ``flowgrpo config explain loss``; :func:`check_objective_options` range-checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError
from ..fields import help_field as _f
from .terms.anchor import AnchorOptions, LowNoiseAnchorOptions
from .terms.base import term_field
from .terms.clip_schedule import ClipOptions
from .terms.kl import KLOptions
from .terms.norm_guard import NormGuardOptions
from .terms.self_guidance import SelfGuidanceOptions
from .terms.sft import SFTOptions
from .terms.step_weights import StepWeightOptions

#: ``loss.{nft,awm,dgpo}.rows``: which samples become training rows (one help, one default, three keys)
ROWS_HELP = ("which samples train: all (the authors: every sample with a finite reward; a group whose rewards have "
             "no spread has advantage 0 and still counts in the step's mean and carries the regularisers: for nft "
             "the r = 1/2 pull toward v_old and the KL, for awm the KL and the EMA KL, for dgpo the KL) | signal "
             "(only groups with reward spread: the step is scaled by N_all / N_signal and the regularisers skip the "
             "other samples; the shapes-nft preset's measured setting)")


def _rows_field():
    return _f("all", ROWS_HELP)


@dataclass
class GRPOOptions:
    """``loss.grpo.*``: Flow-GRPO's clipped ratio and every GRPO variant's loss terms."""

    clip_range: float = term_field(ClipOptions, "clip_range")
    clip_adapt: float = term_field(ClipOptions, "clip_adapt")
    kl_beta: float = _f(0.0, "KL weight against the reference model (adapter off); 0 disables the reference pass", ge=0.0)
    kl_sigma: Literal["sigma_t", "transition_std"] = _f("sigma_t", "KL denominator: sigma_t (mean((mu - mu_ref)^2) / (2 sigma_t^2), as the current Flow-GRPO code) | transition_std (divides by s^2 = sigma_t^2 * (-dt) instead: ~T times larger at T steps, so divide kl_beta by ~T to match)")
    batched_reference: bool = _f(True, "KL reference velocities of a minibatch's rows in no-grad batches of train.micro_batch before its micro-batches, computed once per iteration and reused by every inner epoch, so epochs after the first make no reference call (false: one reference call per micro-batch and epoch; same values up to float rounding; lock-step engines such as FSDP always use the per-micro-batch path)")
    guard: bool = _f(False, "GRPO-Guard ratio normalisation (with the gaussian log-prob: not with sampler.cps_log_prob=mse)")
    guard_reweight: bool = term_field(StepWeightOptions, "guard_reweight")
    tempflow_weight: bool = term_field(StepWeightOptions, "tempflow_weight")
    sft_beta: float = term_field(SFTOptions, "sft_beta")
    anchor_beta: float = term_field(AnchorOptions, "anchor_beta")
    anchor_steps: int = term_field(AnchorOptions, "anchor_steps")
    backend: Literal["auto", "reference", "fused"] = _f("auto", "GRPO loss op: auto (fused op where built, else reference) | reference | fused")


@dataclass
class NFTOptions:
    beta: float = _f(1.0, "beta: strength of the implicit policies v+ = beta v + (1 - beta) v_old and v- = (1 + beta) v_old - beta v (the authors: 1; 0.1 for OCR)")
    kl_beta: float = term_field(KLOptions, "kl_beta", 1e-4)
    adv_clip: float = _f(5.0, "A_max: advantages are clipped to +-A_max and mapped to the optimality r = clip(A / A_max / 2 + 1/2, 0, 1)")
    adv_mode: Literal["all", "positive_only", "negative_only", "binary"] = _f("all", "which advantages train: all | positive_only (A < 0 -> 0) | negative_only (A > 0 -> 0) | binary (A -> sign(A), as the authors: r = 1/2 +- 1 / (2 A_max), 0.6 / 0.4 at A_max = 5)")
    rows: Literal["all", "signal"] = _rows_field()
    timesteps: int = _f(0, "training times per sample, taken from the rollout's grid (0: all T grid times; K < T: a random subset of K per sample; the authors train 9 of 10)")
    sample_with_old: bool = _f(True, "roll out with the old policy, as the authors do (false: with the trained weights)")
    policy_min_t: float = term_field(LowNoiseAnchorOptions, "policy_min_t")
    anchor_beta: float = term_field(LowNoiseAnchorOptions, "anchor_beta")
    self_guidance_beta: float = term_field(SelfGuidanceOptions, "self_guidance_beta")
    self_guidance_scale: float = term_field(SelfGuidanceOptions, "self_guidance_scale")
    self_guidance_uncond: Literal["old", "base"] = term_field(SelfGuidanceOptions, "self_guidance_uncond")
    decay_flat: int = _f(0, "old-policy EMA schedule d(step) = min(max(step - flat, 0) * rate, cap): flat")
    decay_rate: float = _f(0.001, "old-policy EMA schedule: rate per update")
    decay_cap: float = _f(0.5, "old-policy EMA schedule: cap (0 with rate 0: the old policy is the previous update's weights)")
    train_guidance: float = _f(1.0, "guidance scale of the training forward passes (1: CFG-free, as the authors train)")
    weight_floor: float = _f(1e-5, "floor of the adaptive x0-space weights mean|x0_hat - x0| (detached)")
    norm_guard_beta: float = term_field(NormGuardOptions, "norm_guard_beta")
    norm_guard_margin: float = term_field(NormGuardOptions, "norm_guard_margin")


@dataclass
class AWMOptions:
    clip_range: float = _f(1.0, "PPO clip epsilon on the ratio exp(l - l_old) (the authors: 1; on-policy with one step per iteration the ratio is 1 anyway)")
    kl_beta: float = term_field(KLOptions, "kl_beta", 1e-3, "the authors: 1e-3 GenEval, 3e-3 OCR, 1e-4 PickScore")
    kl_sigma_weighting: bool = term_field(KLOptions, "kl_sigma_weighting")
    kl_noise_level: float = term_field(KLOptions, "kl_noise_level")
    ema_kl_beta: float = _f(1.0, "weight of a KL term mean((v - v_ema)^2) to a lagging copy of the trained weights (0: off)", ge=0.0)
    ema_decay_rate: float = _f(0.001, "lagging copy: decay d(n) = min(n * rate, cap) after each iteration, n = optimizer steps so far")
    ema_decay_cap: float = _f(0.3, "lagging copy: cap of the decay")
    timesteps: int = _f(6, "training times per sample")
    time_sampler: Literal["grid_strata", "logit_normal", "uniform", "rollout"] = _f("grid_strata", "grid_strata: one grid time from each of K strata of the rollout's grid indices [1, 0.9 T) (the authors' 'discrete_wo_init') | logit_normal (with shift) | uniform | rollout (K of the grid times)")
    logit_mean: float = _f(0.0, "logit-normal time sampler: mean")
    logit_std: float = _f(1.0, "logit-normal time sampler: std")
    time_shift: float = _f(3.0, "logit-normal time sampler: shift s, t -> s t / (1 + (s - 1) t)")
    weighting: Literal["ghuber", "uniform", "t", "t2"] = _f("ghuber", "surrogate l = -w(t) f(err), err = mean((v - u)^2): ghuber (w = t, f = ((err + 1e-10)^p - 1e-10^p) / p, the authors' default) | uniform | t | t2 (f = err)")
    ghuber_power: float = _f(0.25, "p of the ghuber weighting")
    ratio_mode: Literal["per_timestep", "mean"] = _f("per_timestep", "clip each (sample, t) ratio (per_timestep) or the ratio of the mean surrogate over a sample's times (mean: micro-batches then hold whole samples, so it does not depend on train.micro_batch; a sample of more rows than train.micro_batch makes a larger micro-batch)")
    rows: Literal["all", "signal"] = _rows_field()
    adv_clip: float = _f(5.0, "advantages are clipped to +-adv_clip and divided by it (the authors: 5)")
    train_guidance: float = _f(1.0, "guidance scale of the training forward passes (1: CFG-free)")
    norm_guard_beta: float = term_field(NormGuardOptions, "norm_guard_beta")
    norm_guard_margin: float = term_field(NormGuardOptions, "norm_guard_margin")


@dataclass
class DGPOOptions:
    beta_dpo: float = _f(100.0, "beta of the group-level Bradley-Terry likelihood log sigmoid(R(G+) - R(G-)), r_i = -beta d_i (the authors: 100 with CFG rollouts, 10 PickScore, 2000-5000 with an EMA reference)")
    kl_beta: float = term_field(KLOptions, "kl_beta", 1e-3, "always the base model, whatever the DPO reference")
    reference: Literal["frozen", "ema"] = _f("frozen", "the DPO reference: the frozen base model, or an EMA of the trained weights (the KL still goes to the base model, as the authors)")
    ema_decay: float = _f(0.3, "cap of the EMA's decay: after optimizer step n the EMA moves with d(n) = min(ema_decay, ema_decay_rate * n) (the authors: 0.3)")
    ema_decay_rate: float = _f(0.001, "growth of the EMA's decay per optimizer step (the authors: 0.001)")
    ema_rollouts_after: int = _f(500, "roll out with the EMA once more than this many optimizer steps are taken, as the authors (500 GenEval, 200 compressibility); the EMA is kept whenever this is >= 0 or reference=ema (-1: always the trained weights)")
    rows: Literal["all", "signal"] = _rows_field()
    timesteps: int = _f(4, "training times per sample (the authors: 4)")
    time_sampler: Literal["rollout", "grid_strata", "logit_normal", "uniform"] = _f("rollout", "rollout: K of the first time_fraction of the rollout's grid times (the authors) | grid_strata | logit_normal | uniform")
    time_fraction: float = _f(0.7, "rollout time sampler: the first fraction of the grid to draw from (the authors: 7 of 10 steps, 5 for GenEval)")
    logit_mean: float = _f(0.0, "logit-normal time sampler: mean")
    logit_std: float = _f(1.0, "logit-normal time sampler: std")
    time_shift: float = _f(1.0, "logit-normal time sampler: shift s")
    train_guidance: float = _f(1.0, "guidance scale of the training forward passes (1: CFG-free, as the authors train)")
    norm_guard_beta: float = term_field(NormGuardOptions, "norm_guard_beta")
    norm_guard_margin: float = term_field(NormGuardOptions, "norm_guard_margin")


def check_objective_options(loss_cfg) -> None:
    """Range checks of ``loss.nft``, ``loss.awm`` and ``loss.dgpo`` (a ConfigError names the key)."""

    def need(ok: bool, key: str, value, what: str) -> None:
        if not ok:
            raise ConfigError(f"config key 'loss.{key}' must be {what}, got {value!r}")

    n, a, d = loss_cfg.nft, loss_cfg.awm, loss_cfg.dgpo
    need(n.beta > 0, "nft.beta", n.beta, "> 0")
    need(n.decay_rate >= 0, "nft.decay_rate", n.decay_rate, ">= 0")  # the KL weights' ranges sit on their fields
    for key, v in (("nft.adv_clip", n.adv_clip), ("awm.adv_clip", a.adv_clip), ("awm.clip_range", a.clip_range),
                   ("dgpo.beta_dpo", d.beta_dpo), ("nft.weight_floor", n.weight_floor), ("awm.time_shift", a.time_shift),
                   ("dgpo.time_shift", d.time_shift), ("awm.logit_std", a.logit_std), ("dgpo.logit_std", d.logit_std),
                   ("nft.train_guidance", n.train_guidance), ("awm.train_guidance", a.train_guidance),
                   ("dgpo.train_guidance", d.train_guidance)):
        need(v > 0, key, v, "> 0")
    for key, v in (("nft.decay_cap", n.decay_cap), ("awm.ema_decay_cap", a.ema_decay_cap), ("dgpo.ema_decay", d.ema_decay)):
        need(0 <= v < 1, key, v, "in [0, 1)")
    need(d.ema_decay_rate >= 0, "dgpo.ema_decay_rate", d.ema_decay_rate, ">= 0")
    need(d.ema_rollouts_after >= -1, "dgpo.ema_rollouts_after", d.ema_rollouts_after, ">= -1 (-1: never)")
    # the self-guidance push compounds through the old policy; only the KL holds it (terms/self_guidance.py)
    need(n.self_guidance_beta * (n.self_guidance_scale - 1) < n.kl_beta or n.self_guidance_beta == 0,
         "nft.self_guidance_beta", n.self_guidance_beta,
         f"< loss.nft.kl_beta / (loss.nft.self_guidance_scale - 1) = {n.kl_beta / (n.self_guidance_scale - 1):g} "
         "(at or above it the policy's guidance runs away; 0: off)")
    need(n.policy_min_t == 0 or n.anchor_beta > 0 or n.kl_beta > 0, "nft.policy_min_t", n.policy_min_t,
         "0 when loss.nft.anchor_beta and loss.nft.kl_beta are both 0 (the low-noise rows would have no loss)")
    need(n.decay_flat >= 0, "nft.decay_flat", n.decay_flat, ">= 0")
    need(n.timesteps >= 0, "nft.timesteps", n.timesteps, ">= 0 (0: every grid time)")
    for key, v in (("awm.timesteps", a.timesteps), ("dgpo.timesteps", d.timesteps)):
        need(v >= 1, key, v, ">= 1")
    need(0 < d.time_fraction <= 1, "dgpo.time_fraction", d.time_fraction, "in (0, 1]")
    need(a.ghuber_power > 0, "awm.ghuber_power", a.ghuber_power, "> 0")
    need(a.ema_decay_rate >= 0, "awm.ema_decay_rate", a.ema_decay_rate, ">= 0")
