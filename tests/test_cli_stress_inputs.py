"""Inputs a stress re-run of the training CLI tried (issue 31, "Training CLI"): each ends in one line and
exit 2 (or a documented notice), with nothing half-written on disk.

* schedule keys out of range (``eval.every_minutes=-3`` used to hang, ``log.checkpoint_every=0`` to
  divide by zero), NaN/inf reward weights, a chain group of one sample: refused at config time;
* a read-only ``log.out_dir``, a full disk while a checkpoint (or metrics.jsonl) is written;
* checkpoint bytes overwritten inside a weight record (found by the archive's CRC-32), ``--resume`` of a
  run without checkpoints (a notice, then iteration 0);
* an update that breaks the weights (``train.lr=1e30``) stops the run; metrics.jsonl is strict JSON;
* ``lr: 1e-4`` in a YAML file; a 1.2 MB prompt; a prompt file over 64 MiB (``train`` and ``sample``: one
  reader); a FIFO, socket, device or directory as the prompt file, named for what it is and never opened;
* overrides on both sides of ``--preset``; an unknown key names its near miss.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_overrides
from test_cli_errors import one_line_error

from flowgrpo.cli import build_parser, main, parse_args
from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError, UserError
from flowgrpo.trainer import checkpoint as checkpoint_module
from flowgrpo.trainer.checkpoint import list_checkpoints, load_checkpoint
from flowgrpo.trainer.metrics import MetricsLogger

SIGNAL = "reward.weights={shapes: 1.0, jpeg_compressibility: 0.01}"  # every group has reward spread


def strict_json_lines(path: Path) -> list[dict]:
    """Each line of ``path`` parsed as strict JSON (a bare NaN / Infinity fails)."""
    def refuse(token):
        raise AssertionError(f"{path} holds a bare {token}: not JSON")

    return [json.loads(ln, parse_constant=refuse) for ln in path.read_text().splitlines() if ln.strip()]


def train_args(model_dir, out: Path, name: str, *extra: str, **keys) -> list[str]:
    return ["train", *tiny_overrides(model_dir, **{"log.trackers": "[]", **keys}), f"log.out_dir={out}",
            f"log.run_name={name}", *extra]


# --------------------------------------------------------------------------- config-time refusals


@pytest.mark.parametrize("override, needle", [
    ("eval.every_minutes=-3", "'eval.every_minutes' must be a finite number >= 0.0, got -3.0"),
    ("log.checkpoint_every=0", "'log.checkpoint_every' must be >= 1, got 0"),
    ("eval.every=-1", "'eval.every' must be >= 0, got -1"),
    ("log.grid_every=-5", "'log.grid_every' must be >= 0, got -5"),
    ("reward.weights={shapes: .nan}", "'reward.weights.shapes' must be a finite number, got nan"),
    ("reward.weights={shapes: 1.0, jpeg_compressibility: .inf}", "'reward.weights.jpeg_compressibility' must be a finite"),
    ("reward.weights={shapes: -.inf}", "'reward.weights.shapes' must be a finite number, got -inf"),
    ("reward.weights={shapes: heavy}", "'reward.weights.shapes' must be a finite number, got 'heavy'"),
    ("data.trees_per_prompt=1", "'data.trees_per_prompt' = 1 trains nothing"),
])
def test_bad_values_are_one_line_before_any_run_folder(override, needle, shapes_model_dir, tmp_path, capsys):
    out = tmp_path / "runs"
    rc = main(train_args(shapes_model_dir, out, "bad", override))
    one_line_error(rc, capsys.readouterr().err, needle)
    assert not out.exists()


def test_zero_schedules_still_mean_off():
    cfg = load_config("shapes", None, ["eval.every=0", "eval.every_minutes=0", "log.grid_every=0"])
    assert (cfg.eval.every, cfg.eval.every_minutes, cfg.log.grid_every) == (0, 0.0, 0)


def test_a_group_of_one_is_refused_only_where_it_trains_nothing(shapes_model_dir):
    """Chains (one leaf per tree) with one tree per prompt: refused, because such a run really trains
    nothing (shown by building it anyway). Tree methods with one tree per prompt (the group is the
    tree's leaves) load as before."""
    from flowgrpo.trainer.trainer import Trainer

    for preset in ("flow-grpo", "shapes", "shapes-nft", "dance-grpo"):
        with pytest.raises(ConfigError, match=r"config key 'data\.trees_per_prompt' = 1 trains nothing"):
            load_config(preset, None, ["data.trees_per_prompt=1"])
    for preset in ("branch-grpo", "tree-rpo", "branch-grpo-mix"):
        assert load_config(preset, None, ["data.trees_per_prompt=1"]).data.trees_per_prompt == 1
    # the refused configuration, built behind validation's back: no sample carries signal, nothing trains
    cfg = load_config("shapes", None, tiny_overrides(shapes_model_dir) + [SIGNAL, "loss.grpo.backend=reference"])
    cfg.data.trees_per_prompt = 1
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.policy.trainable_state_dict().items()}
    m = trainer.iteration_step().metrics
    assert m["zero_std_ratio"] == 1.0 and "loss" not in m  # no row carries signal: no update ran
    assert all(torch.equal(before[k], v) for k, v in trainer.policy.trainable_state_dict().items())


