"""A run folder is locked while a run writes it (issue 43, "a new hostile round", item 8).

Two ``flowgrpo train`` started a second apart with the same ``log.run_name`` both exited 0 and
``metrics.jsonl`` interleaved their iterations (``[0, 1, 0, 2, 1, 2]``). Now the second one is refused
in one line naming the folder and the holder's pid, writes nothing there and removes nothing; so is a
``--resume`` of a folder in use. A fresh run on a folder that already holds checkpoints is refused with
a hint to use ``--resume`` (as before). The lock goes with the run: a later ``--resume`` takes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import cli_env, flowgrpo_command, tiny_overrides
from test_cli_errors import one_line_error

from flowgrpo.cli import main
from flowgrpo.trainer import run_state as run_module
from flowgrpo.trainer.run_lock import LOCK_FILE, RunFolderInUse, lock_run_dir

pytestmark = pytest.mark.skipif(os.name != "posix", reason="flock")


def train_args(model_dir, out: Path, name: str, **keys) -> list[str]:
    return ["train", *tiny_overrides(model_dir, **{"log.trackers": "[]", **keys}), f"log.out_dir={out}",
            f"log.run_name={name}"]


def iterations(run_dir: Path) -> list[int]:
    return [json.loads(ln)["iteration"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def test_a_lock_is_exclusive_until_released(tmp_path):
    held = lock_run_dir(tmp_path)
    assert (tmp_path / LOCK_FILE).read_text() == str(os.getpid())
    with pytest.raises(RunFolderInUse, match=rf"run directory {tmp_path} is in use by another flowgrpo run "
                                             rf"\(pid {os.getpid()}\)"):
        lock_run_dir(tmp_path)
    held.release()
    held.release()  # twice is harmless
    lock_run_dir(tmp_path).release()


def test_a_second_run_with_the_same_name_is_refused_while_the_first_writes(shapes_model_dir, tmp_path):
    out, name = tmp_path / "runs", "same"
    run_dir = out / name
    args = train_args(shapes_model_dir, out, name, **{"train.iterations": 6, "log.checkpoint_every": 1})
    with open(tmp_path / "first.log", "w") as log:
        first = subprocess.Popen(flowgrpo_command() + args, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not (run_dir / "metrics.jsonl").exists():  # the first run holds the folder and trains
                assert first.poll() is None, (tmp_path / "first.log").read_text()
                assert time.monotonic() < deadline, "the first run wrote no metrics within 120 s"
                time.sleep(0.05)
            second = subprocess.run(flowgrpo_command() + args, env=cli_env(), capture_output=True, text=True,
                                    timeout=300)
            assert first.poll() is None, "the first run ended before the second was refused: nothing was tested"
            one_line_error(second.returncode, second.stderr, f"run directory {run_dir} is in use by another flowgrpo "
                                                             f"run (pid {first.pid})")
            assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
    assert iterations(run_dir) == list(range(6))  # one run's rows, none interleaved
    assert json.loads((run_dir / "summary.json").read_text())["iterations"] == 6


@pytest.fixture
def finished_run(shapes_model_dir, tmp_path) -> Path:
    """A 1-iteration run with its checkpoint (the lock was released when it ended)."""
    assert main(train_args(shapes_model_dir, tmp_path / "runs", "done", **{"train.iterations": 1,
                                                                           "eval.evaluator": "none"})) == 0
    return tmp_path / "runs" / "done"


def test_resume_of_a_folder_in_use_is_refused_and_writes_nothing(finished_run, capsys):
    held = lock_run_dir(finished_run)  # another run writing it (this process, through another open file)
    before = {p: p.stat().st_mtime_ns for p in finished_run.rglob("*")}
    try:
        rc = main(["train", "--resume", str(finished_run), "train.iterations=2"])
        one_line_error(rc, capsys.readouterr().err, f"run directory {finished_run} is in use", f"pid {os.getpid()}")
    finally:
        held.release()
    assert {p: p.stat().st_mtime_ns for p in finished_run.rglob("*")} == before
    assert main(["train", "--resume", str(finished_run), "train.iterations=2"]) == 0  # free again
    assert iterations(finished_run) == [0, 1]


def test_a_fresh_run_on_a_folder_with_checkpoints_is_refused_with_a_hint(finished_run, shapes_model_dir, capsys):
    rc = main(train_args(shapes_model_dir, finished_run.parent, finished_run.name, **{"train.iterations": 1}))
    one_line_error(rc, capsys.readouterr().err, f"run directory {finished_run} already holds checkpoints",
                   f"use --resume {finished_run}")
    assert iterations(finished_run) == [0]


def test_a_refused_fresh_run_never_removes_the_folder_another_run_made(shapes_model_dir, tmp_path, capsys,
                                                                         monkeypatch):
    """The other run made the folder after this one listed log.out_dir (they started together): this run's
    clean-up of a folder it made must not take the other's."""
    out = tmp_path / "runs"
    real = run_module.make_run_dir
    holder = []

    def other_run_made_it_first(cfg):
        path = real(cfg)
        (path / "config.yaml").write_text("the other run's\n")
        holder.append(lock_run_dir(path))
        return path

    monkeypatch.setattr(run_module, "make_run_dir", other_run_made_it_first)
    try:
        rc = main(train_args(shapes_model_dir, out, "race", **{"train.iterations": 1}))
        one_line_error(rc, capsys.readouterr().err, f"run directory {out / 'race'} is in use")
        assert (out / "race" / "config.yaml").read_text() == "the other run's\n"
    finally:
        for lock in holder:
            lock.release()
