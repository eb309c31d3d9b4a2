"""Policy adapter for Stable Diffusion 3 / 3.5 (diffusers ``StableDiffusion3Pipeline`` components).

Latent space: the VAE's ``[latent_channels, H/f, W/f]`` (16 x H/8 x W/8 for SD3). Prompts are
encoded with SD3's recipe (the same tensors as ``StableDiffusion3Pipeline.encode_prompt``):

* each CLIP (L, then G) tokenizes to its ``model_max_length`` (77), padding to max length; the
  penultimate hidden layer is the token feature and the projected text embedding the pooled one;
* the two CLIP token features are concatenated on channels and zero-padded to T5's width;
* T5 tokenizes to ``max_sequence_length`` (special tokens added) and its last hidden state follows
  the CLIP tokens on the sequence axis (zeros when the pipeline has no T5);
* ``prompt_embeds`` = [B, 77 + max_sequence_length, joint_dim], ``pooled_prompt_embeds`` =
  [B, pooled_dim] (the two projected CLIP embeddings concatenated).

The transformer is called with ``timestep = 1000 * sigma``. Text encoders and VAE are frozen; the
trainable part is a peft LoRA adapter on the transformer (or the whole transformer).

Sigma grid: rollouts use the grid the pipeline's own scheduler would use (:meth:`SD3Policy.sigma_grid`,
``FlowMatchEulerDiscreteScheduler.set_timesteps``), not FLUX's ``samplers.sigma_grid``. With SD3's
config (shift 3, 1000 training timesteps) the two differ: diffusers spaces the timesteps between
the *already shifted* training sigma_max and sigma_min and then shifts them again.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from ...errors import UserError
from ..base.lora import DEFAULT_LORA_INIT
from .common import load_policy, scheduler_grid
from .policy import DiffusersPolicy
from .switches import runtime_options, torch_dtype

# Attention (both streams, and the second attention of SD3.5-M dual-attention blocks, which share
# the names to_q/to_k/to_v/to_out.0) and feed-forward projections of SD3's MMDiT blocks.
SD3_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]

def default_sd3_scheduler():
    """The scheduler of the stock SD3 / SD3.5 pipelines (``scheduler_config.json``): flow-matching Euler,
    1000 training timesteps, static shift 3."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


