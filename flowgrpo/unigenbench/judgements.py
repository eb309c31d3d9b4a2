"""``RESULTS_DIR/judgements.jsonl``: every judgement, appended the moment it arrives.

One JSON object a line, keyed by the image name ``{index}_{j}``::

    {"key": "12_3", "index": 12, "j": 3, "ok": true, "testpoints": [...], "scores": [1, 0, ...],
     "analysis": [...], "answer": "<raw judge text>", "error": null, "attempts": 1, "seconds": 2.7}

A failed judgement (no readable verdict within the retries, an HTTP error, an unreadable image) is a
line with ``"ok": false`` and its ``error``. Each line goes out in one ``write`` on an append-only
descriptor, so a killed run loses at most the requests still in flight; the next run reads the file,
skips every key already present (failed ones too, unless asked to retry them) and appends. A later
line for a key replaces an earlier one. ``RESULTS_DIR/run.json`` records the set, the judge model
and a hash of the prompt file; resuming with another of these is refused, so that one results
folder never mixes judges or prompt versions.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..errors import UserError
from ..text_inputs import loads_json

LOG_NAME = "judgements.jsonl"
RUN_NAME = "run.json"
#: run.json keys that must match for a results folder to be resumed
IDENTITY = ("set", "judge_model", "prompts_sha256")


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class JudgementLog:
    """The judgements of one results folder: ``records`` (key -> latest record) and :meth:`append`.

    Args:
        results_dir: the folder (created). meta: this run's identity (``set``, ``judge_model``,
            ``prompts_sha256``, plus anything informative); a folder begun with another identity
            raises a UserError.
    """

    def __init__(self, results_dir: str | Path, meta: dict):
        self.dir = Path(results_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        run = self.dir / RUN_NAME
        if run.is_file():
            old = loads_json(run.read_text(encoding="utf-8"))
            for key in IDENTITY:
                if old.get(key) != meta.get(key):
                    raise UserError(f"{self.dir} holds judgements with {key}={old.get(key)!r}, not {meta.get(key)!r}; "
                                    "use another --out (or the same judge and prompts) to keep results comparable")
        else:
            run.write_text(json.dumps(meta, indent=2, ensure_ascii=False), encoding="utf-8")
        self.path = self.dir / LOG_NAME
        self.records: dict[str, dict] = {}
        self.unreadable_lines = 0
        self._read()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self.path.stat().st_size:
            with open(self.path, "rb") as fh:
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":  # a line cut short by a kill: end it, so the next record stands alone
                    os.write(self._fd, b"\n")

    def _read(self) -> None:
        if not self.path.is_file():
            return
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    rec = loads_json(line)
                    self.records[rec["key"]] = rec
                except (json.JSONDecodeError, KeyError, TypeError):
                    self.unreadable_lines += 1

    def append(self, record: dict) -> None:
        """Write ``record`` (with its ``key``) as one line, at once."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        os.write(self._fd, line.encode("utf-8"))
        self.records[record["key"]] = record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "JudgementLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
