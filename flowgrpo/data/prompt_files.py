"""Prompt files: the one reader of every ``.txt`` / ``.jsonl`` file of prompts (``data.prompts``,
``sample --prompts``, the edit and benchmark evaluators' files).

It refuses what is not a regular file before opening it, a file over :data:`MAX_PROMPT_FILE_BYTES`
before reading it, and a prompt over :data:`MAX_PROMPT_CHARS`, each in one line naming the file (and
line) and the limit.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from ..errors import UserError
from ..text_inputs import loads_json

#: the largest prompt file read, in bytes (64 MiB: about a million prompts of 60 characters); a file is
#: read whole, so every reader (train's data.prompts, sample --prompts, the edit evaluator's file) checks
#: its size first (:func:`check_prompt_file`)
MAX_PROMPT_FILE_BYTES = 64 * 2**20
#: the longest prompt, in characters (T5 reads 512 tokens, about 2,000 characters; CLIP 77 tokens)
MAX_PROMPT_CHARS = 10_000


def load_prompt_file(path: str | Path) -> list[dict]:
    """Read prompts from ``.txt`` (one per line) or ``.jsonl`` (``{"prompt": ..., "tag": ..., "image": ...}``).

    Returns a list of ``{"prompt": str, "tag": str}``, on .jsonl rows ``"metadata"`` (the line's whole
    object, for rewards that read prompt metadata), plus ``"image"`` (a :class:`Path`) on every row
    of a .jsonl file with an ``image`` column: the reference image of an image-editing prompt, a path
    relative to the prompt file's folder (or absolute). Either every line names an image or none does.
    Raises :class:`UserError` naming the file (and line) for what :func:`check_prompt_file` refuses
    before opening, a file that is not UTF-8 text, an empty file, a malformed line, a prompt over
    :data:`MAX_PROMPT_CHARS`, a line lacking the image the others have, or an image file that is
    missing or unreadable (each is opened once here).
    """
    path = Path(path)
    check_prompt_file(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
        bad = data.find(b"\x00")
    except UnicodeDecodeError as exc:
        bad = exc.start
    if bad >= 0:
        raise UserError(f"prompt file {path} is not UTF-8 text (byte {data[bad]:#04x} at offset {bad}); "
                        "is it a binary file?")
    rows: list[dict] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                obj = loads_json(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: malformed JSON line ({exc.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
                raise UserError(f"{path}:{lineno}: each JSONL line needs a non-empty string field 'prompt'")
            row = {"prompt": obj["prompt"].strip(), "tag": str(obj.get("tag", "default")), "metadata": obj}
            image = obj.get("image")
        else:
            row, image = {"prompt": line.strip(), "tag": "default"}, None
        if len(row["prompt"]) > MAX_PROMPT_CHARS:
            raise UserError(f"{path}:{lineno}: a prompt of {len(row['prompt']):,} characters, over the limit of "
                            f"{MAX_PROMPT_CHARS:,} (text encoders read a few hundred tokens at most)")
        if image is not None:
            if not isinstance(image, str) or not image.strip():
                raise UserError(f"{path}:{lineno}: field 'image' must be a non-empty string path")
            row["image"] = _check_image(path.parent / image.strip(), f"{path}:{lineno}")
        rows.append(row)
    if not rows:
        raise UserError(f"prompt file {path} holds no prompts")
    with_image = ["image" in r for r in rows]
    if any(with_image) and not all(with_image):
        lines = [i for i, line in enumerate(text.splitlines(), start=1) if line.strip()]
        first = lines[with_image.index(False)]
        raise UserError(f"{path}:{first}: no 'image' although other lines name one (an edit prompt file gives "
                        "every prompt its reference image)")
    return rows


#: what a path that is not a regular file is, by its ``st_mode`` test (named in the refusal)
_NOT_FILES = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
              (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def check_prompt_file(path: Path) -> None:
    """A UserError unless ``path`` is a regular file of at most :data:`MAX_PROMPT_FILE_BYTES`, found
    from its ``stat`` alone: a FIFO, socket or device is named for what it is before anything opens it
    (opening a FIFO waits for a writer), and a file too large is refused before it is read whole."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UserError(f"prompt file not found: {path}") from None
    except OSError as exc:
        raise UserError(f"prompt file {path} cannot be read: {exc.strerror or exc}") from None
    for test, kind in _NOT_FILES:
        if test(st.st_mode):
            raise UserError(f"prompt file {path} is {kind}, not a .txt or .jsonl file of prompts")
    if st.st_size > MAX_PROMPT_FILE_BYTES:
        raise UserError(f"prompt file {path} is {st.st_size / 2**20:.1f} MiB, over the limit of "
                        f"{MAX_PROMPT_FILE_BYTES // 2**20} MiB for a prompt file; split it or keep the prompts you use")


def _check_image(image: Path, where: str) -> Path:
    """``image`` itself once PIL has decoded it; UserError naming ``where`` when it is missing or unreadable."""
    from ..references import read_reference

    read_reference(image, where)
    return image