def test_yaml_file_floats_written_as_users_write_them(tmp_path):
    """YAML 1.1 reads ``1e-4`` (no dot) as a string; a config file's float keys and reward weights take it."""
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 1e-4\n  max_minutes: 5\nloss:\n  grpo:\n    clip_range: 2E-4\n"
                    "reward:\n  weights: {shapes: 1, jpeg_compressibility: 1e-2}\n")
    cfg = load_config("shapes", str(path))
    assert cfg.train.lr == 1e-4 and isinstance(cfg.train.lr, float)
    assert cfg.loss.grpo.clip_range == 2e-4 and cfg.train.max_minutes == 5.0
    assert cfg.reward.weights == {"shapes": 1, "jpeg_compressibility": 0.01}
    path.write_text("train:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"config key 'train.lr' expects float, got str 'fast'"):
        load_config("shapes", str(path))
    path.write_text("train:\n  iterations: 1e3\n")  # an int key does not take a float's spelling
    with pytest.raises(ConfigError, match=r"config key 'train.iterations' expects int"):
        load_config("shapes", str(path))


# --------------------------------------------------------------------------- the command line


def test_overrides_stand_on_both_sides_of_the_options(capsys):
    args = parse_args(build_parser(), ["train", "train.lr=1e-4", "--preset", "shapes", "train.iterations=7",
                                       "--config", "x.yaml", "eval.every=2"])
    assert args.preset == "shapes" and args.config == "x.yaml"
    assert args.overrides == ["train.lr=1e-4", "train.iterations=7", "eval.every=2"]
    assert main(["config", "show", "train.lr=1e-4", "--preset", "shapes", "train.iterations=7"]) == 0
    shown = capsys.readouterr().out
    assert "lr: 0.0001" in shown and "iterations: 7" in shown
    with pytest.raises(SystemExit) as exc:  # an unknown option is still refused, by name
        parse_args(build_parser(), ["train", "a.b=1", "--presett", "shapes"])
    assert exc.value.code == 2 and "unrecognized arguments: --presett" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a command without overrides takes no stray words
        parse_args(build_parser(), ["presets", "extra"])


@pytest.mark.parametrize("override, needle", [
    ("train.lrr=1e-4", "unknown config key 'train.lrr'; valid keys under 'train': iterations"),
    ("train.lrr=1e-4", "did you mean 'train.lr'?"),
    ("lr=1e-4", "did you mean 'train.lr'?"),
    ("trian.lr=1e-4", "did you mean 'train'?"),
    ("eval.evry=5", "did you mean 'eval.every'?"),
])
def test_unknown_key_names_its_near_miss(override, needle, capsys):
    one_line_error(main(["train", override]), capsys.readouterr().err, needle)


def test_unknown_key_without_a_near_miss_lists_the_keys_only():
    with pytest.raises(ConfigError) as exc:
        load_config("shapes", None, ["train.zzzzzz=1"])
    assert "did you mean" not in str(exc.value) and "valid keys under 'train'" in str(exc.value)


# --------------------------------------------------------------------------- disks


def test_read_only_out_dir_is_one_line_naming_it(shapes_model_dir, tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: refuse as the kernel would for anyone else
        real = Path.mkdir

        def mkdir(self, *a, **k):
            if ro in self.parents:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real(self, *a, **k)

        monkeypatch.setattr(Path, "mkdir", mkdir)
    try:
        rc = main(train_args(shapes_model_dir, ro, "r"))
        one_line_error(rc, capsys.readouterr().err, f"cannot create run directory {ro / 'r'}", "Permission denied")
    finally:
        ro.chmod(0o755)
    assert list(ro.iterdir()) == []


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                     RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos "
                                                  "34603008 vs 34602904\nPytorchStreamWriter failed writing file "
                                                  "data/3: file write failed")])
