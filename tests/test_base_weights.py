"""A shapes run records which base weights it was trained from, and refuses to be loaded onto others.

A checkpoint holds only the trained parameters: rebuilt on other base weights (the shipped weights of a
newer release, say) the policy would be half the run's and half the new base's, silently."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import tiny_overrides
from flowgrpo.config import load_config
from flowgrpo.errors import UserError
from flowgrpo.shapes.model import ShapesFlowModel, base_fingerprint
from flowgrpo.trainer.base_weights import BASE_FILE
from flowgrpo.trainer.checkpoint import load_trained_policy
from flowgrpo.trainer.run import train


def test_a_run_refuses_base_weights_it_was_not_trained_from(shapes_model_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(shapes_model_dir, base)
    cfg = load_config("shapes", None, tiny_overrides(base, **{
        "train.iterations": 1, "log.out_dir": str(tmp_path), "log.run_name": "r", "log.trackers": "[]",
        "eval.evaluator": "none"}), recipe="shapes")
    train(cfg)
    run = tmp_path / "r"
    recorded = json.loads((run / BASE_FILE).read_text())
    assert recorded == base_fingerprint(str(base)) and len(recorded["sha256"]) == 64
    load_trained_policy(run)  # the same base: loads

    with torch.random.fork_rng(devices=[]):  # the same architecture, other weights (a retrained base)
        torch.manual_seed(1)
        ShapesFlowModel().save(base)
    with pytest.raises(UserError, match=r"was trained from the shapes base weights .* Set model.path in .*config.yaml"):
        load_trained_policy(run)
    resumed = load_config("shapes", None, [f"model.path={base}", "train.iterations=2"], recipe="shapes")
    with pytest.raises(UserError, match="Its checkpoints hold only the trained parameters"):
        train(resumed, run_dir=run, resume=True)
    # pointing the run at its own weights again loads it
    shutil.copytree(shapes_model_dir, tmp_path / "original")
    load_trained_policy(run, overrides=(f"model.path={tmp_path / 'original'}",))
