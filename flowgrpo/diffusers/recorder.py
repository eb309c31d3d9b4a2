"""``StepRecorder``: a ``callback_on_step_end`` that keeps what a policy update needs from a stock
diffusers pipeline call: the latents after every step, the conditioning tensors the pipeline
exposes (``callback_on_step_end_tensor_inputs``: SD3 prompt_embeds / pooled_prompt_embeds, FLUX
prompt_embeds, Wan prompt_embeds / negative_prompt_embeds) and, through forward pre-hooks on the
denoiser(s), the exact keyword arguments of every transformer call (so that
:meth:`StepRecorder.velocity` recomputes the guided velocity with gradients, whatever the
pipeline's extra inputs: FLUX's pooled projections, image / text ids and guidance, ...).

    rec = StepRecorder().attach(pipe)
    pipe(prompt, callback_on_step_end=rec, callback_on_step_end_tensor_inputs=rec.tensor_inputs(pipe))
    rec.detach()
    x = rec.latents_in(step, initial_latents)  # or the scheduler record's ``sample``
    v = rec.velocity(step, x)  # [B, ...] float32, differentiable in the transformer's weights

The guidance scale a replay combines the outputs with is read off each step, not taken from the
pipeline's arguments (FLUX's ``guidance_scale`` is its distilled guidance, embedded in the
transformer input; its true CFG scale is ``true_cfg_scale``, which the pipeline does not expose; Wan
2.2 switches scale with the expert): ``attach`` also wraps ``pipe.scheduler.step`` to see the
velocity the pipeline steps with, and the scale is the one (a hint, the pipeline's attribute, else
a least-squares fit) that turns the step's transformer outputs into exactly that velocity. A step
whose velocity is no such combination (SD3's skip-layer guidance, a guidance rescale) is marked and
:meth:`StepRecorder.velocity` refuses it rather than return another velocity.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

#: denoiser attributes of a pipeline that get a forward pre-hook (Wan 2.2 has two experts)
DENOISERS = ("transformer", "transformer_2")


def _detach(value):
    return value.detach() if isinstance(value, Tensor) else value


def _output(out) -> Tensor:
    """The prediction of a transformer's return value (a tuple or a ``Transformer2DModelOutput``)."""
    return out[0] if isinstance(out, tuple) else out.sample


def cond_uncond(outputs: list[Tensor], batch: int) -> tuple[Tensor, Tensor | None] | None:
    """(c, u) of one step's transformer outputs for a batch of ``batch`` latents: one output of 2B rows
    is [u; c] (SD3's batched CFG), two of B rows are (c, u) (Wan, FLUX true CFG: conditional call
    first); one output of B rows is (c, None), no CFG. None for any other layout."""
    rows = [o.shape[0] for o in outputs]
    if rows == [batch]:
        return outputs[0], None
    if rows == [2 * batch]:
        u, c = outputs[0].chunk(2)
        return c, u
    if rows == [batch, batch]:
        return outputs[0], outputs[1]
    return None


