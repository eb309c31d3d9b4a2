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
whose velocity is no such combination is replayed through the generic adapter's call layouts and
guidance schemes instead (:mod:`flowgrpo.diffusers.general_replay`: Qwen-Image's true CFG with norm
rescale, Z-Image's negated c + g (c - u), positional or list inputs); a step that fits none of them
(SD3's skip-layer guidance, a guidance rescale) is marked and :meth:`StepRecorder.velocity` refuses
it rather than return another velocity.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .replay.step_record import TransformerCall
from .general_replay import GeneralStep, learn_step

#: denoiser attributes of a pipeline that get a forward pre-hook (Wan 2.2 has two experts)
DENOISERS = ("transformer", "transformer_2")


def _detach_tree(value):
    """``value`` with every tensor detached (inside lists and tuples too)."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detach_tree(v) for v in value)
    return value


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
        general: per step replayed through the generic adapter's call layouts and guidance schemes
            (:mod:`~flowgrpo.diffusers.general_replay`): pipelines that call their transformer
            positionally or with the sample inside a list or with extra channels, and schemes other
            than u + g (c - u) (Z-Image, Qwen-Image, HunyuanVideo 1.5, FLUX.1-Kontext, ...).
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
        self.general: dict[int, GeneralStep] = {}
        self._hints = tuple(float(g) for g in guidance_scales)
        self._raw: list[tuple[torch.nn.Module, TransformerCall]] = []  # the running step's calls, with outputs
        # steps seen by the scheduler wrapper, and what it saw: the step index and, for pipelines that
        # take no callback_on_step_end (HunyuanVideo 1.5), the latents and timesteps
        self._stepped = 0
        self._stepped_latents: list[Tensor] = []
        self._stepped_timesteps: list[float] = []
        self._hooks: list = []
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
                sample = kwargs.get("sample", args[1] if len(args) > 1 else None)
                timestep = kwargs.get("timestep", args[0] if args else None)
                self._read_guidance(model_output, sample)
                out = step(model_output, *args, **kwargs)
                self._stepped += 1
                prev = out[0] if isinstance(out, tuple) else getattr(out, "prev_sample", None)
                if isinstance(prev, Tensor):
                    self._stepped_latents.append(prev.detach())
                if timestep is not None:
                    self._stepped_timesteps.append(float(timestep.flatten()[0]) if isinstance(timestep, Tensor)
                                                   else float(timestep))
                return out

            scheduler.step = recorded_step
            self._unwrap = (recorded_step, step if had_own else None)
        return self

    def detach(self) -> None:
        """Remove the hooks and the scheduler wrapper (the recorded data stays)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if not self.latents and self._stepped_latents:  # no callback ran: the scheduler's view of the steps
            self.latents, self.timesteps = self._stepped_latents, self._stepped_timesteps
            if 0 in self.guidance_scales:
                self.guidance_scale = self.guidance_scales[0]
                self.cfg = self.guidance_scale is not None
        if self._scheduler is not None:
            wrapper, previous = self._unwrap
            if vars(self._scheduler).get("step") is wrapper:  # else someone wrapped it after us: leave theirs
                if previous is None:
                    del self._scheduler.step
                else:
                    self._scheduler.step = previous
        self._pipe = self._scheduler = None
        self._raw = []

    def _pre_hook(self, module, args, kwargs):
        step = self._step_index()
        while len(self.calls) <= step:
            self.calls.append([])
        kw = {k: _detach_tree(v) for k, v in kwargs.items()}
        self.calls[step].append((module, kw))
        self._raw.append((module, TransformerCall(tuple(_detach_tree(a) for a in args), kw)))

    def _step_index(self) -> int:
        """The running step: steps the scheduler wrapper saw, else callbacks so far."""
        return self._stepped if self._scheduler is not None else len(self.latents)

    def _post_hook(self, module, args, output):
        first = output[0] if isinstance(output, (tuple, list)) else output.sample
        if self._raw:
            self._raw[-1][1].output = _detach_tree(first)

    def _scale_hints(self) -> list[float]:
        """Guidance scales to try: the hints, the pipeline's ``guidance_scale``, Wan 2.2's
        ``_guidance_scale_2`` and a guider component's ``guidance_scale`` (HunyuanVideo 1.5)."""
        pipe = self._pipe
        hints = [*self._hints, getattr(pipe, "guidance_scale", None), getattr(pipe, "_guidance_scale_2", None),
                 getattr(getattr(pipe, "guider", None), "guidance_scale", None)]
        out = []
        for g in hints:
            if isinstance(g, numbers.Real) and not isinstance(g, bool) and float(g) not in out:
                out.append(float(g))
        return out

    def _read_guidance(self, velocity: Tensor, sample: Tensor | None = None) -> None:
        """Called with the velocity [B, ...] the pipeline steps with (and the ``sample`` it steps):
        record how this step's transformer outputs make that velocity, or why they do not.

        SD3 / FLUX.1 / Wan 2.1 calls (keyword ``hidden_states``, outputs u + g (c - u)): the CFG
        scale g from, in order, the hints, the pipeline's ``guidance_scale`` (and Wan 2.2's
        ``_guidance_scale_2``), then the least-squares g = <v - u, c - u> / |c - u|^2 (float64).
        Any other call or scheme: a :class:`~flowgrpo.diffusers.general_replay.GeneralStep`.
        """
        step, raw = self._step_index(), self._raw
        self._raw = []
        # the plain replay swaps hidden_states for the latents: only where it is the sample itself
        plain = all(not call.args and isinstance(call.kwargs.get("hidden_states"), Tensor)
                    and isinstance(call.output, Tensor)
                    and (sample is None or call.kwargs["hidden_states"].shape[1:] == sample.shape[1:])
                    for _, call in raw)
        if plain:
            self._read_plain_guidance(step, velocity, [call.output for _, call in raw])
        if (not plain or step in self.unreplayable) and sample is not None and raw:
            learnt = learn_step(raw, sample.detach(), velocity.detach(), self._scale_hints())
            if isinstance(learnt, GeneralStep):
                self.general[step] = learnt
                self.guidance_scales[step] = learnt.guidance
                self.unreplayable.pop(step, None)
            elif not plain:
                self.unreplayable[step] = learnt
        elif not plain:
            self.unreplayable[step] = "the scheduler's sample was not seen"
        for _, call in raw:
            call.output = None  # the outputs were needed only to read the scheme

    def _read_plain_guidance(self, step: int, velocity: Tensor, outputs: list[Tensor]) -> None:
        """The u + g (c - u) reading of :meth:`_read_guidance` over the step's transformer ``outputs``."""
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
        hints = self._scale_hints()
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
            self.conditioning = {k: _detach_tree(v) for k, v in callback_kwargs.items() if k != "latents"}
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
        if step in self.general:
            return self.general[step].velocity(latents, guidance_scale)
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
