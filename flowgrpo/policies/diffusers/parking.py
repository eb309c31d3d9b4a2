"""The denoisers wait in host memory while ``model.precompute_prompts`` encodes the run's prompts.

Precomputation runs once, in the trainer's set-up, after the policy is on its device. The text
encoders (T5-XXL alone is about 9.5 GB in bf16) would otherwise sit beside the transformer for that
one moment, and for several recipes that moment is the run's peak (docs/recipes.md, "Memory per
GPU"). :func:`networks_in_host_memory` moves the transformer (and Wan 2.2's second expert, and a full
fine-tune's resident reference copy) to host memory for the encode and back afterwards, so the encode
phase holds the text encoders and the VAE, not the transformer.

Moves are in place (``Module.to`` keeps each ``Parameter`` object), so the optimizer, the EMA's
references and peft's layers still see the same parameters. It applies on CUDA only (on the CPU there
is nothing to move) and not to FSDP-sharded networks (their shards are 1/N of the weights already,
and moving DTensors is the engine's business). While parked, :attr:`policy.device` stays the device
the encodings are made on (``policy._parked_device``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def parkable_networks(policy) -> list[nn.Module]:
    """The networks that can wait in host memory during the encode: the transformer, a second expert
    (``transformer_2``) and a full fine-tune's frozen reference copy when it is resident (a streamed
    copy, ``model.reference_device=cpu``, lives in host memory already)."""
    nets = [policy.transformer, getattr(policy, "transformer_2", None)]
    if getattr(policy, "reference_device", "auto") != "cpu":
        nets.append(getattr(policy, "_frozen", None))
    return [m for m in nets if isinstance(m, nn.Module)]


def _sharded(nets: list[nn.Module]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for m in nets for p in m.parameters())


def parks_on(device: torch.device) -> bool:
    """Whether networks on ``device`` are parked during the encode (CUDA: their memory is what matters)."""
    return device.type == "cuda"


@contextlib.contextmanager
def networks_in_host_memory(policy):
    """Within the block, :func:`parkable_networks` of ``policy`` live in host memory and
    ``policy.device`` still names their device; afterwards they are back there. Yields the list of
    parked networks (empty where nothing moves: off CUDA, or FSDP-sharded)."""
    device = policy.device
    nets = parkable_networks(policy)
    if not parks_on(device) or _sharded(nets):
        yield []
        return
    policy._parked_device = device
    try:
        for m in nets:
            m.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back, so the encoders can use them
        yield nets
    finally:
        for m in nets:
            m.to(device)
        policy._parked_device = None
