"""Replaying a recorded pipeline step whatever its transformer's signature and guidance scheme.

:class:`~flowgrpo.diffusers.recorder.StepRecorder` replays SD3, FLUX.1 and Wan 2.1 steps itself
(``hidden_states`` keyword, plain CFG u + g (c - u)). Other pipelines call their transformer
positionally (Z-Image), pass the sample as a list or with extra channels (HunyuanVideo 1.5) or with a
reference image's tokens appended (FLUX.1-Kontext), and combine the outputs otherwise (Z-Image's
negated c + g (c - u), Qwen-Image's true CFG with norm rescale). For those the recorder uses the
generic adapter's pieces: a :class:`~flowgrpo.diffusers.replay.call_replay.CallLayout` learnt from each
recorded call and the step's sample rebuilds the call on new latents, and
:func:`~flowgrpo.diffusers.replay.velocity_combine.infer_combine` finds the scheme that turns the recorded
outputs into exactly the velocity the pipeline stepped with. Every argument other than the latent
input (timesteps included) is replayed as recorded, since a step is replayed at its own time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .replay.call_replay import CallLayout, sample_part
from .replay.step_record import TransformerCall
from .replay.velocity_combine import Combine, infer_combine


def latent_key(call: TransformerCall):
    """The key of the call's latent input: the keyword ``hidden_states`` (or ``x``), else position 0."""
    for key in ("hidden_states", "x"):
        if key in call.kwargs:
            return key
    if call.args:
        return 0
    raise ValueError("the transformer was called without hidden_states or a positional latent input")


@dataclass
class GeneralStep:
    """One recorded step, replayable on new latents [B, ...] with gradients.

    Attributes:
        modules: the denoiser of each call, in call order.
        layouts: how each call is rebuilt; encodings: its recorded conditioning rows.
        rule: the guidance scheme; guidance: its scale (None for a single output).
    """

    modules: list[torch.nn.Module]
    layouts: list[CallLayout]
    encodings: list[dict[str, Tensor]]
    rule: Combine
    guidance: float | None

    def velocity(self, latents: Tensor, guidance_scale: float | None = None) -> Tensor:
        """The step's velocity [B, ...] float32 at ``latents`` [B, ...] (``guidance_scale`` overrides the
        recorded scale)."""
        t = torch.zeros(latents.shape[0])  # unused: the timesteps are replayed as recorded
        parts = torch.cat([lay.call(mod, latents, t, enc) for mod, lay, enc in
                           zip(self.modules, self.layouts, self.encodings)])
        g = guidance_scale if guidance_scale is not None else self.guidance
        return self.rule(parts, 1.0 if g is None else g).reshape(latents.shape)


def learn_step(calls: list[tuple[torch.nn.Module, TransformerCall]], sample: Tensor, velocity: Tensor,
               scales: list[float]) -> GeneralStep | str:
    """A :class:`GeneralStep` from one step's ``calls`` (each with its recorded ``output``), the
    ``sample`` [B, ...] the scheduler stepped and the ``velocity`` [B, ...] it stepped with, trying the
    guidance ``scales``; else a one-line reason why the step cannot be replayed."""
    b = sample.shape[0]
    layouts, encodings, parts = [], [], []
    try:
        for i, (_, call) in enumerate(calls):
            lay = CallLayout.learn(i, call, sample, latent_key(call), None)
            layouts.append(lay)
            encodings.append(lay.conditioning(call, b))
            parts.append(sample_part(call.output, tuple(sample.shape[1:])).reshape(lay.k, b, *sample.shape[1:]))
    except ValueError as exc:
        return f"its transformer call cannot be replayed: {exc}"
    stacked = torch.cat(parts)
    for g in (scales or [1.0]) if stacked.shape[0] > 1 else [None]:
        rule = infer_combine(stacked, 1.0 if g is None else g, velocity)
        if rule is not None:
            return GeneralStep([m for m, _ in calls], layouts, encodings, rule, None if rule.kind == "single" else g)
    return (f"no guidance scheme over its {stacked.shape[0]} transformer output(s) gives the velocity it stepped "
            f"with (scales tried: {scales or 'none'}; skip-layer guidance? guidance rescale?)")
