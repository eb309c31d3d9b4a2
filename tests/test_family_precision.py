"""Every tiny pipeline family trains under the default recipe in its own precision (bf16) and in float32.

``flowgrpo train model.name=DIR`` picks the ``diffusers`` recipe, whose ``model.dtype`` is bfloat16:
that is the path every user of a real checkpoint takes. Per family and dtype:

* (a) two LoRA iterations through the CLI: exit 0, finite losses, the LoRA moves, the first update is
  on-policy (ratio 1);
* (b) for the generic adapter, the velocity it replays equals the stock pipeline's (loaded by diffusers
  in the same dtype) at every step of a 3-step run within the dtype's rounding, amplified by the
  guidance combination (a CFG velocity ``u + g (c - u)`` carries ``1 + 2g`` times its parts' rounding).
* (c) for the generic adapter, the exported LoRA loaded into the stock pipeline (in the run's dtype)
  steps with the trained policy's velocity, within the same tolerance as (b);

The generic adapter learns its maps from what the pipeline hands its transformer; in bf16 those
tensors are rounded (Qwen-Image's timestep is ``t.to(bf16) / 1000``, Wan 2.2 combines its CFG in
bf16), which the float32-only tests of ``test_pipeline_families.py`` never exercise.
"""

from __future__ import annotations

import json
import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from flowgrpo.cli import main
from flowgrpo.config import ModelConfig
from flowgrpo.policies import build_policy
from flowgrpo.policies.diffusers.generic.adapter import PipelinePolicy
from flowgrpo.policies.diffusers.wan import is_flow_solver
from flowgrpo.policies.diffusers.wan import wan_euler_scheduler
from flowgrpo.policies.tiny.families import save_tiny_pipeline
from flowgrpo.references import probe_references
from flowgrpo.trainer.checkpoint import latest_checkpoint, load_checkpoint, load_trained_policy

PROMPTS = ["a photo of a cat", "a mountain lake at dawn"]

#: family -> the model options of its tiny run (resolution, text tokens, frames, guidance)
FAMILIES = {
    "sd3": dict(resolution=64, seq=32, guidance=2.0),
    "sd35-large": dict(resolution=64, seq=32, guidance=2.0),
    "flux": dict(resolution=64, seq=32, guidance=3.0),
    "wan21": dict(resolution=32, seq=16, guidance=4.0, frames=5),
    "z-image": dict(resolution=64, seq=32, guidance=3.0),
    "qwen-image": dict(resolution=32, seq=200, guidance=3.0),
    "flux2": dict(resolution=32, seq=256, guidance=3.0),
    "wan22-a14b": dict(resolution=32, seq=16, guidance=4.0, frames=5),
    "wan22-5b": dict(resolution=64, seq=16, guidance=4.0, frames=5),
    "hunyuan-video15": dict(resolution=16, guidance=4.0, frames=5),
    "flux-kontext": dict(resolution=32, seq=32, guidance=2.5, edit=True),
    "qwen-image-edit": dict(resolution=64, seq=256, guidance=3.0, edit=True),
}


#: families whose CPU runs take minutes (HunyuanVideo 1.5 pads every prompt to 1,256 text tokens;
#: Qwen-Image-Edit resizes each reference to ~1024^2 for its VAE): run with `pytest -m slow`
SLOW = {"hunyuan-video15", "qwen-image-edit"}


