"""What every adapter shares about *training* one network: the ``train_mode`` logic.

:class:`TrainedPolicy` is the base of every adapter (the shapes model, and through
:class:`~flowgrpo.policies.diffusers.policy.DiffusersPolicy` every diffusers pipeline). The trained
network (the denoiser) sits at the dotted attribute path :attr:`TrainedPolicy.denoiser_path`
(``"transformer"`` for diffusers pipelines, ``"model.transformer"`` for the shapes model); from it
the base gives, for each ``train_mode``:

=========  ==========================  ===========================================================
mode       trainable parameters        the reference (base) model of :meth:`adapter_disabled`
=========  ==========================  ===========================================================
lora       the peft adapter's          the same network with its adapters disabled
full       every denoiser weight       a frozen copy taken by :meth:`snapshot_reference`, swapped in
frozen     none                        the policy itself (it is the base model)
=========  ==========================  ===========================================================

The frozen copy is held outside the module tree (``object.__setattr__``): it is neither trained
nor checkpointed nor moved by ``.to``-style calls made before it exists. Where it lives is
:attr:`TrainedPolicy.reference_device` (``model.reference_device``): "auto", beside the trained
denoiser; "cpu", in CPU memory with its blocks streamed to the device per forward
(:mod:`.streamed`).
"""

from __future__ import annotations

import contextlib
import copy

from torch import nn

from ...errors import ConfigError
from . import Policy, check_train_mode
from .lora import lora_disabled
from .streamed import block_list_entries, streamed_copy


class TrainedPolicy(Policy):
    """A :class:`Policy` that trains one network at :attr:`denoiser_path` in ``train_mode``.

    Subclasses set ``self.train_mode`` with :meth:`set_train_mode` in their constructor (before any
    reference is taken) and put the denoiser at :attr:`denoiser_path`.
    """

    #: dotted attribute path from the policy to the trained network
    denoiser_path: str = "transformer"
    #: "lora", "full" or "frozen" (:data:`~flowgrpo.policies.base.TRAIN_MODES`)
    train_mode: str = "frozen"
    #: where full fine-tuning's frozen reference copy lives: "auto" (the denoiser's device) | "cpu" (streamed)
    reference_device: str = "auto"

    def set_train_mode(self, train_mode: str) -> None:
        """Check and set ``train_mode``; no reference copy is held yet."""
        self.train_mode = check_train_mode(train_mode)
        object.__setattr__(self, "_frozen", None)

    # ------------------------------------------------------------------ the denoiser
    def _owner_and_name(self) -> tuple[object, str]:
        *parents, name = self.denoiser_path.split(".")
        owner: object = self
        for part in parents:
            owner = getattr(owner, part)
        return owner, name

    @property
    def denoiser(self) -> nn.Module:
        """The trained network (what multi-process engines shard)."""
        owner, name = self._owner_and_name()
        return getattr(owner, name)

    def _set_denoiser(self, module: nn.Module) -> None:
        owner, name = self._owner_and_name()
        setattr(owner, name, module)

    # ------------------------------------------------------------------ train_mode logic
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The denoiser's parameters that require grad (the LoRA adapter, all of them, or none)."""
        return [p for p in self.denoiser.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def adapter_disabled(self):
        """Context in which the policy is the base model (see the module docstring's table)."""
        if self.train_mode == "lora":
            with lora_disabled(self.denoiser):
                yield
            return
        if self.train_mode == "frozen":  # the policy is the base model
            yield
            return
        frozen = getattr(self, "_frozen", None)
        if frozen is None:
            raise RuntimeError("call snapshot_reference() before using the reference model in full fine-tuning")
        live = self.denoiser
        self._set_denoiser(frozen)
        try:
            yield
        finally:
            self._set_denoiser(live)

    def set_reference_device(self, where: str) -> None:
        """``model.reference_device``: "auto" or "cpu" (before :meth:`snapshot_reference`); ConfigError for
        "cpu" outside full fine-tuning (LoRA's reference is the same weights with the adapter off: there is
        no copy to move) or a denoiser without block lists."""
        if where not in ("auto", "cpu"):
            raise ConfigError(f"unknown model.reference_device {where!r}; valid: auto, cpu")
        if where == "cpu" and self.train_mode != "full":
            raise ConfigError(f"model.reference_device=cpu applies to model.train_mode=full (a frozen copy of the "
                              f"denoiser); train_mode={self.train_mode} keeps no copy to move")
        if where == "cpu" and not block_list_entries(self.denoiser):
            raise ConfigError(f"model.reference_device=cpu streams the denoiser's blocks, and "
                              f"{type(self.denoiser).__name__} has no block list (an nn.ModuleList child)")
        self.reference_device = where

    def snapshot_reference(self) -> None:
        """Keep a frozen copy of the current denoiser as the reference (full fine-tuning only; once), on
        :attr:`reference_device`."""
        if self.train_mode == "full" and getattr(self, "_frozen", None) is None:
            if self.reference_device == "cpu":
                frozen = streamed_copy(self.denoiser)
            else:
                frozen = copy.deepcopy(self.denoiser).requires_grad_(False)
            object.__setattr__(self, "_frozen", frozen)  # not a submodule: not trained, not checkpointed
