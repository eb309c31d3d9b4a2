"""Policy adapter for FLUX.1 [dev] / [schnell] (diffusers ``FluxPipeline`` components).

Latent space: the policy's latents are the VAE's **unpacked** ``[latent_channels, H/8, W/8]``
(16 x H/8 x W/8 for FLUX.1), as ``FluxPipeline.prepare_latents`` draws its noise before packing.
Each transformer call packs them into FLUX's 2x2-patch tokens [B, (H/16)(W/16), 4C] with
``FluxPipeline._pack_latents`` and unpacks the velocity with ``FluxPipeline._unpack_latents``.
Packing is a permutation of elements, so every elementwise step of flowgrpo (Euler, the SDE
kinds, their Gaussian log-probs summed over a sample) is the same on either layout; the unpacked
one keeps the initial noise identical to the stock pipeline's for one generator, and lets
:meth:`FluxPolicy.decode` hand the latents to the VAE directly.

Transformer inputs, as ``FluxPipeline.__call__`` builds them:

* prompts: ``FluxPipeline.encode_prompt`` (CLIP's pooled output -> ``pooled_projections``,
  T5's last hidden state over ``max_sequence_length`` tokens -> ``encoder_hidden_states``);
* RoPE ids: ``img_ids`` from ``FluxPipeline._prepare_latent_image_ids`` over the packed grid and
  ``txt_ids`` zeros [T5 tokens, 3];
* ``timestep`` = sigma (the pipeline passes ``t / 1000`` with ``t = 1000 * sigma``);
* ``guidance``: FLUX.1-dev is guidance-distilled: when ``transformer.config.guidance_embeds`` the
  guidance value ``model.guidance_scale`` is an *input* of the transformer, one forward per step
  and no unconditional pass (flowgrpo's classifier-free guidance is never used). FluxPipeline's
  default is 3.5; ``model.guidance_scale``'s default 1.0 is passed as is, so set 3.5 for dev.
  schnell has no guidance embedding and ignores the value.

Sigma grid: the pipeline's own (``np.linspace(1, 1/T, T)`` passed to the scheduler's
``set_timesteps`` with the dynamic-shift ``mu = calculate_shift(image_seq_len, ...)``), computed on
a copy of the scheduler; ``sampler.shift`` is ignored, as for SD3.

LoRA, reference model, full fine-tuning, LoRA export and decoding (the unpacked latents go to the VAE
as ``FluxPipeline``'s tail does: ``z / scaling + shift``) are
:class:`~flowgrpo.policies.diffusers.policy.DiffusersPolicy`'s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ...errors import UserError
from ..base.lora import DEFAULT_LORA_INIT
from .common import load_policy, scheduler_grid
from .policy import DiffusersPolicy
from .switches import runtime_options, torch_dtype

#: every linear layer of FLUX's double-stream blocks (both streams: attention and feed-forward) and
#: single-stream blocks (attention, fused MLP input and output); the final ``proj_out`` is left out
FLUX_LORA_TARGETS = (
    r".*transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
    r"|ff\.net\.(0\.proj|2)|ff_context\.net\.(0\.proj|2))"
    r"|.*single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v)|proj_mlp|proj_out)"
)


def default_flux_scheduler():
    """FLUX.1's ``scheduler_config.json``: flow-matching Euler, shift from the image size (dynamic)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                           max_image_seq_len=4096)


def _pipeline_cls():
    from diffusers import FluxPipeline

    return FluxPipeline


