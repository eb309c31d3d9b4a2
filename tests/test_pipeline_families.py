"""Text-to-image families through the generic pipeline adapter, each on a tiny random pipeline saved to disk.

Per family: (a) Euler at noise 0 through flowgrpo = the stock pipeline's images for the same latents;
(b) on-policy ratio 1 on the first update; (c) 2 LoRA iterations move the LoRA, not the base;
(d) ``flowgrpo export`` gives a LoRA the stock pipeline loads and that reproduces the policy's
images; (e) an untrainable pipeline class gets one line naming what it lacks.
"""

from __future__ import annotations

import json
import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from flowgrpo.cli import main
from flowgrpo.config import ModelConfig, load_config
from flowgrpo.errors import UserError
from flowgrpo.policies import build_policy, resolve_adapter
from flowgrpo.policies.families import family_of
from flowgrpo.policies.families_tiny import save_tiny_pipeline
from flowgrpo.policies.generic import PipelinePolicy
from flowgrpo.samplers.solvers import solve_ode
from flowgrpo.trainer.checkpoint import latest_checkpoint, load_checkpoint
from flowgrpo.trainer.run import train

RES, SEQ, STEPS = 64, 32, 3
PROMPTS = ["a photo of a cat", "a mountain lake at dawn"]
#: family -> (guidance value, the adapter model.name=<folder> picks)
FAMILIES = {"sd35-large": (2.0, "sd3"), "z-image": (3.0, "pipeline")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, pipeline folder, guidance, run dir, run config): a 2-iteration LoRA run on the tiny pipeline."""
    name = request.param
    guidance = FAMILIES[name][0]
    root = tmp_path_factory.mktemp(name)
    base = save_tiny_pipeline(name, root / "base")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = load_config("shapes", None, [
        f"model.name={base}", "model.train_mode=lora", f"model.resolution={RES}", f"model.max_sequence_length={SEQ}",
        "model.lora_rank=4", "model.lora_alpha=8", f"model.guidance_scale={guidance}",
        "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompts}", "data.prompts_per_iteration=2",
        "data.trees_per_prompt=2", f"sampler.num_steps={STEPS}", "sampler.strategy=flow_grpo", "train.iterations=2",
        "train.threads=1", "train.lr=3e-2", "eval.evaluator=none", "log.progress=false", "log.trackers=[]",
        "log.checkpoint_every=1", f"log.out_dir={root}", "log.run_name=run",
    ])
    train(cfg)
    return name, base, guidance, root / "run", cfg


def stock(path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stock_images(pipe, noise, guidance):
    with torch.no_grad():
        # a copy: ZImagePipeline writes its chat-templated prompts into the list it is given
        return pipe(prompt=list(PROMPTS), height=RES, width=RES, num_inference_steps=STEPS, guidance_scale=guidance,
                    latents=noise.clone(), output_type="pt", max_sequence_length=SEQ).images


def policy_images(policy, noise):
    with torch.no_grad():
        cond = policy.encode_prompts(PROMPTS)
        vel = lambda x, s: policy.velocity(x, torch.full((x.shape[0],), s), cond).float()  # noqa: E731
        return policy.decode(solve_ode(vel, noise.clone(), policy.sigma_grid(STEPS)))


def test_a_euler_matches_the_stock_pipeline(family):
    name, base, guidance, _, cfg = family
    assert resolve_adapter(cfg.model)[0] == FAMILIES[name][1]
    frozen = ModelConfig(name=str(base), train_mode="frozen", resolution=RES, max_sequence_length=SEQ,
                         guidance_scale=guidance)
    pipe = stock(base)
    generic = PipelinePolicy(pipe, family_of(type(pipe).__name__), resolution=RES, max_sequence_length=SEQ,
                             guidance_scale=guidance, train_mode="frozen")
    noise = torch.randn(2, *generic.latent_shape, generator=torch.Generator().manual_seed(0))
    theirs = stock_images(stock(base), noise, guidance)
    for policy in (build_policy(frozen), generic):
        ours = policy_images(policy, noise)
        assert ours.shape == theirs.shape == (2, 3, RES, RES)
        assert (ours - theirs).abs().max() <= 1e-5, (type(policy).__name__, (ours - theirs).abs().max())


def test_bc_two_lora_iterations(family):
    _, base, _, run_dir, _ = family
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert rows[0]["onpolicy_ratio_maxdev"] < 1e-5
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    state = load_checkpoint(latest_checkpoint(run_dir))["trainer"]["trainable"]
    assert state and all("lora" in k for k in state)
    moved = [k for k, v in state.items() if "lora_B" in k and v.abs().max() > 0]  # B starts at zero
    assert moved
    # the base weights the policy was built from are the pipeline folder's (only the LoRA is saved/trained)
    policy = build_policy(ModelConfig(name=str(base), train_mode="lora", resolution=RES, max_sequence_length=SEQ,
                                      lora_rank=4, lora_alpha=8))
    assert set(policy.trainable_state_dict()) == set(state)


def test_d_export_loads_into_the_stock_pipeline(family, tmp_path):
    _, base, guidance, run_dir, cfg = family
    noise = torch.randn(2, *build_policy(cfg.model).latent_shape, generator=torch.Generator().manual_seed(3))
    assert main(["export", str(run_dir), "--to", str(tmp_path / "lora")]) == 0
    policy = build_policy(cfg.model)
    policy.load_trainable_state_dict(load_checkpoint(latest_checkpoint(run_dir))["trainer"]["ema"])
    ours = policy_images(policy, noise)
    pipe = stock(base)
    before = stock_images(pipe, noise, guidance)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    theirs = stock_images(pipe, noise, guidance)
    assert (theirs - before).abs().max() > 1e-4  # the trained LoRA changes the images
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


def test_e_untrainable_pipelines_get_one_line(tmp_path):
    cases = {"unet": ({"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
                       "scheduler": ["diffusers", "EulerDiscreteScheduler"]}, "names no transformer component"),
             "ddpm": ({"_class_name": "SomeDiTPipeline", "transformer": ["diffusers", "DiTTransformer2DModel"],
                       "scheduler": ["diffusers", "DDPMScheduler"]}, "'DDPMScheduler' is not a flow-matching one")}
    for folder, (index, needle) in cases.items():
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "model_index.json").write_text(json.dumps(index))
        with pytest.raises(UserError) as info:
            resolve_adapter(ModelConfig(name=str(tmp_path / folder)))
        assert needle in str(info.value) and "\n" not in str(info.value)
