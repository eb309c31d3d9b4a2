"""The base of every adapter over a diffusers transformer pipeline (SD3, FLUX, Wan, the generic one).

:class:`DiffusersPolicy` adds to :class:`~flowgrpo.policies.diffusers.switches.SwitchedPolicy` (the model
switches) and :class:`~flowgrpo.policies.base.trained.TrainedPolicy` (the ``train_mode`` logic) what
every diffusers pipeline has in common:

* :meth:`DiffusersPolicy.setup_modules`: the pipeline's modules on the policy, frozen and in their
  dtypes, then the trainable part for ``train_mode`` (``common.load_frozen`` and
  ``make_trainable``);
* :meth:`DiffusersPolicy.train`: only the transformer follows train/eval; the frozen VAE and text
  encoders stay in eval (T5's dropout is 0.1);
* :meth:`DiffusersPolicy.decode`: image latents [B, C, h, w] through an ``AutoencoderKL``-style VAE
  (``z / scaling_factor + shift_factor``), as the tails of ``StableDiffusion3Pipeline`` and
  ``FluxPipeline`` do; adapters of other latent layouts override it;
* :meth:`DiffusersPolicy.save_lora`: diffusers' LoRA file. Its layout (``transformer.``-prefixed
  peft keys, the LoRA config in the safetensors metadata) is the same for every pipeline's
  ``save_lora_weights``, so one writer serves every pipeline's ``load_lora_weights``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from ..base.lora import DEFAULT_LORA_INIT
from .common import load_frozen, make_trainable
from .switches import SwitchedPolicy, torch_dtype


class DiffusersPolicy(SwitchedPolicy):
    """A policy over a diffusers pipeline's ``transformer`` (trained), ``vae`` and ``text_encoder*`` (frozen).

    Subclasses call :meth:`setup_modules` in their constructor, then set their geometry, then
    :meth:`make_trainable` and :meth:`~flowgrpo.policies.diffusers.switches.SwitchedPolicy.apply_switches`.
    """

    #: peft adapter name of the LoRA on the transformer
    adapter_name = "default"
    #: largest VAE decode batch (constructors set it)
    decode_batch: int = 8

    def setup_modules(self, train_mode: str, dtype: torch.dtype | str, **modules: nn.Module | None) -> None:
        """``train_mode`` and ``dtype`` checked and set; ``modules`` on the policy, frozen
        (``common.load_frozen``: VAE in float32, the rest in ``dtype``)."""
        self.set_train_mode(train_mode)
        self.dtype = torch_dtype(dtype)
        load_frozen(self, self.dtype, **modules)

    def make_trainable(self, *, lora_rank: int, lora_alpha: float, lora_targets,
                       lora_init: bool | str = DEFAULT_LORA_INIT) -> None:
        """The trainable part of the transformer for ``self.train_mode`` (``common.make_trainable``)."""
        make_trainable(self.denoiser, self.train_mode, lora_rank=lora_rank, lora_alpha=lora_alpha,
                       lora_targets=lora_targets, lora_init=lora_init, adapter_name=self.adapter_name)

    def train(self, mode: bool = True):
        """Only the transformer follows ``mode``: every other submodule (VAE, text encoders) stays in eval."""
        super().train(mode)
        for name, module in self.named_children():
            if name != self.denoiser_path:
                module.eval()
        return self

    def decode(self, latents: Tensor) -> Tensor:
        """Latents [B, C, h, w] -> images [B, 3, H, W] in [0, 1], in chunks of :attr:`decode_batch`."""
        cfg = self.vae.config
        shift = cfg.shift_factor if getattr(cfg, "shift_factor", None) is not None else 0.0
        images = []
        for chunk in latents.split(self.decode_batch):
            z = chunk.to(self.vae.dtype) / cfg.scaling_factor + shift
            images.append(self.vae.decode(z, return_dict=False)[0])
        return ((torch.cat(images).float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def save_lora(self, directory: str | Path, weights: dict[str, Tensor] | None = None) -> Path:
        """Save the adapter so that the stock pipeline's ``load_lora_weights(directory)`` loads it.

        Writes ``pytorch_lora_weights.safetensors`` (diffusers' key layout, with the LoRA config —
        rank, alpha, targets — in the file's metadata so the loaded scale matches). ``weights`` (keyed
        as :meth:`trainable_state_dict`, e.g. the trainer's EMA) are saved instead of the live adapter.
        The file is built from whole tensors, never from the module's state: the weights of a sharded
        (FSDP) transformer are slices, which the trainer gathers before calling this.
        """
        if self.train_mode != "lora":
            raise ValueError(f"save_lora needs train_mode='lora' (this policy is {self.train_mode!r})")
        return self.write_lora(directory, self.denoiser_path, weights)

    def write_lora(self, directory: str | Path, module_name: str, weights: dict[str, Tensor] | None = None) -> Path:
        """Write the LoRA of the submodule ``module_name`` (e.g. ``transformer_2``) to ``directory`` in the
        layout of :meth:`save_lora` (keys ``transformer.``-prefixed, as ``load_lora_weights`` expects for
        the module it loads into); ``weights``: as :meth:`save_lora`."""
        from diffusers import StableDiffusion3Pipeline
        from peft.utils import get_peft_model_state_dict

        module = getattr(self, module_name)
        if weights is None:
            weights = self.trainable_state_dict()
        prefix = module_name + "."  # trainable_state_dict names are the policy's; peft's the module's
        own = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(module, state_dict=own, adapter_name=self.adapter_name)
        state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        metadata = module.peft_config[self.adapter_name].to_dict()
        # any pipeline's LoraBaseMixin writes the same file; SD3's is used for all
        StableDiffusion3Pipeline.save_lora_weights(directory, transformer_lora_layers=state,
                                                   transformer_lora_adapter_metadata=metadata)
        return directory
