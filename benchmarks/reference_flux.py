"""The Flow-GRPO side of ``bench gpu``'s FLUX stage: its own FLUX functions from a checkout, and its update.

Nothing of Flow-GRPO (github.com/yifan123/flow_grpo, FLUX support since its 2025-07-28 release)
is copied here. From the checkout :func:`load_flux_reference` imports
``flow_grpo.diffusers_patch.flux_pipeline_with_logprob.pipeline_with_logprob`` (FLUX.1 denoising
with guidance embedded, no CFG, 2x2-packed latents [B, n, 64], returning the images, every state,
the image and text position ids and the per-step log-probs) and the ``sde_step_with_logprob`` it
steps with (its SD3 one). :class:`FluxReferenceSide` is its ``scripts/train_flux.py`` loop around
them: a stock ``FluxPipeline`` with a peft LoRA, prompts encoded each iteration, the rollout, and
per timestep in order a forward with gradients (``timestep / 1000``, the embedded guidance, text
ids zero), ``sde_step_with_logprob`` on the stored next state, the base model's mean under
``disable_adapter()`` for the KL term, and its clipped loss (the shared loop of
:func:`flowgrpo.benchmarks.reference_flow_grpo.reference_update`). Its script encodes prompts
with its own ``encode_prompt`` (the same CLIP pooled and T5 calls); the pipeline's is used here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference_flow_grpo import ReferenceCode, ReferenceSettings, load_reference, reference_update

FLUX_PIPELINE_MODULE = "flow_grpo.diffusers_patch.flux_pipeline_with_logprob"


def load_flux_reference(path) -> ReferenceCode:
    """Flow-GRPO's FLUX ``pipeline_with_logprob`` and its SDE step from the checkout at ``path``
    (FileNotFoundError, naming the file, for a checkout older than its FLUX support)."""
    return load_reference(path, FLUX_PIPELINE_MODULE)


def flux_reference_pipeline(components: dict, lora_rank: int, lora_alpha: float, lora_targets):
    """A stock ``FluxPipeline`` over ``components`` with a peft LoRA on its transformer (as its script:
    ``get_peft_model``, gaussian init; ``lora_targets`` a list or a regex)."""
    from diffusers import FluxPipeline
    from peft import LoraConfig, get_peft_model

    names = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "transformer")
    pipe = FluxPipeline(**{k: components[k] for k in names})
    pipe.set_progress_bar_config(disable=True)
    for m in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.transformer):
        m.requires_grad_(False)
    targets = lora_targets if isinstance(lora_targets, str) else list(lora_targets)
    config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, init_lora_weights="gaussian", target_modules=targets)
    pipe.transformer = get_peft_model(pipe.transformer, config)
    return pipe


def pack_flux(x: Tensor) -> Tensor:
    """flowgrpo's FLUX state [B, C, H, W] -> the pipeline's packed tokens [B, H/2 * W/2, 4C]."""
    from diffusers import FluxPipeline

    b, c, h, w = x.shape
    return FluxPipeline._pack_latents(x, b, c, h, w)


class FluxReferenceSide:
    """Flow-GRPO's FLUX rollout and update (module docstring) over ``components``; the rollout /
    update interface of :class:`flowgrpo.benchmarks.bench_reference.ReferenceSide`."""

    def __init__(self, code: ReferenceCode, s: ReferenceSettings, group: int, lora_targets, components: dict,
                 lora_rank: int = 32, lora_alpha: float = 64.0):
        self.code, self.s, self.group = code, s, group
        self.pipe = flux_reference_pipeline(components, lora_rank, lora_alpha, lora_targets)
        params = [p for p in self.pipe.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """T5 token features [B, S, D] and CLIP pooled [B, P], ``group`` rows per prompt."""
        with torch.no_grad():
            embeds, pooled, _ = self.pipe.encode_prompt(prompts, prompts, max_sequence_length=self.s.max_sequence_length)
        return embeds.repeat_interleave(self.group, 0), pooled.repeat_interleave(self.group, 0)

    def rollout(self, prompts: list[str], iteration: int, latents: Tensor | None = None) -> dict:
        """``{"latents", "next_latents": [B, T, n, 64], "log_probs", "timesteps": [B, T], "images",
        "embeds", "pooled", "image_ids": [n, 3]}``; ``latents`` (packed) replays given initial states."""
        s = self.s
        self.pipe.transformer.eval()
        embeds, pooled = self.encode(prompts)
        images, states, image_ids, _, log_probs = self.code.pipeline_with_logprob(
            self.pipe, prompt_embeds=embeds, pooled_prompt_embeds=pooled, num_inference_steps=s.num_steps,
            guidance_scale=s.guidance_scale, output_type="pt", height=s.resolution, width=s.resolution,
            noise_level=s.noise_level, latents=latents, max_sequence_length=s.max_sequence_length)
        lat = torch.stack(states, dim=1)
        return {"latents": lat[:, :-1], "next_latents": lat[:, 1:], "log_probs": torch.stack(log_probs, dim=1),
                "timesteps": self.pipe.scheduler.timesteps.repeat(lat.shape[0], 1), "images": images,
                "embeds": embeds, "pooled": pooled, "image_ids": image_ids}

    def _recompute(self, sample: dict, j: int) -> tuple:
        """Its ``compute_log_prob``: the transformer at state j, then the SDE step's log-prob of state j + 1."""
        x, t = sample["latents"][:, j], sample["timesteps"][:, j]
        tr = self.pipe.transformer
        guidance = None
        if tr.config.guidance_embeds:
            guidance = torch.tensor([self.s.guidance_scale], device=x.device).expand(x.shape[0])
        embeds = sample["embeds"]
        pred = tr(hidden_states=x, timestep=t / 1000, guidance=guidance, pooled_projections=sample["pooled"],
                  encoder_hidden_states=embeds, txt_ids=torch.zeros(embeds.shape[1], 3, device=x.device, dtype=x.dtype),
                  img_ids=sample["image_ids"], return_dict=False)[0]
        return self.code.sde_step_with_logprob(self.pipe.scheduler, pred.float(), t, x.float(),
                                               prev_sample=sample["next_latents"][:, j].float(),
                                               noise_level=self.s.noise_level)

    def update(self, out: dict, rewards: Tensor, iteration: int) -> dict[str, float]:
        """Per-prompt z-score of ``rewards`` [B] (population std + 1e-4), then its update."""
        r = rewards.to(out["log_probs"].device).view(-1, self.group)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-4)).reshape(-1)
        return reference_update(self.code, self.pipe, self.optimizer, out, adv, None, self.s,
                                recompute=lambda j: self._recompute(out, j))
