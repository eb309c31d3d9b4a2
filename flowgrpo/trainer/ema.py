"""``train.ema``: the exponential moving average of the trainable weights that runs evaluate and export.

The EMA is a plain ``{name: tensor}`` dict beside the policy (the same names as
``policy.named_trainable_parameters()``), so checkpoints and the LoRA export read it like any other
weights. It is a lagging copy of the trainable weights like the objectives' old policies, and is made,
moved and loaded by the same functions (:mod:`flowgrpo.objectives.old_policy`: ``trainable_copy``,
``lerp_toward``, ``copy_loaded``). ``train.ema_device=cpu`` keeps it in host memory (its ``home``):
one device-to-host copy of the trainable weights per iteration, nothing of it on the accelerator.
"""

from __future__ import annotations

from ..objectives.old_policy import host_copy_home


def ema_home(train_cfg, engine_name: str) -> str | None:
    """Where the EMA lives: None (beside the weights) or ``"cpu"`` (``train.ema_device=cpu``). FSDP shards
    the EMA with the weights, so a whole host copy is refused there in one line (when ``train.ema`` is on)."""
    return host_copy_home("train.ema_device", train_cfg.ema_device, engine_name if train_cfg.ema else None)
