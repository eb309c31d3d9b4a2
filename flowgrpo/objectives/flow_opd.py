"""``loss.objective=flow_opd``: Flow-OPD (Fang et al., arXiv 2605.08063), on-policy distillation of
single-reward teachers into one student, with Manifold Anchor Regularization.

Stage 1 (outside this objective) trains one teacher per task: any flowgrpo run, or a LoRA, of the
student's base model (:mod:`.teachers`). Stage 2 is this objective:

* **Cold start** (``cold_start``): ``merge`` loads the element-wise mean of the teachers' trainable
  weights into the student before the first rollout (the authors' merge script: LoRA A and B matrices
  averaged separately); ``sft`` spends the first ``sft_iterations`` iterations on teacher trajectories
  (below); ``none`` starts from the student's own weights.
* **On-policy sampling**: the student's own SDE rollout (``sampler.*``, Flow-GRPO's SDE), every trained
  step's transitions are rows; the rewards are computed and logged but do not train.
* **Task routing**: each prompt's key (its tag) picks its teacher (``teachers``, ``default_teacher``).
* **Dense per-step supervision**: at every trained transition x_t -> x_t' of the student's trajectory,
  the routed teacher's velocity gives its SDE mean mu_T (same step, same noise level) and

      kl_T = mean_D((mu_theta - mu_T)^2) / (2 sigma_t^2),
      A    = clip(-reward_scale * kl_T, -adv_clip_max, adv_clip_max),
      L    = mean_rows max(-A r, -A clip(r, 1 - eps, 1 + eps))
             + anchor_beta * mean_rows mean_D((mu_theta - mu_anchor)^2) / (2 sigma_t^2),

  with r = p_theta(x_t' | x_t) / p_old(x_t' | x_t) the rollout's likelihood ratio (Gaussian log-density
  averaged over the D elements, as GRPO), sigma_t the SDE's diffusion coefficient at the step (for
  Flow-GRPO's SDE a sqrt(t / (1 - t)), the authors' ``std_dev_t``) and mu_anchor the mean under the
  **Manifold Anchor** teacher (``anchor_teacher``; the base model when unset, as the authors' code
  falls back to). The sum is computed by the GRPO reference op
  (:func:`~flowgrpo.ops.reference.grpo_loss_ref`), the distillation reward in place of the advantage
  and the anchor in place of the KL reference.

Paper and code differ on one point, which ``reward_gradient`` chooses. The paper (eq. 10) detaches
the reward, so the gradient reaches theta only through the ratio r. The authors' released training
script (``train_sd3_opd_mix.py``, ``reward_mode="kl_only"``) computes kl_T from the trained forward's
mean without a detach, so the gradient also runs through kl_T: r * grad kl_T, a direct regression of
the student's velocity onto the teacher's (the "dense velocity supervision"). ``through`` (default)
is the code, ``detached`` the paper. Either way a teacher equal to the student gives kl_T = 0 and no
distillation gradient. kl_T is per latent element over 2 sigma_t^2 (the code's units: the paper's KL
of eq. 9 times |Delta t| / D).

SFT cold start (``cold_start=sft``, flowgrpo's reading of "SFT on teacher trajectories"; the
authors' scripts publish no SFT stage for Flow-OPD): iteration n < ``sft_iterations`` rolls out with
teacher n mod K (the K distinct teachers in turn), keeps the transitions of prompts routed to that
teacher, and regresses the student's velocity onto the teacher's at those states,
L = mean_rows mean_D((v_theta - v_T)^2). Then on-policy distillation begins.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..fields import help_field as _f
from ..ops.kl import mean_kl
from ..ops.reference import grpo_loss_ref
from ..samplers.recompute import transition_log_prob_std, transition_means, transition_sigma_t
from .base import MicroLoss, Objective, UpdateContext, idle_inputs
from .old_policy import trainable_weights_loaded
from .teachers import TeacherSet

OPTION = "loss.flow_opd"


@dataclass
class FlowOPDOptions:
    """``loss.flow_opd.*`` (defaults: the authors' SD3.5-M configuration ``mix_opd_8gpu``)."""

    teachers: dict = _f({}, "prompt key -> teacher: the run folder (or checkpoints/ckpt_N folder) of a finished run, or a LoRA folder / .safetensors file, of the student's own base model; the key is the prompt's tag (the shapes world's tags, a .jsonl prompt file's tag column; data.curriculum_key)")
    default_teacher: str = _f("", "teacher of the prompts whose key is not in teachers (a run folder or LoRA); '' none: such a prompt is an error")
    anchor_teacher: str = _f("", "Manifold Anchor Regularization's task-agnostic teacher (a run folder or LoRA, e.g. an aesthetics teacher); '' the frozen base model (the authors' fallback when no MAR LoRA is given)")
    anchor_beta: float = _f(0.04, "weight of the anchor term mean_D((mu_theta - mu_anchor)^2) / (2 sigma_t^2) (the authors: train.beta = 0.04); 0 turns MAR off", ge=0.0)
    reward_scale: float = _f(1.0, "the distillation reward is -reward_scale * kl_T (the authors: kl_scale = -1)", gt=0.0)
    adv_clip_max: float = _f(5.0, "the reward is clipped to [-adv_clip_max, adv_clip_max] (the authors: 5)", gt=0.0)
    clip_range: float = _f(1e-4, "PPO ratio clip epsilon (the authors: 1e-4)", gt=0.0)
    reward_gradient: Literal["through", "detached"] = _f("through", "through: kl_T keeps its gradient, a direct regression onto the teacher's velocity besides the ratio's (the authors' released code) | detached: the gradient only through the likelihood ratio (the paper's eq. 10)")
    cold_start: Literal["merge", "sft", "none"] = _f("merge", "merge: start from the mean of the teachers' trainable weights (the paper's better cold start) | sft: the first sft_iterations iterations regress onto the teachers along their own rollouts | none: the student's own weights")
    sft_iterations: int = _f(4, "iterations of the sft cold start (cold_start=sft), the teachers taking turns", ge=0)


def flow_opd_loss(prev_sample: Tensor, mean: Tensor, mean_teacher: Tensor, mean_anchor: Tensor | None,
                  mean_old: Tensor, std: Tensor, logp_old: Tensor, sigma_t: Tensor, opt: FlowOPDOptions):
    """Flow-OPD's loss over N transitions (see the module docstring), and kl_T [N].

    Args:
        prev_sample: x_t' [N, ...] of the rollout. mean: mu_theta [N, ...] with gradient.
        mean_teacher: mu_T [N, ...] of each row's routed teacher; mean_anchor: mu_anchor [N, ...] or None
            (no anchor term). mean_old: [N, ...] rollout means. std: [N] the log-prob std.
        logp_old: [N] rollout log-probs. sigma_t: [N] the SDE's diffusion coefficient (kl denominators).
    Returns: (:class:`~flowgrpo.ops.GRPOLossOutput` with the scalar loss, kl_T [N] detached).
    """
    distilled = mean if opt.reward_gradient == "through" else mean.detach()
    kl_t = mean_kl(distilled, mean_teacher, sigma_t)
    reward = (-opt.reward_scale * kl_t).clamp(-opt.adv_clip_max, opt.adv_clip_max)
    out = grpo_loss_ref(prev_sample, mean, mean_old, std, logp_old, reward, torch.ones_like(reward),
                        clip_range=opt.clip_range, mean_ref=mean_anchor, kl_sigma=sigma_t,
                        beta=opt.anchor_beta if mean_anchor is not None else 0.0)
    return out, kl_t.detach()


class FlowOPDObjective(Objective):
    """Flow-OPD (see the module docstring). Args: opt (``loss.flow_opd``), model_cfg (the run's ``model``)."""

    name = "flow_opd"

    def __init__(self, opt: FlowOPDOptions, model_cfg):
        self.opt, self.model_cfg = opt, model_cfg
        self.needs_reference = opt.anchor_beta > 0 and not opt.anchor_teacher
        self.teachers: TeacherSet | None = None
        self.next_iteration = 0  # the iteration the next rollout belongs to (the SFT turns)
        self._route: Tensor | None = None

    def setup(self, policy) -> None:
        opt = self.opt
        self.teachers = TeacherSet(opt.teachers, opt.default_teacher, opt.anchor_teacher, policy, self.model_cfg, OPTION)
        if opt.cold_start == "merge":
            policy.load_trainable_state_dict(self.teachers.merged())

    def sft_teacher(self, iteration: int) -> int | None:
        """The teacher whose rollouts iteration ``iteration`` clones (SFT cold start), else None."""
        if self.opt.cold_start != "sft" or iteration >= self.opt.sft_iterations:
            return None
        return iteration % len(self.teachers.paths)

    def rollout_weights(self, policy):
        k = self.sft_teacher(self.next_iteration)
        return contextlib.nullcontext() if k is None else trainable_weights_loaded(policy, self.teachers.weights[k])

    def rows(self, ctx: UpdateContext):
        col = ctx.collected
        self.next_iteration = col.iteration + 1
        self._sft = self.sft_teacher(col.iteration)
        route = self.teachers.route(col.prompt_keys)
        levels = col.rollout.levels
        # the rewards do not train: every trained step's transition is a row, advantage slots left at 0
        zeros = [None] + [torch.zeros(len(lv.x)) for lv in levels[1:]]
        batch = col.rollout.transitions(zeros, ctx.credit.steps, None, allow_empty=True)
        teacher = route[batch.prompt]
        if self._sft is not None:
            batch = batch.select((teacher == self._sft).nonzero(as_tuple=True)[0])
            teacher = teacher[teacher == self._sft]
        self._teacher = teacher
        self._logp_std = transition_log_prob_std(batch, col.plan)
        return dataclasses.replace(batch, row=torch.arange(len(batch))) if len(batch) else None

    def _teacher_velocities(self, ctx, mb, x, cond_rows) -> Tensor:
        """v_T [m, ...] float32 of each row's routed teacher at x (no gradient). Lock-step engines
        (sharded weights) run every teacher on every row, so that all ranks make the same calls."""
        who = self._teacher[mb.row]
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        for k in range(len(self.teachers.paths)) if ctx.lockstep else who.unique().tolist():
            r = torch.arange(len(who)) if ctx.lockstep else (who == k).nonzero(as_tuple=True)[0]
            with ctx.autocast():
                v = self.teachers.velocity(ctx.policy, k, x[r.to(x.device)], mb.sigma[r],
                                           ctx.collected.cond.index(cond_rows[r])).float()
            mine = (who[r] == k).to(x.device)
            out[r.to(x.device)[mine]] = v[mine]
        return out

    def idle_pass(self, ctx: UpdateContext) -> Tensor:
        """A rank without rows makes the others' calls: every teacher, the anchor, the student."""
        x, sigma, cond = idle_inputs(ctx)
        with ctx.autocast():
            for k in range(len(self.teachers.paths)):
                self.teachers.velocity(ctx.policy, k, x, sigma, cond)
            if self.opt.anchor_teacher and self.opt.anchor_beta > 0 and getattr(self, "_sft", None) is None:
                self.teachers.velocity(ctx.policy, None, x, sigma, cond)
        return super().idle_pass(ctx)

    def micro_loss(self, ctx: UpdateContext, mb) -> MicroLoss:
        opt, plan, policy = self.opt, ctx.collected.plan, ctx.policy
        cond = ctx.collected.cond.index(mb.prompt)
        x = mb.sample.to(ctx.device).to(ctx.dtype)
        # the teachers and the anchor run before the forward with gradients (their weights are swapped in)
        v_teacher = self._teacher_velocities(ctx, mb, x, mb.prompt)
        v_anchor = None
        if self._sft is None and opt.anchor_beta > 0:
            with ctx.autocast():
                v_anchor = (self.teachers.velocity(policy, None, x, mb.sigma, cond) if opt.anchor_teacher
                            else policy.reference_velocity(x, mb.sigma, cond)).float()
        with ctx.autocast():
            v = policy.velocity(x, mb.sigma, cond).float()
        if self._sft is not None:
            sq = ((v - v_teacher) ** 2).reshape(len(v), -1).mean(1)
            return MicroLoss(loss=sq.mean(), stats={"sft_mse": sq.detach()})
        mean = transition_means(mb, v, plan)
        dev = mean.device
        out, kl_t = flow_opd_loss(
            mb.prev_sample.to(dev), mean, transition_means(mb, v_teacher, plan).detach(),
            None if v_anchor is None else transition_means(mb, v_anchor, plan).detach(), mb.mean_old.to(dev),
            self._logp_std[mb.row].to(dev), mb.log_prob_old.to(dev), transition_sigma_t(mb, plan).to(dev), opt)
        stats = {"opd_kl": kl_t, "anchor_kl": out.kl, "ratio": out.ratio,
                 "clipfrac": (out.clipped_high | out.clipped_low).float()}
        return MicroLoss(loss=out.loss, stats=stats)

    def after_update(self, ctx: UpdateContext) -> dict[str, float]:
        return {"opd_sft": float(self._sft is not None)}

    def state_dict(self) -> dict:
        return {"next_iteration": self.next_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.next_iteration = int(state.get("next_iteration", self.next_iteration))


def build_flow_opd(cfg, device=None) -> FlowOPDObjective:
    """Factory of ``loss.objective=flow_opd`` from a :class:`~flowgrpo.config.RunConfig`."""
    return FlowOPDObjective(cfg.loss.flow_opd, cfg.model)
