"""One training run's shared state: its folder (created or resumed, locked while written), its clock,
its metrics log and the roles of this process; what the run loop (:mod:`.run`) and its parts
(:mod:`.run_parts`, :mod:`flowgrpo.evaluation.in_training`) read and advance.

Multi-process runs (:mod:`.data_parallel`): every rank holds a :class:`RunState` on the same clock (the
main process's, broadcast each iteration); only the main process writes the folder, logs and prints.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator

import yaml

from ..config import RunConfig, to_dict
from ..disk import write_text_atomically
from ..errors import UserError
from .accelerator import start_trackers
from .base_weights import check_base_weights, record_base_weights
from .checkpoint import CONFIG_FILE, load_latest_intact
from .metrics import MetricsLogger, json_safe, read_metrics
from .run_lock import LOCK_FILE, RunLock, lock_run_dir


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as strict JSON (NaN and inf as null), atomically."""
    write_text_atomically(path, json.dumps(json_safe(data), indent=2, allow_nan=False))


def make_run_dir(cfg: RunConfig) -> Path:
    """``log.out_dir/log.run_name`` (default name: preset and time), created; a UserError when a run is
    writing it (:mod:`.run_lock`) or it holds checkpoints already (a hint to ``--resume`` it)."""
    name = cfg.log.run_name or f"{cfg.preset or 'run'}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.log.out_dir) / name
    if (run_dir / LOCK_FILE).exists():  # a run writing it: named before its checkpoints say "resume it"
        lock_run_dir(run_dir).release()
    if (run_dir / "checkpoints").exists():
        raise UserError(f"run directory {run_dir} already holds checkpoints; use --resume {run_dir} or another log.run_name")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only or full log.out_dir, a file in the way
        raise UserError(f"cannot create run directory {run_dir} (log.out_dir={cfg.log.out_dir}): "
                        f"{exc.strerror or exc}") from None
    return run_dir


def record_config(run_dir: Path, cfg: RunConfig) -> None:
    """Write ``cfg`` as ``RUN_DIR/config.yaml`` (atomically) unless the file holds it already: a fresh
    run's resolved configuration, or a resumed run's with the budgets it changed, which a later
    ``--resume`` then keeps (:mod:`flowgrpo.commands.resume`)."""
    path = run_dir / CONFIG_FILE
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if path.read_text(encoding="utf-8") == text:
            return
    write_text_atomically(path, text)


def prepare_run_dir(cfg: RunConfig, run_dir: Path | None, resume: bool, dp, locks: list[RunLock]) -> Path:
    """The run directory, the same on every rank: created (fresh run) or continued (resume) by the main
    process, which locks it (:mod:`.run_lock`) before writing anything there and appends the lock to
    ``locks`` for the caller to release when the run ends."""
    if resume:
        assert run_dir is not None
        check_base_weights(run_dir, cfg.model)  # before any checkpoint is loaded onto other base weights
    outcome: tuple[str | None, str | None] = (None, None)
    failure = None
    if dp.is_main:
        path = Path(run_dir) if run_dir is not None else None
        try:
            if not resume:
                path = path or make_run_dir(cfg)
                path.mkdir(parents=True, exist_ok=True)
            locks.append(lock_run_dir(path))  # a second run on this folder stops here, having written nothing
            record_config(path, cfg)
            if not resume:
                record_base_weights(path, cfg.model)  # which base the checkpoints belong to, where it may change
            outcome = (str(path), None)
        except UserError as e:
            failure, outcome = e, (None, str(e))
        except OSError as e:  # a run directory that exists but cannot be written
            outcome = (None, f"cannot write in run directory {path} (log.out_dir={cfg.log.out_dir}): {e.strerror or e}")
    path, error = dp.broadcast(outcome)
    if failure is not None:
        raise failure  # its own class (the caller keeps a folder another run holds)
    if error is not None:
        raise UserError(error)
    return Path(path)