class StepRecorder:
    """Callable with diffusers' ``callback_on_step_end`` signature ``(pipe, i, t, kwargs) -> kwargs``.

    Attributes:
        latents: per step i, the latents after step i ([B, ...], detached; packed for FLUX).
        timesteps: per step, the scheduler timestep (float).
        conditioning: the non-latent callback tensors of the first step (detached), e.g.
            {"prompt_embeds": [B', L, D], "pooled_prompt_embeds": [B', D]}; with classifier-free
            guidance SD3 exposes the concatenated [uncond; cond] tensors (B' = 2B).
        calls: per step, a list of (denoiser, kwargs) of each transformer call of that step.
        guidance_scales: per step seen by the scheduler, the CFG scale g of v = u + g (c - u) that the
            pipeline stepped with (None: no CFG, v is the one output).
        unreplayable: per step whose stepped velocity is no such combination, why.
        guidance_scale: step 0's CFG scale (None without CFG); the pipeline's ``guidance_scale``
            attribute when the scheduler's steps were not seen.
        cfg: whether the pipeline did classifier-free guidance (at step 0).

    Args:
        guidance_scales: CFG scales to try first on every step (:func:`~flowgrpo.diffusers.rollout.rollout`
            passes the call's ``true_cfg_scale`` / ``guidance_scale`` / ``guidance_scale_2``); they
            matter only where cond and uncond outputs coincide, which any scale fits.
    """

    def __init__(self, guidance_scales: tuple[float, ...] = ()):
        self.latents: list[Tensor] = []
        self.timesteps: list[float] = []
        self.conditioning: dict[str, Tensor] = {}
        self.calls: list[list[tuple[torch.nn.Module, dict]]] = []
        self.guidance_scales: dict[int, float | None] = {}
        self.unreplayable: dict[int, str] = {}
        self.guidance_scale: float | None = None
        self.cfg = False
        self._hints = tuple(float(g) for g in guidance_scales)
        self._hooks: list = []
        self._outputs: list[Tensor] = []  # the running step's transformer outputs, until the scheduler steps
        self._pipe = None
        self._scheduler = None
        self._unwrap = None  # (our wrapper, the instance's own step before it or None)

    # ------------------------------------------------------------------ wiring
    @staticmethod
    def tensor_inputs(pipe) -> list[str]:
        """The names to pass as ``callback_on_step_end_tensor_inputs``: all the pipeline exposes."""
        return list(getattr(pipe, "_callback_tensor_inputs", ["latents"]))

    def attach(self, pipe) -> "StepRecorder":
        """Hook the pipeline's denoiser(s) to record each call's keyword arguments (and output), and wrap
        ``pipe.scheduler.step`` (on the instance) to read each step's guidance; returns self."""
        self.detach()
        scheduler = getattr(pipe, "scheduler", None)
        for name in DENOISERS:
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
                if scheduler is not None:  # outputs are kept only until the scheduler's step reads them
                    self._hooks.append(module.register_forward_hook(self._post_hook))
        if scheduler is not None:
            self._pipe, self._scheduler = pipe, scheduler
            step, had_own = scheduler.step, "step" in vars(scheduler)

            def recorded_step(model_output, *args, **kwargs):
                self._read_guidance(model_output)
                return step(model_output, *args, **kwargs)

            scheduler.step = recorded_step
            self._unwrap = (recorded_step, step if had_own else None)
        return self

    def detach(self) -> None:
        """Remove the hooks and the scheduler wrapper (the recorded data stays)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._scheduler is not None:
            wrapper, previous = self._unwrap
            if vars(self._scheduler).get("step") is wrapper:  # else someone wrapped it after us: leave theirs
                if previous is None:
                    del self._scheduler.step
                else:
                    self._scheduler.step = previous
        self._pipe = self._scheduler = None
        self._outputs = []

    def _pre_hook(self, module, args, kwargs):
        if args:
            raise TypeError("StepRecorder expects the pipeline to call its transformer with keyword arguments")
        step = len(self.latents)  # callbacks so far = index of the running step
        while len(self.calls) <= step:
            self.calls.append([])
        self.calls[step].append((module, {k: _detach(v) for k, v in kwargs.items()}))

    def _post_hook(self, module, args, output):
        self._outputs.append(_output(output).detach())

    def _read_guidance(self, velocity: Tensor) -> None:
        """Called with the velocity [B, ...] the pipeline steps with: record the CFG scale g for which
        u + g (c - u) of this step's transformer outputs is that velocity (to rounding), or why none is.

        Candidates in order: the hints, the pipeline's ``guidance_scale`` (and Wan 2.2's
        ``_guidance_scale_2``), then the least-squares g = <v - u, c - u> / |c - u|^2 (float64).
        """
        step, outputs, self._outputs = len(self.latents), self._outputs, []
        v = velocity.detach()
        parts = cond_uncond(outputs, v.shape[0])
        if parts is None:
            rows = [o.shape[0] for o in outputs]
            self.unreplayable[step] = (f"its {len(rows)} transformer call(s) of {rows} rows for a batch of "
                                       f"{v.shape[0]} are no cond / uncond pair")
            return
        c, u = (None if t is None else t.double() for t in parts)
        v = v.double()
        # rounding of the pipeline's own combination in its dtype, scaled like the terms it adds
        eps = max(torch.finfo(t.dtype).eps for t in [velocity, *outputs])
        size = max(t.abs().max().item() for t in (v, c) + (() if u is None else (u,)))
        if u is None:
            err = (c - v).abs().max().item()
            if err <= 8 * eps * (1 + size):
                self.guidance_scales[step] = None
            else:
                self.unreplayable[step] = f"it stepped with a velocity {err:.3g} away from its transformer output"
            return
        pipe = self._pipe
        hints = [*self._hints, getattr(pipe, "guidance_scale", None), getattr(pipe, "_guidance_scale_2", None)]
        hints = [float(g) for g in hints if isinstance(g, numbers.Real) and not isinstance(g, bool)]
        d = c - u
        denom = float((d * d).sum())
        fit = float(((v - u) * d).sum()) / denom if denom > 0 else (hints[0] if hints else 1.0)
        best = None
        for g in [*hints, fit]:
            err = (u + g * d - v).abs().max().item()
            if err <= 8 * eps * (1 + abs(g)) * (1 + size):
                self.guidance_scales[step] = g
                return
            best = err if best is None else min(best, err)
        self.unreplayable[step] = (f"it stepped with a velocity {best:.3g} away from u + g (c - u) of its "
                                   "transformer outputs for every g (skip-layer guidance? guidance rescale?)")

    def __call__(self, pipe, step_index: int, timestep, callback_kwargs: dict) -> dict:
        if step_index == 0:
            self.conditioning = {k: _detach(v) for k, v in callback_kwargs.items() if k != "latents"}
            if 0 in self.guidance_scales:
                self.guidance_scale = self.guidance_scales[0]
                self.cfg = self.guidance_scale is not None
            else:  # the scheduler's steps were not seen: the pipeline's attributes
                self.guidance_scale = getattr(pipe, "guidance_scale", None)
                self.cfg = bool(getattr(pipe, "do_classifier_free_guidance", False))
        if "latents" in callback_kwargs:
            self.latents.append(callback_kwargs["latents"].detach())
        self.timesteps.append(float(timestep))
        return callback_kwargs

    # ------------------------------------------------------------------ recomputation
    def velocity(self, step: int, latents: Tensor, guidance_scale: float | None = None) -> Tensor:
        """Recompute step ``step``'s (guided) velocity at ``latents`` [B, ...] with gradients.

        Replays the recorded transformer call(s) of that step with ``hidden_states`` replaced by
        ``latents`` (repeated when the pipeline batched [uncond; cond]) and combines the outputs as
        the pipeline did (:func:`cond_uncond`): v = u + g (c - u) with the step's own scale g
        (``guidance_scales[step]``; ``guidance_scale`` overrides it), or the one output without CFG.
        A ValueError for a step recorded as unreplayable (``unreplayable``), unless
        ``guidance_scale`` is given. Returns [B, ...] float32.
        """
        if step in self.unreplayable and guidance_scale is None:
            raise ValueError(f"StepRecorder cannot replay step {step}: {self.unreplayable[step]}")
        g = guidance_scale if guidance_scale is not None else self.guidance_scales.get(step, self.guidance_scale)
        outs = []
        for module, kwargs in self.calls[step]:
            rec = kwargs["hidden_states"]
            reps = rec.shape[0] // latents.shape[0]
            x = latents.to(rec.dtype)
            kw = dict(kwargs, hidden_states=torch.cat([x] * reps) if reps > 1 else x)
            outs.append(_output(module(**kw)).float())
        parts = cond_uncond(outs, latents.shape[0])
        if parts is None:
            raise ValueError(f"StepRecorder cannot replay step {step}: transformer outputs of "
                             f"{[o.shape[0] for o in outs]} rows for a batch of {latents.shape[0]}")
        c, u = parts
        if u is None:
            return c
        if g is None:
            raise ValueError(f"StepRecorder: step {step} did CFG but its scale is unknown; pass guidance_scale")
        return u + g * (c - u)

    def latents_in(self, step: int, initial: Tensor) -> Tensor:
        """The latents [B, ...] step ``step`` started from (``initial`` for step 0)."""
        return initial if step == 0 else self.latents[step - 1]
