"""``flowgrpo compare``: runs side by side, finished or still training, read from their folders."""

from __future__ import annotations

import csv
import json
import statistics

import pytest
import yaml

from flowgrpo.cli import main
from flowgrpo.commands.compare import read_run, spread
from flowgrpo.trainer.core_share import cores_used
from flowgrpo.trainer.metrics import read_metrics


def _finished(root, name, seed, accs, tags=("counting", "position")):
    """A finished run folder: summary.json with an evaluation curve (minute i * 5) whose points carry tags."""
    run = root / name
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"seed": seed}}))
    curve = [{"iteration": 10 * i, "train_seconds": 300.0 * i, "accuracy": a, "accuracy_se": 0.01, "fidelity": 0.98,
              "per_tag": {t: a - 0.1 * k for k, t in enumerate(tags)}} for i, a in enumerate(accs)]
    summary = {"iterations": 10 * (len(accs) - 1), "train_seconds": 300.0 * (len(accs) - 1), "eval_curve": curve,
               "eval_before": {"accuracy": accs[0], "per_tag": curve[0]["per_tag"]},
               "eval_after": {"accuracy": accs[-1], "per_tag": curve[-1]["per_tag"]}}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text("")
    return run


def _training(root, name, accs, torn=True):
    """A run still training: eval_before.json, evaluations in metrics.jsonl, a torn last line."""
    run = root / name
    run.mkdir()
    (run / "eval_before.json").write_text(json.dumps({"accuracy": accs[0], "accuracy_se": 0.015, "per_tag": {"counting": 0.4}}))
    lines = []
    for it in range(12):
        ln = {"iteration": it, "train_seconds": 30.0 * (it + 1), "loss": 0.5,
              "cpu_s": 0.5, "iter_s": 1.0 + it % 2}
        if it % 4 == 3 and (it // 4 + 1) < len(accs):
            a = accs[it // 4 + 1]
            ln.update({"eval_accuracy": a, "eval_accuracy_se": 0.01, "eval_fidelity": 0.97,
                       "eval_accuracy.counting": a - 0.2})
        lines.append(json.dumps(ln))
    text = "\n".join(lines) + "\n" + ('{"iteration": 12, "train_sec' if torn else "")
    (run / "metrics.jsonl").write_text(text)
    return run


def test_a_finished_run_reads_its_curve_peak_and_distance_from_the_peak(tmp_path):
    rec = read_run(_finished(tmp_path, "a", 7, [0.5, 0.9, 0.95, 0.92]))
    assert rec.finished and rec.seed == 7 and rec.iterations == 30 and rec.minutes == pytest.approx(15.0)
    assert [p.accuracy for p in rec.curve] == [0.5, 0.9, 0.95, 0.92]
    assert rec.peak.accuracy == 0.95 and rec.peak.minutes == pytest.approx(10.0)
    assert rec.under_peak == pytest.approx(0.03) and rec.latest.per_tag == {"counting": 0.92, "position": pytest.approx(0.82)}
    # a run whose base is its best evaluation: the peak is taken after training started
    assert read_run(_finished(tmp_path, "b", 8, [0.6, 0.4, 0.5])).peak.accuracy == 0.5


def test_a_run_still_training_reads_its_evaluations_so_far_past_a_torn_last_line(tmp_path):
    rec = read_run(_training(tmp_path, "t", [0.5, 0.7, 0.8, 0.75]))
    assert not rec.finished and rec.seed is None and rec.iterations == 12 and rec.minutes == pytest.approx(6.0)
    assert [p.accuracy for p in rec.curve] == [0.5, 0.7, 0.8, 0.75]
    assert [p.minutes for p in rec.curve] == pytest.approx([0.0, 2.0, 4.0, 6.0])
    assert rec.curve[2].per_tag == {"counting": pytest.approx(0.6)} and rec.under_peak == pytest.approx(0.05)
    assert rec.cores_used == pytest.approx(6.0 / 18.0)  # CPU over wall of the iterations so far (shared cores)


def test_the_spread_counts_runs_at_their_peak(tmp_path):
    recs = [read_run(_finished(tmp_path, n, s, accs)) for n, s, accs in
            (("a", 1, [0.5, 0.9, 0.93]), ("b", 2, [0.5, 0.95, 0.92]), ("c", 3, [0.5, 0.97, 0.94]))]
    s = spread(recs, within=0.02)
    assert s["n"] == 3 and s["mean"] == pytest.approx(statistics.fmean([0.93, 0.92, 0.94]))
    assert s["sd"] == pytest.approx(statistics.stdev([0.93, 0.92, 0.94])) and (s["min"], s["max"]) == (0.92, 0.94)
    assert s["at_peak"] == 1  # b is 0.03 under its peak, c 0.03
    assert spread(recs, within=0.03)["at_peak"] == 3


def test_the_command_prints_the_table_and_writes_csv_png_json(tmp_path, capsys):
    runs = [_finished(tmp_path, "a", 1, [0.5, 0.9, 0.93]), _training(tmp_path, "t", [0.5, 0.7, 0.8])]
    out = tmp_path / "out"
    assert main(["compare", *map(str, runs), "--out", str(out), "--json", str(tmp_path / "c.json")]) == 0
    printed = capsys.readouterr().out
    assert "finished" in printed and "training" in printed and "within 0.02 of their peak: 2 of 2" in printed
    assert "counting" in printed and "position" in printed  # the tags' own table
    rows = list(csv.DictReader((out / "compare.csv").open()))
    assert [r["run"] for r in rows] == ["a", "t"] and float(rows[0]["latest"]) == 0.93
    assert float(rows[1]["tag_counting"]) == pytest.approx(0.6) and rows[0]["seed"] == "1"
    # a run written before cpu_s was logged: blank
    assert rows[0]["cores_used"] == "" and float(rows[1]["cores_used"]) == pytest.approx(1 / 3)
    assert (out / "compare.png").stat().st_size > 0
    assert json.loads((tmp_path / "c.json").read_text())["spread"]["n"] == 2


def test_bad_folders_get_one_line_errors(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert "not a run folder (no summary.json or metrics.jsonl)" in capsys.readouterr().err
    run = _training(tmp_path, "broken", [0.5, 0.7], torn=False)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    assert main(["compare", str(run)]) == 2
    err = capsys.readouterr().err
    assert "line 2 is not JSON" in err and len(err.strip().splitlines()) == 1


def test_a_real_run_reads_as_its_summary_says(cli_run_dir, capsys):
    rec = read_run(cli_run_dir)
    s = json.loads((cli_run_dir / "summary.json").read_text())
    assert rec.finished and rec.iterations == s["iterations"]
    assert rec.curve[0].accuracy == s["eval_before"]["accuracy"] and rec.latest.accuracy == s["eval_after"]["accuracy"]
    assert rec.latest.per_tag == s["eval_after"]["per_tag"] and rec.cores_used == cores_used(read_metrics(cli_run_dir)) > 0
    assert main(["compare", str(cli_run_dir)]) == 0 and cli_run_dir.name in capsys.readouterr().out
