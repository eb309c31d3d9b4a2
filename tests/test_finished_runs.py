"""Any finished run can be evaluated, sampled and exported, whatever it trained with.

Found before: a run trained with ``eval.evaluator=none`` could not be evaluated afterwards (``flowgrpo eval
RUN`` -> "evaluation disabled", ``eval.evaluator=auto`` -> "unrecognized arguments"); a run trained from
Python with a function as its reward could not be evaluated or sampled (``config key 'reward.weights':
unknown reward 'warmth'``), though neither needs the reward; the default world's full fine-tune could
not be exported (``not a LoRA run``).
"""

from __future__ import annotations

import json

import pytest
import torch

import flowgrpo
from flowgrpo.cli import main
from flowgrpo.shapes.model import ShapesFlowModel
from flowgrpo.trainer.checkpoint import load_trained_policy

TINY = ["train.iterations=1", "data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=3",
        "eval.evaluator=none", "train.max_minutes=0", "log.progress=false", "log.trackers=[]", "log.grid_every=0"]
EVAL = ["eval.num_prompts=4", "eval.seeds_per_prompt=1", "eval.num_steps=3", "eval.seen=false"]


def warmth(images, prompts):
    """Red minus blue: a reward no registry knows."""
    return (images[:, 0] - images[:, 2]).flatten(1).mean(1)


@pytest.fixture(scope="module")
def function_run(tmp_path_factory):
    """A shapes run (full fine-tuning, no evaluator) trained with a Python function as its reward."""
    out = tmp_path_factory.mktemp("runs")
    cfg = flowgrpo.load_config(overrides=[*TINY, f"log.out_dir={out}", "log.run_name=fn"])
    flowgrpo.train(trainer=flowgrpo.Trainer.from_config(cfg, rewards={"warmth": warmth}))
    run = out / "fn"
    assert "warmth" in (run / "config.yaml").read_text()
    return run


def test_a_run_without_an_evaluator_is_evaluated_with_one_named_on_the_command_line(function_run, tmp_path, capsys):
    assert main(["eval", str(function_run)]) == 2  # the run's own setting, said as it is
    assert "evaluation disabled" in capsys.readouterr().err
    out = tmp_path / "eval.json"
    assert main(["eval", str(function_run), "--evaluator", "auto", *EVAL, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert 0.0 <= res["accuracy"] <= 1.0 and res["num_samples"] == 4
    # the same with the key written as an override
    assert main(["eval", str(function_run), "eval.evaluator=shapes", *EVAL]) == 0


def test_eval_takes_eval_settings_only(function_run, capsys):
    assert main(["eval", str(function_run), "train.lr=3"]) == 2
    assert "eval.KEY=VALUE settings only, got 'train.lr=3'" in capsys.readouterr().err


def test_a_function_rewards_run_samples_without_its_reward(function_run, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\ntwo blue squares\n")
    assert main(["sample", str(function_run), "--prompts", str(prompts), "--out", str(tmp_path / "s")]) == 0
    assert len(list((tmp_path / "s").glob("*.png"))) == 3  # two images and the grid


def test_the_default_worlds_full_fine_tune_exports_its_weights_folder(function_run, tmp_path, capsys):
    to = tmp_path / "weights"
    assert main(["export", str(function_run), "--to", str(to), "--fuse"]) == 2
    assert "--fuse fuses a LoRA" in capsys.readouterr().err
    assert main(["export", str(function_run), "--to", str(to)]) == 0
    exported = ShapesFlowModel.load(to).state_dict()
    trained = load_trained_policy(function_run).policy.model.state_dict()
    base = ShapesFlowModel.load().state_dict()
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in exported)  # the run's (EMA) weights, bit for bit
    assert any(not torch.equal(exported[k], base[k]) for k in exported)  # and not the base's


def test_a_diffusers_full_fine_tune_exports_the_pipeline_with_its_trained_transformer(tmp_path):
    from diffusers import DiffusionPipeline

    from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline

    base = tmp_path / "base"
    tiny_sd3_pipeline().save_pretrained(base)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a photo of a cat\na red apple\n")
    assert main(["train", f"model.name={base}", "model.train_mode=full", "model.dtype=float32", "model.resolution=64",
                 "model.max_sequence_length=16", f"data.prompts={prompts}", "reward.weights={jpeg_compressibility: 1.0}",
                 "train.lr=1e-2", *TINY, f"log.out_dir={tmp_path}", "log.run_name=full"]) == 0
    assert main(["export", str(tmp_path / "full"), "--to", str(tmp_path / "pipe")]) == 0
    exported = DiffusionPipeline.from_pretrained(tmp_path / "pipe").transformer.state_dict()
    trained = load_trained_policy(tmp_path / "full").policy.transformer.state_dict()
    before = DiffusionPipeline.from_pretrained(base).transformer.state_dict()
    assert all(torch.equal(exported[k], trained[k]) for k in exported)
    assert any(not torch.equal(exported[k], before[k]) for k in exported)
