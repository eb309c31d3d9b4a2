"""Rollouts with the LoRA adapter folded into the base weights (a speed switch of the sampler).

A peft LoRA layer computes ``W x + s B (A x)``: two extra matmuls per targeted linear and per call,
plus peft's Python dispatch. A rollout runs without gradients, so the adapter can be folded in for
its duration: ``W' = W + s B A`` once per rollout (one small matmul per layer), then ``W' x`` per
call. On the tiny SD3 (width 64, rank 32) this removes about a sixth of a forward; on a real model
the adapter's share is smaller but its per-layer dispatch remains, on CUDA as on the CPU.

:func:`lora_merged` is exact up to float rounding (``W' x`` and ``W x + s B A x`` round
differently, ~1e-7 relative in float32). The base weights are **copied back**, not unmerged by
subtraction (``(W + D) - D`` is not ``W`` in floating point), so the model after the context is the
model before it, bit for bit, and no drift accumulates over iterations.

It folds nothing (and is a no-op) where folding would not be exact or safe: base weights that
are not float32 (folding into bf16 / fp16 would round the adapter's float32 update away), sharded
parameters (FSDP DTensors, DeepSpeed ZeRO partitions), DoRA layers, adapters already merged or
disabled, and when gradients are enabled.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def lora_layers(module: nn.Module) -> list:
    """The peft LoRA layers of ``module`` (empty without peft)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return []
    return [m for m in module.modules() if isinstance(m, LoraLayer)]


def foldable_layer(layer) -> bool:
    """Whether ``W + s B A`` of this peft LoRA layer is exactly what its forward computes, in float32:
    a plain ``nn.Linear`` base with an unsharded float32 weight, active adapters without DoRA, LoRA
    bias, dropout or another peft variant, and not merged already."""
    base = layer.get_base_layer()
    w = getattr(base, "weight", None)
    if not isinstance(base, nn.Linear) or not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
        return False
    if type(w).__name__ == "DTensor" or hasattr(w, "ds_id") or w.numel() == 0:  # sharded (FSDP, ZeRO-3)
        return False
    if layer.merged or getattr(layer, "fan_in_fan_out", False):
        return False
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    plain = all(not layer.use_dora.get(a, False) and not getattr(layer, "lora_bias", {}).get(a, False)
                and a not in getattr(layer, "lora_variant", {})
                and isinstance(layer.lora_dropout[a], nn.Identity) for a in active)
    return bool(active) and plain


@contextlib.contextmanager
def lora_merged(module: nn.Module | None, enabled: bool = True):
    """Inside: every foldable peft LoRA layer of ``module`` runs as one linear with ``W + s B A``.

    Yields the number of layers folded (0: nothing applies, the model runs as it is). On exit the
    saved base weights are copied back and the layers are marked unmerged.
    """
    if not enabled or module is None or torch.is_grad_enabled():
        yield 0
        return
    layers = lora_layers(module)
    if not layers or any(m.disable_adapters for m in layers) or not all(foldable_layer(m) for m in layers):
        yield 0  # all or nothing: one consistent model
        return
    saved = [(m, m.get_base_layer().weight.detach().clone()) for m in layers]
    try:
        for m, _ in saved:
            m.merge(safe_merge=False)
        yield len(saved)
    finally:
        with torch.no_grad():
            for m, w in saved:
                m.get_base_layer().weight.copy_(w)
                m.merged_adapters.clear()
