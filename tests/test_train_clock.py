"""train.clock: the time budget counts wall-clock (default) or the process's CPU time, so that a
recipe compared on a busy machine gets the budget it would get on a quiet one. Time the process
spends waiting (here: a sleep inside each iteration, standing in for a competing process) counts
on the wall clock only."""

from __future__ import annotations

import json
import time

import pytest

from flowgrpo.trainer.run import train
from flowgrpo.trainer.trainer import Trainer

PAUSE = 0.4


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_waiting_counts_on_the_wall_clock_only(clock, tiny_config, tmp_path, monkeypatch):
    step = Trainer.iteration_step

    def waiting_step(self):
        out = step(self)
        time.sleep(PAUSE)
        return out

    monkeypatch.setattr(Trainer, "iteration_step", waiting_step)
    cfg = tiny_config(**{"train.clock": clock, "train.iterations": 3, "eval.evaluator": "none",
                         "log.trackers": "[]", "log.grid_every": 0})
    train(cfg, tmp_path / clock)
    summary = json.loads((tmp_path / clock / "summary.json").read_text())
    assert summary["iterations"] == 3
    waited = 3 * PAUSE
    if clock == "wall":
        assert summary["train_seconds"] >= waited
    else:
        metrics = [json.loads(ln) for ln in (tmp_path / clock / "metrics.jsonl").read_text().splitlines()]
        busy = sum(m["iter_s"] for m in metrics)  # wall time of the iterations, their sleeps excluded
        assert summary["train_seconds"] < busy + waited / 2  # CPU time: none of the sleeping
        assert summary["train_seconds"] > 0
