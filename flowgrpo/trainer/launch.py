"""``flowgrpo train --num-processes N``: start N training processes through ``accelerate launch``.

The processes run ``python -m flowgrpo train ...`` with the same arguments (accelerate's launcher,
torch elastic underneath: one process per GPU, or gloo processes on a CPU-only machine). When a
process fails, the launcher stops the others; this module turns torch elastic's report into one
line that names the rank which failed first and how to resume.

The ranks live and stop with the launcher (:func:`follow_launcher`). torch elastic starts each rank in
a session of its own (so a terminal's Ctrl-C reaches the launcher only) and, on SIGTERM, SIGINT,
SIGHUP or SIGQUIT, sends the same signal to every rank before it raises; :func:`launch` turns that
into one line. A launcher killed outright (SIGKILL, the OOM killer) forwards nothing: each rank
therefore asks the kernel for SIGKILL when its parent, the launcher (whose in-process elastic agent
started it), goes, and polls for that where the kernel cannot. A rank stopped either way leaves the
checkpoints intact: they are written under a temporary name and renamed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from ..errors import UserError


def in_launched_process() -> bool:
    """Whether this process was started by a distributed launcher (accelerate / torchrun)."""
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_args(num_processes: int, train_argv: list[str], accelerate_config: str | None = None) -> list[str]:
    """The ``accelerate launch`` argument list for ``flowgrpo train`` with ``train_argv``."""
    args = []
    if accelerate_config:
        args += ["--config_file", accelerate_config]
    else:  # a plain multi-process launch: one machine, no mixed precision or dynamo from accelerate
        args += ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if _single_machine_without_port(accelerate_config):
        # accelerate's default rendezvous port is 29500 for every run: a second run on the same machine
        # would fail to bind it. A free port, when the run is on this machine alone and names none
        from ..serve.server import free_port

        args += ["--main_process_port", str(free_port())]
    args += ["--num_processes", str(num_processes), "-m", "flowgrpo", "train", *train_argv]
    return args


def _single_machine_without_port(accelerate_config: str | None) -> bool:
    """Whether the launch is on one machine and its accelerate config file (if any) sets no
    ``main_process_port`` (several machines must agree on one: theirs is kept)."""
    if not accelerate_config:
        return True
    from ..errors import ConfigError
    from ..text_inputs import load_yaml

    try:
        data = load_yaml(open(accelerate_config).read(), str(accelerate_config)) or {}
    except (OSError, UnicodeDecodeError, ConfigError):
        return False  # accelerate reports an unreadable file itself
    return isinstance(data, dict) and str(data.get("num_machines") or 1) == "1" and not data.get("main_process_port")


#: exit code of a process that stopped because another one stopped answering (not the cause); a rank
#: whose launcher is gone exits with it too
PEER_LOST_EXIT = 3
#: exit code of ``flowgrpo`` on a UserError / ConfigError (bad configuration or input)
USER_ERROR_EXIT = UserError.exit_code
#: the launcher's pid, in its ranks' environment: a rank that starts after the launcher died finds
#: another parent (init) and stops at once
LAUNCHER_PID_ENV = "FLOWGRPO_LAUNCHER_PID"
#: seconds between a rank's checks that its launcher is alive (the fallback to the kernel's signal)
LAUNCHER_POLL_S = 1.0
#: Linux prctl option: the signal this process gets when the thread that started it exits
_PR_SET_PDEATHSIG = 1


class StoppedBySignal(UserError):
    """The launcher was told to stop (SIGTERM, SIGINT...): it stopped its ranks; exit code 128 + signal,
    as a shell reports a process a signal ended."""

    def __init__(self, message: str, sig: signal.Signals):
        super().__init__(message)
        self.exit_code = 128 + int(sig)


def follow_launcher() -> None:
    """Make this rank stop when its launcher stops (call early in every rank).

    SIGINT ends the rank at once, as SIGTERM does: only the launcher sends it (a rank has a session
    of its own), and a KeyboardInterrupt would unwind a rank blocked in a collective only after
    the collective returned, with a traceback. The kernel kills the rank when its parent exits
    (Linux prctl); elsewhere a daemon thread polls the parent's pid."""
    launcher = int(os.environ.pop(LAUNCHER_PID_ENV, 0) or os.getppid())  # not inherited by the rank's children
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher:  # it died before the request above: nothing will signal this rank
        os._exit(PEER_LOST_EXIT)
    threading.Thread(target=_watch_launcher, args=(launcher,), name="flowgrpo-launcher-watch", daemon=True).start()


