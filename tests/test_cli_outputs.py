"""Output the commands write for people lands whole or not at all (issue 43, "a new hostile round"):

* ``eval --json`` into a folder that does not exist (or a file, or a folder as the target) is refused
  before the evaluation, whose result was lost after it; the file is written atomically;
* ``export --to`` a full disk: one line, no partial folder (a temporary sibling renamed at the end);
* ``realsize write-pipeline`` checks the free space it needs before writing, streams the transformer
  in shards (bounded memory), writes beside ``--out`` and renames; a full disk is one line and
  leaves nothing.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from test_cli_errors import one_line_error

from flowgrpo import disk
from flowgrpo.cli import main
from flowgrpo.errors import UserError


def enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


# --------------------------------------------------------------------------- eval --json


@pytest.mark.parametrize("where, needle", [
    ("NO_SUCH_DIR/eval.json", "the folder {tmp}/NO_SUCH_DIR does not exist"),
    ("a_file/eval.json", "{tmp}/a_file is not a folder"),
    ("a_dir", "--json {tmp}/a_dir is a folder; give a file name"),
])
def test_eval_json_that_cannot_be_written_is_refused_before_evaluating(where, needle, tmp_path, capsys, monkeypatch):
    """The evaluation takes minutes (42 s on the default run): a --json path whose folder is missing
    used to raise a traceback after it, losing the result. Now nothing is loaded or evaluated."""
    import flowgrpo.trainer.checkpoint as checkpoint

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    monkeypatch.setattr(checkpoint, "load_trained_policy", lambda *a, **k: pytest.fail("the run was loaded"))
    rc = main(["eval", str(tmp_path / "run"), "--json", str(tmp_path / where)])
    one_line_error(rc, capsys.readouterr().err, needle.format(tmp=tmp_path))


def test_text_written_atomically_keeps_the_old_file_when_the_disk_is_full(tmp_path, monkeypatch):
    target = tmp_path / "eval.json"
    disk.write_text_atomically(target, "old")
    assert target.read_text() == "old"

    class Full:
        def __init__(self, fd, *a, **k):
            os.close(fd)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        write = staticmethod(enospc)

    monkeypatch.setattr(disk.os, "fdopen", Full)
    with pytest.raises(UserError, match=rf"cannot write {target}: No space left on device \(\d+ MiB free"):
        disk.write_text_atomically(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["eval.json"]


# --------------------------------------------------------------------------- export --to


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A 2-iteration tiny SD3 LoRA run (conftest's), for export."""
    from conftest import train_tiny_sd3_lora_run

    _, run_dir, _, _ = train_tiny_sd3_lora_run(tmp_path_factory.mktemp("lora_run"), ["a cat", "a lake"], seq=8,
                                               steps=2, guidance=1.0)
    return run_dir


def disk_fills_in_save_file(monkeypatch, failure: str, under: Path) -> None:
    """safetensors' save_file writes a part of a file under ``under``, then the disk is full: an OSError,
    or the SafetensorError it raises itself for ENOSPC."""
    import safetensors.torch
    from safetensors import SafetensorError

    real = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        if under not in Path(filename).parents:
            return real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(bytes(4096))
        if failure == "oserror":
            enospc()
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


@pytest.mark.parametrize("fuse, failure", [(False, "oserror"), (True, "safetensors")])
def test_export_to_a_full_disk_is_one_line_and_leaves_nothing(lora_run, fuse, failure, tmp_path, capsys, monkeypatch):
    """Used to leave a partial folder and print a traceback."""
    disk_fills_in_save_file(monkeypatch, failure, tmp_path)
    out = tmp_path / "new" / "export"
    rc = main(["export", str(lora_run), "--to", str(out), *(["--fuse"] if fuse else [])])
    one_line_error(rc, capsys.readouterr().err, f"cannot write {'fused pipeline' if fuse else 'LoRA'} folder {out}",
                   "No space left on device", "MiB free", "nothing was left there")
    assert list(tmp_path.iterdir()) == []  # neither the folder, its temporary sibling, nor the parent made for it