class SD3Policy(DiffusersPolicy):
    """Wraps the components of a ``StableDiffusion3Pipeline``.

    Args:
        transformer, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, text_encoder_3,
            tokenizer_3: the pipeline's components (T5 may be None, as in the stock pipeline).
        resolution: image side in pixels; sets :attr:`latent_shape`.
        guidance_scale: classifier-free guidance scale (1 = off, one forward per step).
        train_mode: "lora" (peft adapter on the transformer), "full" (every transformer weight) or
            "frozen" (nothing trainable; evaluation only).
        lora_rank, lora_alpha, lora_targets, lora_init: adapter size, scale, target modules (module names or
            a named set, :mod:`flowgrpo.policies.base.lora`; default :data:`SD3_LORA_TARGETS`) and peft's
            ``init_lora_weights``.
        max_sequence_length: T5 tokens.
        dtype: dtype of the transformer and text encoders (the VAE runs in float32; LoRA weights
            are kept in float32). Velocities are returned in this dtype; callers cast.
        decode_batch: largest VAE decode batch.
        switches: the model switches (``gradient_checkpointing``, ``vae_slicing``, ``vae_tiling``,
            ``offload_text_encoders``, ``attention_backend``, ``compile_transformer``,
            ``prompt_cache_size``), as :meth:`~flowgrpo.policies.diffusers.switches.SwitchedPolicy.apply_switches`.
        scheduler: the pipeline's scheduler; it defines the rollout sigma grid (:meth:`sigma_grid`)
            and is never stepped or modified. None: SD3's stock one (:func:`default_sd3_scheduler`).
    """

    model_name = "SD3"

    def __init__(self, transformer, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, text_encoder_3=None,
                 tokenizer_3=None, *, resolution: int = 512, guidance_scale: float = 1.0, train_mode: str = "lora",
                 lora_rank: int = 32, lora_alpha: float = 64.0, lora_targets: list[str] | str | None = None,
                 lora_init: bool | str = DEFAULT_LORA_INIT,
                 max_sequence_length: int = 256, dtype: torch.dtype | str = torch.float32, decode_batch: int = 8,
                 scheduler=None, **switches):
        super().__init__(guidance_scale)
        self.setup_modules(train_mode, dtype, transformer=transformer, vae=vae, text_encoder=text_encoder,
                           text_encoder_2=text_encoder_2, text_encoder_3=text_encoder_3)
        if text_encoder_3 is not None and tokenizer_3 is None:
            raise ValueError("text_encoder_3 (T5) needs tokenizer_3")
        self.tokenizer, self.tokenizer_2, self.tokenizer_3 = tokenizer, tokenizer_2, tokenizer_3
        self.max_sequence_length = int(max_sequence_length)
        self.decode_batch = int(decode_batch)
        self.scheduler = scheduler if scheduler is not None else default_sd3_scheduler()

        # latent geometry
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        patch = self.transformer.config.patch_size
        step = self.vae_scale_factor * patch
        if resolution <= 0 or resolution % step:
            raise ValueError(f"resolution {resolution} must be a positive multiple of {step} "
                             f"(VAE factor {self.vae_scale_factor} x patch size {patch})")
        side = resolution // self.vae_scale_factor
        max_patches = self.transformer.config.pos_embed_max_size
        if max_patches is not None and side // patch > max_patches:
            raise ValueError(f"resolution {resolution} exceeds the transformer's positional grid "
                             f"({max_patches} patches per side = {max_patches * step} px)")
        self.resolution = int(resolution)
        self.latent_shape = (self.vae.config.latent_channels, side, side)

        self.make_trainable(lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets or SD3_LORA_TARGETS,
                            lora_init=lora_init)
        self.apply_switches(**switches)

    @classmethod
    def from_components(cls, components: dict, **kwargs) -> "SD3Policy":
        """From a ``pipeline.components``-style dict (unused entries are ignored; the scheduler sets the grid)."""
        names = ["transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                 "text_encoder_3", "tokenizer_3", "scheduler"]
        return cls(**{n: components.get(n) for n in names}, **kwargs)

    # ------------------------------------------------------------------ prompts
    def _clip_max_length(self) -> int:
        length = self.tokenizer.model_max_length  # the stock pipeline uses tokenizer 1's length for both
        if length is None or length > 10_000:
            length = 77
        return int(length)

    def _clip(self, prompts: list[str], tokenizer, encoder: nn.Module) -> tuple[Tensor, Tensor]:
        ids = tokenizer(prompts, padding="max_length", max_length=self._clip_max_length(), truncation=True,
                        return_tensors="pt").input_ids.to(self.device)
        out = encoder(ids, output_hidden_states=True)
        return out.hidden_states[-2], out[0]  # penultimate layer, projected pooled embedding

    def _encode_now(self, prompts: list[str]) -> dict[str, Tensor]:
        hidden_1, pooled_1 = self._clip(prompts, self.tokenizer, self.text_encoder)
        hidden_2, pooled_2 = self._clip(prompts, self.tokenizer_2, self.text_encoder_2)
        joint_dim = self.transformer.config.joint_attention_dim
        if self.text_encoder_3 is not None:
            ids = self.tokenizer_3(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                                   add_special_tokens=True, return_tensors="pt").input_ids.to(self.device)
            t5 = self.text_encoder_3(ids)[0]
        else:
            t5 = torch.zeros(len(prompts), self.max_sequence_length, joint_dim, device=self.device, dtype=self.dtype)
        clip = torch.cat([hidden_1, hidden_2], dim=-1)
        clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {
            "prompt_embeds": torch.cat([clip, t5], dim=-2).to(self.dtype),
            "pooled_prompt_embeds": torch.cat([pooled_1, pooled_2], dim=-1).to(self.dtype),
        }

    # ------------------------------------------------------------------ schedule
    def sigma_grid(self, num_steps: int, shift: float | None = None) -> Tensor:
        """The float32 [num_steps + 1] sigma grid (1 -> ... -> 0, CPU) of this pipeline's scheduler.

        Exactly ``scheduler.sigmas`` after ``scheduler.set_timesteps(num_steps)`` on a copy of the
        pipeline's scheduler (the scheduler itself is untouched), i.e. what
        ``StableDiffusion3Pipeline.__call__`` denoises on: its config owns the shift, sigma_min/max
        (from the training timesteps), shift_terminal, Karras/exponential/beta spacing and dynamic
        shifting (``mu`` computed from this policy's latent size as the pipeline does).

        ``shift`` is **ignored**: for SD3 the scheduler config owns the shift (3.0 in the stock
        pipelines), so ``sampler.shift`` has no effect on an SD3 policy's grid. To change it, change
        the pipeline's ``scheduler_config.json`` (or pass another ``scheduler``).
        """
        config = self.scheduler.config
        kwargs = {}
        if config.get("use_dynamic_shifting", False):
            # StableDiffusion3Pipeline.__call__: mu from the number of image tokens (latent patches)
            patch = self.transformer.config.patch_size
            seq_len = (self.latent_shape[-2] // patch) * (self.latent_shape[-1] // patch)
            base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
            base_shift, max_shift = config.get("base_shift", 0.5), config.get("max_shift", 1.16)
            slope = (max_shift - base_shift) / (max_len - base_len)
            kwargs["mu"] = seq_len * slope + base_shift - slope * base_len
        return scheduler_grid(self.scheduler, num_steps, **kwargs)

    # ------------------------------------------------------------------ model
    def _forward(self, x: Tensor, sigma: Tensor, enc: dict[str, Tensor]) -> Tensor:
        sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).reshape(-1).expand(x.shape[0])
        return self.transformer(
            hidden_states=x.to(self.dtype),
            timestep=sigma * 1000.0,
            encoder_hidden_states=enc["prompt_embeds"].to(self.dtype),
            pooled_projections=enc["pooled_prompt_embeds"].to(self.dtype),
            return_dict=False,
        )[0]


def build_sd3_policy(cfg) -> SD3Policy:
    """Factory for ``model.name=sd3``: ``cfg.path`` is a local diffusers SD3/SD3.5 pipeline folder."""
    if not cfg.path:
        raise UserError("model.name=sd3 needs model.path: a local diffusers StableDiffusion3Pipeline folder "
                        "(one holding model_index.json); weights are never downloaded")
    path = Path(cfg.path).expanduser()
    if not (path / "model_index.json").is_file():
        what = "does not exist" if not path.exists() else "has no model_index.json"
        raise UserError(f"model.path {str(path)!r} {what}: it must be a local diffusers StableDiffusion3Pipeline "
                        "folder (e.g. from `huggingface-cli download` or pipeline.save_pretrained)")
    from diffusers import StableDiffusion3Pipeline

    return load_policy(SD3Policy, StableDiffusion3Pipeline, path, cfg, torch_dtype(cfg.dtype), "an SD3",
                       **runtime_options(cfg))
