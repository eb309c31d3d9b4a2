"""Editing runs beyond training: held-out evaluation with the references (eval.evaluator=edit) and
`flowgrpo sample` of an edit run, on the tiny FLUX.1-Kontext pipeline."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest
import torch

from flowgrpo.cli import main
from flowgrpo.config import EvalConfig, ModelConfig
from flowgrpo.evaluation.edit import EditEvaluator
from flowgrpo.errors import ConfigError, UserError
from flowgrpo.images import to_uint8
from flowgrpo.policies import build_policy
from flowgrpo.policies.tiny.families import save_tiny_pipeline
from flowgrpo.references import resize_references
from flowgrpo.rewards import build_reward

from test_edit_families import edit_prompt_file

STEPS, RES = 3, 32


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    """(pipeline folder, edits.jsonl, references, a file with the references swapped, run dir)."""
    root = tmp_path_factory.mktemp("kontext")
    base = save_tiny_pipeline("flux-kontext", root / "base")
    prompts, refs = edit_prompt_file(root)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    swapped = prompts.with_name("swapped.jsonl")
    swapped.write_text("".join(json.dumps({**r, "image": rows[1 - i]["image"]}) + "\n" for i, r in enumerate(rows)))
    argv = ["train", "--preset", "shapes", "--recipe", "shapes", f"model.name={base}", "model.train_mode=lora",
            f"model.resolution={RES}", "model.max_sequence_length=32", "model.lora_rank=4", "model.guidance_scale=3.0",
            "reward.weights={edit_consistency: 1.0}", f"data.prompts={prompts}", "data.prompts_per_iteration=2",
            "data.trees_per_prompt=2", f"sampler.num_steps={STEPS}", "sampler.strategy=flow_grpo", "train.iterations=1",
            "train.threads=1",
            "eval.evaluator=edit", "eval.seen=false", "eval.num_prompts=2", "eval.seeds_per_prompt=2",
            f"eval.num_steps={STEPS}", f"eval.options.prompts={prompts}", "eval.options.threshold=0.3",
            "log.progress=false", "log.trackers=[]", f"log.out_dir={root}", "log.run_name=run"]
    assert main(argv) == 0
    return base, prompts, refs, swapped, root / "run"


def evaluator(prompts, **options) -> EditEvaluator:
    return EditEvaluator(EvalConfig(evaluator="edit", seen=False, num_prompts=2, seeds_per_prompt=2, num_steps=STEPS,
                                    options={"prompts": str(prompts), **options}))


def test_an_edit_run_is_evaluated_with_its_references(kontext):
    base, prompts, refs, swapped, run_dir = kontext
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["evaluation"] == "edit"
    for key in ("eval_before", "eval_after"):
        assert summary[key]["num_samples"] == 4 and set(summary[key]["per_tag"]) == {"t0", "t1"}

    policy = build_policy(ModelConfig(name=str(base), train_mode="frozen", resolution=RES, max_sequence_length=32,
                                      guidance_scale=3.0))
    res = evaluator(prompts, threshold=0.3).evaluate(policy, keep_images=True)
    # the scores are the reward's on the drawn images with each prompt's reference at their size
    sized = resize_references([refs[i // 2] for i in range(4)], RES, RES)
    expected = build_reward("edit_consistency")(res.images, res.prompts, torch.arange(4) // 2, references=sized).scores
    assert res.score == pytest.approx(float(expected.mean()), abs=1e-6)
    assert res.correct == [float(s >= 0.3) for s in expected.tolist()]
    # the references condition the drawing: the same prompts with each other's references draw other images
    other = evaluator(swapped).evaluate(policy, keep_images=True)
    assert (other.images - res.images).abs().max() > 1e-3
    # the same evaluation again: the same images (fixed seeds)
    assert torch.equal(evaluator(prompts).evaluate(policy, keep_images=True).images, res.images)


def test_edit_evaluator_errors(kontext, tmp_path):
    _, prompts, _, _, _ = kontext
    plain = tmp_path / "plain.txt"
    plain.write_text("make it red\n")
    with pytest.raises(ConfigError, match="needs eval.options.prompts"):
        EditEvaluator(EvalConfig(evaluator="edit", seen=False))
    with pytest.raises(ConfigError, match="set eval.seen=false"):
        EditEvaluator(EvalConfig(evaluator="edit", options={"prompts": str(prompts)}))
    with pytest.raises(ConfigError, match="names no reference images"):
        evaluator(plain)
    with pytest.raises(ConfigError, match="unknown eval.options thresh for the edit evaluator"):
        evaluator(prompts, thresh=1)
    with pytest.raises(UserError, match="takes no reference images"):
        evaluator(prompts).evaluate(build_policy(ModelConfig(name="sd3-tiny", resolution=64, max_sequence_length=16)))


def test_sample_an_edit_run(kontext, tmp_path):
    base, prompts, _, _, run_dir = kontext
    out = tmp_path / "out"
    assert main(["sample", str(run_dir), "--prompts", str(prompts), "--out", str(out), "--images-per-prompt", "2",
                 "--quiet"]) == 0
    files = np.stack([iio.imread(out / f"{i:04d}_{j}.png") for i in range(2) for j in range(2)])
    assert files.shape == (4, RES, RES, 3)
    # the run's trained policy under the edit evaluator (same seeds, steps and batch) draws the same images
    from flowgrpo.trainer.checkpoint import load_trained_policy

    res = evaluator(prompts).evaluate(load_trained_policy(run_dir).policy, keep_images=True)
    assert np.array_equal(to_uint8(res.images), files)
    plain = tmp_path / "plain.txt"
    plain.write_text("make it red\n")
    assert main(["sample", str(run_dir), "--prompts", str(plain), "--out", str(tmp_path / "x"), "--quiet"]) == 2
    assert not (tmp_path / "x").exists()
