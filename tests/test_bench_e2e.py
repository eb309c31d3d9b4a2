"""`bench e2e`: the summary math on hand-built curves of several seeds, run folders read back, and
a smoke run of two presets as real `flowgrpo train` runs whose summaries feed the table."""

from __future__ import annotations

import csv
import json

import pytest
from conftest import tiny_overrides

from flowgrpo.benchmarks import bench_e2e
from flowgrpo.benchmarks.bench_e2e import (CurvePoint, RunSpec, collect_runs, run_bench_e2e, run_specs, runs_clock,
                                           seconds_to, summarize, train_command)


def curve(*pts):
    return [CurvePoint(*p) for p in pts]


def test_seconds_to_ignores_the_base_point():
    pts = curve((0.0, 0.40), (60.0, 0.35), (120.0, 0.41), (180.0, 0.45))
    assert seconds_to(pts, 0.40) == 120.0  # the base already scores 0.40, but it is not training
    assert seconds_to(pts, 0.45) == 180.0
    assert seconds_to(pts, 0.50) is None


# flow-grpo's seeds end at 0.5 and 0.7: the target is 0.6, reached at 90 s and 60 s (mean 75 s);
# nft reaches it at 30 s on one seed and never on the other (mean over the seed that did: 30 s)
CURVES = {
    "flow-grpo": {0: curve((0, 0.25, 1.0), (60, 0.4, 0.9), (90, 0.6, 0.8), (120, 0.5, 0.7)),
                  1: curve((0, 0.25, 1.0), (60, 0.6, 0.95), (120, 0.7, 0.9))},
    "diffusion-nft": {0: curve((0, 0.25, 1.0), (30, 0.65, 0.99), (120, 0.8, 0.98)),
                      1: curve((0, 0.25, 1.0), (120, 0.45, 1.0))},
}


def test_summarize_known_numbers(tmp_path):
    out = summarize(CURVES, 2.0, tmp_path / "res", str(tmp_path / "sum.json"), quiet=True, min_fidelity=0.0)
    assert out["target_preset"] == "flow-grpo" and out["target"] == pytest.approx(0.6)
    fg, nft = out["rows"]
    assert fg["seconds_to_target"] == 75.0 and fg["time_ratio"] == 1.0 and fg["seeds_reaching_target"] == 2
    assert fg["final_accuracy"] == pytest.approx(0.6) and fg["final_accuracy_se"] == pytest.approx(0.1)
    assert fg["gain"] == pytest.approx(0.35) and fg["peak_accuracy"] == pytest.approx(0.65)
    assert fg["final_fidelity"] == pytest.approx(0.8)
    assert nft["seconds_to_target"] == 30.0 and nft["time_ratio"] == pytest.approx(0.4)
    assert nft["seeds_reaching_target"] == 1 and nft["final_fidelity"] == pytest.approx(0.99)
    assert out["mix_grpo_within_claim"] is None  # mix-grpo did not run
    assert json.loads((tmp_path / "sum.json").read_text()) == json.loads(json.dumps(out))
    rows = list(csv.reader((tmp_path / "res" / "e2e.csv").open()))
    assert rows[0] == ["preset", "seed", "train_seconds", "accuracy", "fidelity"]
    assert rows[1] == ["flow-grpo", "0", "0.0", "0.2500", "1.0000"] and len(rows) == 1 + 4 + 3 + 3 + 2
    assert (tmp_path / "res" / "e2e.png").stat().st_size > 1000


def test_an_evaluation_with_broken_images_does_not_reach_the_target(tmp_path):
    pts = curve((0.0, 0.40, 1.0), (60.0, 0.70, 0.85), (120.0, 0.72, 0.93))
    assert seconds_to(pts, 0.70) == 60.0
    assert seconds_to(pts, 0.70, min_fidelity=0.9) == 120.0  # 60 s had the accuracy, not the images
    assert seconds_to(pts, 0.73, min_fidelity=0.9) is None
    # with the default gate (0.9), flow-grpo's seed 0 reaches 0.6 only at 90 s with fidelity 0.8:
    # it no longer counts, so flow-grpo's time is seed 1's 60 s and nft's ratio 30 / 60
    out = summarize(CURVES, 2.0, tmp_path, None, quiet=True)
    fg, nft = out["rows"]
    assert out["min_fidelity"] == 0.9 and fg["seeds_reaching_target"] == 1 and fg["seconds_to_target"] == 60.0
    assert nft["time_ratio"] == pytest.approx(0.5)


def test_the_plot_names_the_clock_the_runs_counted(tmp_path):
    assert runs_clock(tmp_path) == "wall"  # no run: the trainer's default
    (tmp_path / "flow-grpo-s0").mkdir()
    (tmp_path / "flow-grpo-s0" / "config.yaml").write_text("train:\n  seed: 0\n")
    assert runs_clock(tmp_path) == "wall"
    (tmp_path / "flow-grpo-s0" / "config.yaml").write_text("train:\n  clock: cpu\n")
    assert runs_clock(tmp_path) == "cpu"


def _fake_run(path, before, curve_pts):
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps({
        "eval_before": {"accuracy": before, "fidelity": 1.0},
        "eval_curve": [{"train_seconds": s, "accuracy": a, "fidelity": f} for s, a, f in curve_pts]}))


