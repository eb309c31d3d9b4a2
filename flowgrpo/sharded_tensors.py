"""Tensors of a sharded model (FSDP2's DTensors) converted to whole tensors and back.

A fully sharded denoiser keeps each parameter as a ``DTensor``: every rank holds one slice
(``Shard(0)``: rows ``rank * ceil(n / world) ...``). Checkpoints, EMA exports and LoRA files hold
whole tensors, so a run can resume on another number of processes, or on one.
"""

from __future__ import annotations

from torch import Tensor


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed: nothing is ever sharded
        return None
    return DTensor


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor (a slice of a tensor spread over ranks)."""
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def full_tensors(obj):
    """``obj`` (nested dicts / lists / tuples of tensors and other values) with every DTensor
    replaced by its whole tensor.

    A collective when ``obj`` holds DTensors: every rank must call it with the same structure
    (the same keys in the same order), which holds for state dicts of the same model and optimizer."""
    if is_sharded(obj):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: full_tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(full_tensors(v) for v in obj)
    return obj


def like_param(t: Tensor, like: Tensor) -> Tensor:
    """Whole tensor ``t`` laid out as ``like``: this rank's slice as a DTensor when ``like`` is one
    (no communication: every rank holds the whole ``t``), else ``t`` itself on ``like``'s device."""
    if is_sharded(t) or not is_sharded(like):
        return t.to(like.device)
    from torch.distributed.tensor import distribute_tensor

    if tuple(t.shape) != tuple(like.shape):
        raise ValueError(f"tensor of shape {tuple(t.shape)} cannot take the place of one of shape {tuple(like.shape)}")
    return distribute_tensor(t.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)