def test_export_checks_the_free_space_and_the_target_first(lora_run, tmp_path, capsys, monkeypatch):
    import shutil

    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    rc = main(["export", str(lora_run), "--to", str(full)])
    one_line_error(rc, capsys.readouterr().err, f"--to {full} already exists and is not an empty folder")
    assert [p.name for p in full.iterdir()] == ["keep.txt"]

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    rc = main(["export", str(lora_run), "--to", str(tmp_path / "lora")])
    one_line_error(rc, capsys.readouterr().err, f"LoRA folder {tmp_path / 'lora'} needs about", "0 MiB free")
    assert not (tmp_path / "lora").exists()
    monkeypatch.undo()
    assert main(["export", str(lora_run), "--to", str(tmp_path / "lora")]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["full", "lora"]
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()


# --------------------------------------------------------------------------- realsize write-pipeline

WAN_ONE_LAYER = ["realsize", "write-pipeline", "--recipe", "wan21-t2v-1.3b", "--num-layers", "1"]


def test_write_pipeline_to_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """The VAE's file fills the disk: a traceback and 66 MiB of partial folder used to be left."""
    disk_fills_in_save_file(monkeypatch, "safetensors", tmp_path)
    out = tmp_path / "new" / "wan"
    rc = main([*WAN_ONE_LAYER, "--out", str(out)])
    one_line_error(rc, capsys.readouterr().err, f"cannot write pipeline folder {out}", "No space left on device",
                   "MiB free", "nothing was left there")
    assert list(tmp_path.iterdir()) == []


def test_write_pipeline_stops_on_a_full_disk_inside_the_streamed_transformer(tmp_path, capsys, monkeypatch):
    from flowgrpo.realsize import stream_weights

    real_open = open

    class FillsUp:
        """A file that takes 1 MiB, then raises ENOSPC."""

        def __init__(self, *a, **k):
            self.fh, self.left = real_open(*a, **k), 2**20

        def write(self, data):
            self.left -= memoryview(data).nbytes
            if self.left < 0:
                enospc()
            return self.fh.write(data)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()
            return False

    monkeypatch.setattr(stream_weights, "open", FillsUp, raising=False)
    out = tmp_path / "wan"
    one_line_error(main([*WAN_ONE_LAYER, "--out", str(out)]), capsys.readouterr().err,
                   f"cannot write pipeline folder {out}", "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_write_pipeline_checks_free_space_before_writing(tmp_path, capsys, monkeypatch):
    """The size is known from the configuration (the transformer built on the meta device)."""
    import re
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: usage._replace(free=2**20))
    out = tmp_path / "wan"
    line = one_line_error(main([*WAN_ONE_LAYER, "--out", str(out)]), capsys.readouterr().err,
                          f"pipeline folder {out} needs about", "1 MiB free")
    assert list(tmp_path.iterdir()) == []
    need_mib = float(re.search(r"needs about ([\d,]+) MiB", line).group(1).replace(",", ""))
    monkeypatch.undo()
    assert main([*WAN_ONE_LAYER, "--out", str(out)]) == 0
    written = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
    assert written <= need_mib <= written + 80  # the weights, and a margin for configs and tokenizers


def test_streamed_weights_hold_a_chunk_at_a_time(tmp_path):
    """512 MiB of meta-device weights written with RSS growing by about one chunk (64 MiB), not the file:
    the whole model used to be built and saved in memory (4.4 GB RSS for a 1.6 GB SD3.5-Medium folder)."""
    import subprocess
    import sys

    script = f"""
import resource, torch
from pathlib import Path
from flowgrpo.realsize.stream_weights import save_streamed
with torch.device("meta"):
    state = {{"big.weight": torch.empty(16384, 16384, dtype=torch.bfloat16), "big.bias": torch.empty(16384),
             "norm.weight": torch.empty(16384, dtype=torch.bfloat16)}}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
save_streamed(state, Path({str(tmp_path / 'w.safetensors')!r}), seed=3)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    growth_mib = int(proc.stdout.split()[-1])
    assert growth_mib < 160, f"RSS grew by {growth_mib} MiB writing 512 MiB"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == ["big.bias", "big.weight", "norm.weight"]
        rows = f.get_slice("big.weight")[:64]
        assert rows.dtype.is_floating_point and 0 < rows.float().abs().max() <= 1 / 16384**0.5
        assert f.get_tensor("big.bias").abs().max() == 0 and bool((f.get_tensor("norm.weight") == 1).all())