def close_process_group() -> None:
    """End this rank's part in the run's process group: wait for every rank (a barrier), then destroy
    the group. A no-op when no group is open.

    Why: a rank that leaves the interpreter with the group still open tears down gloo's worker
    threads while they may still hold work whose tensors point into Python objects that interpreter
    finalisation frees, which can crash that rank with SIGSEGV (the other rank then reads "Connection
    reset by peer"). torch does not destroy the group at exit (an
    atexit hook for it was proposed and withdrawn: pytorch/pytorch#179291), so every entry point that
    opens one closes it. The barrier keeps a fast rank from destroying the group while a slower one
    still has a collective in flight.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()


def _parent_death_signal(sig: signal.Signals) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits; whether it took.

    (The kernel ties this to the parent's *thread* that started the process: torch elastic starts
    the ranks from the launcher's main thread, which lives as long as the launcher.)"""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_launcher(launcher: int) -> None:
    """Exit this process once its parent is no longer ``launcher`` (it died and the rank was
    re-parented): the fallback where no parent-death signal is available."""
    import time

    while os.getppid() == launcher:
        time.sleep(LAUNCHER_POLL_S)
    os._exit(PEER_LOST_EXIT)  # nobody reads this rank's exit any more; skip hooks that wait on peers


def _resume_command(num_processes: int) -> str:
    """The command that resumes a stopped run on ``num_processes`` processes (its folder left to fill in)."""
    return f"flowgrpo train --resume RUN_DIR --num-processes {num_processes}"


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed or timed out (a peer process died or hangs)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(k in text for k in ("Gloo", "gloo", "NCCL", "Connection closed",
                                                                    "Connection reset", "timed out", "Timed out"))


def _root_cause(failures: dict) -> tuple[int, object]:
    """The failure that caused the others: a process killed by a signal other than the launcher's
    SIGTERM, else one that failed by itself, before the ones the launcher stopped or that lost a peer."""
    def rank_key(item):
        code = item[1].exitcode
        if code is not None and code < 0 and -code != signal.SIGTERM:
            category = 0
        elif code not in (PEER_LOST_EXIT, -signal.SIGTERM):
            category = 1
        elif code == -signal.SIGTERM:
            category = 2
        else:
            category = 3
        return category, item[1].timestamp, item[0]

    return min(failures.items(), key=rank_key)


def _describe(failure) -> str:
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def launch(num_processes: int, train_argv: list[str], accelerate_config: str | None = None) -> int:
    """Run ``flowgrpo train train_argv`` on ``num_processes`` processes; 0 on success.

    Raises UserError with one line naming the first failed rank when a process fails, and
    :class:`StoppedBySignal` when the launcher is told to stop (the ranks have stopped then)."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(launch_args(num_processes, train_argv, accelerate_config))
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks inherit it (follow_launcher)
    try:
        launch_command(args)
    except SignalException as e:  # elastic has sent the signal on to the ranks and waited for them
        raise StoppedBySignal(f"the run was stopped by {e.sigval.name}; resume with "
                              f"{_resume_command(num_processes)}", e.sigval) from None
    except ChildFailedError as e:
        failures = getattr(e, "failures", {}) or {}
        if not failures:
            raise UserError(f"a training process failed: {e}") from None
        rank, first = _root_cause(failures)
        if first.exitcode == USER_ERROR_EXIT:  # a configuration or input error, printed above by the rank
            raise UserError(f"rank {rank} stopped on the configuration or input error above; fix it and run "
                            "again (a run that wrote checkpoints goes on with --resume RUN_DIR)") from None
        others = sorted(r for r in failures if r != rank)
        also = f"; ranks {others} then stopped" if others else ""
        raise UserError(f"rank {rank} (pid {first.pid}) {_describe(first)}{also}; the run stopped. "
                        f"Resume from its last checkpoint with: {_resume_command(num_processes)}") from None
    except SystemExit as e:  # accelerate exits on a bad launch configuration
        if e.code not in (0, None):
            raise UserError(f"accelerate launch failed (exit code {e.code})") from None
    finally:  # a rank started later by other means from this process has another parent
        os.environ.pop(LAUNCHER_PID_ENV, None)
    sys.stdout.flush()
    return 0
