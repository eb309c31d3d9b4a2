"""``train.ema``: the exponential moving average of the trainable weights that runs evaluate and export.

The EMA is a plain ``{name: tensor}`` dict beside the policy (the same names as
``policy.named_trainable_parameters()``), so checkpoints and the LoRA export read it like any other
weights. ``train.ema_device=cpu`` keeps it in host memory (its ``home``): one device-to-host copy of
the trainable weights per iteration, nothing of it on the accelerator.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..sharded_tensors import like_param


def ema_home(train_cfg, engine_name: str) -> str | None:
    """Where the EMA lives: None (beside the weights) or ``"cpu"`` (``train.ema_device=cpu``). FSDP shards
    the EMA with the weights, so a whole host copy is refused there in one line."""
    if train_cfg.ema and train_cfg.ema_device == "cpu" and engine_name == "fsdp":
        raise ConfigError("train.ema_device=cpu keeps whole weights, and FSDP shards the EMA with them: use "
                          "train.ema_device=auto (fsdp_offload_params: true puts the shards on the CPU)")
    return "cpu" if train_cfg.ema_device == "cpu" else None


def ema_start(policy, home: str | None) -> dict[str, torch.Tensor]:
    """A copy of the policy's trainable weights on ``home`` (None: their own device)."""
    return {n: p.detach().to(home, copy=True) for n, p in policy.named_trainable_parameters()}


@torch.no_grad()
def ema_update(ema: dict[str, torch.Tensor], policy, decay: float, home: str | None) -> None:
    """ema <- decay * ema + (1 - decay) * theta, in place (theta copied to ``home`` first)."""
    for n, p in policy.named_trainable_parameters():
        ema[n].lerp_(p.detach().to(home), 1 - decay)


def ema_loaded(saved: dict[str, torch.Tensor], policy, home: str | None) -> dict[str, torch.Tensor]:
    """A checkpoint's whole EMA tensors laid out like the live weights (sharded where they are) on ``home``."""
    live = dict(policy.named_trainable_parameters())
    return {n: like_param(t, live[n]).to(home) for n, t in saved.items()}

