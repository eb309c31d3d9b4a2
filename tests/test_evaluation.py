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


def test_each_evaluation_logs_its_tags_and_a_resumed_run_keeps_them_in_its_curve(tmp_path, shapes_model_dir):
    """``eval_accuracy.<tag>`` in every evaluation's metrics line; the summary's curve carries each
    point's ``per_tag``, the points before a resume rebuilt from those lines."""
    from flowgrpo.cli import main

    over = tiny_overrides(shapes_model_dir, **{"eval.every": 1, "eval.num_prompts": 6, "log.trackers": "[]",
                                               "log.out_dir": str(tmp_path), "log.run_name": "r"})
    assert main(["train", *over]) == 0
    run = tmp_path / "r"
    assert main(["train", "--resume", str(run), "train.iterations=4"]) == 0
    lines = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    evaluated = [ln for ln in lines if "eval_accuracy" in ln]
    summary = json.loads((run / "summary.json").read_text())
    tags = set(summary["eval_before"]["per_tag"])
    assert len(tags) >= 2
    # one evaluation after each iteration but each run's last (iteration 1: the first run's final one, 3:
    # the summary's own)
    assert [ln["iteration"] for ln in evaluated] == [0, 2]
    for ln in evaluated:
        logged = {k.split(".", 1)[1]: v for k, v in ln.items() if k.startswith("eval_accuracy.")}
        assert set(logged) == tags and all(0.0 <= v <= 1.0 for v in logged.values())
    curve = summary["eval_curve"]
    assert [c["iteration"] for c in curve] == [0, 1, 3, 4]
    assert curve[0]["per_tag"] == summary["eval_before"]["per_tag"]
    assert curve[-1]["per_tag"] == summary["eval_after"]["per_tag"]
    for point, ln in zip(curve[1:-1], evaluated):  # point 1 comes from the first run's line, rebuilt on resume
        assert point["per_tag"] == {k.split(".", 1)[1]: v for k, v in ln.items() if k.startswith("eval_accuracy.")}


def test_the_accuracy_curve_draws_a_tag_panel_only_when_every_point_has_the_tags(tmp_path):
    import imageio.v3 as iio

    from flowgrpo.output.plots import save_accuracy_curve

    tagged = [{"train_seconds": 60.0 * i, "accuracy": a, "per_tag": {"counting": a / 2, "position": a}}
              for i, a in enumerate((0.4, 0.6, 0.7))]
    untagged_point = [*tagged[:2], {k: v for k, v in tagged[2].items() if k != "per_tag"}]  # a resumed old run
    widths = {}
    for name, curve in (("tagged", tagged), ("mixed", untagged_point), ("one_tag", [
            dict(c, per_tag={"counting": c["accuracy"]}) for c in tagged])):
        save_accuracy_curve(tmp_path / f"{name}.png", curve, 32)
        widths[name] = iio.imread(tmp_path / f"{name}.png").shape[1]
    assert widths["tagged"] > 1.5 * widths["mixed"] and widths["mixed"] == widths["one_tag"]
