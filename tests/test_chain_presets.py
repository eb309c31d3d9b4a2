"""The chain-method presets run end to end: 2 iterations on the shapes world (random tiny model) and
on the tiny random SD3, on-policy ratio exactly 1 on the first update."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.trainer.run import train
from flowgrpo.trainer.trainer import GRPOTrainer

torch.set_num_threads(1)

PRESETS = ["flow-grpo", "dance-grpo", "mix-grpo", "mix-grpo-flash", "mix-grpo-flash-star", "pref-grpo"]
EXPECTED_STRATEGY = {"flow-grpo": "flow_grpo", "dance-grpo": "dance_grpo", "mix-grpo": "mix_grpo",
                     "mix-grpo-flash": "mix_grpo_flash", "mix-grpo-flash-star": "mix_grpo_flash_star",
                     "pref-grpo": "flow_grpo"}


def overrides(model_dir, preset, world, prompt_file=None):
    ov = [f"model.path={model_dir}", "data.prompts_per_iteration=2", "data.group_size=4", "sampler.num_steps=6",
          "eval.num_prompts=2", "eval.seeds_per_prompt=1", "eval.num_steps=2", "train.threads=1",
          "log.progress=false", "log.tensorboard=false", "loss.backend=reference"]
    if preset.startswith("mix-grpo"):
        ov.append("strategy.window=2")  # T = 6: leave room for the window to move and a compressed tail
        if preset != "mix-grpo-flash-star":
            ov.append("strategy.shift_every=1")
    if world == "sd3":
        ov += ["model.name=sd3-tiny", "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompt_file}"]
    elif preset == "pref-grpo":
        # a random model draws nothing the verifier reads, so the pairwise judge ties everywhere: a
        # continuous reward beside it gives the groups signal
        ov.append("reward.weights={shapes_pairwise: 1.0, test_brightness: 1.0}")
    else:
        ov.append("reward.weights={test_brightness: 1.0}")
    return ov


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("a red circle left of a blue square\ntwo green triangles\na photo of a cat\n")
    return p


def test_presets_describe_themselves():
    for preset in PRESETS:
        cfg = load_config(preset)
        assert cfg.description and cfg.model.name == "shapes" and cfg.data.prompts == "shapes"
        assert cfg.sampler.strategy == EXPECTED_STRATEGY[preset]
    assert load_config("pref-grpo").reward.weights == {"shapes_pairwise": 1.0}
    assert load_config("pref-grpo").reward.combine == "normalize_then_sum"


@pytest.mark.parametrize("world", ["shapes", "sd3"])
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_two_iterations(preset, world, shapes_model_dir, prompt_file):
    cfg = load_config(preset, None, overrides(shapes_model_dir, preset, world, prompt_file))
    trainer = GRPOTrainer(cfg)
    records = [trainer.iteration_step().metrics for _ in range(2)]
    assert trainer.iteration == 2
    updates = [m for m in records if "onpolicy_ratio_maxdev" in m]
    assert updates, f"{preset}/{world}: no iteration carried signal"
    assert updates[0]["onpolicy_ratio_maxdev"] < 1e-6
    for m in records:
        assert m["nfe_rollout"] == trainer.strategy.plan(m["iteration"]).nfe(8)
    plan0 = trainer.strategy.plan(0)
    if preset.startswith("mix-grpo"):
        assert updates[0]["trained_steps"] == 2  # only the window is trained
    if preset == "mix-grpo":
        assert trainer.strategy.window_start(1) == 1
    if preset == "mix-grpo-flash":
        assert plan0.num_steps == 2 + 2 and records[0]["nfe_rollout"] == 8 * 4  # round(4 * 0.4) = 2 dpm2 steps
    if preset == "mix-grpo-flash-star":
        assert plan0.num_steps == 2 + 1 and records[0]["nfe_rollout"] == 8 * 3  # round(4 * 0.2) -> 1
    if preset == "dance-grpo":
        assert updates[0]["trained_steps"] == 4  # round(0.6 * 6)
    if preset == "pref-grpo" and world == "shapes":
        assert "reward.shapes_pairwise" in records[0]
        assert 0.0 <= records[0]["reward.shapes_pairwise"] <= 1.0


def test_train_run_directory(shapes_model_dir, tmp_path):
    cfg = load_config("mix-grpo-flash", None, overrides(shapes_model_dir, "mix-grpo-flash", "shapes") +
                      ["train.iterations=2", "log.checkpoint_every=1", "log.grid_every=0"])
    summary = train(cfg, tmp_path / "run")
    assert summary["iterations"] == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1]
