"""LoRA through peft on diffusers models, saved so that stock pipelines can load it."""

from __future__ import annotations

import contextlib

from torch import nn


def add_lora(model: nn.Module, rank: int, alpha: float, targets: list[str], name: str = "default") -> None:
    """Attach a peft LoRA adapter (B initialised to zero, so the policy starts as the base model).

    ``model`` is a diffusers ``ModelMixin`` (it has ``add_adapter``); only the adapter is trainable.
    """
    from peft import LoraConfig

    model.requires_grad_(False)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights="gaussian")
    model.add_adapter(config, adapter_name=name)


@contextlib.contextmanager
def lora_disabled(model: nn.Module):
    """Run ``model`` without its LoRA adapters (the frozen base model), then re-enable them."""
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()
