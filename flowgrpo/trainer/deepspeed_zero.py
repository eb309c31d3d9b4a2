"""DeepSpeed ZeRO stage 1 / 2: whole weights on every rank, gradients and Adam moments partitioned.

Selected by an accelerate config with ``distributed_type: DEEPSPEED`` (``configs/accelerate/zero2.yaml``).
DeepSpeed takes the denoiser and the trainer's AdamW (``deepspeed.initialize``); the policy keeps
calling its own modules, since ZeRO 1/2 leave the weights whole and whole on every rank. What the
trainer's update needs from it:

* one gradient reduction per optimizer step, whatever the number of backward passes a rank makes:
  the backward passes of a step run inside ``coalesce_grad_reduction`` (each rank's row count per
  minibatch differs, and ZeRO-2's per-backward reduction would need equal counts);
* a rank with no rows in a minibatch still makes one (zero-loss) backward pass, because the
  reduction on exit expects a gradient from every rank;
* DeepSpeed averages gradients over ranks; the trainer wants the sum (it weights every row by
  1 / rows on all ranks), so losses are scaled by the number of processes;
* clipping is DeepSpeed's (``gradient_clipping`` = ``train.max_grad_norm``).

Checkpoints keep torch AdamW's layout with whole tensors (``safe_get_full_optimizer_state``), as
every other engine writes, so a ZeRO run resumes on any number of processes and engines.
ZeRO stage 3 partitions the weights too: use FSDP (``configs/accelerate/fsdp.yaml``) for that.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from ..errors import ConfigError
from .engines import ReplicatedWeights

#: AdamW's per-parameter state that DeepSpeed partitions
_MOMENTS = ("exp_avg", "exp_avg_sq")


class ZeroWeights(ReplicatedWeights):
    """DeepSpeed ZeRO (stage 1 or 2) over the denoiser's trainable parameters.

    Args:
        dp: the run's :class:`~flowgrpo.trainer.data_parallel.DataParallel`.
        plugin: accelerate's ``DeepSpeedPlugin`` (the launcher's DeepSpeed settings).
    """

    collective_state = True  # gathering partitioned moments is a collective
    name = "deepspeed"

    def __init__(self, dp, plugin):
        super().__init__(dp)
        stage = int(plugin.zero_stage)
        if stage not in (1, 2):
            raise ConfigError(f"accelerate DeepSpeed config: zero_stage {stage} is not supported; flowgrpo runs ZeRO "
                              "stage 1 or 2 (configs/accelerate/zero2.yaml); to partition the weights too (ZeRO-3), "
                              "use FSDP: configs/accelerate/fsdp.yaml")
        self.plugin = plugin
        self.ds = None
        self.params: list[nn.Parameter] = []

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, policy, max_grad_norm: float) -> None:
        try:
            import deepspeed
        except ImportError:
            raise ConfigError("the accelerate config asks for DeepSpeed, which is not installed: "
                              "pip install 'flowgrpo[deepspeed]' (or use configs/accelerate/fsdp.yaml)") from None
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        config = dict(self.plugin.deepspeed_config)
        config.update({
            # flowgrpo batches and accumulates itself: DeepSpeed sees one "micro-batch" per step
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "train_batch_size": self.dp.world, "gradient_clipping": float(max_grad_norm),
            "zero_optimization": {**config.get("zero_optimization", {}), "stage": int(self.plugin.zero_stage)},
        })
        for key in ("optimizer", "scheduler"):
            if key in config:
                raise ConfigError(f"accelerate DeepSpeed config: remove its '{key}' section; flowgrpo's AdamW and "
                                  "learning rate (train.lr, train.adam_*) are the run's")
        config = {k: v for k, v in config.items() if v != "auto"}  # accelerate fills these from a prepared model
        for key in ("fp16", "bf16"):  # precision is flowgrpo's (model.dtype); DeepSpeed's would cast the model
            if config.get(key, {}).get("enabled") is True:
                raise ConfigError(f"accelerate DeepSpeed config: {key} is enabled; flowgrpo sets precision with "
                                  "model.dtype: set mixed_precision: 'no' in the accelerate config")
            config.pop(key, None)
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=policy.denoiser, optimizer=optimizer, config=config)

    # ------------------------------------------------------------------ one optimizer step
    def accumulate(self) -> contextlib.AbstractContextManager:
        return self.ds.coalesce_grad_reduction()

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss * self.dp.world)  # DeepSpeed averages over ranks: make it the sum

    def idle_passes(self, micro_batches: torch.Tensor) -> int:
        return 1 if int(micro_batches[self.dp.rank]) == 0 else 0

    def step(self, params: list[nn.Parameter], max_norm: float) -> float:
        # gradients were reduced on leaving accumulate(); DeepSpeed clips (to the max_grad_norm given
        # to attach_optimizer), steps and zeroes them
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    # ------------------------------------------------------------------ checkpoints
    def _base_states(self) -> list[dict]:
        """The wrapped AdamW's state of each flat partition DeepSpeed gives it."""
        base = self.optimizer.optimizer
        return [base.state[fp] for group in base.param_groups for fp in group["params"] if fp in base.state]

    def optimizer_state_dict(self) -> dict:
        """torch AdamW's ``state_dict`` layout, every moment gathered whole (a collective)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        base = self.optimizer.optimizer
        hyper = {k: v for k, v in base.param_groups[0].items() if k != "params"}
        states = self._base_states()
        state = {}
        if states:  # before the first step AdamW has no state
            step = states[0]["step"]
            state = {i: {"step": step.clone() if torch.is_tensor(step) else torch.tensor(float(step)),
                         **{m: safe_get_full_optimizer_state(p, m).detach().cpu() for m in _MOMENTS}}
                     for i, p in enumerate(self.params)}
        return {"state": state, "param_groups": [{**hyper, "params": list(range(len(self.params)))}]}

    def load_optimizer_state_dict(self, state: dict) -> None:
        from deepspeed.utils import safe_set_full_optimizer_state

        if not state["state"]:
            return
        base = self.optimizer.optimizer
        step = next(iter(state["state"].values()))["step"]
        for group in base.param_groups:  # AdamW creates its state on the first step: create it now
            for fp in group["params"]:
                base.state[fp] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                                  **{m: torch.zeros_like(fp) for m in _MOMENTS}}
        # DeepSpeed maps each parameter onto its slice of that state on its first step; ask for it now
        # (a private hook of ZeRO's optimizer; the public safe_set_* below need it)
        self.optimizer._lazy_init_hp_params_optimizer_state()
        for i, p in enumerate(self.params):
            for m in _MOMENTS:
                safe_set_full_optimizer_state(p, state["state"][i][m].to(p.device, torch.float32), m)

    def load_weights(self, policy, trainable: dict[str, torch.Tensor]) -> None:
        """Into the module and into DeepSpeed's fp32 master partitions (which the next step writes back)."""
        from deepspeed.utils import safe_set_full_fp32_param

        policy.load_trainable_state_dict(trainable)
        for name, p in policy.named_trainable_parameters():
            safe_set_full_fp32_param(p, trainable[name].to(p.device, torch.float32))
