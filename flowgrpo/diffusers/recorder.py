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
"""

from __future__ import annotations

import torch
from torch import Tensor

#: denoiser attributes of a pipeline that get a forward pre-hook (Wan 2.2 has two experts)
DENOISERS = ("transformer", "transformer_2")


def _detach(value):
    return value.detach() if isinstance(value, Tensor) else value


class StepRecorder:
    """Callable with diffusers' ``callback_on_step_end`` signature ``(pipe, i, t, kwargs) -> kwargs``.

    Attributes:
        latents: per step i, the latents after step i ([B, ...], detached; packed for FLUX).
        timesteps: per step, the scheduler timestep (float).
        conditioning: the non-latent callback tensors of the first step (detached), e.g.
            {"prompt_embeds": [B', L, D], "pooled_prompt_embeds": [B', D]}; with classifier-free
            guidance SD3 exposes the concatenated [uncond; cond] tensors (B' = 2B).
        calls: per step, a list of (denoiser, kwargs) of each transformer call of that step.
        guidance_scale: the pipeline's guidance scale (None when it has none), read at step 0.
        cfg: whether the pipeline did classifier-free guidance.
    """

    def __init__(self):
        self.latents: list[Tensor] = []
        self.timesteps: list[float] = []
        self.conditioning: dict[str, Tensor] = {}
        self.calls: list[list[tuple[torch.nn.Module, dict]]] = []
        self.guidance_scale: float | None = None
        self.cfg = False
        self._hooks: list = []

    # ------------------------------------------------------------------ wiring
    @staticmethod
    def tensor_inputs(pipe) -> list[str]:
        """The names to pass as ``callback_on_step_end_tensor_inputs``: all the pipeline exposes."""
        return list(getattr(pipe, "_callback_tensor_inputs", ["latents"]))

    def attach(self, pipe) -> "StepRecorder":
        """Hook the pipeline's denoiser(s) to record each call's keyword arguments; returns self."""
        self.detach()
        for name in DENOISERS:
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                self._hooks.append(module.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        return self

    def detach(self) -> None:
        """Remove the hooks (the recorded data stays)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _pre_hook(self, module, args, kwargs):
        if args:
            raise TypeError("StepRecorder expects the pipeline to call its transformer with keyword arguments")
        step = len(self.latents)  # callbacks so far = index of the running step
        while len(self.calls) <= step:
            self.calls.append([])
        self.calls[step].append((module, {k: _detach(v) for k, v in kwargs.items()}))

    def __call__(self, pipe, step_index: int, timestep, callback_kwargs: dict) -> dict:
        if step_index == 0:
            self.conditioning = {k: _detach(v) for k, v in callback_kwargs.items() if k != "latents"}
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
        ``latents`` (repeated when the pipeline batched [uncond; cond]). One call of batch 2B:
        v = u + g (c - u) with (u, c) its halves; two calls (Wan, FLUX true CFG): the first is the
        conditional one, the second the unconditional one. Returns [B, ...] float32.
        """
        calls = self.calls[step]
        g = self.guidance_scale if guidance_scale is None else guidance_scale
        outs = []
        for module, kwargs in calls:
            rec = kwargs["hidden_states"]
            reps = rec.shape[0] // latents.shape[0]
            x = latents.to(rec.dtype)
            kw = dict(kwargs, hidden_states=torch.cat([x] * reps) if reps > 1 else x)
            out = module(**kw)
            out = out[0] if isinstance(out, tuple) else out.sample
            outs.append(out.float())
        if len(outs) == 1 and outs[0].shape[0] == 2 * latents.shape[0]:
            u, c = outs[0].chunk(2)
            return u + g * (c - u)
        if len(outs) == 2:
            c, u = outs
            return u + g * (c - u)
        return outs[0]

    def latents_in(self, step: int, initial: Tensor) -> Tensor:
        """The latents [B, ...] step ``step`` started from (``initial`` for step 0)."""
        return initial if step == 0 else self.latents[step - 1]