def test_collect_runs_reads_finished_runs_by_label_and_seed(tmp_path):
    _fake_run(tmp_path / "awm-s1", 0.4, [(60.0, 0.5, 0.9), (120.0, 0.6, 0.8)])
    _fake_run(tmp_path / "flow-grpo-s0", 0.4, [(60.0, 0.45, 0.95)])
    _fake_run(tmp_path / "my-recipe-s3", 0.4, [(60.0, 0.5, None)])
    (tmp_path / "flow-grpo-s1").mkdir()  # interrupted: no summary, not counted
    runs = collect_runs(tmp_path)
    assert list(runs) == ["flow-grpo", "awm", "my-recipe"]  # known presets in their order, then others
    assert runs["flow-grpo"] == {0: curve((0.0, 0.4, 1.0), (60.0, 0.45, 0.95))}
    assert runs["awm"][1][-1] == CurvePoint(120.0, 0.6, 0.8) and runs["my-recipe"][3][-1].fidelity is None


def test_interrupted_run_is_resumed(tmp_path):
    cmd = train_command("awm", 2, 10, 60, tmp_path)
    assert "--preset" in cmd and "train.seed=2" in cmd and "log.run_name=awm-s2" in cmd
    assert "eval.every_minutes=1.0" in cmd and "train.max_minutes=10" in cmd
    (tmp_path / "awm-s2" / "checkpoints" / "ckpt_5").mkdir(parents=True)
    (tmp_path / "awm-s2" / "config.yaml").write_text("{}")
    assert train_command("awm", 2, 10, 60, tmp_path)[-2:] == ["--resume", str(tmp_path / "awm-s2")]


def _fake_runs(monkeypatch, fail=()):
    """Each spec's command: a Python process that logs its start and end and writes the run's summary
    (or exits 3 for a name in ``fail``), so the scheduling is observable without training."""
    import sys

    def command(spec, runs_dir):
        code = ("import json, pathlib, sys, time; d = pathlib.Path(sys.argv[1]); log = d.parent / 'order.txt'\n"
                "log.open('a').write('start ' + d.name + '\\n'); time.sleep(0.3)\n"
                f"if d.name in {list(fail)!r}: sys.exit(3)\n"
                "d.mkdir(); (d / 'summary.json').write_text('{}'); log.open('a').write('end ' + d.name + '\\n')")
        return [sys.executable, "-c", code, str(runs_dir / spec.name)]

    monkeypatch.setattr(bench_e2e, "spec_command", command)


def test_a_run_naming_another_runs_folder_waits_for_its_summary(tmp_path, monkeypatch):
    _fake_runs(monkeypatch)
    specs = [RunSpec("teacher-a", ()), RunSpec("student", (f"loss.teachers={{a: {tmp_path / 'teacher-a'}}}",)),
             RunSpec("teacher-ab", ())]  # a name that starts with teacher-a's: not a dependency of student
    run_specs(specs, tmp_path, jobs=2)
    order = (tmp_path / "order.txt").read_text().split("\n")
    assert order.index("start student") > order.index("end teacher-a")
    assert order.index("start teacher-ab") < order.index("end teacher-a")  # a free job goes to the next ready run
    assert all((tmp_path / n / "summary.json").is_file() for n in ("teacher-a", "student", "teacher-ab"))
    run_specs(specs, tmp_path, jobs=2)  # every run finished: nothing runs again
    assert (tmp_path / "order.txt").read_text().count("start") == 3


def test_a_failed_run_skips_the_runs_that_need_it(tmp_path, monkeypatch, capsys):
    _fake_runs(monkeypatch, fail=("teacher-a",))
    run_specs([RunSpec("teacher-a", ()), RunSpec("student", (f"x={tmp_path / 'teacher-a'}",)), RunSpec("b", ())],
              tmp_path, jobs=1)
    out = capsys.readouterr().out
    assert "teacher-a FAILED (exit 3" in out and "student skipped: it needs teacher-a" in out
    assert (tmp_path / "b" / "summary.json").is_file() and not (tmp_path / "student").exists()


def test_bench_e2e_runs_train_and_tabulates_its_summaries(shapes_model_dir, tmp_path):
    over = [o for o in tiny_overrides(shapes_model_dir, **{"log.grid_every": 0, "log.trackers": "[]"})
            if not o.startswith("train.iterations")]
    runs = tmp_path / "runs"
    res = run_bench_e2e(str(tmp_path / "e2e.json"), presets=("flow-grpo", "mix-grpo"), seeds=(0,), minutes=0.05,
                        eval_every_s=1.0, runs_dir=runs, jobs=2, overrides=over, out_dir=tmp_path / "out", quiet=True)
    assert [r["preset"] for r in res["rows"]] == ["flow-grpo", "mix-grpo"]
    for r in res["rows"]:
        summary = json.loads((runs / f"{r['preset']}-s0" / "summary.json").read_text())
        assert r["final_accuracy"] == summary["eval_after"]["accuracy"]
        assert r["gain"] == pytest.approx(summary["eval_after"]["accuracy"] - summary["eval_before"]["accuracy"])
        assert r["final_fidelity"] == summary["eval_after"]["fidelity"]
    assert res["rows"][0]["time_ratio"] in (1.0, None)  # flow-grpo reaches its own final accuracy
    assert (tmp_path / "out" / "e2e.png").is_file() and json.loads((tmp_path / "e2e.json").read_text())["rows"]
    # a second call finds every summary and trains nothing: same result
    again = run_bench_e2e(None, presets=("flow-grpo", "mix-grpo"), seeds=(0,), minutes=0.05, eval_every_s=1.0,
                          runs_dir=runs, overrides=over, out_dir=tmp_path / "out2", quiet=True)
    assert again["rows"] == res["rows"]
