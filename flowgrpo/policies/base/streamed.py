"""A frozen copy of a network kept in CPU memory, its blocks visiting the device one at a time
(``model.reference_device=cpu``: full fine-tuning's reference model).

The blocks are the entries of the network's block lists (every ``nn.ModuleList`` child: SD3's
``transformer_blocks``, FLUX's ``transformer_blocks`` and ``single_transformer_blocks``, Wan's
``blocks``), which hold nearly all of a transformer's weights. Their parameters and buffers live on
the CPU (pinned where CUDA is present, so the copies to the device do not wait on pageable memory).
A forward pre-hook points a block's tensors at copies on the device of the block's inputs, made
for this call; a forward hook points them back at the CPU tensors: the device copies are dropped,
never copied back (the weights are frozen). Everything else (embedders, output norm and
projection, parameters of the network itself) is copied to the network's device and stays there:
small, and it keeps ``policy.device`` (read from the first parameter) the run's device.

So the device holds the non-block weights plus one block at a time, and every reference forward
copies all block weights host-to-device once: the same result as a resident copy (the same
float tensors, only moved), for memory traded against transfer time.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


def block_list_entries(network: nn.Module) -> list[nn.Module]:
    """Every entry of each ``nn.ModuleList`` child of ``network`` (its transformer blocks)."""
    return [block for child in network.children() if isinstance(child, nn.ModuleList) for block in child]


def _first_tensor_device(args, kwargs) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            return value.device
    return None


def _stream(block: nn.Module) -> None:
    """Hooks that bring ``block``'s (CPU) tensors to its inputs' device for each forward."""
    tensors = [*block.parameters(), *block.buffers()]
    homes = [t.data for t in tensors]

    def to_inputs_device(module, args, kwargs):
        device = _first_tensor_device(args, kwargs)
        if device is None or device.type == "meta":
            return None
        for t, home in zip(tensors, homes):
            # copy=True: a fresh tensor even where the device is the CPU, so the stored weights are never the
            # ones a forward sees (what the CPU tests check); non_blocking overlaps a pinned copy
            t.data = home.to(device, copy=True, non_blocking=True)
        return None

    def back_home(module, args, output):
        for t, home in zip(tensors, homes):
            t.data = home
        return None

    block.register_forward_pre_hook(to_inputs_device, with_kwargs=True)
    block.register_forward_hook(back_home)


def streamed_copy(network: nn.Module) -> nn.Module:
    """A frozen copy of ``network`` (no gradients) with its blocks in CPU memory, streamed per forward
    (module docstring); the rest on ``network``'s device. No device copy of the blocks is ever made
    here, so taking the copy costs no device memory beyond the non-block weights. ValueError for a
    network without block lists."""
    blocks = block_list_entries(network)
    if not blocks:
        raise ValueError(f"{type(network).__name__} has no block list (an nn.ModuleList child) to stream from the CPU")
    pin = torch.cuda.is_available()
    in_blocks = {id(t) for b in blocks for t in (*b.parameters(), *b.buffers())}

    def clone(t: Tensor) -> Tensor:
        if id(t) not in in_blocks:
            return t.detach().clone()
        out = t.detach().to("cpu", copy=True)
        return out.pin_memory() if pin else out

    # deepcopy with every tensor pre-copied (memo by id): the structure is copied, the tensors are ours
    memo: dict[int, object] = {}
    for p in network.parameters():
        memo[id(p)] = nn.Parameter(clone(p), requires_grad=False)
    for b in network.buffers():
        memo[id(b)] = clone(b)
    frozen = copy.deepcopy(network, memo).requires_grad_(False)
    for block in block_list_entries(frozen):
        _stream(block)
    return frozen
