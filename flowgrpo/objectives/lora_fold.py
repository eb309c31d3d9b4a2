"""The update's forward with a LoRA layer computed as one linear with ``W + s B A`` (``train.fold_lora``).

peft's LoRA linear computes ``y = W x + s B (A x)`` for x of N tokens [N, in] (A [r, in], B [out, r]).
Its extra work per token, forward and backward, is ``3 r (in + out)`` multiply-adds (``A x`` and
``B (A x)``; their input gradients; the gradients of A and B). Folded, ``y = (W + s B A) x``: no
extra work per token for the product and the input gradient, but the gradient of the folded weight
``g^T x`` costs ``in * out`` per token (the frozen W alone needs none), and building ``W + s B A``
and taking A's and B's gradients from it cost ``3 r in out`` per call. Hence the rule of
``fold_lora="auto"``, checked per layer and call::

    fold  iff  N * in * out + 3 * r * in * out  <  3 * N * r * (in + out)

i.e. when the rank is a large share of the layer's width (``r > in out / (3 (in + out))`` for many
tokens): the tiny test models (width 64, rank 32: every layer folds, about 30 % less forward +
backward time on the CPU), never a real model's wide layers (SD3.5-M, width 1536, rank 32 would need
r > 256), which keep peft's path. The rule is FLOPs, so it holds alike on CUDA.

The gradients of A and B are those of peft's path up to float rounding (the chain rule through
``W + s B A``). Layers that :func:`~flowgrpo.samplers.lora_merge.foldable_layer` rejects (not
float32, sharded, DoRA, dropout, ...) and models with gradient checkpointing (its recomputation
would run outside this context) always keep peft's path; a layer whose adapters are disabled (the KL
reference pass) runs its base layer.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..samplers.lora_merge import foldable_layer, lora_layers

FOLD_MODES = ("auto", "always", "never")


def fold_wins(tokens: int, fan_in: int, fan_out: int, rank: int) -> bool:
    """The ``auto`` rule (module docstring): whether folding does fewer multiply-adds for this call."""
    folded = tokens * fan_in * fan_out + 3 * rank * fan_in * fan_out
    return folded < 3 * tokens * rank * (fan_in + fan_out)


def _folded_forward(always: bool):
    def forward(self, x: torch.Tensor, *args, **kwargs):
        if self.disable_adapters or args or kwargs:  # the base model, or a call peft must handle itself
            return type(self).forward(self, x, *args, **kwargs)
        base = self.get_base_layer()
        active = [a for a in self.active_adapters if a in self.lora_A]
        rank = sum(self.r[a] for a in active)
        if not always and not fold_wins(x.numel() // base.in_features, base.in_features, base.out_features, rank):
            return type(self).forward(self, x)
        weight = base.weight
        for a in active:
            weight = weight + self.scaling[a] * (self.lora_B[a].weight @ self.lora_A[a].weight)
        return F.linear(x.to(weight.dtype), weight, base.bias).to(x.dtype)

    return forward


@contextlib.contextmanager
def lora_folded(module: nn.Module | None, mode: str = "auto"):
    """Inside: ``module``'s foldable LoRA layers run folded (``mode`` "always"), folded where
    :func:`fold_wins` (``"auto"``), or as peft runs them (``"never"``). Yields the layers patched."""
    if mode not in FOLD_MODES:
        raise ValueError(f"fold_lora must be one of {FOLD_MODES}, got {mode!r}")
    if mode == "never" or module is None or getattr(module, "is_gradient_checkpointing", False):
        yield 0
        return
    layers = [m for m in lora_layers(module) if foldable_layer(m)]
    forward = _folded_forward(always=mode == "always")
    for m in layers:
        m.forward = types.MethodType(forward, m)  # an instance attribute: the class's forward is untouched
    try:
        yield len(layers)
    finally:
        for m in layers:
            del m.forward
