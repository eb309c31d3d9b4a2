"""The Flow-GRPO side of ``flowgrpo bench reference``: the reference implementation's own SD3 functions,
imported at run time from a checkout the user points to, and the training loop around them.

Nothing of Flow-GRPO (github.com/yifan123/flow_grpo) is copied into this repository. From the
checkout at ``path`` two functions are imported:

* ``flow_grpo.diffusers_patch.sd3_pipeline_with_logprob.pipeline_with_logprob`` -- its rollout: SD3
  denoising with classifier-free guidance, its SDE step and the per-step log-probs, then the VAE;
* ``flow_grpo.diffusers_patch.sd3_sde_with_logprob.sde_step_with_logprob`` -- the step whose mean,
  std and log-prob its update recomputes.

:func:`reference_update` is the update of its ``scripts/train_sd3.py`` written against those
functions (that loop sits inside the script's ``main`` and cannot be imported): for every timestep
j in order, a forward with gradients on the CFG-doubled batch (the unconditional half detached, as
its ``compute_log_prob`` does with ``train.cfg``), ``sde_step_with_logprob`` on the stored next
latents, the reference model's mean under ``disable_adapter()`` without gradients when beta > 0,
advantages clamped, the clipped ratio loss plus beta times the KL ``mean((mu - mu_ref)^2) / (2
std_dev_t^2)``, its approx-KL and clip-fraction statistics, and a backward of loss / T (the
gradient accumulation over the T timesteps of one sample batch); then one clipped optimizer step.

Stubs: the two modules need only torch and diffusers. Should a checkout's package ``__init__``
import what this environment lacks (``wandb``, ``ml_collections``, ``absl``), :func:`load_reference`
puts an empty module of that name into ``sys.modules`` and retries -- only inside the benchmark
process, and only for the names in :data:`STUBBABLE`; the functions timed never call into them.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

#: modules the reference's packages may import that the timed functions never use (stubbed when missing)
STUBBABLE = ("wandb", "ml_collections", "absl", "absl.flags", "absl.app", "ml_collections.config_flags")
PIPELINE_MODULE = "flow_grpo.diffusers_patch.sd3_pipeline_with_logprob"
SDE_MODULE = "flow_grpo.diffusers_patch.sd3_sde_with_logprob"


@dataclass
class ReferenceCode:
    """The reference's functions and the module the SDE step draws its noise in.

    Attributes:
        pipeline_with_logprob: ``(pipeline, **kwargs) -> (images, all_latents, all_log_probs)``.
        sde_step_with_logprob: ``(scheduler, model_output, timestep, sample, noise_level, prev_sample)
            -> (prev_sample, log_prob, prev_sample_mean, std_dev_t)``.
        sde_module: the module holding ``sde_step_with_logprob`` (its ``randn_tensor`` is swapped for
            replayed noise when both sides are checked to draw the same chains).
        path: the checkout.
    """

    pipeline_with_logprob: Callable
    sde_step_with_logprob: Callable
    sde_module: types.ModuleType
    path: Path


def load_reference(path: str | Path, pipeline_module: str = PIPELINE_MODULE) -> ReferenceCode:
    """Import the reference's ``pipeline_with_logprob`` from ``pipeline_module`` (default SD3's) of the
    Flow-GRPO checkout at ``path``, and the ``sde_step_with_logprob`` that pipeline steps with (SD3's
    ``sd3_sde_with_logprob``; FLUX's pipeline imports the same one).

    Raises FileNotFoundError when ``path`` has no such module file (an older checkout without FLUX)."""
    root = Path(path).expanduser().resolve()
    file = Path(*pipeline_module.split(".")).with_suffix(".py")
    if not (root / file).is_file():
        raise FileNotFoundError(f"{root} is not a Flow-GRPO checkout with {file}; clone github.com/yifan123/flow_grpo "
                                "(FLUX code since its 2025-07-28 release) and pass its folder")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for _ in range(len(STUBBABLE) + 1):
        try:
            pipe_mod = importlib.import_module(pipeline_module)
            break
        except ModuleNotFoundError as exc:
            if exc.name not in STUBBABLE or exc.name in sys.modules:
                raise
            sys.modules[exc.name] = types.ModuleType(exc.name)  # the timed functions never use it
    step = getattr(pipe_mod, "sde_step_with_logprob", None)
    sde_mod = sys.modules[step.__module__] if step is not None else importlib.import_module(SDE_MODULE)
    return ReferenceCode(pipe_mod.pipeline_with_logprob, sde_mod.sde_step_with_logprob, sde_mod, root)


def reference_pipeline(components: dict, lora_rank: int, lora_alpha: float, lora_targets: list[str]):
    """A stock ``StableDiffusion3Pipeline`` over ``components`` with a peft LoRA on its transformer,
    set up as the reference's script does (``get_peft_model``, float32 adapter)."""
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig, get_peft_model

    pipe = StableDiffusion3Pipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    for m in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        m.requires_grad_(False)
    pipe.transformer.requires_grad_(False)
    config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, init_lora_weights="gaussian", target_modules=lora_targets)
    pipe.transformer = get_peft_model(pipe.transformer, config)
    return pipe


