"""Output that lands whole or not at all, and one line when the disk refuses it.

The commands that write files for people (``eval --json``, ``export --to``, ``sample --out``,
``realsize write-pipeline --out``, and the run folder's checkpoints) check what they can before the
work that produces the output, write into a temporary sibling and rename it into place, and on a
failed write remove what they wrote and stop with one :class:`~flowgrpo.errors.UserError` line:

* :func:`write_problem`: why a write failed, with the free space left on that disk;
* :func:`check_free_space`: refuse before writing when the disk cannot hold what will be written;
* :func:`check_output_file`: refuse an output file whose folder is missing or not writable, before
  the minutes of work whose result it would hold;
* :func:`write_text_atomically`: a file written beside its place and renamed over it;
* :func:`check_new_folder` and :func:`new_folder`: an output folder that is new (or empty), written
  under a temporary name and renamed at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path, PurePath

from .errors import ConfigError, UserError


def write_problem(exc: BaseException, folder: Path) -> str:
    """One line on why a write into ``folder`` failed, with the free space on its disk where known."""
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror
    else:  # torch's stream writer: "[enforce fail at ...] ... file write failed", the last line says what
        lines = str(exc).strip().splitlines()
        text = lines[-1] if lines else type(exc).__name__
    try:
        return f"{text} ({free_bytes(folder) / 2**20:.0f} MiB free on that disk)"
    except OSError:
        return text


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk of ``folder``, or of its nearest existing parent (it may not exist yet)."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def check_free_space(folder: Path, need_bytes: int, what: str) -> None:
    """A UserError naming ``what`` when the disk of ``folder`` has less than ``need_bytes`` free, so a
    write that cannot fit is refused before its first byte (an unknown free space is not refused)."""
    try:
        free = free_bytes(folder)
    except OSError:
        return
    if free < need_bytes:
        raise UserError(f"{what} needs about {need_bytes / 2**20:,.0f} MiB and the disk of {folder} has "
                        f"{free / 2**20:,.0f} MiB free; free some space or choose a folder on another disk")


def check_output_file(path: str | Path, option: str) -> Path:
    """``path`` as a Path once it can be written: its folder exists, is a folder and is writable, and
    ``path`` itself is not a folder; else a UserError naming ``option``. Checked before the work whose
    result the file holds, so a typo in the path does not cost that work."""
    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise UserError(f"{option} {path} is a folder; give a file name")
    if not parent.exists():
        raise UserError(f"{option} {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise UserError(f"{option} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{option} {path}: the folder {parent} is not writable")
    return path


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary sibling renamed over it: ``path`` holds the
    old content or the new, never a part. A failed write removes the sibling and is one UserError."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    try:  # not mkstemp: the file keeps the umask's mode, as the file written in place did
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise UserError(f"cannot write {path}: {write_problem(exc, path.parent)}") from None


def check_output_folder(out: str | Path, option: str, why: str = "created if missing") -> Path:
    """``out`` as a Path unless it exists and is not a folder (a UserError naming ``option``); for an
    output folder that may already hold earlier output (``why`` says what becomes of it)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{option} {out} is a file; give a folder ({why})")
    return out


def check_new_folder(out: str | Path, option: str) -> Path:
    """``out`` as a Path when it does not exist or is an empty folder, else a UserError naming ``option``:
    an output folder is never written over (nor mixed with what a folder already holds)."""
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"{option} {out} already exists and is not an empty folder; give a new or empty one")
    return out


@contextlib.contextmanager
def new_folder(out: str | Path, what: str, need_bytes: int = 0,
               write_errors: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """Yield a temporary folder beside ``out`` to write into; renamed to ``out`` when the block ends.

    ``out`` must be new or an empty folder (:func:`check_new_folder`) and its disk must have
    ``need_bytes`` free (:func:`check_free_space`). When the block raises, the temporary folder and
    any parent folders made for it are removed, so nothing is left half-written. A block that only
    writes names in ``write_errors`` what its writers raise when the disk refuses (OSError, and e.g.
    safetensors' or torch's own errors): those become one UserError naming ``what`` and ``out``; a block
    that also computes leaves them empty, so that its other errors keep their own message."""
    out = check_new_folder(out, what).absolute()
    check_free_space(out.parent, need_bytes, f"{what} {out}")
    made = [d for d in out.parents if not d.exists()]  # folders this call creates (innermost first)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.{secrets.token_hex(4)}"
        tmp.mkdir()  # not mkdtemp: the folder keeps the umask's mode (0700 would hide the output from others)
    except OSError as exc:
        _remove_empty(made)
        raise UserError(f"cannot create {what} {out}: {write_problem(exc, out.parent)}") from None
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)
        if isinstance(exc, write_errors) and not isinstance(exc, UserError):
            raise UserError(f"cannot write {what} {out}: {write_problem(exc, out.parent)}; nothing was left "
                            "there") from None
        raise


def tensor_bytes(tensors) -> int:
    """Bytes the ``tensors`` hold: what their safetensors files take, headers aside (meta tensors count
    as the tensors they stand for, so a size is known before anything is allocated)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def tensor_write_errors() -> tuple[type[BaseException], ...]:
    """What the tensor writers raise when the disk refuses a write (for :func:`new_folder`'s
    ``write_errors``): OSError, safetensors' SafetensorError (a full disk is its "IoError(... StorageFull
    ...)") and torch's stream writer's RuntimeError ("file write failed")."""
    from safetensors import SafetensorError

    return OSError, SafetensorError, RuntimeError


def _remove_empty(folders: list[Path]) -> None:
    """Remove each of ``folders`` (innermost first) that is empty: the parents made for an output."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


#: the longest file or folder name, in bytes, that Linux's and macOS's file systems take (NAME_MAX)
NAME_MAX_BYTES = 255


def check_inside(parent: str | Path, name: str, key: str, parent_key: str) -> None:
    """Refuse, in one ConfigError naming ``key``, a ``name`` whose folder ``parent/name`` is not a
    folder inside ``parent`` (config key ``parent_key``): an absolute path (``Path(parent) / "/abs"`` is
    ``/abs``), a ``..`` component, a NUL, ``parent`` itself, or a folder that resolves elsewhere
    (through a symlink) would write outside it; and a name no file system takes or no shell shows: a
    control character (a newline makes a folder that ``ls`` and logs print as two lines), or a path
    component longer than :data:`NAME_MAX_BYTES` bytes."""
    problem = None
    longest = max((len(part.encode(errors="surrogateescape")) for part in PurePath(name).parts), default=0)
    if "\0" in name:
        problem = "holds a NUL character"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "holds a control character"
    elif longest > NAME_MAX_BYTES:
        problem = f"has a component of {longest} bytes (file systems take {NAME_MAX_BYTES})"
    elif PurePath(name).is_absolute():
        problem = "is an absolute path"
    elif ".." in PurePath(name).parts:
        problem = "has a '..' component"
    else:
        out = Path(parent).resolve()
        run = (out / name).resolve()
        if run == out:
            problem = f"is {parent_key} itself"
        elif out not in run.parents:
            problem = f"resolves to {run}"
    if problem:
        raise ConfigError(f"config key '{key}' = {name!r} {problem}: it must name a folder inside "
                          f"{parent_key} ({parent})")
