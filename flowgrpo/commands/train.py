"""``flowgrpo train``: a fresh run, a resumed one, or one rank of a multi-process run
(registered by :mod:`flowgrpo.cli`, which only parses)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from ..errors import UserError


def cmd_train(args) -> int:
    from ..trainer.launch import in_launched_process, launch

    if args.help_config is not None:
        from ..config.help import explain_config

        return explain_config(args.help_config or None)
    if args.num_processes > 1 and not in_launched_process():
        if args.resume:  # refused here in one line, not once by every rank
            resumed_config_of(args)
        argv = args.raw_argv[args.raw_argv.index("train") + 1:]
        return launch(args.num_processes, _drop_option(argv, "--num-processes", "--accelerate-config"),
                      args.accelerate_config)
    if in_launched_process():
        return _train_in_launched_process(args)
    return _run_train(args)


def _run_train(args) -> int:
    """Train (or resume) in this process and print the outcome (the main process's)."""
    from ..trainer.launch import in_launched_process
    from ..trainer.run import train

    if args.resume:  # the launcher of a multi-process run named the changes: its ranks stay quiet
        summary = train(resumed_config_of(args, quiet=in_launched_process()), Path(args.resume), resume=True)
    else:
        summary = _train_fresh(_fresh_config(args))
    if "rank" in summary:  # a non-main rank of a multi-process run: the main process reports
        return 0
    done = f"done: {summary['iterations']} iterations, {summary['train_seconds'] / 60:.1f} min of training"
    if summary["eval_before"] is None:
        print(f"{done}; {summary['evaluation']}")
    else:
        b, a = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
        print(f"{done}; held-out accuracy {b:.3f} -> {a:.3f} ({a - b:+.3f})")
    return 0


def resumed_config_of(args, quiet: bool = False):
    """The configuration ``train --resume`` continues with: the recorded one, changed only where
    :mod:`flowgrpo.commands.resume` allows (a note names the changes unless ``quiet``)."""
    from .resume import resumed_config

    if args.config:
        check_text_file(Path(args.config), "config file")
    return resumed_config(Path(args.resume), args.preset, args.recipe, args.config, args.overrides, quiet=quiet)


def _fresh_config(args):
    """The validated config of ``train``'s layers; a UserError when the recipe needs keys the run left unset."""
    from ..config import compose_config, validate
    from ..config.layers import RECIPE_METHOD, check_needs

    if args.config:
        check_text_file(Path(args.config), "config file")
    composed = compose_config(args.preset or RECIPE_METHOD, args.config, args.overrides, args.recipe)
    validate(composed.config)
    check_needs(composed)
    return composed.config


def check_text_file(path: Path, what: str) -> None:
    """A UserError unless ``path`` (when it is a file) reads as UTF-8 text."""
    if not path.is_file():
        return  # the reader names a missing file
    try:
        path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                        f"{exc.start}); is it a binary file?") from None


def _train_fresh(cfg) -> dict:
    """Train a new run. The main process makes the run folder first, and removes it again (with the
    ``log.out_dir`` it made) when the run fails before anything of value is in it: no checkpoint,
    no exported LoRA, no summary. A folder that was there before, or that another run holds (it may
    have made it a moment before this one looked), is never removed."""
    import shutil

    from ..trainer.run import train
    from ..trainer.run_state import make_run_dir
    from ..trainer.run_lock import RunFolderInUse

    if os.environ.get("RANK", "0") != "0":  # another rank: the main process names the folder
        return train(cfg)
    out = Path(cfg.log.out_dir)
    out_existed = out.is_dir()
    before = set(out.iterdir()) if out_existed else set()
    run_dir = make_run_dir(cfg)
    try:
        return train(cfg, run_dir)
    except RunFolderInUse:
        raise
    except Exception:
        if run_dir not in before and not _holds_results(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            if not out_existed:
                with contextlib.suppress(OSError):  # only when empty
                    out.rmdir()
        raise


def _holds_results(run_dir: Path) -> bool:
    """Whether a run folder holds anything a run leaves of value: a checkpoint, a LoRA, a summary."""
    from .export import LORA_DIRNAME
    from ..trainer.checkpoint import list_checkpoints

    checkpoints = run_dir / "checkpoints"
    return bool(list_checkpoints(run_dir) or (checkpoints.is_dir() and any(checkpoints.iterdir()))
                or (run_dir / LORA_DIRNAME).exists() or (run_dir / "summary.json").exists())


def _drop_option(argv: list[str], *names: str) -> list[str]:
    """``argv`` without the options ``names`` (``--name value`` or ``--name=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not any(a.startswith(n + "=") for n in names):
            out.append(a)
    return out


def _train_in_launched_process(args) -> int:
    """One rank of a multi-process run: a failed collective ends this rank with one line and
    :data:`~flowgrpo.trainer.launch.PEER_LOST_EXIT` (the launcher names the rank that caused it)."""
    from ..trainer.launch import PEER_LOST_EXIT, close_process_group, follow_launcher, is_collective_failure

    follow_launcher()  # before torch's import: seconds in which a killed launcher would leave this rank behind
    import torch.distributed as dist

    rank = os.environ.get("RANK", "?")
    args_single = argparse.Namespace(**{**vars(args), "num_processes": 1})
    try:
        code = _run_train(args_single)
        close_process_group()  # every rank, before the interpreter's exit (close_process_group says why)
        return code
    except Exception as exc:  # noqa: BLE001 - anything a collective raises ends this rank the same way
        if not is_collective_failure(exc):
            raise
        print(f"flowgrpo: rank {rank}: lost contact with another process ({str(exc).splitlines()[0][:160]}); "
              "stopping", file=sys.stderr)
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # the group is already broken: nothing to tidy
                dist.destroy_process_group()
        os._exit(PEER_LOST_EXIT)  # skip atexit hooks that would wait on the dead peers
