"""The presets of the objectives beside GRPO (diffusion-nft, awm, dgpo, crd, flow-dppo, diffusion-dpo) train on
every test model: the shapes world (full fine-tuning), and tiny random SD3, FLUX and Wan pipelines with
LoRA, where the base weights must not move. Each runs 2 iterations shrunk to seconds (2 prompts x 2
samples, 3 steps). Flow-DPPO trains SDE transitions; the others train on the forward process."""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.trainer.trainer import Trainer

PRESETS = ["diffusion-nft", "awm", "dgpo", "crd", "shapes-nft", "flow-dppo", "diffusion-dpo"]
#: presets whose rows are the rollout's SDE transitions (the others train no transition)
SDE_PRESETS = ("flow-dppo",)
SMALL = ["data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=3", "train.iterations=2",
         "train.threads=1", "train.lr=1e-3", "log.progress=false", "eval.evaluator=none",
         "loss.nft.timesteps=2", "loss.awm.timesteps=2", "loss.dgpo.timesteps=2", "loss.crd.timesteps=2",
         # every group gets signal on random models
         "reward.weights={jpeg_compressibility: 1.0}"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from flowgrpo.policies.tiny.flux import save_tiny_flux_pipeline
    from flowgrpo.policies.tiny.wan import save_tiny_wan

    return {"flux": save_tiny_flux_pipeline(tmp_path_factory.mktemp("flux"), seed=0, guidance_embeds=True),
            "wan": save_tiny_wan(tmp_path_factory.mktemp("wan") / "tiny-wan")}


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("a photo of a cat\na red circle on a white table\na mountain lake at dawn\n")
    return f


def _model_overrides(model: str, dirs) -> list[str]:
    if model == "sd3":
        return ["model.name=sd3-tiny", "model.resolution=64", "model.max_sequence_length=16", "sampler.shift=3.0"]
    if model == "flux":
        return [f"model.name={dirs['flux']}", "model.resolution=32", "model.max_sequence_length=16"]
    return [f"model.name={dirs['wan']}", "model.resolution=32", "model.num_frames=5", "model.max_sequence_length=16"]


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("model", ["sd3", "flux", "wan"])
def test_preset_trains_lora_on_tiny_pipelines(preset, model, model_dirs, prompt_file):
    cfg = load_config(preset, None, [*_model_overrides(model, model_dirs), "model.train_mode=lora", "model.lora_rank=4",
                                     "model.lora_alpha=8", f"data.prompts={prompt_file}", *SMALL], recipe="shapes")
    trainer = Trainer(cfg)
    policy = trainer.policy
    before = policy.trainable_state_dict()
    assert before and all("lora" in k for k in before)
    ids = {id(p) for p in policy.trainable_parameters()}
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if id(p) not in ids and n.startswith("transformer")}
    metrics = [trainer.iteration_step().metrics for _ in range(2)]
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
        assert (m["trained_steps"] > 0) == (preset in SDE_PRESETS)
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    params = dict(policy.named_parameters())
    assert all(torch.equal(params[n].detach(), t) for n, t in base.items())


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_trains_the_shapes_world(preset, shapes_model_dir):
    cfg = load_config(preset, None, [f"model.path={shapes_model_dir}", *SMALL[:-1],
                                     "reward.weights={test_brightness: 1.0}"], recipe="shapes")
    trainer = Trainer(cfg)
    before = trainer.policy.trainable_state_dict()
    m = trainer.iteration_step().metrics
    assert math.isfinite(m["loss"]) and m["transitions" if preset in SDE_PRESETS else "rows"] > 0
    after = trainer.policy.trainable_state_dict()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 0
