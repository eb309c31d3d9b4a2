"""Experiment trackers through accelerate: TensorBoard, W&B (offline) and MLflow (a local folder)."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from conftest import cli_env, flowgrpo_command, tiny_overrides

needs = pytest.mark.skipif(importlib.util.find_spec("wandb") is None or importlib.util.find_spec("mlflow") is None,
                           reason="wandb and mlflow are test extras")


@needs
def test_tensorboard_wandb_offline_and_mlflow_receive_the_metrics(shapes_model_dir, tmp_path):
    env = cli_env()
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
    env.pop("MLFLOW_TRACKING_URI", None)
    args = ["train", *tiny_overrides(shapes_model_dir, **{"train.iterations": 2, "log.grid_every": 1,
                                                          "log.trackers": "[tensorboard, wandb, mlflow]"}),
            f"log.out_dir={tmp_path}", "log.run_name=tracked", "eval.evaluator=none"]
    proc = subprocess.run(flowgrpo_command() + args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "tracked"
    assert list((run / "tensorboard").rglob("events.out.tfevents.*"))
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb")), "no offline W&B run in RUN_DIR/wandb"
    # MLflow's file store: mlruns/<experiment>/<run>/metrics/<name>, one line per logged step
    reward = [p for p in (run / "mlruns").rglob("metrics/reward_mean")]
    assert reward and len(reward[0].read_text().splitlines()) == 2


def test_unknown_tracker_is_one_line_listing_the_valid_ones(shapes_model_dir, tmp_path):
    args = ["train", *tiny_overrides(shapes_model_dir, **{"log.trackers": "[tensorbord]"}), f"log.out_dir={tmp_path}"]
    proc = subprocess.run(flowgrpo_command() + args, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "tensorbord" in err[0] and "tensorboard" in err[0] and "wandb" in err[0]
