"""The generic adapter: any local diffusers pipeline folder with a flow-matching scheduler, no per-family class.

At construction, :class:`PipelinePolicy` runs the stock pipeline for two steps on three probe
prompts (:func:`~flowgrpo.diffusers.replay.step_record.record_pipeline`) and learns from what it saw:

* the latent layout: the scheduler's sample [B, ...] (packed tokens for FLUX / Qwen-Image, the VAE
  grid for SD3 / Z-Image); :attr:`latent_shape` is its shape without B. Where the pipeline's
  ``latents=`` argument has another layout (FLUX.2 packs it itself), :attr:`layout`
  (:mod:`~flowgrpo.diffusers.replay.latent_layout`) maps between the two (:meth:`pipeline_latents`);
* per transformer call of a step, how each argument is rebuilt (:class:`~flowgrpo.diffusers.replay.call_replay.CallLayout`);
* the timestep the transformer gets: ``a * sigma + b`` fitted from the two steps (SD3 / Wan ``1000
  sigma``, FLUX / Qwen-Image ``sigma``, Z-Image ``1 - sigma``), the simplest integers within the
  rounding of the dtype it was recorded in (:mod:`~flowgrpo.diffusers.replay.timestep_map`);
* how the step combines the call outputs into the velocity
  (:func:`~flowgrpo.diffusers.replay.velocity_combine.infer_combine`).

Prompt encoding runs the stock pipeline with the transformer stubbed (zeros) up to its first
scheduler step and keeps the prompt-dependent arguments; the training forward replays the recorded
calls on the policy's latents and sigmas with gradients. The sigma grid is the one the pipeline sets
on its scheduler. Decoding runs the stock pipeline's own tail: one step at zero velocity from the
given latents, ``output_type="pt"``. What a family needs beyond this is a
:class:`~flowgrpo.policies.diffusers.generic.families.PipelineFamily` entry.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from pathlib import Path

import torch
from torch import Tensor, nn

from flowgrpo.diffusers.replay.call_replay import CallLayout, sample_part
from flowgrpo.diffusers.replay.latent_layout import learn_layout
from flowgrpo.diffusers.replay.row_calls import mark_per_prompt, row, stack_rows
from flowgrpo.diffusers.replay.step_record import record_pipeline
from flowgrpo.diffusers.replay.timestep_map import fit_timestep_map
from flowgrpo.diffusers.replay.velocity_combine import infer_combine
from flowgrpo.errors import UserError
from flowgrpo.references import probe_references, quantize, resize_references, to_pil

from ...base import Conditioning
from ...base.lora import DEFAULT_LORA_INIT, lora_disabled
from ..common import make_trainable
from ..policy import DiffusersPolicy
from ..wan import is_flow_solver, wan_euler_scheduler
from .experts import ExpertSwitch, route_rows
from .families import PipelineFamily

PROBE_PROMPTS = ("a red cube on a table", "two blue spheres", "a photo of a cat")
#: steps of the stubbed run whose timesteps fit the sigma -> timestep map (many sigmas pin its rounding)
TIMESTEP_PROBE_STEPS = 24


class PipelinePolicy(DiffusersPolicy):
    """A policy over any flow-matching diffusers pipeline (see the module docstring).

    Args:
        pipeline: the stock pipeline (its modules become the policy's; it is kept, never trained).
        family: its :class:`~flowgrpo.policies.diffusers.generic.families.PipelineFamily` entry.
        resolution: image side in pixels; guidance_scale: the value of ``family.guidance_kwarg``.
        train_mode, lora_rank, lora_alpha, lora_targets, lora_init, dtype, decode_batch, switches: as
            :class:`~flowgrpo.policies.diffusers.sd3.SD3Policy` (``lora_targets`` default: the family's; a LoRA
            goes on every expert, and ``full`` needs a single one).
        max_sequence_length, num_frames: text tokens and video frames, passed to the pipeline when its
            ``__call__`` takes them.

    A scheduler that is a multistep solver on flow sigmas (Wan's UniPC) is replaced by flow-matching
    Euler at its ``flow_shift`` (the SDE steps need a one-step grid), as the ``wan`` adapter does.
    """

    # its calls are replayed as the pipeline batched them (cond and uncond in one call where it did so)
    can_detach_uncond = False

    def __init__(self, pipeline, family: PipelineFamily, *, resolution: int | None = None,
                 guidance_scale: float = 1.0, train_mode: str = "lora", lora_rank: int = 32, lora_alpha: float = 64.0,
                 lora_targets=None, lora_init: bool | str = DEFAULT_LORA_INIT, max_sequence_length: int | None = None,
                 num_frames: int | None = None,
                 dtype: torch.dtype | str = torch.float32, decode_batch: int | None = None, **switches):
        super().__init__(1.0)  # guidance lives in the recorded step, not in Policy.velocity's CFG
        self.model_name = type(pipeline).__name__
        self.family, self.cfg_scale = family, float(guidance_scale)
        if is_flow_solver(pipeline.scheduler):
            pipeline.scheduler = wan_euler_scheduler(pipeline.scheduler)
        self.switch = ExpertSwitch.of(pipeline, family.experts, family.boundary_config)
        modules = {n: m for n, m in pipeline.components.items() if isinstance(m, nn.Module) and (
            n in (*self.switch.names, "vae") or n.startswith("text_encoder"))}
        self.setup_modules(train_mode, dtype, **modules)
        pipeline.set_progress_bar_config(disable=True)  # its calls are the adapter's internals, not the user's
        object.__setattr__(self, "pipe", pipeline)
        self.resolution = int(resolution or family.resolution)
        self.max_sequence_length = int(max_sequence_length or family.max_sequence_length)
        self.num_frames = int(num_frames or family.num_frames)
        self.decode_batch = int(decode_batch or family.decode_batch)
        self._grids: dict[int, Tensor] = {}
        self._learn()
        self.make_trainable(lora_rank=lora_rank, lora_alpha=lora_alpha,
                            lora_targets=lora_targets or list(family.lora_targets), lora_init=lora_init)
        self.apply_switches(**switches)

    # ------------------------------------------------------------------ recording
    def _call_kwargs(self, prompts, steps: int, guidance: float | None = None, references: Tensor | None = None,
                     **extra) -> dict:
        """The ``__call__`` options of a recorded run over ``prompts``; an edit family's reference images
        ``references`` [B, 3, R, R] in [0, 1] (default: :func:`~flowgrpo.references.probe_references`)
        go to its ``reference_kwarg`` as PIL images."""
        params = inspect.signature(type(self.pipe).__call__).parameters
        kwargs = {"prompt": list(prompts), "height": self.resolution, "width": self.resolution,
                  "num_inference_steps": steps, "output_type": "latent",
                  "generator": torch.Generator(device="cpu").manual_seed(0)}
        if self.family.reference_kwarg is not None:
            refs = probe_references(len(prompts), self.resolution) if references is None else references
            kwargs[self.family.reference_kwarg] = to_pil(refs)
        if self.family.area_kwarg is not None:
            kwargs[self.family.area_kwarg] = self.resolution ** 2
        if "max_sequence_length" in params:
            kwargs["max_sequence_length"] = self.max_sequence_length
        if "num_frames" in params:
            kwargs["num_frames"] = self.num_frames
        if self.family.guidance_attr is None:  # else _record sets it on the pipeline
            kwargs[self.family.guidance_kwarg] = self.cfg_scale if guidance is None else guidance
        kwargs.update(self.family.call_kwargs)
        if self.family.reference_kwarg is not None and isinstance(kwargs.get("negative_prompt"), str):
            # one per prompt: Qwen-Image-Edit encodes each with its prompt's image (a string is one prompt)
            kwargs["negative_prompt"] = [kwargs["negative_prompt"]] * len(prompts)
        kwargs.update(extra)
        return kwargs

    def _learn(self) -> None:
        """Record two steps on the probe prompts and learn the layout, timestep map and guidance scheme."""
        one = self.family.prompts_per_call == 1  # probed with one prompt, the others compared with it
        rec = self._record(self._call_kwargs(PROBE_PROMPTS[:1] if one else PROBE_PROMPTS, 4), max_steps=2,
                           run_transformer=True)
        if len(rec.steps) < 2 or not rec.steps[0].calls:
            raise ValueError("no transformer call was recorded in its first two denoising steps")
        self.switch.check(rec.steps)
        first, second = rec.steps
        self.latent_shape = tuple(first.sample.shape[1:])
        self.layout = learn_layout(self.pipe, self._call_kwargs(PROBE_PROMPTS[:1], 4), first.sample[:1], self.dtype,
                                   self.switch.names)
        self.layouts = []
        for i, call in enumerate(first.calls):
            latent_key = next((k for k in ("hidden_states", "x") if k in call.kwargs), 0)
            ts_key = self.family.timestep_arg
            if isinstance(ts_key, str) and ts_key not in call.kwargs:
                raise ValueError(f"its transformer call has no {ts_key!r} argument (set PipelineFamily.timestep_arg)")
            self.layouts.append(CallLayout.learn(i, call, first.sample, latent_key, ts_key))
        if one:
            refs = probe_references(len(PROBE_PROMPTS), self.resolution)
            mark_per_prompt(self.layouts, first.calls, [self._record(
                self._call_kwargs([p], 4, references=refs[i:i + 1]), max_steps=1, run_transformer=False).steps[0].calls
                for i, p in enumerate(PROBE_PROMPTS) if i])
        self.timestep_map = self._learn_timestep_map()
        parts = torch.cat([o.output_parts for o in self._outputs(first)])
        combine = infer_combine(parts, self.cfg_scale, first.velocity)
        if combine is None:
            raise ValueError(f"its {len(parts)} transformer outputs per step combine into the velocity by no known "
                             "scheme (single, CFG, CFG with norm rescale)")
        self.combine = combine

    def _learn_timestep_map(self, steps: int = TIMESTEP_PROBE_STEPS):
        """The sigma -> timestep map, from every step of a ``steps``-step run with the transformer stubbed
        (cheap: the pipeline's text encoding once, then its loop at zero velocity), so that the exact
        rounding the pipeline applies is seen at many sigmas (:func:`fit_timestep_map`)."""
        rec = self._record(self._call_kwargs(PROBE_PROMPTS[:1], steps), max_steps=steps, run_transformer=False)
        ts = [self._timestep_value(step) for step in rec.steps]
        train_steps = getattr(self.pipe.scheduler.config, "num_train_timesteps", None)
        return fit_timestep_map([step.sigma for step in rec.steps], [float(t) for t in ts], ts[0].dtype, train_steps)

    def _record(self, call_kwargs: dict, guidance: float | None = None, **options):
        """:func:`~flowgrpo.diffusers.replay.step_record.record_pipeline` of this pipeline and its experts; where
        the family's guidance is a pipeline attribute (``guidance_attr``), it holds ``guidance`` (default:
        the policy's) for the call."""
        options = {"experts": self.switch.names, "sample_shape": getattr(self, "latent_shape", None), **options}
        if self.family.guidance_attr is None:
            return record_pipeline(self.pipe, call_kwargs, **options)
        *path, name = self.family.guidance_attr.split(".")
        owner = functools.reduce(getattr, path, self.pipe)
        old = getattr(owner, name)
        setattr(owner, name, self.cfg_scale if guidance is None else float(guidance))
        try:
            return record_pipeline(self.pipe, call_kwargs, **options)
        finally:
            setattr(owner, name, old)

    def _timestep_value(self, step) -> Tensor:
        """The timestep the step's first call received (its first element, a 0-d tensor in its dtype)."""
        call = step.calls[0]
        key = self.family.timestep_arg
        value = call.kwargs[key] if isinstance(key, str) else call.args[key]
        return torch.as_tensor(value).reshape(-1)[0]

    def _outputs(self, step):
        b = step.sample.shape[0]
        for layout, call in zip(self.layouts, step.calls):
            call.output_parts = sample_part(call.output, self.latent_shape).reshape(layout.k, b, *self.latent_shape)
            yield call

    # ------------------------------------------------------------------ experts: LoRA on each
    def _experts(self) -> list[nn.Module]:
        return [getattr(self, name) for name in self.switch.names]

    # ------------------------------------------------------------------ context parallelism (Wan experts)
    def context_parallel_networks(self) -> list[nn.Module]:
        """Every expert (``dist.context_parallel``, :mod:`flowgrpo.trainer.context_parallel`) where each is a
        Wan transformer (Wan 2.2 A14B's two, TI2V-5B's one); none for other pipelines."""
        experts = self._experts()
        return experts if all(type(e).__name__ == "WanTransformer3DModel" for e in experts) else []

    def context_parallel_tokens(self) -> int:
        """Transformer tokens of one sample: latent frames x (h / patch) x (w / patch) of :attr:`latent_shape`."""
        p = self._experts()[0].config.patch_size
        _, frames, h, w = self.latent_shape
        return (frames // p[0]) * (h // p[1]) * (w // p[2])

    def make_trainable(self, *, lora_rank: int, lora_alpha: float, lora_targets,
                       lora_init: bool | str = DEFAULT_LORA_INIT) -> None:
        """The trainable part of every expert for ``train_mode`` (``full``: one expert only)."""
        if self.train_mode == "full" and len(self.switch.names) > 1:
            raise ValueError(f"full fine-tuning of its {len(self.switch.names)} experts is not supported; "
                             "use model.train_mode=lora (a LoRA on each expert)")
        for module in self._experts():
            make_trainable(module, self.train_mode, lora_rank=lora_rank, lora_alpha=lora_alpha,
                           lora_targets=lora_targets, lora_init=lora_init, adapter_name=self.adapter_name)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Every expert's parameters that require grad (its LoRA, or the single transformer's weights)."""
        return [p for module in self._experts() for p in module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def adapter_disabled(self):
        """The base model: every expert's LoRA off (other modes: as :class:`TrainedPolicy`)."""
        if self.train_mode != "lora" or len(self.switch.names) == 1:
            with super().adapter_disabled():
                yield
            return
        with contextlib.ExitStack() as stack:
            for module in self._experts():
                stack.enter_context(lora_disabled(module))
            yield

    def train(self, mode: bool = True):
        """Every expert follows ``mode``; the VAE and text encoders stay in eval."""
        super().train(mode)
        for module in self._experts():
            module.train(mode)
        return self

    def apply_switches(self, **switches) -> None:
        """:meth:`SwitchedPolicy.apply_switches`, whose per-network switches (gradient checkpointing,
        attention backend, ``torch.compile`` whole or regional) act on ``transformer``, and the same on
        every further expert."""
        super().apply_switches(**switches)
        for module in self._experts()[1:]:
            if switches.get("gradient_checkpointing"):
                module.enable_gradient_checkpointing()
            self._set_attention_backend(switches.get("attention_backend", "sdpa"), [module])
            self._compile(module)

    def save_lora(self, directory: str | Path, weights: dict[str, Tensor] | None = None) -> Path:
        """The first expert's LoRA as :meth:`DiffusersPolicy.save_lora`; each further expert's in
        ``directory/<name>/`` (Wan 2.2: ``pipe.load_lora_weights(directory / "transformer_2",
        load_into_transformer_2=True)``)."""
        directory = super().save_lora(directory, weights)
        for name in self.switch.names[1:]:
            self.write_lora(directory / name, name, weights)
        return directory

    # ------------------------------------------------------------------ prompts and schedule
    @property
    def takes_references(self) -> bool:
        """Whether this is an image-editing pipeline: every prompt comes with a reference image."""
        return self.family.reference_kwarg is not None

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], references=None) -> Conditioning:
        """The pipeline's prompt encoding (:meth:`Policy.encode_prompts`); for an edit pipeline also its
        reference-image encoding, once per prompt: ``references`` (a list of [3, h, w] or a tensor [B, 3,
        h, w], in [0, 1]) are resized to ``resolution`` x ``resolution``, rounded to 8 bits and handed
        to the pipeline, whose image tokens (and, for Qwen-Image-Edit, its VL encoder's view of the
        image) become per-prompt conditioning. These encodings bypass the prompt cache (keyed by prompt
        only); with ``offload_text_encoders`` the encoders visit :attr:`device` for the call."""
        if not self.takes_references:
            return super().encode_prompts(prompts, references)
        if references is None or len(references) != len(prompts):
            raise UserError(f"{self.model_name} edits a reference image: each prompt needs one (a .jsonl prompt "
                            f"file with an \"image\" column), got {0 if references is None else len(references)} "
                            f"for {len(prompts)} prompts")
        refs = quantize(resize_references(references, self.resolution, self.resolution))
        if not self.offload_text_encoders:
            return Conditioning(self._encode_now(list(prompts), refs))
        self._text_encoders_to(self.device)  # for this call only, as the prompt cache's misses
        try:
            return Conditioning(self._encode_now(list(prompts), refs))
        finally:
            self._text_encoders_to("cpu")

    def _encode_now(self, prompts: list[str], references: Tensor | None = None) -> dict[str, Tensor]:
        if self.family.prompts_per_call == 1 and len(prompts) > 1:  # one call per prompt, stacked
            return stack_rows([self._encode_now([p], None if references is None else references[i:i + 1])
                               for i, p in enumerate(prompts)])
        rec = self._record(self._call_kwargs(prompts, 2, references=references), max_steps=1, run_transformer=False)
        calls = rec.steps[0].calls
        if len(calls) != len(self.layouts):
            raise ValueError(f"{self.model_name} made {len(calls)} transformer calls for these prompts, "
                             f"{len(self.layouts)} when probed")
        out: dict[str, Tensor] = {}
        for layout, call in zip(self.layouts, calls):
            out.update(layout.conditioning(call, len(prompts)))
        return out

    def sigma_grid(self, num_steps: int, shift: float | None = None) -> Tensor:
        """The float32 [num_steps + 1] grid the pipeline sets on its scheduler for ``num_steps`` steps
        (1 -> 0, CPU); ``shift`` is ignored: the pipeline and its scheduler config own it."""
        if num_steps not in self._grids:
            rec = self._record(self._call_kwargs([""], num_steps), max_steps=0, run_transformer=False)
            sigmas = rec.sigmas
            if sigmas is None or len(sigmas) != num_steps + 1 or float(sigmas[-1]) != 0.0 \
                    or not bool((sigmas[1:] < sigmas[:-1]).all()):
                raise ValueError(f"{type(self.pipe.scheduler).__name__} gives no flow-matching Euler grid of "
                                 f"{num_steps} steps ({None if sigmas is None else sigmas.tolist()[:4]}...)")
            self._grids[num_steps] = sigmas
        return self._grids[num_steps].clone()

    # ------------------------------------------------------------------ model
    def velocity(self, x: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float | None = None) -> Tensor:
        """Velocity [B, ...] (float32) for x [B, ...] at sigma [B]: the recorded calls replayed and combined
        as the pipeline does; ``guidance_scale`` (if given) replaces the recorded guidance value g."""
        g = self.cfg_scale if guidance_scale is None else float(guidance_scale)
        sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).reshape(-1).expand(x.shape[0])
        if self.family.prompts_per_call == 1 and x.shape[0] > 1:  # the transformer as the pipeline calls it
            return torch.cat([self.velocity(x[r:r + 1], sigma[r:r + 1], Conditioning(row(cond.tensors, r)), g)
                              for r in range(x.shape[0])])
        timestep = self.timestep_map(sigma)

        def run(expert: int, rows: Tensor | None) -> Tensor:  # [m, rows, ...]: every call's outputs
            module = getattr(self, self.switch.names[expert])
            if rows is None:
                return torch.cat([layout.call(module, x, timestep, cond.tensors) for layout in self.layouts])
            enc = {k: v[rows] for k, v in cond.tensors.items()}
            return torch.cat([layout.call(module, x[rows], timestep[rows], enc) for layout in self.layouts])

        parts = run(0, None) if self.switch.boundary is None else route_rows(self.switch, sigma, run)
        return self.combine(parts, g)

    def _forward(self, x: Tensor, sigma: Tensor, enc: dict[str, Tensor]) -> Tensor:
        return self.velocity(x, sigma, Conditioning(enc))

    def pipeline_latents(self, x: Tensor) -> Tensor:
        """Policy latents [B, *latent_shape] -> the stock pipeline's ``latents=`` argument [B, *layout.input_shape]
        (the same tensor unless the pipeline rearranges its ``latents=`` itself, as FLUX.2 packs them)."""
        return self.layout.to_pipeline(x)

    def policy_latents(self, z: Tensor) -> Tensor:
        """The inverse of :meth:`pipeline_latents`: the pipeline's ``latents=`` -> policy latents."""
        return self.layout.from_pipeline(z)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents [B, ...] -> images [B, 3, H, W] in [0, 1]: the stock pipeline's tail (one zero-velocity
        Euler step from ``latents``, guidance off, ``output_type="pt"``)."""
        images = []
        for chunk in latents.split(self.decode_batch):
            kwargs = self._call_kwargs([""] * len(chunk), 1, guidance=1.0, latents=self.pipeline_latents(chunk.float()),
                                       output_type="pt")
            kwargs.pop("negative_prompt", None)
            rec = self._record(kwargs, guidance=1.0, max_steps=2, run_transformer=False)
            images.append(torch.as_tensor(rec.output[0]).float())
        return torch.cat(images).clamp(0.0, 1.0)
