"""Run folders on the command line (issue 21 items 15, 22, 23).

* one reader of a run's trained weights (:func:`load_policy_weights`, a :class:`PolicyWeights` record);
* a damaged latest checkpoint: ``train --resume`` and ``eval`` fall back to the previous intact one with
  a warning naming the bad file, and stop with one line when none is intact;
* bad input found late is one line and exit 2: a binary ``--config``, ``data.prompts=`` a directory, a
  binary prompt file, a malformed ``config.yaml`` on ``--resume``;
* a run that fails before it holds anything of value leaves no run folder; a folder with a
  checkpoint, or one that was there before, is kept.
"""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest
import torch
from conftest import run_cli, tiny_overrides

from flowgrpo.cli import main
from flowgrpo.config import load_config
from flowgrpo.errors import UserError
from flowgrpo.rewards import REWARDS, RewardOutput
from flowgrpo.trainer.checkpoint import (PolicyWeights, latest_checkpoint, load_checkpoint, load_latest_intact,
                                         load_policy_weights, read_run_config)
from flowgrpo.trainer.run import train

FAILS_AT = "test_fails_at_call"


if FAILS_AT not in REWARDS:

    @REWARDS.register(FAILS_AT)
    class FailsAtCall:
        """Brightness, until call ``at`` (0-based): then a UserError, as an unreachable reward service gives."""

        name = FAILS_AT

        def __init__(self, at: int = 0):
            self.at, self.calls = at, 0

        def __call__(self, images, prompts, groups=None):
            self.calls += 1
            if self.calls > self.at:
                raise UserError(f"reward {FAILS_AT} is unavailable (call {self.calls})")
            return RewardOutput(images.float().flatten(1).mean(1))


