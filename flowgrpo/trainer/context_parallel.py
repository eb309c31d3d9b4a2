"""Context parallelism (``dist.context_parallel=N``): one video's tokens split over N processes.

A Wan video at 480 px x 81 frames is 32,760 tokens per sample; the transformer's activations grow with
them, and a 14 B model's rollout and update run out of one GPU's memory on activations before weights.
Context parallelism splits the token sequence: the N processes of a *group* hold the same samples (the
same trees, prompts and noise: the trainer shards trees over groups, not processes,
:class:`~flowgrpo.trainer.data_parallel.DataParallel`), and each runs the transformer blocks on 1/N of
every sample's tokens.

The engine is diffusers' own (``ModelMixin.enable_parallelism`` with a ``ContextParallelConfig``, in
diffusers 0.36 and later; experimental there): the model's ``_cp_plan`` splits the hidden states at the
first block and the rotary embedding to match, and gathers the output of ``proj_out``, so every rank
of a group receives the whole velocity [B, C, F, h, w] and computes the same SDE log-probs and loss.
Self-attention runs as Ulysses attention: an all-to-all trades the token split for a head split, so
each rank attends over all tokens with 1/N of the heads, then trades back. Cross-attention needs no
exchange (the text tokens are whole on every rank). Ring attention is not offered: diffusers' ``native``
(torch SDPA) backend, the one that runs everywhere, does not return the log-sum-exp that its ring needs.

Gradients: the gather's backward hands each rank its own tokens' slice of the (identical) upstream
gradient, so a rank's backward yields the share of every weight's gradient that flowed through its
tokens; the shares add up to the 1-process gradient. The trainer's one all-reduce per optimizer step
therefore sums over every process (the groups' ranks and the data-parallel groups alike), with rows
weighted by the data-parallel groups' row count, and the optimizer step is the same on every rank.

What stays whole on every rank of a group: the text encoder, the patch and condition embedders (before
the split), the VAE decode, and the sampler's state; rewards are scored by each group's first rank only
and shared. Requirements, checked with one-line errors before anything runs: N divides the number of
processes, the adapter declares the split (:data:`SUPPORTED_ADAPTERS`), N divides the attention heads
and every sample's token count, the weight engine keeps whole weights (not FSDP / DeepSpeed), and the
attention backend is one diffusers runs Ulysses on (``sdpa``/``native`` here).

On the CPU (gloo) diffusers 0.42's ``enable_parallelism`` computes its device as ``rank %
torch.accelerator.device_count()``, which is 0 without an accelerator; :func:`enable` lets that count
read 1 for the call, and nothing else of diffusers is changed (gloo has the all-to-all and all-gather
Ulysses uses), which is what lets the CPU tests run the same engine as the GPUs.
"""

from __future__ import annotations

import contextlib
import logging
from unittest import mock

import torch
from torch import nn

from ..errors import ConfigError

#: adapters whose policies split their tokens (``context_parallel_networks`` and ``context_parallel_tokens``)
SUPPORTED_ADAPTERS = ("wan (Wan 2.1)", "pipeline with Wan transformers (Wan 2.2)")


def check_degree(degree: int, processes: int, engine_name: str) -> None:
    """ConfigError (one line) unless ``degree`` (``dist.context_parallel``) can split this launch:
    it divides ``processes`` and the weight engine (``engine_name``) keeps whole weights."""
    if degree == 1:
        return
    if processes % degree:
        raise ConfigError(f"dist.context_parallel={degree} must divide the number of processes ({processes}): "
                          f"launch a multiple of {degree} processes (flowgrpo train --num-processes {degree})")
    if engine_name != "replicated":
        raise ConfigError(f"dist.context_parallel={degree} runs with whole weights on every rank (DDP or "
                          f"--num-processes N), not with the {engine_name} engine of this accelerate config")


def check_policy(policy, degree: int, model_name: str) -> None:
    """ConfigError (one line) unless ``policy`` can split its tokens ``degree`` ways: an adapter that
    declares the split, heads and every sample's tokens divisible by ``degree``."""
    networks = policy.context_parallel_networks() if hasattr(policy, "context_parallel_networks") else []
    if not networks:
        raise ConfigError(f"dist.context_parallel={degree}: model.name={model_name!r} ({type(policy).__name__}) cannot "
                          f"split its tokens; supported adapters: {', '.join(SUPPORTED_ADAPTERS)}")
    tokens = policy.context_parallel_tokens()
    if tokens % degree:
        raise ConfigError(f"dist.context_parallel={degree} must divide a sample's {tokens} transformer tokens "
                          "(latent frames x latent height / 2 x latent width / 2): change model.num_frames or "
                          "model.resolution")
    for net in networks:
        heads = int(net.config.num_attention_heads)
        if heads % degree:
            raise ConfigError(f"dist.context_parallel={degree} must divide the transformer's {heads} attention heads "
                              "(Ulysses attention splits them)")


def device_mesh(degree: int, processes: int, device_type: str):
    """The run's device mesh [processes / degree, 1, degree] named ("dp", "ring", "ulysses"): each row of
    ``degree`` consecutive ranks is a context-parallel group (diffusers reads the last two dimensions)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (processes // degree, 1, degree), mesh_dim_names=("dp", "ring", "ulysses"))


def enable(policy, degree: int, processes: int, device: torch.device) -> None:
    """Split the tokens of every network of ``policy.context_parallel_networks()`` over groups of
    ``degree`` ranks (diffusers' Ulysses context parallelism, one mesh for all of them). Call after the
    policy is on ``device`` and before its first forward; ConfigError (one line) where diffusers refuses
    the attention backend."""
    from diffusers import ContextParallelConfig

    mesh = device_mesh(degree, processes, device.type)
    cp_mesh = mesh["ring", "ulysses"]
    for net in policy.context_parallel_networks():
        config = ContextParallelConfig(ulysses_degree=degree, mesh=cp_mesh)
        with _cpu_device_count(device), _quiet():
            try:
                net.enable_parallelism(config=config)
            except ValueError as e:  # e.g. an attention backend without context parallelism
                raise ConfigError(f"dist.context_parallel={degree}: diffusers refuses {type(net).__name__}: "
                                  f"{str(e).splitlines()[0]} (model.attention_backend sdpa or native run it)") from None


def _cpu_device_count(device: torch.device):
    """On the CPU, ``torch.accelerator.device_count()`` reads 1 (diffusers divides by it); elsewhere nothing."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return mock.patch.object(torch.accelerator, "device_count", lambda: 1)


@contextlib.contextmanager
def _quiet():
    """diffusers warns that ``enable_parallelism`` is experimental on every call: once in the docs suffices."""
    logger = logging.getLogger("diffusers.models.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def is_enabled(network: nn.Module) -> bool:
    """Whether ``network`` splits its tokens (diffusers' parallel config set on it)."""
    config = getattr(network, "_parallel_config", None)
    return config is not None and getattr(config, "context_parallel_config", None) is not None