def cases(names) -> list:
    """``names`` as pytest params, those in :data:`SLOW` marked slow."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(names)]


def save_family(name: str, directory):
    """The tiny pipeline folder of ``name`` (the dedicated adapters' builders for sd3 / flux / wan21)."""
    if name == "sd3":
        from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline

        tiny_sd3_pipeline().save_pretrained(str(directory))
        return directory
    if name == "flux":
        from flowgrpo.policies.tiny.flux import save_tiny_flux_pipeline

        return save_tiny_flux_pipeline(directory)
    if name == "wan21":
        from flowgrpo.policies.tiny.wan import save_tiny_wan

        return save_tiny_wan(directory)
    return save_tiny_pipeline(name, directory)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Family name -> its pipeline folder (written once, on first use)."""
    root = tmp_path_factory.mktemp("families")
    made = {}

    def get(name):
        if name not in made:
            made[name] = save_family(name, root / name)
        return made[name]

    return get


def prompt_file(root, edit: bool):
    """A prompt file of :data:`PROMPTS`; for an edit family a .jsonl with a reference PNG per prompt."""
    if not edit:
        path = root / "prompts.txt"
        path.write_text("\n".join(PROMPTS) + "\n")
        return path
    from torchvision.utils import save_image

    refs = probe_references(len(PROMPTS), 48)
    lines = []
    for i, p in enumerate(PROMPTS):
        save_image(refs[i], root / f"ref{i}.png")
        lines.append(json.dumps({"prompt": p, "image": f"ref{i}.png"}))
    path = root / "edits.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def model_overrides(options: dict) -> list[str]:
    out = [f"model.resolution={options['resolution']}", f"model.guidance_scale={options['guidance']}"]
    if "seq" in options:
        out.append(f"model.max_sequence_length={options['seq']}")
    if "frames" in options:
        out.append(f"model.num_frames={options['frames']}")
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", cases(FAMILIES))
def test_a_default_recipe_trains_two_lora_iterations(name, dtype, folders, tmp_path):
    options = FAMILIES[name]
    folder = folders(name)
    argv = ["train", f"model.name={folder}", *model_overrides(options),
            f"data.prompts={prompt_file(tmp_path, options.get('edit', False))}", "data.prompts_per_iteration=2",
            "data.trees_per_prompt=2", "sampler.num_steps=2", "train.iterations=2", "train.micro_batch=4",
            "model.lora_rank=4", "model.lora_alpha=8", "train.lr=3e-2", "reward.weights={jpeg_compressibility: 1.0}",
            "reward.frame_stride=1", "log.progress=false", "log.trackers=[]", "log.checkpoint_every=1",
            f"log.out_dir={tmp_path}", "log.run_name=run"]
    if dtype != "bfloat16":  # bf16 is the recipe's own: it is not overridden
        argv.append(f"model.dtype={dtype}")
    assert main(argv) == 0
    run = tmp_path / "run"
    assert f"dtype: {dtype}" in (run / "config.yaml").read_text()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    print(f"\n[{name} {dtype}] losses {[round(r['loss'], 5) for r in rows]}, "
          f"on-policy ratio max |r - 1| {rows[0]['onpolicy_ratio_maxdev']:.3g}")
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    assert rows[0]["onpolicy_ratio_maxdev"] < (1e-5 if dtype == "float32" else 1e-3)
    state = load_checkpoint(latest_checkpoint(run))["trainer"]["trainable"]
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in state.items())
    if name not in GENERIC:
        return
    # (c) exported, the LoRA in the stock pipeline (in the run's dtype) steps as the trained policy does
    assert main(["export", str(run), "--to", str(tmp_path / "lora")]) == 0
    pipe = stock_pipeline(folder, getattr(torch, dtype))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    if (tmp_path / "lora" / "transformer_2").is_dir():
        pipe.load_lora_weights(str(tmp_path / "lora" / "transformer_2"), load_into_transformer_2=True)
    trained = load_trained_policy(run).policy.eval()
    assert_replay_is_the_pipelines(trained, pipe, name, options, dtype, "trained policy vs stock + exported LoRA")


def stock_pipeline(folder, dtype: torch.dtype):
    """The folder's pipeline as diffusers loads it in ``dtype`` (Wan's UniPC replaced by flow-matching Euler
    at its flow_shift, as the adapter does)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
    if is_flow_solver(pipe.scheduler):
        pipe.scheduler = wan_euler_scheduler(pipe.scheduler)
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: the generic adapter's families (HunyuanVideo 1.5's velocity is compared in test_pipeline_families)
GENERIC = [n for n in FAMILIES if n not in ("sd3", "sd35-large", "flux", "wan21", "hunyuan-video15")]


def assert_replay_is_the_pipelines(policy, pipe, name: str, options: dict, dtype: str, what: str) -> None:
    """The velocity ``policy`` replays equals the one ``pipe`` (a stock pipeline in ``dtype``) steps with, at
    every step of a 3-step run from the same noise, within the dtype's rounding amplified by guidance."""
    from flowgrpo.diffusers.replay.step_record import record_pipeline

    torch_dtype = getattr(torch, dtype)
    refs = probe_references(len(PROMPTS), options["resolution"]) if policy.takes_references else None
    cond = policy.encode_prompts(PROMPTS, refs)
    x = torch.randn(len(PROMPTS), *policy.latent_shape, generator=torch.Generator().manual_seed(1))
    x = x.to(torch_dtype).float()  # representable in the pipeline's dtype
    kwargs = policy._call_kwargs(PROMPTS, 3, references=refs, latents=policy.pipeline_latents(x).to(torch_dtype))
    rec = record_pipeline(pipe, kwargs, max_steps=3, run_transformer=True, experts=policy.switch.names)
    assert len(rec.steps) == 3
    eps = max(torch.finfo(torch_dtype).eps, 1e-6)
    g = options["guidance"] if policy.combine.kind != "single" else 0.0
    for step in rec.steps:
        with torch.no_grad():
            ours = policy.velocity(step.sample.float(), torch.full((len(PROMPTS),), step.sigma), cond).float()
        theirs = step.velocity.float()
        rel = float((ours - theirs).abs().max() / theirs.abs().max())
        print(f"\n[{name} {dtype}] {what}, sigma {step.sigma:.3f}: max rel {rel:.3g}")
        assert rel <= 2 * eps * (1 + 2 * g), rel


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", cases(GENERIC))
def test_b_replayed_velocity_is_the_stock_pipelines(name, dtype, folders):
    options = FAMILIES[name]
    policy = build_policy(ModelConfig(name=str(folders(name)), dtype=dtype, resolution=options["resolution"],
                                      guidance_scale=options["guidance"], train_mode="frozen",
                                      max_sequence_length=options.get("seq"), num_frames=options.get("frames")))
    assert isinstance(policy, PipelinePolicy)
    assert_replay_is_the_pipelines(policy, stock_pipeline(folders(name), getattr(torch, dtype)), name, options, dtype,
                                   "replayed vs stock velocity")