def one_line_error(rc: int, err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, f"exit code {rc}, stderr:\n{err}"
    assert "Traceback" not in err and len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("flowgrpo: error: ")
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


def truncate(path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.fixture(scope="module")
def shapes_run(tmp_path_factory, shapes_model_dir):
    """A 3-iteration shapes LoRA run with checkpoints 2 and 3 (EMA on)."""
    out = tmp_path_factory.mktemp("ckpt_runs")
    train(load_config("shapes", None, tiny_overrides(shapes_model_dir, **{
        "train.iterations": 3, "log.checkpoint_every": 1, "train.lr": "1e-3", "log.trackers": "[]", "model.train_mode": "lora",
        "reward.weights": "{shapes: 1.0, jpeg_compressibility: 0.01}"}) + [f"log.out_dir={out}", "log.run_name=run"]))
    run = out / "run"
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["ckpt_000002", "ckpt_000003"]
    return run


@pytest.fixture
def run_copy(shapes_run, tmp_path):
    return shutil.copytree(shapes_run, tmp_path / "run")


# --------------------------------------------------------------------------- item 15: one reader


def test_load_policy_weights_is_a_typed_record(shapes_run):
    ckpt = shapes_run / "checkpoints" / "ckpt_000003"
    trainer = load_checkpoint(ckpt)["trainer"]
    w = load_policy_weights(shapes_run)
    assert isinstance(w, PolicyWeights) and (w.kind, w.iteration, w.path) == ("ema", 3, ckpt)
    assert w.weights.keys() == trainer["ema"].keys() and all(torch.equal(w.weights[k], trainer["ema"][k]) for k in w.weights)
    raw = load_policy_weights(shapes_run, prefer_ema=False, checkpoint=2)
    assert (raw.kind, raw.iteration, raw.path.name) == ("raw", 2, "ckpt_000002")
    assert load_policy_weights(shapes_run, checkpoint=ckpt).iteration == 3  # a checkpoint folder works too
    with pytest.raises(UserError, match=r"has no checkpoint 7 \(available: 2, 3\)"):
        load_policy_weights(shapes_run, checkpoint=7)


def test_eval_export_and_generate_load_weights_through_one_function(shapes_run, tmp_path, monkeypatch, capsys):
    """``flowgrpo eval``, ``export`` and ``unigenbench generate`` read no checkpoint keys of their own."""
    import flowgrpo.trainer.checkpoint as checkpoint

    calls = []
    real = checkpoint.load_policy_weights
    monkeypatch.setattr(checkpoint, "load_policy_weights", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert main(["eval", str(shapes_run), "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["checkpoint"].endswith("ckpt_000003")
    assert len(calls) == 1
    # export reads the weights, then refuses a model with no diffusers LoRA format (one line)
    assert main(["export", str(shapes_run), "--to", str(tmp_path / "lora")]) == 2
    assert len(calls) == 2
    from flowgrpo.unigenbench import generate

    policy = generate.build_generator(read_run_config(shapes_run), {"run": str(shapes_run.resolve()),
                                                                    "checkpoint": "ckpt_000002"})
    assert len(calls) == 3
    trained = real(shapes_run, checkpoint=2)
    live = dict(policy.named_trainable_parameters())
    assert trained.kind == "ema" and all(torch.equal(live[k], t) for k, t in trained.weights.items())


# --------------------------------------------------------------------------- item 22: damaged checkpoints


def test_eval_falls_back_to_the_previous_intact_checkpoint(run_copy, tmp_path, capsys):
    bad = run_copy / "checkpoints" / "ckpt_000003" / "state.pt"
    truncate(bad)
    assert main(["eval", str(run_copy), "--json", str(tmp_path / "e.json")]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint {bad} is damaged" in err and "using the older ckpt_000002" in err and "Traceback" not in err
    res = json.loads((tmp_path / "e.json").read_text())
    assert res["checkpoint"].endswith("ckpt_000002")
    assert main(["eval", str(run_copy / "checkpoints" / "ckpt_000002"), "--json", str(tmp_path / "e2.json")]) == 0
    assert json.loads((tmp_path / "e2.json").read_text())["accuracy"] == res["accuracy"]
    # the damaged one named explicitly: one line naming the file
    capsys.readouterr()
    one_line_error(main(["eval", str(run_copy / "checkpoints" / "ckpt_000003")]), capsys.readouterr().err, str(bad))
    # none intact: one line naming each, no warnings
    truncate(run_copy / "checkpoints" / "ckpt_000002" / "state.pt", 0.0)
    one_line_error(main(["eval", str(run_copy)]), capsys.readouterr().err, "no intact checkpoint", "ckpt_000002",
                   "ckpt_000003")


def test_a_checkpoint_that_fails_to_load_is_passed_over(run_copy, capsys):
    """Damage the cheap structural check does not see (a whole archive whose pickle is garbage)."""
    bad = run_copy / "checkpoints" / "ckpt_000003" / "state.pt"
    bad.unlink()
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("state/data.pkl", b"not a pickle")
    assert latest_checkpoint(run_copy) == bad.parent  # structurally whole
    ckpt = load_latest_intact(run_copy)
    assert ckpt.path.name == "ckpt_000002" and ckpt.iteration == 2
    assert f"checkpoint {bad} is damaged" in capsys.readouterr().err
    with pytest.raises(UserError, match="cannot be loaded"):
        load_checkpoint(bad.parent)


def test_resume_falls_back_to_the_previous_intact_checkpoint(run_copy):
    bad = run_copy / "checkpoints" / "ckpt_000003" / "state.pt"
    truncate(bad)
    proc = run_cli(["train", "--resume", str(run_copy), "train.iterations=4"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {run_copy / 'checkpoints' / 'ckpt_000002'} at iteration 2" in proc.stdout
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and f"checkpoint {bad} is damaged" in err[0], proc.stderr
    assert [p.name for p in sorted((run_copy / "checkpoints").iterdir())] == ["ckpt_000003", "ckpt_000004"]
    assert load_checkpoint(run_copy / "checkpoints" / "ckpt_000004")["trainer"]["iteration"] == 4  # rewritten whole
    assert load_checkpoint(run_copy / "checkpoints" / "ckpt_000003")["trainer"]["iteration"] == 3


def test_resume_with_no_intact_checkpoint_is_one_line(run_copy):
    for ckpt in (run_copy / "checkpoints").iterdir():
        truncate(ckpt / "state.pt", 0.9)
    proc = run_cli(["train", "--resume", str(run_copy)])
    one_line_error(proc.returncode, proc.stderr, "no intact checkpoint", "ckpt_000002", "ckpt_000003")


# --------------------------------------------------------------------------- item 23: one line, exit 2


@pytest.fixture
def binary(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 8)
    return path


def test_binary_config_file_is_one_line(binary, capsys):
    one_line_error(main(["train", "--config", str(binary)]), capsys.readouterr().err, str(binary), "not UTF-8 text")


def test_bad_prompt_files_are_one_line_and_leave_no_run_folder(shapes_model_dir, binary, tmp_path, capsys):
    out = tmp_path / "runs"
    common = ["train", *tiny_overrides(shapes_model_dir), f"log.out_dir={out}"]
    one_line_error(main([*common, f"data.prompts={tmp_path}"]), capsys.readouterr().err, str(tmp_path), "directory")
    one_line_error(main([*common, f"data.prompts={binary}"]), capsys.readouterr().err, str(binary), "not UTF-8 text")
    words = tmp_path / "words.txt"
    words.write_text("a red circle\na cat on a mat\n")
    one_line_error(main([*common, f"data.prompts={words}", "log.run_name=vocab"]), capsys.readouterr().err,
                   "'cat'", "shapes-world vocabulary")
    assert not out.exists()  # the run folder (and the log.out_dir it made) are gone again


def test_malformed_run_config_on_resume_is_one_line(run_copy, capsys):
    config = run_copy / "config.yaml"
    for text, needle in ((b"model: [\n", "cannot be read as YAML"), (bytes(range(128, 256)), "cannot be read as YAML"),
                         (b"- a\n- b\n", "must hold a mapping"), (b"train: {lr: abc}\n", "train.lr")):
        config.write_bytes(text)
        one_line_error(main(["train", "--resume", str(run_copy)]), capsys.readouterr().err, str(config), needle)
    one_line_error(main(["eval", str(run_copy)]), capsys.readouterr().err, str(config))


def test_a_failed_run_leaves_no_stub_folder_but_keeps_checkpoints(shapes_model_dir, tmp_path, capsys):
    out = tmp_path / "runs"
    out.mkdir()
    common = ["train", *tiny_overrides(shapes_model_dir, **{"train.iterations": 3, "log.checkpoint_every": 1}),
              f"log.out_dir={out}", f"reward.weights={{{FAILS_AT}: 1.0}}"]
    # fails in its first iteration: nothing of value, no folder (out itself was there before: kept)
    one_line_error(main([*common, "log.run_name=first"]), capsys.readouterr().err, "unavailable")
    assert out.is_dir() and not (out / "first").exists()
    # fails after its first checkpoint: the folder stays, and --resume can continue it
    one_line_error(main([*common, "log.run_name=second", f"reward.options.{FAILS_AT}.at=1"]),
                   capsys.readouterr().err, "unavailable")
    assert [p.name for p in (out / "second" / "checkpoints").iterdir()] == ["ckpt_000001"]
    # a folder that was there before is never removed
    (out / "mine").mkdir()
    (out / "mine" / "notes.txt").write_text("keep me")
    one_line_error(main([*common, "log.run_name=mine"]), capsys.readouterr().err, "unavailable")
    assert (out / "mine" / "notes.txt").read_text() == "keep me"
