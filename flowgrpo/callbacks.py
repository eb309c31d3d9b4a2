"""Callbacks: user code run at the events of a training run (:func:`flowgrpo.trainer.run.train`).

Subclass :class:`Callback` and override the events you need, or pass a plain function
``fn(trainer, metrics)``, which is called at the end of every iteration. Callbacks run on the main
process only, in the order given, after the run loop has finished the event (metrics logged, the
evaluation recorded, the checkpoint written). :meth:`Trainer.iteration_step
<flowgrpo.trainer.trainer.Trainer.iteration_step>` alone fires none: the run loop does.

A callback ends a run early with ``trainer.callbacks.request_stop(reason)``: the run loop finishes the
iteration it is in, then stops as at the end of its time budget (a checkpoint, the evaluation after
training, the summary). The reward-hacking monitors' ``stop`` rules use it (:mod:`flowgrpo.trainer.monitor`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Literal

#: when an evaluation ran: before training, during it (``eval.every`` / ``eval.every_minutes``), after it
EvalStage = Literal["before", "during", "after"]


class Callback:
    """The events of a run; every method is a no-op here.

    One numbering: an event's ``iteration`` is the 0-based index of the iteration it follows, the
    ``iteration`` of that iteration's ``metrics.jsonl`` line (the first iteration is 0). A checkpoint
    folder is named by the number of iterations it holds: the checkpoint written after iteration ``i``
    is ``ckpt_{i + 1:06d}``, and ``trainer.iteration`` (the next iteration to run) is ``i + 1`` by then.

    * :meth:`on_run_start` -- the run directory, once the run (or its resumption) is ready to train;
    * :meth:`on_step_end` -- an iteration's whole result (rollout, decoded images, advantages), before
      its metrics are logged;
    * :meth:`on_iteration_end` -- an iteration's metrics (the ``metrics.jsonl`` line: ``iteration``
      (0-based), ``reward.<name>`` (mean over scorable samples), ``reward_mean``,
      ``nan_rewards_dropped``, ``loss``, ``train_seconds``, ``eval_accuracy`` when an evaluation ran, ...);
    * :meth:`on_evaluation` -- a held-out evaluation's :class:`~flowgrpo.evaluation.EvalResult`;
    * :meth:`on_checkpoint` -- a checkpoint written at ``path`` after iteration ``iteration``;
    * :meth:`on_train_end` -- the run's summary (``summary.json``), once the run has ended.

    The run loop's own work (time budget, grids, evaluation schedule, checkpoints, export) is made of
    callbacks on these same events (:mod:`flowgrpo.trainer.run_parts`).
    """

    def on_run_start(self, trainer, run_dir: Path, resumed: bool) -> None:
        """Before the evaluation before training (a resumed run: before its next iteration, with
        ``trainer.iteration`` the checkpoint's), with the run's folder ``run_dir``."""

    def on_step_end(self, trainer, result) -> None:
        """After an iteration's update, before its metrics are logged (``result``:
        :class:`~flowgrpo.trainer.trainer.IterationResult`; ``result.metrics`` may still gain entries)."""

    def on_iteration_end(self, trainer, metrics: dict) -> None:
        """After iteration ``metrics["iteration"]`` was logged."""

    def on_evaluation(self, trainer, result, stage: EvalStage) -> None:
        """After a held-out evaluation (``result``: :class:`~flowgrpo.evaluation.EvalResult`)."""

    def on_checkpoint(self, trainer, path: Path, iteration: int) -> None:
        """After the checkpoint holding iterations 0..``iteration`` was written at ``path`` (its
        ``metrics.jsonl`` line, with the same ``iteration``, was logged just before)."""

    def on_train_end(self, trainer, summary: dict) -> None:
        """After the run: its summary (what ``summary.json`` holds; parts of the run loop fill it)."""


class _IterationFunction(Callback):
    """A plain function ``fn(trainer, metrics)`` as the iteration-end event."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def on_iteration_end(self, trainer, metrics: dict) -> None:
        self.fn(trainer, metrics)


class CallbackList:
    """The callbacks of one trainer, dispatched in order (what :class:`Trainer` holds as ``callbacks``)."""

    def __init__(self, callbacks: Iterable[Callback | Callable] = ()):
        self.items: list[Callback] = []
        #: why a callback asked the run to stop (:meth:`request_stop`), None while none has
        self.stop_reason: str | None = None
        self.extend(callbacks)

    def extend(self, callbacks: Iterable[Callback | Callable] | Callback | Callable) -> None:
        """Add ``callbacks``: an iterable of callbacks, or one :class:`Callback` or function alone."""
        if isinstance(callbacks, Callback) or callable(callbacks):  # callbacks=my_fn, the common slip
            callbacks = [callbacks]
        elif isinstance(callbacks, (str, bytes)) or not hasattr(callbacks, "__iter__"):
            raise TypeError(f"callbacks is a list of flowgrpo.Callback s or functions (trainer, metrics), got "
                            f"{type(callbacks).__name__}")
        for cb in callbacks:
            if isinstance(cb, Callback):
                self.items.append(cb)
            elif callable(cb):
                self.items.append(_IterationFunction(cb))
            else:
                raise TypeError(f"a callback is a flowgrpo.Callback or a function (trainer, metrics), got "
                                f"{type(cb).__name__}")

    def request_stop(self, reason: str) -> None:
        """Ask the run loop to stop after the current iteration (the first reason is kept)."""
        self.stop_reason = self.stop_reason or reason

    def run_start(self, trainer, run_dir: Path, resumed: bool) -> None:
        self.stop_reason = None  # a trainer run again (resumed) starts without an earlier run's request
        for cb in self.items:
            cb.on_run_start(trainer, run_dir, resumed)

    def step_end(self, trainer, result) -> None:
        for cb in self.items:
            cb.on_step_end(trainer, result)

    def iteration_end(self, trainer, metrics: dict) -> None:
        for cb in self.items:
            cb.on_iteration_end(trainer, metrics)

    def evaluation(self, trainer, result, stage: EvalStage) -> None:
        for cb in self.items:
            cb.on_evaluation(trainer, result, stage)

    def checkpoint(self, trainer, path: Path, iteration: int) -> None:
        for cb in self.items:
            cb.on_checkpoint(trainer, path, iteration)

    def train_end(self, trainer, summary: dict) -> None:
        for cb in self.items:
            cb.on_train_end(trainer, summary)
