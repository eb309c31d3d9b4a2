"""Peak working memory of the rollout's no-grad calls, counted on the meta device.

A rollout step is a no-grad transformer forward of the rollout micro-batch (CFG: the conditional
and unconditional halves in one call); each finished batch of samples is decoded by the VAE. Neither
keeps tensors for backward, so what they need on top of the weights is the largest set of tensors
alive at once during the call. :func:`no_grad_peak` measures that with torch's own
``torch.distributed._tools.mem_tracker.MemTracker``'s method (every tensor storage an op makes is
tracked from creation to release through a weak reference; MemTracker itself refuses a module
called twice in one forward, which the VAEs' causal convolutions are) while the real-size module runs on ``meta`` tensors: no memory is allocated, nothing is
extrapolated. Attention runs through the memory-efficient stand-in of
:mod:`flowgrpo.realsize.activations` (q, k, v, out and a float32 log-sum-exp; never the L x L scores),
as a GPU kernel keeps it.
"""

from __future__ import annotations

import weakref
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from .activations import CPU_FIT, Geometry, _flash_attention, example_inputs, latent_grid
from .configs import RealTransformer


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage an op creates until the storage is released (a weak
    reference per storage, as torch's own ``MemTracker`` keeps them); :attr:`peak` is the largest sum."""

    def __init__(self, existing=()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen = WeakIdKeyDictionary()
        for t in existing:  # weights and inputs: views of them (a transposed weight) allocate nothing
            self.seen[t.untyped_storage()] = None

    def _release(self, nbytes: int, _ref) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st not in self.seen:
                    n = st.nbytes()
                    self.seen[st] = weakref.ref(st, partial(self._release, n))
                    self.live += n
        self.peak = max(self.peak, self.live)
        return out


def no_grad_peak(call, modules=(), inputs=None) -> int:
    """Bytes of the largest set of tensors alive at once while ``call()`` runs without gradients; the
    parameters and buffers of ``modules`` and the tensors in ``inputs`` (made before the call) are not
    counted, nor is anything that views them."""
    existing = [t for m in modules for t in (*m.parameters(), *m.buffers())] + tree_flatten(inputs)[0]
    counter = _LiveBytes([t for t in existing if isinstance(t, torch.Tensor)])
    with _flash_attention(), torch.no_grad(), counter:
        out = call()
    del out
    return counter.peak


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o) for o in obj.values())
    return 0


def rollout_forward_peak(model: torch.nn.Module, entry: RealTransformer, geo: Geometry,
                         dtype: torch.dtype = torch.bfloat16) -> int:
    """Peak bytes of one no-grad forward of ``model`` (``entry``'s transformer, meta) on a batch of
    ``geo`` (``geo.batch``: the rollout micro-batch with both CFG halves), its inputs included. A class
    whose forward branches on tensor values (:data:`~flowgrpo.realsize.activations.CPU_FIT`) is counted
    by :func:`rollout_peak_fit` instead."""
    if entry.class_name in CPU_FIT:
        return rollout_peak_fit(entry, geo, dtype)
    inputs, _ = example_inputs(entry, geo, device="meta", dtype=dtype)
    model.eval()
    peak = no_grad_peak(lambda: model(**inputs, return_dict=False), [model], inputs)
    return peak + _tensor_bytes(inputs)


#: latent sides of :func:`rollout_peak_fit`'s three CPU forwards
SIDES = (4, 8, 12)


def rollout_peak_fit(entry: RealTransformer, geo: Geometry, dtype: torch.dtype = torch.bfloat16) -> int:
    """:func:`rollout_forward_peak` of a class that cannot run on meta tensors (HunyuanVideo 1.5 asks
    whether its image embeddings are all zero), from three CPU forwards of one block at the real width,
    text length and frames, at latent sides :data:`SIDES`, extrapolated in the image tokens by the
    quadratic through them (its joint attention takes a [B, L, L] mask, so the peak has a square term;
    a memory-efficient kernel keeps the rest linear). A no-grad forward frees each block's tensors
    before the next, so its peak does not grow with depth."""
    from .configs import build_transformer

    frames, side, spatial = latent_grid(entry, geo)
    points = {}
    model = build_transformer(entry, device="cpu", dtype=dtype, num_layers=1).eval()
    for n_side in SIDES:  # the real frames (the temporal rotary terms are per frame), small sides
        small = Geometry(n_side * spatial, geo.frames, geo.text_tokens, geo.batch, geo.reference)
        inputs, n = example_inputs(entry, small, device="cpu", dtype=dtype)
        points[n] = no_grad_peak(lambda: model(**inputs, return_dict=False), [model], inputs) + _tensor_bytes(inputs)
    n_real = frames * side * side
    # the quadratic through the three points (Lagrange): the masked joint attention's [B, L, L] mask
    # grows with the square of the tokens (L = image + text)
    total = 0.0
    for i, (ni, pi) in enumerate(points.items()):
        w = 1.0
        for j, nj in enumerate(points):
            if j != i:
                w *= (n_real - nj) / (ni - nj)
        total += w * pi
    return int(total)


def vae_latent(vae: torch.nn.Module, entry: RealTransformer, geo: Geometry, batch: int,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The meta latent that ``vae.decode`` takes for ``batch`` samples of ``geo``: [B, C, h, w], or
    [B, C, F_lat, h, w] for the video VAEs (and Qwen-Image's, which is one)."""
    frames, side, _ = latent_grid(entry, geo)
    cfg = vae.config
    channels = cfg.get("latent_channels") or cfg.get("z_dim")
    video = type(vae).__name__ in ("AutoencoderKLWan", "AutoencoderKLQwenImage", "AutoencoderKLHunyuanVideo15")
    shape = (batch, channels, frames, side, side) if video else (batch, channels, side, side)
    return torch.empty(*shape, device="meta", dtype=dtype)


def vae_decode_peak(vae: torch.nn.Module, entry: RealTransformer, geo: Geometry, batch: int,
                    dtype: torch.dtype = torch.bfloat16) -> int:
    """Peak bytes of ``vae.decode`` (meta) on ``batch`` samples of ``geo`` (the adapter's decode chunk),
    the decoded pixels included."""
    z = vae_latent(vae, entry, geo, batch, dtype)
    vae.eval()
    return no_grad_peak(lambda: vae.decode(z, return_dict=False), [vae], z) + _tensor_bytes(z)
