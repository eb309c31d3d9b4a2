"""What ``train --resume`` may change (issue 43, "a new hostile round", item 7).

``--resume RUN --preset mix-grpo`` and ``--resume RUN train.lr=0.003`` ran on with the recorded
settings, saying nothing. Now another preset or recipe is one line; overrides (and a ``--config``
file) may change the keys of :data:`flowgrpo.commands.resume.CONTINUE_KEYS` (budgets, schedules,
logging), named in a note and recorded in ``config.yaml``; any other changed key is one line naming
it with its recorded value and the asked one. Nothing is trained or written by a refused resume.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import tiny_overrides
from test_cli_errors import one_line_error

from flowgrpo.cli import main
from flowgrpo.commands.resume import CONTINUE_KEYS


@pytest.fixture
def run(shapes_model_dir, tmp_path) -> Path:
    """A finished 1-iteration run of the default preset (shapes-nft) with its checkpoint."""
    args = ["train", *tiny_overrides(shapes_model_dir, **{"train.iterations": 1, "log.trackers": "[]",
                                                          "eval.evaluator": "none"}),
            f"log.out_dir={tmp_path / 'runs'}", "log.run_name=r"]
    assert main(args) == 0
    return tmp_path / "runs" / "r"


def iterations(run_dir: Path) -> list[int]:
    return [json.loads(ln)["iteration"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def unchanged(run_dir: Path):
    """A check that nothing in ``run_dir`` changed since this call."""
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    return lambda: {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"} == before


@pytest.mark.parametrize("argv, needles", [
    (["--preset", "mix-grpo"], ["--preset mix-grpo differs from the run's method 'shapes-nft'"]),
    (["--recipe", "sd35-medium"], ["--recipe sd35-medium differs from the run's recipe 'shapes'"]),
    (["train.lr=0.003"], ["train.lr was 6e-05 in the recorded run, asked 0.003", "start a new run"]),
    (["train.iterations=3", "sampler.num_steps=6", "train.seed=1"],
     ["sampler.num_steps was 4 in the recorded run, asked 6 (and train.seed)"]),
])
def test_a_resume_that_would_change_the_run_is_refused(run, argv, needles, capsys):
    same = unchanged(run)
    capsys.readouterr()
    rc = main(["train", "--resume", str(run), *argv])
    one_line_error(rc, capsys.readouterr().err, f"--resume {run}: ", *needles)
    assert same()


def test_a_config_file_on_resume_is_held_to_the_same_rule(run, tmp_path, capsys):
    changes_lr = tmp_path / "lr.yaml"
    changes_lr.write_text("train:\n  lr: 1e-3\n  iterations: 2\n")
    same = unchanged(run)
    capsys.readouterr()
    one_line_error(main(["train", "--resume", str(run), "--config", str(changes_lr)]), capsys.readouterr().err,
                   "train.lr was 6e-05 in the recorded run, asked 0.001")
    assert same()
    budget = tmp_path / "budget.yaml"
    budget.write_text("train:\n  iterations: 2\n")
    assert main(["train", "--resume", str(run), "--config", str(budget), "--preset", "shapes-nft"]) == 0
    assert iterations(run) == [0, 1]


def test_budgets_and_schedules_change_with_a_note_and_are_recorded(run, capsys):
    """The documented way to extend a run: ``--resume RUN train.max_minutes=60 eval.every_minutes=5``."""
    capsys.readouterr()
    rc = main(["train", "--resume", str(run), "train.iterations=2", "train.max_minutes=60", "eval.every_minutes=5",
               "log.checkpoint_every=1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert (f"note: resuming {run} with train.iterations=2 (was 1), train.max_minutes=60.0 (was 15.0), "
            "eval.every_minutes=5.0 (was 3.0), log.checkpoint_every=1 (was 25)") in out
    assert iterations(run) == [0, 1]
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert (recorded["train"]["iterations"], recorded["train"]["max_minutes"]) == (2, 60.0)
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0  # a later resume keeps them: nothing left to train
    assert "note: resuming" not in capsys.readouterr().out and iterations(run) == [0, 1]


def test_the_keys_a_resume_may_change_are_config_keys():
    from flowgrpo.config import RunConfig
    from flowgrpo.config.layers import flatten

    assert set(CONTINUE_KEYS) <= set(flatten(RunConfig()))


def test_docs_name_every_key_a_resume_may_change():
    text = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    section = text[text.index("A resumed run is the recorded run continued"):]
    section = section[:section.index("\n\n")]
    assert [k for k in CONTINUE_KEYS if f"`{k}`" not in section] == []
