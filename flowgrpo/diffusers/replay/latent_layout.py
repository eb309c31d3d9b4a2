"""How a pipeline's ``latents=`` argument maps to the sample its scheduler steps.

The generic adapter trains on the scheduler's sample [B, *sample_shape] (what ``scheduler.step``
receives: packed tokens for FLUX-style pipelines). Most pipelines also take their ``latents=``
argument in that layout (FLUX.1, Qwen-Image, SD3, Z-Image, Wan), but some take it in the layout they
draw their noise in and rearrange it themselves (FLUX.2: [B, 4C, h, w], packed into [B, h*w, 4C]
after ``latents=`` is read). Decoding through the pipeline's own tail and comparing with the stock
pipeline for the same initial noise both need the map between the two.

:func:`learn_layout` finds it by running the pipeline up to its first scheduler step (transformer
stubbed): first with the probe's own sample as ``latents=`` (the same layout when the step receives
it unchanged), otherwise with ``latents=`` in the shape of the noise the pipeline draws
(``randn_tensor`` of its module), whose entries are the digits of their own flat index. The sample
the step receives then says, entry by entry, which input entry it came from. The digits are small
integers, exact in the pipeline's dtype (bfloat16 too), so a few passes give any permutation.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from .step_record import _patched, record_pipeline


@dataclass
class LatentLayout:
    """The map between the scheduler's sample [B, *sample_shape] and ``latents=`` [B, *input_shape].

    ``index`` [n] (long, n = numel of one sample) is None when the layouts are the same; otherwise
    ``sample.flatten(1)[:, i] = input.flatten(1)[:, index[i]]``.
    """

    sample_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    index: Tensor | None = None

    def to_pipeline(self, x: Tensor) -> Tensor:
        """Samples [B, *sample_shape] -> the pipeline's ``latents=`` [B, *input_shape]."""
        if self.index is None:
            return x
        flat = x.reshape(x.shape[0], -1)
        out = torch.empty_like(flat)
        out[:, self.index.to(x.device)] = flat
        return out.reshape(x.shape[0], *self.input_shape)

    def from_pipeline(self, z: Tensor) -> Tensor:
        """The pipeline's ``latents=`` [B, *input_shape] -> samples [B, *sample_shape]."""
        if self.index is None:
            return z
        flat = z.reshape(z.shape[0], -1)
        return flat[:, self.index.to(z.device)].reshape(z.shape[0], *self.sample_shape)


def _noise_shape(pipeline, call_kwargs: dict, experts: tuple[str, ...]) -> tuple[int, ...] | None:
    """The per-sample shape of the noise the pipeline draws with its module's ``randn_tensor`` (None:
    it draws none that way)."""
    module = sys.modules[type(pipeline).__module__]
    real = getattr(module, "randn_tensor", None)
    if real is None:
        return None
    shapes = []

    @functools.wraps(real)
    def randn_tensor(shape, *args, **kwargs):
        shapes.append(tuple(shape))
        return real(shape, *args, **kwargs)

    with _patched(module, "randn_tensor", randn_tensor):
        record_pipeline(pipeline, call_kwargs, max_steps=1, run_transformer=False, experts=experts)
    return shapes[0][1:] if shapes else None


def _stepped(pipeline, call_kwargs: dict, latents: Tensor, experts: tuple[str, ...]) -> Tensor | None:
    """The sample the first scheduler step receives for ``latents=latents`` (None: the pipeline refused them)."""
    try:
        rec = record_pipeline(pipeline, {**call_kwargs, "latents": latents}, max_steps=1, run_transformer=False,
                              experts=experts)
    except (RuntimeError, ValueError, IndexError):
        return None
    return rec.steps[0].sample if rec.steps else None


def learn_layout(pipeline, call_kwargs: dict, sample: Tensor, dtype: torch.dtype,
                 experts: tuple[str, ...] = ("transformer",)) -> LatentLayout:
    """The :class:`LatentLayout` of ``pipeline`` for the one-prompt call ``call_kwargs``, given the
    probe's sample [1, ...] of that call; ``dtype`` is the pipeline's latent dtype (the digit base
    is the largest integer it holds exactly), ``experts`` its denoisers (stubbed while learning).
    ValueError when ``latents=`` is neither the sample's layout nor a rearrangement of the noise the
    pipeline draws."""
    shape = tuple(sample.shape[1:])
    got = _stepped(pipeline, call_kwargs, sample.clone(), experts)
    if got is not None and got.shape == sample.shape and torch.equal(got.float(), sample.float()):
        return LatentLayout(shape, shape)
    noise = _noise_shape(pipeline, call_kwargs, experts)
    n = sample[0].numel()
    if noise is None or math.prod(noise) != n:
        raise ValueError(f"its latents= argument is not in the layout of the scheduler's sample {list(shape)} and "
                         f"no noise of {n} entries was seen to rearrange (drawn noise: {noise})")
    base = int(2.0 / torch.finfo(dtype).eps)  # integers up to here are exact in dtype
    flat = torch.arange(n)
    index = torch.zeros(n, dtype=torch.long)
    scale = 1
    while scale < n:
        digits = (flat // scale) % base
        got = _stepped(pipeline, call_kwargs, digits.to(torch.float32).reshape(1, *noise), experts)
        if got is None or got.shape != sample.shape:
            raise ValueError(f"its latents= argument of shape {list(noise)} did not reach the scheduler as a "
                             f"sample of shape {list(shape)}")
        index += got.reshape(-1).float().round().long() * scale
        scale *= base
    if not torch.equal(index.sort().values, flat):
        raise ValueError("its latents= argument reaches the scheduler transformed, not only rearranged")
    return LatentLayout(shape, tuple(noise), index)