class FluxPolicy(DiffusersPolicy):
    """Wraps the components of a ``FluxPipeline``.

    Args:
        transformer, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2: the pipeline's
            components (CLIP-L text model and tokenizer, T5 encoder and tokenizer).
        scheduler: the pipeline's scheduler; it defines the rollout grid (:meth:`sigma_grid`) and is
            never stepped or modified. None: FLUX.1's stock one (:func:`default_flux_scheduler`).
        resolution: image side in pixels (a multiple of 16); sets :attr:`latent_shape`.
        guidance_scale: the distilled guidance value fed to a transformer with guidance embeds
            (FLUX.1-dev); ignored by one without (schnell). Never classifier-free guidance.
        train_mode: "lora", "full" or "frozen" (as :class:`SD3Policy`).
        lora_rank, lora_alpha, lora_targets, lora_init: adapter size, scale, target modules (peft names, a
            named set or a regex; default :data:`FLUX_LORA_TARGETS`) and peft's ``init_lora_weights``.
        max_sequence_length: T5 tokens (FLUX.1-dev: 512, schnell: 256).
        dtype: dtype of the transformer and text encoders (VAE in float32, LoRA weights in float32).
        decode_batch: largest VAE decode batch.
        switches: the model switches, as :meth:`~flowgrpo.policies.diffusers.switches.SwitchedPolicy.apply_switches`
            (the same for every adapter).
    """

    model_name = "FLUX"

    def __init__(self, transformer, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, scheduler=None, *,
                 resolution: int = 512, guidance_scale: float = 3.5, train_mode: str = "lora", lora_rank: int = 32,
                 lora_alpha: float = 64.0, lora_targets=None, lora_init: bool | str = DEFAULT_LORA_INIT,
                 max_sequence_length: int = 512,
                 dtype: torch.dtype | str = torch.float32, decode_batch: int = 8, **switches):
        super().__init__(1.0)  # guidance is an input of the distilled transformer, not CFG
        self.set_train_mode(train_mode)
        if max_sequence_length < 1 or max_sequence_length > 512:
            raise ValueError(f"max_sequence_length must be in 1..512 for FLUX, got {max_sequence_length}")
        self.setup_modules(train_mode, dtype, transformer=transformer, vae=vae, text_encoder=text_encoder,
                           text_encoder_2=text_encoder_2)
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
        self.distilled_guidance = float(guidance_scale)
        self.max_sequence_length = int(max_sequence_length)
        self.decode_batch = int(decode_batch)
        self.scheduler = scheduler if scheduler is not None else default_flux_scheduler()
        # the stock pipeline over the text side only: encode_prompt is called on it as is
        self._text_pipeline = _pipeline_cls()(scheduler=None, vae=None, text_encoder=self.text_encoder,
                                              tokenizer=tokenizer, text_encoder_2=self.text_encoder_2,
                                              tokenizer_2=tokenizer_2, transformer=None)

        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        step = 2 * self.vae_scale_factor  # latents are packed in 2x2 patches
        if resolution <= 0 or resolution % step:
            raise ValueError(f"resolution {resolution} must be a positive multiple of {step} "
                             f"(VAE factor {self.vae_scale_factor} x 2x2 packing)")
        channels = self.transformer.config.in_channels // 4
        if channels != self.vae.config.latent_channels:
            raise ValueError(f"transformer in_channels {self.transformer.config.in_channels} != 4 x VAE latent "
                             f"channels {self.vae.config.latent_channels}")
        side = resolution // self.vae_scale_factor
        self.resolution = int(resolution)
        self.latent_shape = (channels, side, side)

        self.make_trainable(lora_rank=lora_rank, lora_alpha=lora_alpha,
                            lora_targets=FLUX_LORA_TARGETS if lora_targets is None else lora_targets,
                            lora_init=lora_init)
        self.apply_switches(**switches)

    @classmethod
    def from_components(cls, components: dict, **kwargs) -> "FluxPolicy":
        """From a ``pipeline.components``-style dict (unused entries such as image_encoder are ignored)."""
        names = ["transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "scheduler"]
        return cls(**{n: components.get(n) for n in names}, **kwargs)

    # ------------------------------------------------------------------ prompts
    def _encode_now(self, prompts: list[str]) -> dict[str, Tensor]:
        prompt_embeds, pooled, _ = self._text_pipeline.encode_prompt(
            list(prompts), device=self.device, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds.to(self.dtype), "pooled_prompt_embeds": pooled.to(self.dtype)}

    # ------------------------------------------------------------------ schedule
    @property
    def image_seq_len(self) -> int:
        """Packed image tokens (what FLUX's dynamic shift is computed from)."""
        return (self.latent_shape[-2] // 2) * (self.latent_shape[-1] // 2)

    def sigma_grid(self, num_steps: int, shift: float | None = None) -> Tensor:
        """The float32 [num_steps + 1] sigma grid (1 -> ... -> 0, CPU) ``FluxPipeline.__call__`` denoises on.

        ``set_timesteps`` on a copy of the scheduler with the pipeline's ``sigmas``
        (``linspace(1, 1/T, T)``, or none when the scheduler uses flow sigmas) and ``mu`` from
        ``calculate_shift`` at this policy's image token count. ``shift`` is ignored: the scheduler
        config owns it.
        """
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / max(num_steps, 1), num_steps)
        mu = calculate_shift(self.image_seq_len, config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return scheduler_grid(self.scheduler, num_steps, sigmas=sigmas, mu=mu)

    # ------------------------------------------------------------------ model
    def velocity(self, x: Tensor, sigma: Tensor, cond, guidance_scale: float | None = None) -> Tensor:
        """Velocity [B, C, h, w]; ``guidance_scale`` (if given) replaces the distilled guidance value."""
        return self._transformer_velocity(x, sigma, cond.tensors, guidance_scale)

    def _forward(self, x: Tensor, sigma: Tensor, enc: dict[str, Tensor]) -> Tensor:
        return self._transformer_velocity(x, sigma, enc, None)

    def _transformer_velocity(self, x: Tensor, sigma: Tensor, enc: dict[str, Tensor], guidance: float | None) -> Tensor:
        pipe = _pipeline_cls()
        b, c, h, w = x.shape
        packed = pipe._pack_latents(x.to(self.dtype).contiguous(), b, c, h, w)
        img_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, x.device, self.dtype)
        prompt_embeds = enc["prompt_embeds"].to(self.dtype)
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=x.device, dtype=self.dtype)
        sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).reshape(-1).expand(b)
        g = None
        if self.transformer.config.guidance_embeds:
            value = self.distilled_guidance if guidance is None else float(guidance)
            g = torch.full((b,), value, device=x.device, dtype=torch.float32)
        out = self.transformer(
            hidden_states=packed, timestep=sigma.to(self.dtype), guidance=g,
            pooled_projections=enc["pooled_prompt_embeds"].to(self.dtype), encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False,
        )[0]
        return pipe._unpack_latents(out, h * self.vae_scale_factor, w * self.vae_scale_factor, self.vae_scale_factor)


def build_flux_policy(cfg) -> FluxPolicy:
    """Factory for ``model.name=flux`` (``cfg.path`` a local FluxPipeline folder) or ``model.name=<that folder>``."""
    path = Path(cfg.path).expanduser() if cfg.path else None
    if path is None or not (path / "model_index.json").is_file():
        what = "is not set" if path is None else ("does not exist" if not path.exists() else "has no model_index.json")
        raise UserError(f"FLUX needs a local diffusers FluxPipeline folder (model.path or model.name); {str(path)!r} "
                        f"{what}. Weights are never downloaded")
    return load_policy(FluxPolicy, _pipeline_cls(), path, cfg, torch_dtype(cfg.dtype), "a FLUX",
                       **runtime_options(cfg))
