"""train.lr_schedule (the rate a run's optimizer really uses, resumed runs included) and the
evaluation's seed standard error (against the spread of independent seed sets)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import tiny_overrides
from flowgrpo.config import load_config
from flowgrpo.evaluators import seed_standard_error
from flowgrpo.trainer.lr_schedule import lr_factor, run_progress


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_decaying_schedule_runs_from_one_to_the_final_fraction_without_rising(schedule):
    p = np.linspace(0, 1, 101)
    f = np.array([lr_factor(schedule, x, 0.2) for x in p])
    assert f[0] == pytest.approx(1.0) and f[-1] == pytest.approx(0.2)
    assert np.all(np.diff(f) <= 1e-12)
    assert lr_factor(schedule, -0.5, 0.2) == f[0] and lr_factor(schedule, 7.0, 0.2) == f[-1]  # clamped
    if schedule == "cosine":  # point-symmetric about the middle: as far above the midpoint early as below it late
        assert np.allclose(f + f[::-1], 1.2)
    assert lr_factor("constant", 0.7, 0.2) == 1.0
    with pytest.raises(ValueError, match="valid: constant, cosine, linear"):
        lr_factor("step", 0.5, 0.2)


def test_progress_is_the_larger_of_iterations_and_minutes_done():
    assert run_progress(5, 10, 0.0, 0.0) == 0.5
    assert run_progress(5, 100000, 450.0, 15.0) == pytest.approx(0.5)  # a time-budgeted run: its minutes
    assert run_progress(8, 10, 60.0, 15.0) == 0.8
    assert run_progress(12, 10, 9999.0, 15.0) == 1.0


def _train(tmp_path, name, **extra):
    from flowgrpo.trainer.run import train

    base = {"train.iterations": 4, "eval.evaluator": "none", "log.out_dir": str(tmp_path), "log.run_name": name,
            "log.trackers": "[]", "log.checkpoint_every": 2, "train.lr": 1e-3}
    base.update(extra)
    # the shipped base (model.path null): its rollouts have reward spread, so every iteration trains
    return load_config("shapes", None, tiny_overrides("null", **base)), train


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_optimizer_steps_with_the_scheduled_rate_and_a_resumed_run_continues_it(tmp_path):
    from flowgrpo.trainer.checkpoint import latest_checkpoint, load_policy_weights

    cfg, train = _train(tmp_path, "linear", **{"train.lr_schedule": "linear", "train.lr_final": 0.25})
    train(cfg)
    lrs = [r["lr"] for r in _records(tmp_path / "linear")]
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] < lrs[0]
    assert all(b < a for a, b in zip(lrs, lrs[1:]))
    assert lrs[-1] == pytest.approx(1e-3 * lr_factor("linear", 3 / 4, 0.25))

    # the first iteration runs at the full rate in both runs: same weights after it; different after two
    cfg_c, _ = _train(tmp_path, "constant", **{"train.iterations": 2, "log.checkpoint_every": 1})
    train(cfg_c)
    cfg_l, _ = _train(tmp_path, "linear2", **{"train.iterations": 2, "log.checkpoint_every": 1,
                                              "train.lr_schedule": "linear", "train.lr_final": 0.25})
    train(cfg_l)

    def weights(run, it):
        return load_policy_weights(tmp_path / run, prefer_ema=False, checkpoint=it).weights

    assert [r["lr"] for r in _records(tmp_path / "constant")] == [1e-3, 1e-3]
    first_c, first_l = weights("constant", 1), weights("linear2", 1)
    assert all(torch.equal(first_c[k], first_l[k]) for k in first_c)
    last_c, last_l = weights("constant", 2), weights("linear2", 2)
    assert any(not torch.equal(last_c[k], last_l[k]) for k in last_c)

    # a run interrupted after 2 of its 4 iterations and resumed logs the rates of the uninterrupted one
    from flowgrpo.callbacks import Callback
    from flowgrpo.trainer.trainer import Trainer

    class StopAfterTwo(Callback):
        def on_iteration_end(self, trainer, metrics):
            if metrics["iteration"] == 1:
                trainer.callbacks.request_stop("interrupted by the test")

    cfg_r, _ = _train(tmp_path, "resumed", **{"train.lr_schedule": "linear", "train.lr_final": 0.25})
    assert train(cfg_r, trainer=Trainer(cfg_r, callbacks=[StopAfterTwo()]))["iterations"] == 2
    assert latest_checkpoint(tmp_path / "resumed") is not None
    train(cfg_r, run_dir=tmp_path / "resumed", resume=True)
    assert [r["lr"] for r in _records(tmp_path / "resumed")] == pytest.approx(lrs)


def test_a_bad_schedule_is_one_line_naming_the_valid_ones(tmp_path):
    from flowgrpo.errors import ConfigError

    with pytest.raises(ConfigError, match="train.lr_schedule.*constant.*cosine.*linear"):
        _train(tmp_path, "bad", **{"train.lr_schedule": "step"})


def test_the_seed_standard_error_matches_the_spread_of_independent_seed_sets():
    rng = np.random.default_rng(0)
    p = rng.uniform(0.05, 0.95, size=30)  # 30 prompts, each its own success rate
    groups = [f"prompt {i}" for i in range(30) for _ in range(8)]
    sets = [rng.random((30, 8)) < p[:, None] for _ in range(4000)]  # 4000 evaluations: new seeds, same prompts
    spread = np.std([s.mean() for s in sets])
    estimates = [seed_standard_error(s.reshape(-1).astype(float).tolist(), groups) for s in sets[:200]]
    assert np.mean(estimates) == pytest.approx(spread, rel=0.05)
    # the binomial formula over all samples counts the between-prompt spread too, which a new seed set
    # does not move: it overstates
    binomial = np.mean([np.sqrt(s.mean() * (1 - s.mean()) / s.size) for s in sets[:200]])
    assert binomial > 1.1 * spread
    # one sample a prompt: the within-prompt spread cannot be told apart; all samples' variance stands in
    x = [1.0, 0.0, 1.0, 1.0]
    assert seed_standard_error(x, ["a", "b", "c", "d"]) == pytest.approx(np.std(x, ddof=1) / 2)
    with pytest.raises(ValueError, match="4 verdicts but 3 group keys"):
        seed_standard_error(x, ["a", "b", "c"])


def test_the_shapes_evaluation_reports_its_standard_error(tmp_path, shapes_model_dir):
    from flowgrpo.shapes.evaluate import evaluate_policy, heldout_prompts
    from flowgrpo.shapes.model import ShapesFlowModel
    from flowgrpo.shapes.policy import ShapesPolicy

    policy = ShapesPolicy(ShapesFlowModel.load(shapes_model_dir), train_mode="frozen")
    res = evaluate_policy(policy, num_prompts=6, seeds_per_prompt=3, num_steps=2)
    prompts = heldout_prompts(6, 3)[0]
    assert res.accuracy_se == pytest.approx(seed_standard_error(res.correct, prompts))
    assert res.to_json()["accuracy_se"] == res.accuracy_se and res.metrics()["eval_accuracy_se"] == res.accuracy_se


def test_the_default_recipe_evaluates_with_a_seed_standard_error_of_at_most_0_015():
    cfg = load_config(None, None, [])
    n = cfg.eval.num_prompts * cfg.eval.seeds_per_prompt
    assert np.sqrt(0.25 / n) <= 0.015  # the worst case, accuracy 0.5, one independent noise per sample
