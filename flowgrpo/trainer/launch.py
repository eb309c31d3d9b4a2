"""``flowgrpo train --num-processes N``: start N training processes through ``accelerate launch``.

The processes run ``python -m flowgrpo train ...`` with the same arguments (accelerate's launcher,
torch elastic underneath: one process per GPU, or gloo processes on a CPU-only machine). When a
process fails, the launcher stops the others; this module turns torch elastic's report into one
line that names the rank which failed first and how to resume.
"""

from __future__ import annotations

import signal
import sys

from ..errors import UserError


def in_launched_process() -> bool:
    """Whether this process was started by a distributed launcher (accelerate / torchrun)."""
    import os

    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def launch_args(num_processes: int, train_argv: list[str], accelerate_config: str | None = None) -> list[str]:
    """The ``accelerate launch`` argument list for ``flowgrpo train`` with ``train_argv``."""
    args = []
    if accelerate_config:
        args += ["--config_file", accelerate_config]
    else:  # a plain multi-process launch: one machine, no mixed precision or dynamo from accelerate
        args += ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    args += ["--num_processes", str(num_processes), "-m", "flowgrpo", "train", *train_argv]
    return args


#: exit code of a process that stopped because another one stopped answering (not the cause)
PEER_LOST_EXIT = 3
#: exit code of ``flowgrpo`` on a UserError / ConfigError (bad configuration or input)
USER_ERROR_EXIT = 2  # (flowgrpo.cli.main)


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

    Raises UserError with one line naming the first failed rank when a process fails."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except ImportError:  # pragma: no cover - torch without elastic
        ChildFailedError = RuntimeError  # noqa: N806
    args = launch_command_parser().parse_args(launch_args(num_processes, train_argv, accelerate_config))
    try:
        launch_command(args)
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
                        "Resume from its last checkpoint with: flowgrpo train --resume RUN_DIR "
                        f"--num-processes {num_processes}") from None
    except SystemExit as e:  # accelerate exits on a bad launch configuration
        if e.code not in (0, None):
            raise UserError(f"accelerate launch failed (exit code {e.code})") from None
    sys.stdout.flush()
    return 0
