"""A run whose rewards cannot score its images stops with one line instead of training nothing
(issue 21 item 6): a reward that reads only one model's images is refused on another model before
anything loads, and an iteration whose images all score NaN under a reward stops the run before a
checkpoint or LoRA is written."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli, tiny_overrides

from flowgrpo.config import load_config
from flowgrpo.errors import UserError
from flowgrpo.trainer.trainer import Trainer


@pytest.mark.parametrize("reward", ["shapes", "shapes_correct", "shapes_pairwise"])
def test_shapes_reward_on_another_model_is_refused_up_front(reward):
    cfg = load_config("shapes", None, ["model.name=sd3-tiny", "model.train_mode=lora", f"reward.weights={{{reward}: 1.0}}",
                                       "data.prompts=shapes", "log.progress=false"], recipe="shapes")
    with pytest.raises(UserError) as err:
        Trainer(cfg)
    msg = str(err.value)
    assert f"reward {reward!r}" in msg and "sd3-tiny" in msg and "reward.weights" in msg and "\n" not in msg


def test_every_reward_nan_stops_the_run_with_one_line_and_writes_nothing(tmp_path):
    # in the world's vocabulary, but not prompts its verifier can parse: every image scores NaN. A model
    # with the word-level encoder (which reads any in-vocabulary words) draws them; the scene encoder
    # refuses such prompts before sampling (tests/test_scene_text.py)
    from flowgrpo.shapes.model import ShapesFlowModel, ShapesModelConfig

    torch.manual_seed(0)
    ShapesFlowModel(ShapesModelConfig(num_layers=1, text_encoder="words")).save(tmp_path / "words_model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("red blue green\nleft of above\n")
    out = tmp_path / "runs"
    args = ["train", *tiny_overrides(tmp_path / "words_model", **{"data.prompts": prompts, "eval.evaluator": "none"}),
            f"log.out_dir={out}", "log.run_name=allnan"]
    proc = run_cli(args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "reward 'shapes' gave NaN for all 8 images of iteration 0" in err[0], proc.stderr
    assert "Traceback" not in proc.stderr
    run = out / "allnan"
    assert not list(run.glob("checkpoints/ckpt_*")) and not (run / "lora").exists()


def test_a_reward_nan_on_some_images_only_drops_them(tiny_config):
    # the other half of the rule: a partly-NaN iteration trains on what scored (NaN leaves dropped)
    cfg = tiny_config(**{"reward.weights": "{shapes: 1.0}"})
    trainer = Trainer(cfg)
    score = trainer.score

    def half_nan(images, prompts, groups, *rest):
        scores, comps = score(images, prompts, groups, *rest)
        scores["shapes"][::2] = float("nan")
        return scores, comps

    trainer.score = half_nan
    m = trainer.iteration_step().metrics
    assert m["nan_rewards_dropped"] == 4 and m["reward_mean"] == m["reward_mean"]
