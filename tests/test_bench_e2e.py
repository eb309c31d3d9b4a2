"""`bench e2e` smoke test on tiny budgets: CSV/PNG/JSON outputs, shared base point, target rule."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ sits at the repository root

from benchmarks.bench_e2e import run_bench_e2e, seconds_to  # noqa: E402


def test_seconds_to_ignores_the_base_point():
    pts = [(0.0, 0.40), (60.0, 0.35), (120.0, 0.41), (180.0, 0.45)]
    assert seconds_to(pts, 0.40) == 120.0  # the base already scores 0.40, but it is not training
    assert seconds_to(pts, 0.45) == 180.0
    assert seconds_to(pts, 0.50) is None


def test_bench_e2e_outputs(tmp_path):
    overrides = [f"log.out_dir={tmp_path / 'runs'}", "log.tensorboard=false", "log.progress=false",
                 "log.grid_every=0", "sampler.num_steps=5", "eval.num_steps=3", "data.prompts_per_iteration=1",
                 "data.group_size=2", "train.threads=1"]
    res = run_bench_e2e(str(tmp_path / "e2e.json"), presets=("flow-grpo", "mix-grpo"), minutes=0.02,
                        eval_every_s=0.5, num_prompts=2, seeds=1, overrides=overrides, out_dir=tmp_path, quiet=True)
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert data["target"] == res["target"]
    assert [r["preset"] for r in data["rows"]] == ["flow-grpo", "mix-grpo"]
    for r in data["rows"]:
        assert set(r) == {"preset", "final_accuracy", "seconds_to_target", "time_ratio"}
        assert 0.0 <= r["final_accuracy"] <= 1.0
    curves = data["curves"]
    # the base model is evaluated once and shared: every curve starts at the same (0, accuracy)
    assert curves["flow-grpo"][0] == curves["mix-grpo"][0] == [0.0, data["base_accuracy"]]
    assert data["target"] == curves["flow-grpo"][-1][1]
    # flow-grpo reaches its own final accuracy, so its time ratio is 1 by construction of the rule
    assert data["rows"][0]["time_ratio"] == 1.0 and data["rows"][0]["seconds_to_target"] is not None
    assert data["mix_grpo_within_claim"] in (True, False)
    for c in curves.values():
        assert len(c) >= 2 and all(b[0] > a[0] for a, b in zip(c, c[1:]))  # time moves forward
    rows = list(csv.reader((tmp_path / "e2e.csv").open()))
    assert rows[0] == ["preset", "train_seconds", "accuracy"]
    assert len(rows) - 1 == sum(len(c) for c in curves.values())
    assert (tmp_path / "e2e.png").stat().st_size > 1000


def test_merge_recomputes_rows_across_runs(tmp_path):
    from benchmarks.bench_e2e import merge

    base = {"minutes": 1.0, "samples": 256, "base_accuracy": 0.4}
    a = {**base, "curves": {"flow-grpo": [[0.0, 0.4], [30.0, 0.45], [60.0, 0.5]]}, "iterations": {"flow-grpo": 10}}
    b = {**base, "curves": {"mix-grpo": [[0.0, 0.4], [20.0, 0.5], [60.0, 0.6]]}, "iterations": {"mix-grpo": 20}}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = merge([str(tmp_path / "b.json"), str(tmp_path / "a.json")], str(tmp_path / "m.json"), tmp_path)
    assert [r["preset"] for r in out["rows"]] == ["flow-grpo", "mix-grpo"]  # canonical order, target first
    assert out["target"] == 0.5 and out["iterations"] == {"flow-grpo": 10, "mix-grpo": 20}
    mix = out["rows"][1]
    assert mix["seconds_to_target"] == 20.0 and mix["time_ratio"] == 20.0 / 60.0
    assert out["mix_grpo_within_claim"] is True
    assert (tmp_path / "e2e.png").is_file() and json.loads((tmp_path / "m.json").read_text())["rows"] == out["rows"]
