"""`bench e2e`: the summary math on hand-built curves, and a smoke run on tiny budgets whose
JSON/CSV are checked against the curves they came from."""

from __future__ import annotations

import csv
import json

import pytest

from flowgrpo.benchmarks.bench_e2e import MIX_CLAIM, merge, run_bench_e2e, seconds_to, summarize


def test_seconds_to_ignores_the_base_point():
    pts = [(0.0, 0.40), (60.0, 0.35), (120.0, 0.41), (180.0, 0.45)]
    assert seconds_to(pts, 0.40) == 120.0  # the base already scores 0.40, but it is not training
    assert seconds_to(pts, 0.45) == 180.0
    assert seconds_to(pts, 0.50) is None


# hand-built curves with known answers: flow-grpo ends at 0.50 (the target), reached at 90 s;
# mix-grpo reaches 0.50 at 30 s (ratio 1/3, within MixGRPO's 0.6 claim); dance-grpo never does
CURVES = {
    "flow-grpo": [(0.0, 0.25), (45.0, 0.375), (90.0, 0.5), (120.0, 0.5)],
    "mix-grpo": [(0.0, 0.25), (30.0, 0.5), (60.0, 0.625)],
    "dance-grpo": [(0.0, 0.25), (60.0, 0.25), (120.0, 0.375)],
}


def test_summarize_known_numbers(tmp_path):
    out = summarize(CURVES, {"flow-grpo": 12, "mix-grpo": 30, "dance-grpo": 25}, 2.0, 16, tmp_path / "res",
                    str(tmp_path / "sum.json"), quiet=True)
    assert out["target"] == 0.5 and out["target_preset"] == "flow-grpo"
    assert out["base_accuracy"] == 0.25 and out["target_above_base"] is True
    assert out["rows"] == [
        {"preset": "flow-grpo", "final_accuracy": 0.5, "seconds_to_target": 90.0, "time_ratio": 1.0},
        {"preset": "mix-grpo", "final_accuracy": 0.625, "seconds_to_target": 30.0, "time_ratio": 30.0 / 90.0},
        {"preset": "dance-grpo", "final_accuracy": 0.375, "seconds_to_target": None, "time_ratio": None},
    ]
    assert out["mix_grpo_within_claim"] is True
    assert json.loads((tmp_path / "sum.json").read_text()) == json.loads(json.dumps(out))
    # the CSV holds every curve point, formatted to 0.1 s and 4 decimals
    rows = list(csv.reader((tmp_path / "res" / "e2e.csv").open()))
    assert rows[0] == ["preset", "train_seconds", "accuracy"]
    assert rows[1:5] == [["flow-grpo", "0.0", "0.2500"], ["flow-grpo", "45.0", "0.3750"],
                         ["flow-grpo", "90.0", "0.5000"], ["flow-grpo", "120.0", "0.5000"]]
    assert rows[-1] == ["dance-grpo", "120.0", "0.3750"] and len(rows) == 1 + 4 + 3 + 3
    assert (tmp_path / "res" / "e2e.png").stat().st_size > 1000


def test_summarize_without_flow_grpo_and_a_target_at_the_base(tmp_path):
    """The first preset is the target when flow-grpo did not run; a target no higher than the base
    is flagged; a mix-grpo slower than 0.6x is outside the claim."""
    curves = {"dance-grpo": [(0.0, 0.5), (60.0, 0.375), (120.0, 0.5)],
              "mix-grpo": [(0.0, 0.5), (100.0, 0.5)]}
    out = summarize(curves, {}, 2.0, 8, tmp_path, quiet=True)
    assert out["target_preset"] == "dance-grpo" and out["target"] == 0.5
    assert out["target_above_base"] is False
    assert [r["seconds_to_target"] for r in out["rows"]] == [120.0, 100.0]
    assert out["rows"][1]["time_ratio"] == pytest.approx(100.0 / 120.0)
    assert 100.0 / 120.0 > MIX_CLAIM and out["mix_grpo_within_claim"] is False


def test_summarize_writes_into_the_current_directory_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summarize(CURVES, {}, 2.0, 16, quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e2e.csv", "e2e.png"]


def test_bench_e2e_outputs(tmp_path):
    overrides = [f"log.out_dir={tmp_path / 'runs'}", "log.trackers=[]", "log.progress=false",
                 "log.grid_every=0", "sampler.num_steps=5", "eval.num_steps=3", "data.prompts_per_iteration=1",
                 "data.trees_per_prompt=2", "train.threads=1"]
    res = run_bench_e2e(str(tmp_path / "e2e.json"), presets=("flow-grpo", "mix-grpo"), minutes=0.02,
                        eval_every_s=0.5, num_prompts=2, seeds=1, overrides=overrides, out_dir=tmp_path / "out",
                        quiet=True)
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert data == json.loads(json.dumps(res))
    assert [r["preset"] for r in data["rows"]] == ["flow-grpo", "mix-grpo"]
    curves = data["curves"]
    # the base model is evaluated once and shared: every curve starts at the same (0, accuracy)
    assert curves["flow-grpo"][0] == curves["mix-grpo"][0] == [0.0, data["base_accuracy"]]
    assert data["target"] == curves["flow-grpo"][-1][1]
    assert data["samples"] == 2 and data["minutes"] == 0.02
    # every row recomputed from its curve: final accuracy, first crossing after 0 s, ratio to flow-grpo's
    t_ref = seconds_to([tuple(p) for p in curves["flow-grpo"]], data["target"])
    for r in data["rows"]:
        c = [tuple(p) for p in curves[r["preset"]]]
        assert r["final_accuracy"] == c[-1][1]
        assert r["seconds_to_target"] == seconds_to(c, data["target"])
        s = r["seconds_to_target"]
        assert r["time_ratio"] == (None if s is None else s / t_ref)
        # 2 evaluation samples: every accuracy is 0, 1/2 or 1
        assert all(a * 2 == int(a * 2) for _, a in c)
    assert data["rows"][0]["time_ratio"] == 1.0  # flow-grpo reaches its own final accuracy by construction
    mix = data["rows"][1]
    assert data["mix_grpo_within_claim"] == (mix["time_ratio"] is not None and mix["time_ratio"] <= MIX_CLAIM)
    for c in curves.values():
        assert len(c) >= 2 and all(b[0] > a[0] for a, b in zip(c, c[1:]))  # time moves forward
    rows = list(csv.reader((tmp_path / "out" / "e2e.csv").open()))
    assert rows[1:] == [[p, f"{s:.1f}", f"{a:.4f}"] for p, c in curves.items() for s, a in c]
    assert (tmp_path / "out" / "e2e.png").stat().st_size > 1000
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["e2e.csv", "e2e.png"]


def test_merge_recomputes_rows_across_runs(tmp_path):
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


def test_merge_refuses_runs_with_different_budgets(tmp_path):
    for name, minutes in (("a", 1.0), ("b", 2.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"minutes": minutes, "samples": 256, "base_accuracy": 0.4, "curves": {name: [[0.0, 0.4]]}}))
    with pytest.raises(SystemExit, match="differ in minutes"):
        merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")], None, tmp_path)
