"""Issue 43, a second hostile round: what a held-out hostile client found, each refused in one line.

* a run folder whose newest ``state.pt`` (or ``eval_before_grid.pt``) is a pickle with a ``__reduce__``:
  ``eval``, ``sample``, ``export`` and ``train --resume`` refuse it without running it, and a real
  run's checkpoint still loads;
* ``log.run_name`` that leaves ``log.out_dir`` (absolute, ``..``): refused at config time.

The HTTP clients' and the reward server's defects are in ``test_hostile_http.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from test_cli_errors import one_line_error

from flowgrpo.cli import main
from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.safe_load import UnsafeFileError, load_tensors
from flowgrpo.trainer.checkpoint import list_checkpoints, load_checkpoint


class WritesMarker:
    """Pickles as a call of ``open(marker, "w")``: unpickling it creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, shapes_model_dir) -> Path:
    """A real 1-iteration shapes LoRA run (a LoRA run, so that ``export`` reaches its checkpoint)."""
    out = tmp_path_factory.mktemp("hostile_runs")
    args = ["train", *tiny_overrides(shapes_model_dir, **{"log.trackers": "[]", "train.iterations": 1,
                                                          "log.checkpoint_every": 1, "model.train_mode": "lora",
                                                          "eval.seen": "false"}),
            f"log.out_dir={out}", "log.run_name=run"]
    assert main(args) == 0
    return out / "run"


def poisoned_copy(run: Path, tmp_path: Path, file: str = "state") -> tuple[Path, Path]:
    """(a copy of ``run`` whose newest state.pt, or eval_before_grid.pt, writes a marker when
    unpickled, the marker's path)."""
    copy = shutil.copytree(run, tmp_path / "run")
    marker = tmp_path / "PWNED"
    target = list_checkpoints(copy)[-1] / "state.pt" if file == "state" else copy / "eval_before_grid.pt"
    torch.save({"trainer": WritesMarker(marker)}, target)
    return copy, marker


def test_a_real_checkpoint_and_grid_load_as_tensors_and_plain_data(lora_run, tmp_path, capsys):
    state = load_tensors(list_checkpoints(lora_run)[-1] / "state.pt")
    assert {"iteration", "trainable", "optimizer", "ema", "objective", "curriculum"} <= set(state["trainer"])
    assert load_tensors(lora_run / "eval_before_grid.pt", "evaluation grid") is not None
    assert main(["eval", str(lora_run), "--json", str(tmp_path / "e.json")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("command", ["eval", "sample", "export", "resume"])
def test_a_checkpoint_that_would_run_code_is_refused_in_one_line(command, lora_run, tmp_path, capsys):
    run, marker = poisoned_copy(lora_run, tmp_path)
    bad = list_checkpoints(run)[-1] / "state.pt"
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n")
    argv = {"eval": ["eval", str(run)],
            "sample": ["sample", str(run), "--prompts", str(prompts), "--out", str(tmp_path / "samples"), "--quiet"],
            "export": ["export", str(run), "--to", str(tmp_path / "lora")],
            "resume": ["train", "--resume", str(run), "train.iterations=2"]}[command]
    rc = main(argv)
    one_line_error(rc, capsys.readouterr().err, f"{bad} is not a flowgrpo checkpoint", "could run code",
                   "io.open")
    assert not marker.exists()
    assert not (tmp_path / "samples").exists() and not (tmp_path / "lora").exists()
    assert [p.name for p in list_checkpoints(run)] == ["ckpt_000001"]  # resume wrote nothing


def test_load_checkpoint_refuses_it_too(lora_run, tmp_path):
    run, marker = poisoned_copy(lora_run, tmp_path)
    with pytest.raises(UnsafeFileError, match="not a flowgrpo checkpoint"):
        load_checkpoint(list_checkpoints(run)[-1])
    assert not marker.exists()


def test_a_poisoned_evaluation_grid_is_refused_when_a_resumed_run_draws_it(lora_run, tmp_path, capsys):
    """The resumed run reads the grid of its first evaluation for before_after.png at the end."""
    run, marker = poisoned_copy(lora_run, tmp_path, "grid")
    rc = main(["train", "--resume", str(run), "train.iterations=2"])
    one_line_error(rc, capsys.readouterr().err, f"{run / 'eval_before_grid.pt'} is not a flowgrpo evaluation grid")
    assert not marker.exists()


def test_a_poisoned_pretraining_state_is_refused(tmp_path):
    from flowgrpo.shapes.pretrain import main as pretrain

    marker = tmp_path / "PWNED"
    torch.save({"model": WritesMarker(marker)}, tmp_path / "state.pt")
    with pytest.raises(SystemExit, match="state.pt is not a flowgrpo pretraining state"):
        pretrain(["--out", str(tmp_path), "--steps", "1", "--device", "cpu"])
    assert not marker.exists()


# --------------------------------------------------------------------------- log.run_name


@pytest.mark.parametrize("name, needle", [
    ("ABS", "is an absolute path"),
    ("../escaped", "has a '..' component"),
    ("a/../../escaped", "has a '..' component"),
    (".", "is log.out_dir itself"),
    ("link/escaped", "resolves to"),
    ("a" * 256, "has a component of 256 bytes"),  # was a traceback (OSError: File name too long)
    ('"run\\tname"', "holds a control character"),  # YAML's escape: a tab inside the name
])
def test_a_run_name_outside_out_dir_is_refused_before_anything_is_written(name, needle, shapes_model_dir, tmp_path,
                                                                         capsys):
    out, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "link").symlink_to(elsewhere)  # a folder of out_dir that resolves outside it
    name = str(elsewhere / "abs") if name == "ABS" else name
    rc = main(["train", *tiny_overrides(shapes_model_dir, **{"log.trackers": "[]"}), f"log.out_dir={out}",
               f"log.run_name={name}"])
    one_line_error(rc, capsys.readouterr().err, "config key 'log.run_name'", needle, "inside log.out_dir")
    assert sorted(p.name for p in out.iterdir()) == ["link"] and not any(elsewhere.iterdir())
    assert not (tmp_path / "escaped").exists()


def test_run_names_inside_out_dir_are_kept():
    for name in ("run", "group/run", "a..b", "./run"):
        assert load_config("shapes", None, [f"log.run_name={name}"]).log.run_name == name
    with pytest.raises(ConfigError, match="'log.run_name'"):
        load_config("shapes", None, ["log.run_name=/tmp/x"])
