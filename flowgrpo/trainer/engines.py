"""Where the denoiser's weights live in a run: whole on every rank, or sharded over ranks (FSDP2).

* :class:`ReplicatedWeights` (one process; data parallel with ``configs/accelerate/ddp*.yaml`` or
  ``--num-processes N``): every rank holds the whole model, and the trainer sums gradients over
  ranks once per optimizer step (:meth:`DataParallel.sum_gradients`).
* :class:`FullyShardedWeights` (an accelerate config with ``distributed_type: FSDP`` and
  ``fsdp_version: 2``, e.g. ``configs/accelerate/fsdp.yaml``): torch's ``fully_shard`` on every
  transformer block (the wrap unit) and on the denoiser itself. Each rank keeps 1/world of every
  weight, gradient and Adam moment; a block's weights are gathered inside its forward and
  backward, and gradients are reduce-scattered in backward.

A sharded block gathers its weights with a collective, so every rank must run the same forwards
and backwards in the same order. The trainer keeps ranks in lock-step when :attr:`lockstep` is
set: equal tree shards (the rollout then makes the same model calls on every rank), zero-weight
padding passes where a rank has fewer update micro-batches than another, and evaluation,
checkpoint and export steps run on every rank (only the main process writes).

On the CPU accelerate itself reports MULTI_CPU for an FSDP config (its FSDP path is for
accelerators); the launcher still exports the config as ``ACCELERATE_USE_FSDP`` / ``FSDP_*``
variables, which is what :func:`weight_engine` reads, so FSDP runs (and is tested) with gloo too.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..errors import ConfigError
from ..sharded_tensors import full_tensors, like_param


class ReplicatedWeights:
    """Every rank holds the whole model (1 process, or data parallel)."""

    #: whether ranks must run the same model calls in the same order
    lockstep = False
    name = "replicated"

    def __init__(self, dp):
        self.dp = dp

    def prepare(self, policy) -> None:
        """Lay out ``policy``'s denoiser (nothing to do: it stays whole)."""

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """Make every gradient the sum over ranks (before clipping and the optimizer step)."""
        self.dp.sum_gradients(params)

    def full(self, obj):
        """``obj`` with whole tensors (checkpoints, exports); already whole here."""
        return obj

    def optimizer_state(self, state: dict, optimizer) -> dict:
        """A checkpoint's optimizer state laid out for this run's parameters."""
        return state


class FullyShardedWeights(ReplicatedWeights):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) over the transformer blocks of the denoiser.

    Args:
        dp: the run's :class:`~flowgrpo.trainer.data_parallel.DataParallel`.
        plugin: accelerate's ``FullyShardedDataParallelPlugin`` (the launcher's FSDP settings).
    """

    lockstep = True
    name = "fsdp"

    def __init__(self, dp, plugin):
        super().__init__(dp)
        if int(plugin.fsdp_version) != 2:
            # FSDP1 replaces the module by a wrapper; the trainer calls the policy's own methods
            raise ConfigError(f"accelerate FSDP config: fsdp_version {plugin.fsdp_version} is not supported; "
                              "flowgrpo shards with FSDP2: set fsdp_version: 2 (see configs/accelerate/fsdp.yaml)")
        self.plugin = plugin

    def prepare(self, policy) -> None:
        """Shard ``policy.denoiser``: every block whose class is in ``fsdp_transformer_layer_cls_to_wrap``
        (default: the model's ``_no_split_modules``, its transformer blocks), then the denoiser."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import OffloadPolicy, fully_shard

        denoiser = policy.denoiser
        wanted = list(self.plugin.transformer_cls_names_to_wrap or getattr(denoiser, "_no_split_modules", None) or [])
        present = sorted({type(m).__name__ for m in denoiser.modules()})
        blocks = [m for m in denoiser.modules() if type(m).__name__ in wanted]
        if not blocks:
            raise ConfigError(f"accelerate FSDP config: no module of {type(denoiser).__name__} is a "
                              f"{' or '.join(wanted) or '(no class named)'}; set fsdp_transformer_layer_cls_to_wrap "
                              f"to its block classes (its module classes: {', '.join(present)})")
        mesh = init_device_mesh(self.dp.accelerator.device.type, (self.dp.world,))
        options = {"mesh": mesh, "reshard_after_forward": bool(self.plugin.reshard_after_forward)}
        if isinstance(self.plugin.cpu_offload, OffloadPolicy):
            options["offload_policy"] = self.plugin.cpu_offload
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(denoiser, **options)

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """Every backward reduce-scattered its gradients as the mean over ranks; the trainer wants the
        sum (it already weights every row by 1 / rows on all ranks). (FSDP's divide factor of 1 would
        say so directly, but needs a PREMUL_SUM reduction, which gloo lacks.)"""
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(self.dp.world)

    def full(self, obj):
        """``obj`` with every sharded tensor gathered whole (a collective: call it on every rank)."""
        return full_tensors(obj)

    def optimizer_state(self, state: dict, optimizer) -> dict:
        """The whole-tensor moments of a checkpoint sliced like this run's sharded parameters."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        out = dict(state)
        out["state"] = {idx: {k: like_param(v, params[idx]) if torch.is_tensor(v) and v.shape == params[idx].shape else v
                              for k, v in entry.items()} for idx, entry in state["state"].items()}
        return out


def weight_engine(accelerator, dp) -> ReplicatedWeights:
    """The weight layout the launch asked for: FSDP2 when the accelerate config says FSDP and the run
    has several processes, else whole weights on every rank."""
    kind = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    wants_fsdp = kind == "FSDP" or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not wants_fsdp or dp.world == 1:
        return ReplicatedWeights(dp)
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None:  # on the CPU accelerate keeps MULTI_CPU: the plugin reads the launcher's FSDP_* variables
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()
    return FullyShardedWeights(dp, plugin)
