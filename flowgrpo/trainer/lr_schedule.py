"""``train.lr_schedule``: the learning rate over a run, as a fraction of ``train.lr``.

A run ends at ``train.iterations`` or at ``train.max_minutes`` of training time, whichever comes
first, so the schedule runs on the run's *progress*, the larger of the two fractions done
(:func:`run_progress`): a time-budgeted run decays over its minutes, an iteration-bounded one over
its iterations, and a resumed run continues where it stopped (both fractions are in its checkpoint).

Why decay at all: with a constant rate the policy keeps moving at full step size to the last
iteration, so the final evaluation lands anywhere in the band the accuracy oscillates in; decaying
towards ``train.lr_final`` lets the last minutes settle (issue: the final evaluation within 0.02 of
the run's peak).
"""

from __future__ import annotations

import math

from ..callbacks import Callback

SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(schedule: str, progress: float, final: float) -> float:
    """The learning rate's multiplier at ``progress`` in [0, 1] (clamped): 1 at the start, ``final`` at
    the end. ``constant``: 1 throughout. ``linear``: 1 - (1 - final) * p. ``cosine``: final +
    (1 - final) * (1 + cos(pi p)) / 2 (flat at both ends, the steepest fall mid-run)."""
    p = min(max(float(progress), 0.0), 1.0)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return 1.0 - (1.0 - final) * p
    if schedule == "cosine":
        return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"unknown train.lr_schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")


def run_progress(iteration: int, iterations: int, train_seconds: float, max_minutes: float) -> float:
    """The fraction of the run done, in [0, 1]: ``max(iteration / iterations, train_seconds / (60 *
    max_minutes))``, the time term only with a budget (``max_minutes`` > 0). ``iteration``: iterations
    finished; ``train_seconds``: training time so far on the run's clock (``train.clock``)."""
    done = iteration / max(1, iterations)
    if max_minutes > 0:
        done = max(done, train_seconds / (60.0 * max_minutes))
    return min(done, 1.0)


class LearningRateSchedule(Callback):
    """Sets every optimizer group's rate to ``train.lr * lr_factor(...)`` before each iteration (at the
    run's start, a resumed one included, and after each iteration) and logs the rate an iteration used
    as ``lr`` in its metrics. Every rank computes the same rate: the run's clock is the main process's."""

    def __init__(self, run):
        self.run = run

    def _rate(self, trainer) -> float:
        tc = self.run.cfg.train
        progress = run_progress(trainer.iteration, tc.iterations, self.run.train_seconds, tc.max_minutes)
        return tc.lr * lr_factor(tc.lr_schedule, progress, tc.lr_final)

    def _apply(self, trainer) -> None:
        rate = self._rate(trainer)
        for group in trainer.engine.optimizer.param_groups:
            group["lr"] = rate

    def on_run_start(self, trainer, run_dir, resumed) -> None:
        self._apply(trainer)

    def on_step_end(self, trainer, result) -> None:
        result.metrics["lr"] = trainer.engine.optimizer.param_groups[0]["lr"]

    def on_iteration_end(self, trainer, metrics) -> None:
        self._apply(trainer)
