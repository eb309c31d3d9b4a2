"""The new presets' race rows (benchmarks/experiments/new_methods/race_rows.py): crd's lr screen rule and
flow-opd's pipeline curve (teacher, then student shifted by the teacher's CPU time), on hand-written run
summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgrpo.benchmarks.bench_e2e import CurvePoint

from conftest import load_experiment


@pytest.fixture(scope="module")
def race_rows():
    return load_experiment("new_methods/race_rows.py")


def write_run(folder: Path, before: tuple, curve: list[tuple], train_seconds: float) -> None:
    folder.mkdir(parents=True)
    summary = {"eval_before": {"accuracy": before[0], "fidelity": before[1]}, "train_seconds": train_seconds,
               "eval_curve": [{"train_seconds": t, "accuracy": a, "fidelity": f} for t, a, f in curve]}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_screen_keeps_the_low_lr_only_when_every_evaluation_keeps_the_images(tmp_path, race_rows):
    write_run(tmp_path / "crd-s9", (0.45, 0.99), [(60, 0.47, 0.985), (120, 0.50, 0.981)], 180)
    assert race_rows.screened_lr(tmp_path, 9)[0] == race_rows.SCREEN_LR
    write_run(tmp_path / "crd-s8", (0.45, 0.99), [(60, 0.47, 0.985), (120, 0.50, 0.975), (180, 0.5, 0.99)], 180)
    assert race_rows.screened_lr(tmp_path, 8)[0] == race_rows.FALLBACK_LR


def test_opd_curve_is_the_teacher_then_the_student_after_the_teachers_minutes(tmp_path, race_rows):
    write_run(tmp_path / "opd-teacher-s0", (0.45, 0.99), [(60, 0.6, 0.99), (300, 0.8, 0.98)], 301.5)
    write_run(tmp_path / "flow-opd-s0", (0.45, 0.99), [(60, 0.55, 0.99), (299, 0.7, 0.99)], 299)
    c = race_rows.opd_curve(tmp_path, 0)
    assert [p.seconds for p in c[:3]] == [0.0, 60.0, 300.0]
    assert c[3].seconds == pytest.approx(301.5, abs=0.01) and c[3].accuracy == 0.45  # the student starts from the base
    assert [p.seconds for p in c[4:]] == [361.5, 600.5] and c[-1] == CurvePoint(600.5, 0.7, 0.99)
    assert all(a.seconds < b.seconds for a, b in zip(c, c[1:]))  # one increasing time axis


def test_the_screen_seed_must_not_be_a_race_seed(tmp_path, race_rows):
    with pytest.raises(SystemExit, match="screen-seed 0 is a race seed"):
        race_rows.main(["--seeds", "0", "1", "--screen-seed", "0", "--runs-dir", str(tmp_path), "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="teacher-minutes"):
        race_rows.main(["--teacher-minutes", "10", "--runs-dir", str(tmp_path), "--out", str(tmp_path)])
