"""A run's share of the cores (``cpu_s`` over ``iter_s``) and the note a CPU-clocked run prints when it shared them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import cli_env, flowgrpo_command, tiny_overrides
from flowgrpo.trainer.core_share import SHARED_BELOW, cores_used, shared_core_note

pinnable = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")


@pinnable
def test_a_cpu_clocked_run_on_a_shared_core_says_so(shapes_model_dir, tmp_path):
    """A busy loop and the run pinned to one core: the run gets about half of it, its iterations' cpu_s
    over iter_s say so, and it prints the note when it ends."""
    core = sorted(os.sched_getaffinity(0))[0]
    pin = lambda: os.sched_setaffinity(0, {core})  # noqa: E731 (preexec_fn)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        out = tmp_path / "runs"
        args = ["train", *tiny_overrides(shapes_model_dir, **{"train.iterations": 2, "train.clock": "cpu",
                                                               "log.grid_every": 0, "eval.evaluator": "none"}),
                f"log.out_dir={out}", "log.run_name=shared"]
        proc = subprocess.run(flowgrpo_command() + args, capture_output=True, text=True, timeout=600,
                              env=cli_env(), preexec_fn=pin)
    finally:
        hog.kill()
        hog.wait()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(ln) for ln in (out / "shared" / "metrics.jsonl").read_text().splitlines()]
    shares = [r["cpu_s"] / r["iter_s"] for r in rows]
    assert len(rows) == 2 and all(0.0 < x < SHARED_BELOW for x in shares), shares
    assert "cores_used" not in json.loads((out / "shared" / "summary.json").read_text())  # timings stay in metrics
    assert "note: this run used 0." in proc.stdout and "train.threads=1" in proc.stdout


def test_only_a_cpu_clocked_run_short_of_its_cores_gets_the_note():
    """A wall-clocked run is not judged (its budget already depends on the load), nor one on torch's
    default thread count (no share asked for); threads=2 is judged against two cores."""
    assert shared_core_note("wall", 1, 0.2) is None
    assert shared_core_note("cpu", 1, 0.95) is None
    assert shared_core_note("cpu", 0, 0.2) is None
    assert shared_core_note("cpu", 1, None) is None
    assert "used 1.20 of the 2 core(s)" in shared_core_note("cpu", 2, 1.2)


def test_cores_used_weighs_iterations_by_their_wall_time_and_skips_lines_without_cpu_s():
    """A run resumed from one written before ``cpu_s`` existed counts only the lines that have it; a long
    iteration weighs more than a short one (CPU-seconds over wall-seconds, not a mean of ratios)."""
    lines = [{"iteration": 0, "iter_s": 9.0}, {"iteration": 1, "cpu_s": 0.5, "iter_s": 1.0},
             {"iteration": 2, "cpu_s": 3.0, "iter_s": 3.0}]
    assert cores_used(lines) == pytest.approx(3.5 / 4.0)
    assert cores_used(lines[:1]) is None
