"""The policy interface: everything the sampler, the loss and the trainer need from a generator.

A policy wraps one text-to-image (or video) flow model: it encodes prompts once, predicts the
velocity v = eps - x0 at (x_sigma, sigma) with classifier-free guidance, exposes the trainable
parameters (a LoRA adapter through peft, or the full transformer), gives the reference velocity
with the adapter disabled (for the KL term) and decodes latents to images.

What every adapter inherits beside this interface: :class:`~.trained.TrainedPolicy` (the
``train_mode`` logic, the shapes model's base too) and :mod:`.lora` (peft LoRA adapters).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Literal, get_args

import torch
from torch import Tensor, nn

from ...errors import UserError
from ...sharded_tensors import like_param


#: What ``model.train_mode`` can train: a peft LoRA adapter on the transformer, or all its weights.
TrainMode = Literal["lora", "full"]
#: Every adapter's train modes: :data:`TrainMode`'s and "frozen" (nothing trainable; evaluation only).
TRAIN_MODES: tuple[str, ...] = (*get_args(TrainMode), "frozen")


def check_train_mode(train_mode: str) -> str:
    """``train_mode`` itself, or ValueError unless it is one of :data:`TRAIN_MODES`."""
    if train_mode not in TRAIN_MODES:
        raise ValueError(f"unknown train_mode {train_mode!r}; valid: {', '.join(TRAIN_MODES)}")
    return train_mode


@dataclass
class Conditioning:
    """Prompt encodings, every tensor batch-first with one row per prompt.

    ``tensors`` holds the conditional encodings and ``uncond`` the same keys for the empty prompt
    (one row, broadcast on use) when classifier-free guidance is available.
    """

    tensors: dict[str, Tensor]
    uncond: dict[str, Tensor] | None = None

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def index(self, idx: Tensor) -> "Conditioning":
        """Rows ``idx`` [B] (long) of every tensor; ``uncond`` is shared and kept as is."""
        return Conditioning({k: v[idx] for k, v in self.tensors.items()}, self.uncond)


class Policy(nn.Module, ABC):
    """Abstract flow-model policy. Subclasses implement :meth:`_forward`, :meth:`_encode` and :meth:`decode`."""

    #: shape of one latent sample, e.g. (3, 32, 32) or (16, 64, 64)
    latent_shape: tuple[int, ...]
    #: the held-out evaluator (a name in ``flowgrpo.evaluation.EVALUATORS``) that suits this model's
    #: prompts when ``eval.evaluator=auto``; None: the model has none and evaluation is skipped
    evaluator: str | None = None

    #: whether gradients flow through the unconditional pass of classifier-free guidance (``loss.cfg_uncond_grad``)
    uncond_grad: bool = True
    #: whether :meth:`velocity` honours ``uncond_grad = False`` (adapters with their own guidance do not)
    can_detach_uncond: bool = True

    def __init__(self, guidance_scale: float = 1.0):
        super().__init__()
        self.guidance_scale = guidance_scale

    # ------------------------------------------------------------------ to implement
    @abstractmethod
    def _encode(self, prompts: list[str]) -> dict[str, Tensor]:
        """Prompts -> dict of batch-first encodings (no grad)."""

    @abstractmethod
    def _forward(self, x: Tensor, sigma: Tensor, enc: dict[str, Tensor]) -> Tensor:
        """Raw model velocity for x [B, ...] at sigma [B] (0..1) given batch-aligned encodings."""

    @abstractmethod
    def decode(self, latents: Tensor) -> Tensor:
        """Latents [B, ...] -> images [B, 3, H, W] float in [0, 1] (or [B, F, 3, H, W] for video)."""

    @abstractmethod
    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the optimiser updates (the LoRA adapter, or the full transformer)."""

    @abstractmethod
    def adapter_disabled(self) -> contextlib.AbstractContextManager:
        """Context in which :meth:`velocity` is the frozen base model's (for the KL reference)."""

    # ------------------------------------------------------------------ hooks with defaults
    def snapshot_reference(self) -> None:
        """Keep a frozen copy of the base weights for :meth:`reference_velocity`.

        The trainer calls it once, before the first update, when a term needs the base model (KL,
        anchor). Full fine-tuning policies must override it; LoRA needs none (the adapter is
        disabled instead), which is this default."""

    def save_lora(self, directory, weights: dict[str, Tensor] | None = None):
        """Write the LoRA adapter in diffusers' format to ``directory`` (returned as a Path), so that the
        stock pipeline's ``load_lora_weights(directory)`` reproduces this policy.

        ``weights``: a :meth:`trainable_state_dict`-keyed dict (e.g. the trainer's EMA) saved instead
        of the live adapter (which is left untouched). Adapters of diffusers models override this;
        the default raises a UserError (``flowgrpo export`` and the end-of-run export rely on it)."""
        raise UserError(f"model {type(self).__name__} has no diffusers LoRA format")

    @property
    def exports_lora(self) -> bool:
        """Whether this adapter implements :meth:`save_lora`."""
        return type(self).save_lora is not Policy.save_lora

    def sigma_grid(self, num_steps: int, shift: float = 1.0) -> Tensor:
        """The sigma grid [num_steps + 1] (1 -> 0, float32) rollouts of this model use.

        Default: uniform in sigma, then shifted by ``shift`` (:func:`flowgrpo.samplers.sigma_grid`).
        Adapters of pipelines that own their scheduler return the scheduler's grid instead."""
        from ...samplers.schedule import sigma_grid

        return sigma_grid(num_steps, shift)

    @property
    def denoiser(self) -> nn.Module:
        """The network every velocity runs through (the transformer), which multi-process engines
        shard (FSDP wraps its blocks). Default: the ``transformer`` submodule."""
        module = getattr(self, "transformer", None)
        if not isinstance(module, nn.Module):
            # only the multi-process engines ask (they shard or partition this module)
            raise UserError(f"policy {type(self).__name__} has no `transformer` submodule: override Policy.denoiser "
                            "to name the module FSDP / DeepSpeed should shard")
        return module

    # ------------------------------------------------------------------ shared logic
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def takes_references(self) -> bool:
        """Whether the model edits a reference image (each prompt comes with one; see
        :meth:`encode_prompts`). Default: False, a text-to-image (or video) model."""
        return False

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], references=None) -> Conditioning:
        """Encode prompts once per rollout; the empty prompt is encoded for guidance. ``references``
        (one image [3, h, w] in [0, 1] per prompt) are for image-editing models
        (:attr:`takes_references`); a model that takes none refuses them with a UserError."""
        if references is not None:
            raise UserError(f"model {type(self).__name__} takes no reference images (it is not an image-editing "
                            "model); give a prompt file without an \"image\" column")
        uncond = self._encode([""]) if self.guidance_scale != 1.0 else None
        return Conditioning(self._encode(list(prompts)), uncond)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float | None = None) -> Tensor:
        """Guided velocity [B, ...] for x [B, ...] at sigma [B] with batch-aligned ``cond``.

        With guidance g != 1 the conditional and unconditional passes share one forward call
        (batch 2B): v = v_u + g * (v_c - v_u). ``sigma`` may also be a float, a 0-dim tensor or a host
        tensor (the forward-process objectives draw their times on the CPU): :meth:`_forward` always
        gets float32 [B] on x's device.
        """
        sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).reshape(-1).expand(x.shape[0])
        g = self.guidance_scale if guidance_scale is None else guidance_scale
        if g == 1.0 or cond.uncond is None:
            return self._forward(x, sigma, cond.tensors)
        b = x.shape[0]
        uncond = {k: cond.uncond[k].expand(b, *v.shape[1:]) for k, v in cond.tensors.items()}
        if not self.uncond_grad and torch.is_grad_enabled():
            # Flow-GRPO's update: the unconditional pass carries no gradient (its noise_pred_uncond.detach());
            # run without a graph it costs no backward, which halves the update's backward under CFG
            with torch.no_grad():
                v_u = self._forward(x, sigma, uncond)
            v_c = self._forward(x, sigma, cond.tensors)
            return v_u + g * (v_c - v_u)
        enc = {k: torch.cat([v, uncond[k]]) for k, v in cond.tensors.items()}
        out = self._forward(torch.cat([x, x]), torch.cat([sigma, sigma]), enc)
        v_c, v_u = out[:b], out[b:]
        return v_u + g * (v_c - v_u)

    @torch.no_grad()
    def reference_velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float | None = None) -> Tensor:
        """Velocity of the frozen base model (adapter off), for the KL term."""
        with self.adapter_disabled():
            return self.velocity(x, sigma, cond, guidance_scale)

    def trainable_state_dict(self) -> dict[str, Tensor]:
        """Named trainable tensors (what checkpoints and EMA hold)."""
        ids = {id(p) for p in self.trainable_parameters()}
        return {n: p.detach().clone() for n, p in self.named_parameters() if id(p) in ids}

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        params = dict(self.named_parameters())
        missing = [n for n in state if n not in params]
        if missing:
            raise KeyError(f"checkpoint holds parameters this policy lacks: {missing[:5]}")
        with torch.no_grad():
            for n, t in state.items():
                # whole tensors (checkpoints) into a sharded denoiser: each rank keeps its slice
                params[n].copy_(like_param(t, params[n]))

    def named_trainable_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        ids = {id(p) for p in self.trainable_parameters()}
        return ((n, p) for n, p in self.named_parameters() if id(p) in ids)