def test_full_disk_while_checkpointing_is_one_line_and_leaves_no_temp_folder(
        failure, shapes_model_dir, tmp_path, capsys, monkeypatch):
    """The second checkpoint's write fails part-way (as on a full disk): one line naming it, the first
    checkpoint kept, no ``.tmp_ckpt_*`` left behind."""
    real = torch.save

    def save(obj, f, *a, **k):
        if str(f).endswith(f".tmp_ckpt_000002{os.sep}state.pt"):
            Path(f).write_bytes(b"PK\x03\x04" + bytes(4096))  # a part was written before the disk filled
            raise failure
        return real(obj, f, *a, **k)

    monkeypatch.setattr(checkpoint_module.torch, "save", save)
    out = tmp_path / "runs"
    rc = main(train_args(shapes_model_dir, out, "full", **{"train.iterations": 3, "log.checkpoint_every": 1}))
    reason = "No space left on device" if isinstance(failure, OSError) else "file write failed"
    line = one_line_error(rc, capsys.readouterr().err,
                          f"cannot write checkpoint {out / 'full' / 'checkpoints' / 'ckpt_000002'}", reason, "MiB free")
    assert "older checkpoints are kept" in line
    assert sorted(p.name for p in (out / "full" / "checkpoints").iterdir()) == ["ckpt_000001"]
    assert not list(out.rglob(".tmp_*"))


def test_full_disk_before_the_first_iteration_is_one_line(shapes_model_dir, tmp_path, capsys, monkeypatch):
    """torch's writer fails on the held-out grid the run keeps for its before/after picture."""
    real = torch.save

    def save(obj, f, *a, **k):
        if str(f).endswith("eval_before_grid.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 64")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(checkpoint_module.torch, "save", save)
    out = tmp_path / "runs"
    rc = main(train_args(shapes_model_dir, out, "g", **{"train.iterations": 1}))
    one_line_error(rc, capsys.readouterr().err, f"cannot write {out / 'g' / 'eval_before_grid.pt'}", "unexpected pos")
    assert not out.exists()


def test_full_disk_elsewhere_in_a_run_is_one_line(shapes_model_dir, tmp_path, capsys, monkeypatch):
    """A write the run makes outside checkpoints (metrics.jsonl) fails with ENOSPC: one line naming the file."""
    def log(self, record):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(MetricsLogger, "log", log)
    out = tmp_path / "runs"
    rc = main(train_args(shapes_model_dir, out, "m", **{"train.iterations": 1}))
    one_line_error(rc, capsys.readouterr().err, "No space left on device", str(out / "m" / "metrics.jsonl"))


