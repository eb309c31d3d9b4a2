"""Policy adapter for Wan 2.1 text-to-video (diffusers ``WanPipeline`` components).

Latent space: ``[z_dim, F_lat, H/8, W/8]`` with ``F_lat = (num_frames - 1) // 4 + 1`` (the Wan VAE
compresses time 4x, keeping the first frame on its own; ``num_frames - 1`` must be a multiple of
4, e.g. 81 -> 21 latent frames). Prompts go through the pipeline's own ``encode_prompt`` (UMT5,
``max_sequence_length`` tokens, embeddings zeroed past each prompt's length); guidance uses the empty
prompt as the negative one (the pipeline's default), skipped when ``guidance_scale`` is 1. Wan's
stock pipelines use ``guidance_scale=5``; ``model.guidance_scale`` sets it here.

The transformer is called with ``timestep = 1000 * sigma`` (what ``WanPipeline.__call__`` passes:
the flow scheduler's timesteps are its sigmas times ``num_train_timesteps``). Decoding undoes the
VAE's per-channel ``latents_mean``/``latents_std`` normalisation as the pipeline does and then uses
the pipeline's ``video_processor`` -> videos ``[B, F, 3, H, W]`` in [0, 1].

Sigma grid: the stock Wan pipelines sample with ``UniPCMultistepScheduler`` (a multistep solver,
``flow_shift`` 3 at 480p, 5 at 720p). Flow-GRPO's SDE needs a one-step Euler-type grid, so
:meth:`WanPolicy.sigma_grid` uses ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` with the
pipeline scheduler's ``flow_shift`` (or its ``shift`` when it already is a flow-matching Euler
scheduler, whose grid is then used as is). ``sampler.shift`` is ignored, as for SD3.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor

from ...errors import UserError
from ..base.lora import DEFAULT_LORA_INIT
from .common import load_policy, scheduler_grid, set_model_options
from .policy import DiffusersPolicy
from .switches import runtime_options, torch_dtype

# self- (attn1) and cross-attention (attn2) projections and the feed-forward of every Wan block
WAN_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def is_flow_solver(scheduler) -> bool:
    """Whether ``scheduler`` is not flow-matching Euler but a multistep solver on flow sigmas predicting
    flow (Wan's ``UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction")``)."""
    config = getattr(scheduler, "config", None) or {}
    return "FlowMatch" not in type(scheduler).__name__ and bool(config.get("use_flow_sigmas")) \
        and config.get("prediction_type") == "flow_prediction"


def wan_euler_scheduler(scheduler=None):
    """The flow-matching Euler scheduler whose grid Wan rollouts use (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return copy.deepcopy(scheduler)
    config = scheduler.config if scheduler is not None else {}
    shift = config.get("flow_shift", config.get("shift", 3.0))
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.get("num_train_timesteps", 1000),
                                           shift=float(shift if shift is not None else 3.0))


class WanPolicy(DiffusersPolicy):
    """Wraps the components of a Wan 2.1 ``WanPipeline`` (text to video).

    Args:
        transformer, vae, text_encoder, tokenizer, scheduler: the pipeline's components (the
            scheduler only sets the sigma grid's shift; it is never stepped).
        resolution: frame side in pixels (square frames); num_frames: frames per video (4k + 1).
        guidance_scale, train_mode, lora_rank, lora_alpha, lora_targets, lora_init, dtype, decode_batch: as
            :class:`~flowgrpo.policies.diffusers.sd3.SD3Policy`.
        max_sequence_length: UMT5 tokens (the stock pipeline uses 512).
        switches: the model switches, as :meth:`~flowgrpo.policies.diffusers.switches.SwitchedPolicy.apply_switches`
            (the same for every adapter; Wan's ``AutoencoderKLWan`` slices and tiles like the image VAEs).
    """

    model_name = "Wan"
    evaluator = None

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler=None, *, resolution: int = 480,
                 num_frames: int = 81, guidance_scale: float = 5.0, train_mode: str = "lora", lora_rank: int = 32,
                 lora_alpha: float = 64.0, lora_targets: list[str] | str | None = None,
                 lora_init: bool | str = DEFAULT_LORA_INIT, max_sequence_length: int = 512,
                 dtype: torch.dtype | str = torch.float32, decode_batch: int = 1, **switches):
        super().__init__(guidance_scale)
        from diffusers import WanPipeline

        self.tokenizer = tokenizer
        self.setup_modules(train_mode, dtype, transformer=transformer, vae=vae, text_encoder=text_encoder)
        self.scheduler = wan_euler_scheduler(scheduler)
        # the stock pipeline over the same modules: its encode_prompt / video_processor are reused
        object.__setattr__(self, "pipe", WanPipeline(tokenizer=tokenizer, text_encoder=self.text_encoder,
                                                     vae=self.vae, scheduler=self.scheduler,
                                                     transformer=self.transformer))
        self.max_sequence_length = int(max_sequence_length)
        self.decode_batch = int(decode_batch)

        temporal, spatial = self.pipe.vae_scale_factor_temporal, self.pipe.vae_scale_factor_spatial
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ValueError(f"num_frames {num_frames}: num_frames - 1 must be a non-negative multiple of {temporal} "
                             f"(the Wan VAE's temporal compression), e.g. 81, 49, 17 or 5")
        patch = self.transformer.config.patch_size
        step = spatial * max(patch[1], patch[2])
        if resolution <= 0 or resolution % step:
            raise ValueError(f"resolution {resolution} must be a positive multiple of {step} "
                             f"(VAE factor {spatial} x patch size {patch[1]})")
        self.resolution, self.num_frames = int(resolution), int(num_frames)
        side = resolution // spatial
        self.latent_shape = (self.vae.config.z_dim, (num_frames - 1) // temporal + 1, side, side)

        self.make_trainable(lora_rank=lora_rank, lora_alpha=lora_alpha, lora_targets=lora_targets or WAN_LORA_TARGETS,
                            lora_init=lora_init)
        self.apply_switches(**switches)

    @classmethod
    def from_components(cls, components: dict, **kwargs) -> "WanPolicy":
        """From a ``pipeline.components``-style dict (Wan 2.2's ``transformer_2`` is not supported)."""
        if components.get("transformer_2") is not None:
            raise ValueError("two-stage Wan 2.2 pipelines (transformer_2) are not supported; use a Wan 2.1 T2V one")
        names = ["transformer", "vae", "text_encoder", "tokenizer", "scheduler"]
        return cls(**{n: components.get(n) for n in names}, **kwargs)

    # ------------------------------------------------------------------ context parallelism
    def context_parallel_networks(self) -> list:
        """The networks ``dist.context_parallel`` splits the tokens of (:mod:`flowgrpo.trainer.context_parallel`):
        the transformer, and the frozen reference copy that full fine-tuning keeps for KL."""
        frozen = getattr(self, "_frozen", None)
        return [self.transformer] + ([frozen] if frozen is not None else [])

    def context_parallel_tokens(self) -> int:
        """Transformer tokens of one sample: latent frames x (h / patch) x (w / patch)."""
        p = self.transformer.config.patch_size
        _, frames, h, w = self.latent_shape
        return (frames // p[0]) * (h // p[1]) * (w // p[2])

    # ------------------------------------------------------------------ prompts
    def _encode_now(self, prompts: list[str]) -> dict[str, Tensor]:
        embeds, _ = self.pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length, device=self.device,
                                            dtype=self.dtype)
        return {"prompt_embeds": embeds}

    # ------------------------------------------------------------------ schedule
    def sigma_grid(self, num_steps: int, shift: float | None = None) -> Tensor:
        """``scheduler.sigmas`` after ``set_timesteps(num_steps)`` on a copy of the flow-matching Euler
        scheduler (float32 [num_steps + 1], 1 -> 0, CPU). ``shift`` is ignored: the pipeline's
        ``flow_shift`` owns it."""
        return scheduler_grid(self.scheduler, num_steps)

    # ------------------------------------------------------------------ model
    def _forward(self, x: Tensor, sigma: Tensor, enc: dict[str, Tensor]) -> Tensor:
        # WanPipeline.__call__: timestep = the flow scheduler's timestep, i.e. sigma * num_train_timesteps
        timestep = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).reshape(-1).expand(x.shape[0]) * 1000.0
        out = self.transformer(hidden_states=x.to(self.dtype), timestep=timestep,
                               encoder_hidden_states=enc["prompt_embeds"].to(self.dtype), return_dict=False)
        return out[0]

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents [B, C, F_lat, h, w] -> videos [B, F, 3, H, W] in [0, 1] (``WanPipeline.__call__``'s tail)."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        videos = []
        for chunk in latents.split(self.decode_batch):
            z = chunk.to(self.vae.dtype)
            z = z * std.to(z.device, z.dtype) + mean.to(z.device, z.dtype)
            video = self.vae.decode(z, return_dict=False)[0]
            videos.append(self.pipe.video_processor.postprocess_video(video, output_type="pt"))
        return torch.cat(videos).float().clamp(0.0, 1.0)


def build_wan_policy(cfg) -> WanPolicy:
    """Factory for ``model.name=wan`` (or a WanPipeline directory as ``model.name``): ``cfg.path`` is a
    local diffusers ``WanPipeline`` folder; ``model.num_frames`` frames of ``model.resolution`` pixels."""
    path = Path(cfg.path or "").expanduser()
    if not cfg.path or not (path / "model_index.json").is_file():
        raise UserError(f"model.name=wan needs model.path to be a local diffusers WanPipeline folder holding "
                        f"model_index.json (got {cfg.path!r}); weights are never downloaded")
    from diffusers import WanPipeline

    return load_policy(WanPolicy, WanPipeline, path, cfg, torch_dtype(cfg.dtype), "a Wan",
                       **set_model_options(cfg, ("num_frames",)), **runtime_options(cfg))