@dataclass
class RunState:
    """What the run loop and its parts share. ``train_seconds`` counts training only (the clock is
    paused while evaluating and writing grids; checkpoint writes count); ``recent`` holds the seconds
    of the latest iterations, checkpoint writes included, for the time budget's estimate."""

    cfg: RunConfig
    trainer: object  # flowgrpo.trainer.trainer.Trainer
    run_dir: Path
    resumed: bool
    logger: MetricsLogger | None = None
    train_seconds: float = 0.0
    start_iteration: int = 0
    recent: list[float] = field(default_factory=list)
    #: ``train_seconds`` when the iteration in progress began
    iteration_started: float = 0.0
    #: the training clock: wall-clock, or this process's CPU time (train.clock=cpu, for a shared machine)
    clock: Callable[[], float] = time.perf_counter

    @property
    def dp(self):
        return self.trainer.dp

    @property
    def main(self) -> bool:
        return self.trainer.dp.is_main

    @property
    def lockstep(self) -> bool:
        """Every rank takes part in evaluations (sharded weights, or a context-parallel transformer,
        need every rank of a group in each forward)."""
        return self.trainer.engine.lockstep or self.trainer.dp.context_parallel > 1

    @property
    def gathers(self) -> bool:
        """Every rank takes part in checkpoints and the LoRA export (tensors gathered from the ranks)."""
        return self.trainer.engine.collective_state

    def say(self, *args, **kwargs) -> None:
        """``print`` on the main process; nothing on the others."""
        if self.main:
            print(*args, **kwargs)

    def add_seconds(self, seconds: float) -> None:
        """Count ``seconds`` of training, on the main process's clock for every rank (so that time-based
        decisions agree)."""
        self.train_seconds = self.dp.broadcast(self.train_seconds + seconds)

    def next_end(self, extra: float | None = None) -> float:
        """When the next iteration would likely end: the longest of the last 5 iterations (and ``extra``,
        the one in progress), +25 %."""
        recent = self.recent + ([extra] if extra is not None else [])
        return self.train_seconds + (1.25 * max(recent[-5:]) if recent else 0.0)

    def within_budget(self, extra: float | None = None) -> bool:
        """Whether one more iteration would likely end within ``train.max_minutes`` (True without one)."""
        limit = self.cfg.train.max_minutes
        return not limit or self.next_end(extra) <= limit * 60

    def write_json(self, name: str, data: dict) -> None:
        """``RUN_DIR/name`` as strict JSON, atomically (:func:`write_json`)."""
        write_json(self.run_dir / name, data)

    def metrics_so_far(self) -> list[dict]:
        """The ``metrics.jsonl`` lines written so far (a resumed run's earlier iterations)."""
        return read_metrics(self.run_dir)

    def records(self) -> list[dict]:
        """The run's ``metrics.jsonl`` lines (main process), its log closed first so that all are there."""
        if self.logger is not None:
            self.logger.close()
        return read_metrics(self.run_dir)


@contextlib.contextmanager
def open_run(trainer, run_dir: Path | None, resume: bool) -> Iterator[RunState]:
    """The run's :class:`RunState`: its folder prepared and locked (released when the block ends), the
    newest intact checkpoint loaded on ``resume`` (a damaged newer one is passed over with a warning),
    trackers and the metrics log started on the main process."""
    cfg = trainer.cfg
    locks: list[RunLock] = []
    try:
        path = prepare_run_dir(cfg, run_dir, resume, trainer.dp, locks)
        run = RunState(cfg, trainer, path, resume,
                       clock=time.process_time if cfg.train.clock == "cpu" else time.perf_counter)
        loaded = load_latest_intact(path) if resume else None
        if loaded is not None:
            trainer.load_state_dict(loaded.state["trainer"])
            run.train_seconds = loaded.state["train_seconds"]
            run.start_iteration = trainer.iteration
            run.say(f"resumed from {loaded.path} at iteration {run.start_iteration}")
        elif resume:  # e.g. killed before its first checkpoint: the run starts over, with its own config
            run.say(f"note: {path} has no checkpoint yet; starting it again from iteration 0 with its config.yaml")
        if run.main:
            last = run.start_iteration - 1 if resume else None
            start_trackers(trainer.accelerator, cfg, path, last)
            run.logger = MetricsLogger(path, trainer.accelerator, resume_iteration=last)
        yield run
    finally:
        for lock in locks:
            lock.release()
