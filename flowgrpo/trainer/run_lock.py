"""One run at a time in a run folder: an exclusive lock held for the run's life.

Two ``flowgrpo train`` started a second apart with the same ``log.run_name`` both ran to exit 0, and
their iterations interleaved in one ``metrics.jsonl`` (``[0, 1, 0, 2, 1, 2]``); a ``--resume`` of a
folder that another run is writing would do the same. The process that writes the run folder (the
main process of a multi-process run: the other ranks write nothing there) takes an exclusive,
non-blocking ``flock`` on ``RUN_DIR/.lock`` when it creates or resumes the folder, before writing
anything in it, and holds it until the run ends. The kernel drops the lock with the process, so a
killed run leaves none behind (the file stays, unlocked). The file holds the holder's pid, which a
refused run names. ``eval``, ``sample`` and ``export`` only read a run folder and take no lock.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import UserError

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there are not locked
    fcntl = None

LOCK_FILE = ".lock"


class RunFolderInUse(UserError):
    """Another process holds the run folder's lock: nothing of this run was written there."""


class RunLock:
    """The lock on one run folder, held from :func:`lock_run_dir` until :meth:`release`."""

    def __init__(self, run_dir: Path, handle=None):
        self.run_dir, self._handle = Path(run_dir), handle

    def release(self) -> None:
        """Let the folder go (closing the file drops the lock); a second call does nothing."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def lock_run_dir(run_dir: Path) -> RunLock:
    """Take ``run_dir``'s lock (the folder exists) and write this process's pid into it; a
    :class:`RunFolderInUse` naming the folder and the holder's pid when another process has it."""
    run_dir = Path(run_dir)
    if fcntl is None:
        return RunLock(run_dir)
    handle = open(run_dir / LOCK_FILE, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the run's life
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunFolderInUse(f"run directory {run_dir} is in use by another flowgrpo run (pid {holder}); wait for "
                             "it to end or stop it (a new run can take another log.run_name)") from None
    except OSError:  # a file system without locks (some network ones): the run goes on unlocked
        handle.close()
        return RunLock(run_dir)
    with contextlib.suppress(OSError):  # the pid is for the message only
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
    return RunLock(run_dir, handle)
