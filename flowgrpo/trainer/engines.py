"""Where the denoiser's weights live in a run, and how an optimizer step is taken over them.

* :class:`ReplicatedWeights` (one process; data parallel with ``configs/accelerate/ddp*.yaml`` or
  ``--num-processes N``): every rank holds the whole model, and the trainer sums gradients over
  ranks once per optimizer step (:meth:`DataParallel.sum_gradients`).
* :class:`FullyShardedWeights` (an accelerate config with ``distributed_type: FSDP`` and
  ``fsdp_version: 2``, e.g. ``configs/accelerate/fsdp.yaml``): torch's ``fully_shard`` on every
  transformer block (the wrap unit) and on the denoiser itself. Each rank keeps 1/world of every
  weight, gradient and Adam moment; a block's weights are gathered inside its forward and
  backward, and gradients are reduce-scattered in backward. With ``fsdp_offload_params: true``
  (``configs/accelerate/fsdp_offload.yaml``) the shards, their gradients and the Adam step live in
  CPU memory (torch's ``CPUOffloadPolicy``): each block's shard is copied to the device for its
  forward and backward, and the optimizer steps on the CPU.
* :class:`~flowgrpo.trainer.deepspeed_zero.ZeroWeights` (``distributed_type: DEEPSPEED``, ZeRO
  stage 1 or 2, ``configs/accelerate/zero2.yaml``): whole weights on every rank, gradients and
  Adam moments partitioned by DeepSpeed.

Every engine has one contract for the update (:meth:`ReplicatedWeights.backward`,
:meth:`~ReplicatedWeights.accumulate`, :meth:`~ReplicatedWeights.step`) and for checkpoints
(:meth:`~ReplicatedWeights.full` and :meth:`~ReplicatedWeights.optimizer_state_dict` give whole
tensors in torch AdamW's layout, whatever the engine, so any run resumes on any number of processes
and any engine).

A sharded block gathers its weights with a collective, so every rank must run the same forwards
and backwards in the same order. The trainer keeps ranks in lock-step when :attr:`lockstep` is
set: equal tree shards (the rollout then makes the same model calls on every rank), zero-weight
padding passes where a rank has fewer update micro-batches than another, and evaluation,
checkpoint and export steps run on every rank (only the main process writes).

On the CPU accelerate itself reports MULTI_CPU for an FSDP or DeepSpeed config (its paths for them
are for accelerators); the launcher still exports the config as ``ACCELERATE_USE_FSDP`` / ``FSDP_*``
(``ACCELERATE_USE_DEEPSPEED`` / ``ACCELERATE_DEEPSPEED_*``) variables, which is what
:func:`flowgrpo.trainer.accelerator.weight_engine` reads, so both run (and are tested) with gloo too.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import ConfigError
from ..sharded_tensors import full_tensors, like_param


class ReplicatedWeights:
    """Every rank holds the whole model (1 process, or data parallel)."""

    #: whether ranks must run the same model calls in the same order (sharded weights)
    lockstep = False
    #: whether checkpoint state (:meth:`full`, :meth:`optimizer_state_dict`) is gathered by collectives
    #: that every rank must join
    collective_state = False
    name = "replicated"

    def __init__(self, dp):
        self.dp = dp
        self.optimizer = None

    # ------------------------------------------------------------------ set-up
    def prepare(self, policy) -> None:
        """Lay out ``policy``'s denoiser, before the optimizer sees its parameters (whole here)."""

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, policy, max_grad_norm: float) -> None:
        """Take ``optimizer`` (torch AdamW over ``policy.trainable_parameters()``) into the engine;
        :meth:`step` clips gradients to ``max_grad_norm``."""
        self.optimizer = self.dp.accelerator.prepare(optimizer)

    # ------------------------------------------------------------------ one optimizer step
    def accumulate(self) -> contextlib.AbstractContextManager:
        """Context around a step's backward passes (DeepSpeed reduces gradients once, on exit)."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate ``loss`` (a rank's share: rows weighted by 1 / rows on all ranks)."""
        self.dp.accelerator.backward(loss)

    def idle_passes(self, micro_batches: torch.Tensor) -> int:
        """Zero-loss passes this rank adds to a step, given every rank's micro-batch count [world]."""
        return 0

    def step(self, params: list[nn.Parameter], max_norm: float) -> float:
        """Sum gradients over ranks, clip them to ``max_norm`` and step; zero them for the next step.
        Returns the gradient norm before clipping."""
        self.dp.sum_gradients(params)
        norm = self.dp.accelerator.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(full_tensors(norm))

    # ------------------------------------------------------------------ checkpoints
    def full(self, obj):
        """``obj`` with whole tensors (checkpoints, exports); already whole here."""
        return obj

    def optimizer_state_dict(self) -> dict:
        """The optimizer's state in torch AdamW's layout with whole tensors."""
        return self.full(self.optimizer.state_dict())

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load a state of :meth:`optimizer_state_dict` (written by any engine and number of processes)."""
        self.optimizer.load_state_dict(state)

    def load_weights(self, policy, trainable: dict[str, torch.Tensor]) -> None:
        """Load whole trainable tensors (a checkpoint's) into ``policy``."""
        policy.load_trainable_state_dict(trainable)


class FullyShardedWeights(ReplicatedWeights):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) over the transformer blocks of the denoiser.

    Args:
        dp: the run's :class:`~flowgrpo.trainer.data_parallel.DataParallel`.
        plugin: accelerate's ``FullyShardedDataParallelPlugin`` (the launcher's FSDP settings).
    """

    lockstep = True
    collective_state = True
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
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

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
        offload = self.plugin.cpu_offload  # fsdp_offload_params: true -> CPUOffloadPolicy (accelerate's plugin)
        if isinstance(offload, CPUOffloadPolicy) and offload.pin_memory and self.dp.accelerator.device.type == "cpu":
            # pinning needs a CUDA driver, and only speeds copies to a device: a CPU run keeps pageable shards
            offload = CPUOffloadPolicy(pin_memory=False)
        if isinstance(offload, OffloadPolicy):
            options["offload_policy"] = offload
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(denoiser, **options)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, policy, max_grad_norm: float) -> None:
        # kept as it is: accelerate's FSDP2 prepare() insists on a model and an optimizer together (it
        # would shard the model itself); the optimizer was built over the sharded parameters already
        self.optimizer = optimizer

    def idle_passes(self, micro_batches: torch.Tensor) -> int:
        """As many passes as the busiest rank makes: every forward and backward is a collective."""
        return int(micro_batches.max() - micro_batches[self.dp.rank])

    def step(self, params: list[nn.Parameter], max_norm: float) -> float:
        # Every backward reduce-scattered its gradients as the mean over ranks; the trainer wants the
        # sum (it already weights every row by 1 / rows on all ranks). (FSDP's divide factor of 1
        # would say so directly, but needs a PREMUL_SUM reduction, which gloo lacks.)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(self.dp.world)
        norm = self.dp.accelerator.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(full_tensors(norm))

    def full(self, obj):
        """``obj`` with every sharded tensor gathered whole (a collective: call it on every rank)."""
        return full_tensors(obj)

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Whole-tensor moments sliced like this run's sharded parameters."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        out = dict(state)
        out["state"] = {idx: {k: like_param(v, params[idx]) if torch.is_tensor(v) and v.shape == params[idx].shape else v
                              for k, v in entry.items()} for idx, entry in state["state"].items()}
        self.optimizer.load_state_dict(out)
