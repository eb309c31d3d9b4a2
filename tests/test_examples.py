"""The scripts in examples/ run as a user runs them (``python examples/x.py``, a subprocess) with tiny
budgets, and print what they promise: the user's reward in the run's metrics, the user's objective's
statistics, a function reward trained on a diffusers pipeline folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str, timeout: float = 300) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=cli_env(), capture_output=True,
                          text=True, timeout=timeout, cwd=EXAMPLES.parent.parent)
    assert proc.returncode == 0, f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def only_run(out_dir: Path) -> Path:
    runs = [p for p in out_dir.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


def test_custom_reward_by_import_path_appears_in_the_metrics(tmp_path):
    out = run_example("custom_reward.py", "train.iterations=2", f"log.out_dir={tmp_path}")
    lines = [ln for ln in out.splitlines() if ln.startswith("iteration ")]
    assert len(lines) == 2 and all("reward.my_rewards:colourfulness=" in ln for ln in lines), out
    logged = [json.loads(ln) for ln in (only_run(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in logged] == [0, 1]
    for m in logged:
        assert 0 < m["reward.my_rewards:colourfulness"] <= 1 and 0 < m["reward.my_rewards:Contrast"] <= 0.4


def test_custom_objective_by_import_path_trains(tmp_path):
    out = run_example("custom_objective.py", "train.iterations=2", f"log.out_dir={tmp_path}")
    assert out.count("objective=weighted_matching") == 2, out
    logged = [json.loads(ln) for ln in (only_run(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert all(m["fm_error"] > 0 and m["row_weight"] > 0 and m["rows"] > 0 for m in logged)


@pytest.fixture(scope="module")
def tiny_pipeline_dir(tmp_path_factory) -> Path:
    from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline

    folder = tmp_path_factory.mktemp("pipeline") / "tiny_sd3"
    tiny_sd3_pipeline(seed=0).save_pretrained(folder)
    return folder


def test_function_reward_on_a_diffusers_pipeline_folder(tiny_pipeline_dir, tmp_path):
    out = run_example("diffusers_reward.py", str(tiny_pipeline_dir), "model.resolution=64",
                      "model.max_sequence_length=16", f"log.out_dir={tmp_path}")
    assert "policy SD3Policy, rewards ['warmth']" in out, out
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("iteration ")] == ["iteration 0", "iteration 1"]
    summary = json.loads((only_run(tmp_path) / "summary.json").read_text())
    assert summary["iterations"] == 2 and "reward.warmth" in summary["final_metrics"]


def test_examples_without_arguments_explain_themselves():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "diffusers_reward.py")], env=cli_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "PIPELINE_DIR" in proc.stderr