@dataclass
class ReferenceSettings:
    """What both sides share. guidance_scale: CFG (also in the update, as ``train.cfg``); noise_level:
    the SDE's a; beta: KL weight; clip_range, adv_clip_max, max_grad_norm: the loss and step clips;
    max_sequence_length: T5 tokens; resolution: image side in pixels; num_steps: T."""

    num_steps: int
    guidance_scale: float
    noise_level: float
    beta: float
    clip_range: float
    adv_clip_max: float
    max_grad_norm: float
    max_sequence_length: int
    resolution: int


def encode(pipe, prompts: list[str], max_sequence_length: int) -> tuple[Tensor, Tensor]:
    """Prompt embeddings [B, S, D] and pooled [B, P] through the pipeline's own ``encode_prompt``
    (the reference encodes its prompts every epoch; the empty prompt once)."""
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt(prompts, prompts, prompts, do_classifier_free_guidance=False,
                                                  max_sequence_length=max_sequence_length)
    return embeds, pooled


def reference_rollout(code: ReferenceCode, pipe, prompts: list[str], per_prompt: int, neg: tuple[Tensor, Tensor],
                      s: ReferenceSettings, latents: Tensor | None = None, generator=None) -> dict:
    """One rollout with log-probs through ``pipeline_with_logprob``: prompts encoded, then
    ``per_prompt`` images per prompt (prompt-major rows, B = len(prompts) * per_prompt).

    Returns ``{"latents": [B, T, C, h, w] states before each step, "next_latents": [B, T, ...],
    "log_probs": [B, T], "timesteps": [B, T], "images": [B, 3, H, W], "embeds", "pooled": [B, ...]}``.
    """
    embeds, pooled = encode(pipe, prompts, s.max_sequence_length)
    embeds = embeds.repeat_interleave(per_prompt, 0)
    pooled = pooled.repeat_interleave(per_prompt, 0)
    b = embeds.shape[0]
    kwargs = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled,
                  negative_prompt_embeds=neg[0].expand(b, -1, -1), negative_pooled_prompt_embeds=neg[1].expand(b, -1),
                  num_inference_steps=s.num_steps, guidance_scale=s.guidance_scale, output_type="pt",
                  height=s.resolution, width=s.resolution, noise_level=s.noise_level, latents=latents,
                  generator=generator, max_sequence_length=s.max_sequence_length)
    accepted = inspect.signature(code.pipeline_with_logprob).parameters
    images, all_latents, all_log_probs = code.pipeline_with_logprob(
        pipe, **{k: v for k, v in kwargs.items() if k in accepted})
    lat = torch.stack(all_latents, dim=1)  # [B, T + 1, ...]
    timesteps = pipe.scheduler.timesteps.repeat(b, 1)
    return {"latents": lat[:, :-1], "next_latents": lat[:, 1:], "log_probs": torch.stack(all_log_probs, dim=1),
            "timesteps": timesteps, "images": images, "embeds": embeds, "pooled": pooled}


def _log_prob(code: ReferenceCode, pipe, sample: dict, j: int, embeds: Tensor, pooled: Tensor, s: ReferenceSettings):
    """Flow-GRPO's per-timestep recomputation (its ``compute_log_prob`` with ``train.cfg``). The latents
    enter the transformer in the prompt embeddings' dtype, as in its pipeline (a bf16 model's stored
    float32 states included; a no-op in float32)."""
    x, t = sample["latents"][:, j], sample["timesteps"][:, j]
    pred = pipe.transformer(hidden_states=torch.cat([x, x]).to(embeds.dtype), timestep=torch.cat([t, t]), encoder_hidden_states=embeds,
                            pooled_projections=pooled, return_dict=False)[0]
    uncond, text = pred.chunk(2)
    uncond = uncond.detach()
    pred = uncond + s.guidance_scale * (text - uncond)
    return code.sde_step_with_logprob(pipe.scheduler, pred.float(), t, x.float(),
                                      prev_sample=sample["next_latents"][:, j].float(), noise_level=s.noise_level)