def test_a_background_writer_on_a_full_disk_is_one_warning_line(capsys, monkeypatch):
    """TensorBoard writes events on its own thread: its ENOSPC is one warning line, not a traceback;
    anything else still reaches the previous hook (Python's traceback printer)."""
    import threading

    passed_on = []
    monkeypatch.setattr(threading, "excepthook", lambda args: passed_on.append(args.exc_value))

    from flowgrpo.cli import _quiet_disk_errors_in_threads

    def fail():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/r/tensorboard/events.out")

    def bug():
        raise ValueError("a real bug keeps its traceback")

    _quiet_disk_errors_in_threads()
    _quiet_disk_errors_in_threads()  # installed once, however often main() runs
    for target in (fail, bug):
        t = threading.Thread(target=target, name="writer")
        t.start()
        t.join()
    err = capsys.readouterr().err
    assert ("flowgrpo: warning: background writer writer stopped: No space left on device: "
            "/runs/r/tensorboard/events.out\n") in err
    assert err.count("flowgrpo: warning") == 1 and "a real bug" not in err
    assert [type(e) for e in passed_on] == [ValueError]


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, shapes_model_dir) -> Path:
    """A 2-iteration run with checkpoints 1 and 2."""
    out = tmp_path_factory.mktemp("stress_runs")
    assert main(train_args(shapes_model_dir, out, "run", SIGNAL, **{"train.iterations": 2,
                                                                     "log.checkpoint_every": 1})) == 0
    return out / "run"


def overwrite_weight_bytes(ckpt: Path) -> str:
    """Flip 64 bytes in the middle of the largest tensor record of ``ckpt``'s state file (its zip
    structure stays whole); returns the record's name."""
    file = ckpt / "state.pt"
    with zipfile.ZipFile(file) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(file, "r+b") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = np.frombuffer(fh.read(4), dtype="<u2")
        start = info.header_offset + 30 + int(name_len) + int(extra_len) + info.file_size // 2
        fh.seek(start)
        chunk = fh.read(64)
        fh.seek(start)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    return info.filename


def test_overwritten_weight_bytes_are_found_on_load_and_resume(two_checkpoints, tmp_path, capsys):
    run = shutil.copytree(two_checkpoints, tmp_path / "run")
    ckpts = list_checkpoints(run)
    record = overwrite_weight_bytes(ckpts[1])
    bad = ckpts[1] / "state.pt"
    with pytest.raises(UserError, match=f"checkpoint {bad} is damaged: record {record} fails its CRC-32 check"):
        load_checkpoint(ckpts[1])
    # resume passes it over for the intact older one, naming the file and the record
    assert main(["train", "--resume", str(run), "train.iterations=2"]) == 0
    cap = capsys.readouterr()
    assert f"checkpoint {bad} is damaged (record {record} fails its CRC-32 check" in cap.err
    assert f"resumed from {ckpts[0]} at iteration 1" in cap.out
    # both damaged: one line naming each, exit 2
    for ckpt in list_checkpoints(run):
        overwrite_weight_bytes(ckpt)
    one_line_error(main(["train", "--resume", str(run)]), capsys.readouterr().err, "no intact checkpoint",
                   "ckpt_000001: record state/data/", "ckpt_000002: record state/data/", "CRC-32")


def test_resume_without_checkpoints_says_it_starts_over(two_checkpoints, tmp_path, capsys):
    run = tmp_path / "killed_early"
    run.mkdir()
    shutil.copy(two_checkpoints / "config.yaml", run / "config.yaml")
    assert main(["train", "--resume", str(run), "train.iterations=1"]) == 0
    out = capsys.readouterr().out
    assert f"note: {run} has no checkpoint yet; starting it again from iteration 0 with its config.yaml" in out
    assert [r["iteration"] for r in strict_json_lines(run / "metrics.jsonl")] == [0]
    assert [p.name for p in list_checkpoints(run)] == ["ckpt_000001"]


# --------------------------------------------------------------------------- diverging runs, metrics


