"""Evaluation is pluggable: the shapes world brings its evaluator, a model without one trains and says so."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_overrides

from flowgrpo.config import EvalConfig, load_config
from flowgrpo.errors import UserError
from flowgrpo.evaluation import EVALUATORS, EvalResult, build_evaluator, paired_gain


class _NoEvaluatorPolicy:
    evaluator = None


class _ShapesLike:
    evaluator = "shapes"


def test_the_evaluator_follows_eval_evaluator_and_the_policy():
    ev, note = build_evaluator(EvalConfig(), _ShapesLike())
    assert ev.name == "shapes" and note == ""
    ev, note = build_evaluator(EvalConfig(), _NoEvaluatorPolicy())
    assert ev is None and "no held-out evaluator" in note and "shapes" in note
    ev, note = build_evaluator(EvalConfig(evaluator="none"), _ShapesLike())
    assert ev is None and "eval.evaluator=none" in note
    ev, _ = build_evaluator(EvalConfig(evaluator="shapes"), _NoEvaluatorPolicy())  # an explicit choice wins
    assert ev.name == "shapes"
    with pytest.raises(UserError, match="unknown evaluator 'nope'; valid choices: bench, edit, shapes, unigenbench"):
        build_evaluator(EvalConfig(evaluator="nope"), _ShapesLike())
    assert EVALUATORS.names() == ["bench", "edit", "shapes", "unigenbench"]


def test_eval_result_json_and_paired_gain():
    before = EvalResult(accuracy=0.25, per_tag={"colors": 0.5, "counting": 0.0}, num_samples=4, score=0.5,
                        correct=[1.0, 0.0, 0.0, 0.0])
    after = EvalResult(accuracy=0.75, per_tag={"colors": 1.0, "counting": 0.5}, num_samples=4, score=0.8,
                       correct=[1.0, 1.0, 1.0, 0.0])
    rec = before.to_json()
    assert "correct" not in rec and "images" not in rec and rec["accuracy"] == 0.25
    assert json.loads(json.dumps(before.to_json(with_correct=True)))["correct"] == [1.0, 0.0, 0.0, 0.0]
    gain, se = paired_gain(before.correct, after.correct)
    # differences (0, 1, 1, 0): mean 0.5, sample std sqrt(1/3), s.e. sqrt(1/3) / 2
    assert gain == pytest.approx(0.5) and se == pytest.approx((1 / 3) ** 0.5 / 2)


def test_a_model_without_an_evaluator_trains_and_the_summary_says_why(tmp_path):
    from flowgrpo.trainer.run import train

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\na mountain lake at dawn\n")
    cfg = load_config("flow-grpo", None, [
        "model.name=sd3-tiny", "model.resolution=64", "model.max_sequence_length=16", "model.lora_rank=4",
        "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompts}", "data.prompts_per_iteration=2",
        "data.trees_per_prompt=2", "sampler.num_steps=3", "train.iterations=1", "train.max_minutes=0",
        "train.threads=1", "log.progress=false", "log.trackers=[]", f"log.out_dir={tmp_path}",
        "log.run_name=sd3", "eval.every_minutes=0"], recipe="shapes")
    summary = train(cfg)
    assert summary["iterations"] == 1
    assert summary["eval_before"] is None and summary["eval_after"] is None and summary["accuracy_gain"] is None
    assert "no held-out evaluator" in summary["evaluation"]
    run = tmp_path / "sd3"
    assert json.loads((run / "summary.json").read_text())["evaluation"] == summary["evaluation"]
    assert not (run / "eval_before.json").exists() and (run / "reward_curve.png").exists()


def test_the_shapes_world_summary_names_its_evaluator(tmp_path, shapes_model_dir):
    from flowgrpo.trainer.run import train

    cfg = load_config("shapes", None, tiny_overrides(shapes_model_dir, **{
        "train.iterations": 1, "log.out_dir": str(tmp_path), "log.run_name": "s", "log.trackers": "[]"}),
        recipe="shapes")
    summary = train(cfg)
    assert summary["evaluation"] == "shapes"
    assert summary["eval_after"]["num_samples"] == cfg.eval.num_prompts * cfg.eval.seeds_per_prompt
    before = json.loads((tmp_path / "s" / "eval_before.json").read_text())
    assert len(before["correct"]) == summary["eval_before"]["num_samples"]
