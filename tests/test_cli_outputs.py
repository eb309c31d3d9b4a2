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