def test_an_update_that_breaks_the_weights_stops_the_run(shapes_model_dir, tmp_path, capsys):
    """train.lr=1e30: the first update writes finite weights of magnitude 1e30, the next rollout is NaN;
    the run stops there with one line instead of training on to "done"."""
    out = tmp_path / "runs"
    rc = main(train_args(shapes_model_dir, out, "lr", SIGNAL, "train.lr=1e30",
                         **{"train.iterations": 4, "log.checkpoint_every": 1}))
    cap = capsys.readouterr()
    one_line_error(rc, cap.err, "training diverged at iteration 1", "NaN or infinite", "train.lr=1e+30")
    assert "done:" not in cap.out
    rows = strict_json_lines(out / "lr" / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [0, 1]
    assert [p.name for p in list_checkpoints(out / "lr")] == ["ckpt_000001"]  # nothing after the divergence


def test_metrics_lines_are_strict_json(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log({"iteration": 0, "reward_mean": float("nan"), "loss": float("inf"), "kl": np.float32("nan"),
                "grad_norm": torch.tensor(0.5), "nan_rewards_dropped": np.int64(8), "per": [1.0, -math.inf],
                "ok": True, "note": None})
    logger.close()
    (row,) = strict_json_lines(tmp_path / "metrics.jsonl")
    assert row == {"iteration": 0, "reward_mean": None, "loss": None, "kl": None, "grad_norm": 0.5,
                   "nan_rewards_dropped": 8, "per": [1.0, None], "ok": True, "note": None}
    # what reads the lines back takes the nulls (an iteration whose every reward was dropped)
    from flowgrpo.output.plots import save_reward_curve
    from flowgrpo.trainer.metrics import read_metrics

    records = read_metrics(tmp_path) + [{"iteration": i, "reward_mean": 0.1 * i} for i in range(1, 6)]
    save_reward_curve(tmp_path / "reward_curve.png", records, [(0, 0.5)])
    assert (tmp_path / "reward_curve.png").stat().st_size > 0


# --------------------------------------------------------------------------- prompts


def test_a_megabyte_prompt_is_one_line_naming_file_line_and_limit(shapes_model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\n\n" + "a red circle " * 100_000 + "\n")
    out = tmp_path / "runs"
    rc = main(train_args(shapes_model_dir, out, "long", f"data.prompts={prompts}"))
    line = one_line_error(rc, capsys.readouterr().err, f"{prompts}:3:", "1,299,999 characters", "limit of 10,000")
    assert len(line) < 400 and not out.exists()


def test_a_prompt_file_over_64_mib_is_refused_before_it_is_read(shapes_model_dir, tmp_path, capsys):
    big = sparse_file(tmp_path / "big.txt", 65)  # read, its NULs would fail as binary
    rc = main(train_args(shapes_model_dir, tmp_path / "runs", "big", f"data.prompts={big}"))
    one_line_error(rc, capsys.readouterr().err, f"prompt file {big} is 65.0 MiB", "limit of 64 MiB")


def sparse_file(path: Path, mib: int) -> Path:
    """``path`` as a sparse file of ``mib`` MiB: that size on paper, nothing on disk."""
    with open(path, "wb") as fh:
        fh.truncate(mib * 2**20)
    return path


def test_sample_refuses_a_prompt_file_over_the_limit_before_reading_it(tmp_path, capsys, monkeypatch):
    """``sample --prompts`` checks the same limit as ``train`` (one reader, one constant), from the file's
    size: nothing of it is read (it used to be read whole first: 1.9 GiB RSS for 128 MiB of text)."""
    from flowgrpo.data import prompt_files as prompts

    big = sparse_file(tmp_path / "big.txt", 128)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} was read"))
    rc = main(["sample", str(tmp_path / "run"), "--prompts", str(big), "--out", str(tmp_path / "out")])
    one_line_error(rc, capsys.readouterr().err, f"prompt file {big} is 128.0 MiB",
                   f"limit of {prompts.MAX_PROMPT_FILE_BYTES // 2**20} MiB")
    assert not (tmp_path / "out").exists()


def special_files(folder: Path) -> dict[str, Path]:
    """A FIFO, a socket and a directory in ``folder`` (short names: a socket path has ~100 characters at most)."""
    import socket

    os.mkfifo(folder / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    here = os.getcwd()
    try:
        os.chdir(folder)
        sock.bind("sock")
    finally:
        os.chdir(here)
    sock.close()
    (folder / "dir.txt").mkdir()
    return {"a FIFO (named pipe)": folder / "fifo", "a socket": folder / "sock", "a directory": folder / "dir.txt"}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_fifo_socket_or_directory_as_prompts_is_named_before_it_is_opened(shapes_model_dir, tmp_path, capsys,
                                                                             monkeypatch):
    """Opening a FIFO waits for a writer: each special file is refused from its ``stat`` with what it is,
    by ``train`` and ``sample`` alike, and never opened."""
    import builtins

    found = special_files(tmp_path)
    found["a character device"] = Path(os.devnull)
    real_open = builtins.open

    def guarded_open(file, *a, **k):
        assert Path(str(file)) not in found.values(), f"{file} was opened"
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded_open)
    for kind, path in found.items():
        rc = main(train_args(shapes_model_dir, tmp_path / "runs", "special", f"data.prompts={path}"))
        one_line_error(rc, capsys.readouterr().err, f"prompt file {path} is {kind}, not a .txt or .jsonl file")
        rc = main(["sample", str(tmp_path / "run"), "--prompts", str(path), "--out", str(tmp_path / "out")])
        one_line_error(rc, capsys.readouterr().err, f"prompt file {path} is {kind}")
    assert not (tmp_path / "runs").exists()


def test_grid_captions_of_huge_prompts_are_cut(tmp_path):
    """PIL cannot lay out a million-character line ("too many characters in string"): captions are cut."""
    import imageio.v3 as iio

    from flowgrpo.output.plots import MAX_CAPTION_CHARS, clip_caption, grid_captions, save_sample_grid

    huge = "a red circle " * 100_000
    path = tmp_path / "grid.png"
    save_sample_grid(path, torch.rand(4, 3, 16, 16), [huge, huge, "a blue square", "a blue square"], [0, 0, 1, 1],
                     torch.rand(4))
    assert iio.imread(path).ndim == 3
    assert len(clip_caption(huge)) == MAX_CAPTION_CHARS and clip_caption(huge).endswith("…")
    assert clip_caption("a blue square") == "a blue square"
    assert grid_captions([huge], None, 1)[0][0] == huge  # captions keep the text; only drawing cuts it


def test_divergence_names_the_first_broken_weight(tiny_config):
    """The check after each iteration: finite samples and weights pass; a NaN weight is named."""
    from types import SimpleNamespace

    from flowgrpo.trainer.run_parts import divergence as _divergence
    from flowgrpo.trainer.trainer import Trainer

    trainer = Trainer(tiny_config())
    out = SimpleNamespace(images=torch.rand(2, 3, 8, 8), metrics={"loss": 0.5, "grad_norm": 1.0})
    assert _divergence(trainer, out) is None
    assert _divergence(trainer, SimpleNamespace(images=out.images, metrics={"loss": float("nan")})) == "loss is nan"
    name, param = list(trainer.policy.named_trainable_parameters())[-1]
    with torch.no_grad():
        param.view(-1)[0] = float("inf")
    assert _divergence(trainer, out) == f"trainable weight {name} holds NaN or infinite values"


def test_a_metrics_file_torn_mid_line_is_read_and_resumed_without_its_torn_tail(tmp_path):
    """A run killed while writing a line leaves it half-written: readers skip it, a resume drops it
    with the lines past the checkpoint, and a corrupt line before the last is one error naming it."""
    from flowgrpo.trainer.metrics import read_metrics

    rows = [{"iteration": i, "loss": 0.5 * i} for i in range(3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 3, "lo')
    assert read_metrics(tmp_path) == rows
    MetricsLogger(tmp_path, resume_iteration=1).close()
    assert strict_json_lines(path) == rows[:2]
    path.write_text(json.dumps(rows[0]) + "\n{oops\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(UserError, match="metrics.jsonl: line 2 is not JSON"):
        read_metrics(tmp_path)