def reference_update(code: ReferenceCode, pipe, optimizer, sample: dict, advantages: Tensor,
                     neg: tuple[Tensor, Tensor] | None, s: ReferenceSettings,
                     recompute: Callable[[int], tuple] | None = None) -> dict[str, float]:
    """One update over a rollout's transitions, as Flow-GRPO's training loop runs it (module docstring).

    ``sample``: :func:`reference_rollout`'s dict; ``advantages`` [B] (one per image, every timestep).
    ``recompute(j)``: the model's ``sde_step_with_logprob`` tuple at timestep j (default: SD3's with
    CFG over ``neg``; FLUX passes its own, :mod:`flowgrpo.benchmarks.reference_flux`).
    Returns the mean loss, policy loss, KL and approx-KL over the T timesteps and the first
    timestep's recomputed log-probs (``log_prob_0`` [B], equal to the rollout's before any step).
    """
    tr = pipe.transformer
    tr.train()
    b, steps = sample["latents"].shape[:2]
    if recompute is None:
        embeds = torch.cat([neg[0].expand(b, -1, -1), sample["embeds"]])
        pooled = torch.cat([neg[1].expand(b, -1), sample["pooled"]])

        def recompute(j: int) -> tuple:
            return _log_prob(code, pipe, sample, j, embeds, pooled, s)
    adv = advantages.reshape(b, 1).expand(b, steps)
    info: dict[str, list[Tensor]] = {"loss": [], "policy_loss": [], "kl_loss": [], "approx_kl": [], "clipfrac": []}
    first = None
    for j in range(steps):
        _, log_prob, mean, std_dev_t = recompute(j)
        if j == 0:
            first = log_prob.detach().clone()
        if s.beta > 0:
            with torch.no_grad(), tr.disable_adapter():
                _, _, mean_ref, _ = recompute(j)
        a = torch.clamp(adv[:, j], -s.adv_clip_max, s.adv_clip_max)
        ratio = torch.exp(log_prob - sample["log_probs"][:, j])
        unclipped = -a * ratio
        clipped = -a * torch.clamp(ratio, 1.0 - s.clip_range, 1.0 + s.clip_range)
        policy_loss = torch.mean(torch.maximum(unclipped, clipped))
        loss = policy_loss
        if s.beta > 0:
            kl = torch.mean(((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.ndim)), keepdim=True) / (2 * std_dev_t ** 2))
            loss = policy_loss + s.beta * kl
            info["kl_loss"].append(kl.detach())
        info["approx_kl"].append(0.5 * torch.mean((log_prob - sample["log_probs"][:, j]) ** 2).detach())
        info["clipfrac"].append(torch.mean((torch.abs(ratio - 1.0) > s.clip_range).float()).detach())
        info["policy_loss"].append(policy_loss.detach())
        info["loss"].append(loss.detach())
        (loss / steps).backward()  # accelerate divides by the accumulation steps (T timesteps per batch)
    torch.nn.utils.clip_grad_norm_([p for p in tr.parameters() if p.requires_grad], s.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tr.eval()
    out = {k: float(torch.stack(v).mean()) for k, v in info.items() if v}
    out["log_prob_0"] = first
    return out


class ReplayNoise:
    """Swaps the reference SDE module's ``randn_tensor`` for given noise tensors, in order (used only
    by the equality check: the reference otherwise draws its step noise from torch's global RNG)."""

    def __init__(self, code: ReferenceCode, noises: list[Tensor]):
        self.code, self.noises = code, list(noises)

    def __enter__(self):
        self.saved = self.code.sde_module.randn_tensor
        queue = iter(self.noises)

        def replay(shape, generator=None, device=None, dtype=None, **_):
            eps = next(queue)
            assert tuple(eps.shape) == tuple(shape), (eps.shape, shape)
            return eps.to(device=device, dtype=dtype)

        self.code.sde_module.randn_tensor = replay
        return self

    def __exit__(self, *exc):
        self.code.sde_module.randn_tensor = self.saved
        return False
