"""The run loop's own parts, each a :class:`~.callbacks.Callback` on the events users' callbacks see:
the time budget, sample grids, the divergence guard, checkpoints and the LoRA export (the evaluation
schedule is :class:`flowgrpo.evaluation.in_training.InTrainingEvaluation`).

Unlike users' callbacks, parts run on every process (:class:`~.run_state.RunState` says which role
this one has) and fire the public events that follow from their work (``on_checkpoint``). Their
order in :func:`flowgrpo.trainer.run.run_parts` is the order of the work within an iteration.
"""

from __future__ import annotations

import math

import torch

from ..output.plots import save_sample_grid
from ..sharded_tensors import is_sharded
from ..errors import UserError
from ..callbacks import Callback
from .checkpoint import latest_checkpoint, save_checkpoint
from .run_state import RunState


class TimeBudget(Callback):
    """``train.max_minutes``: stop before an iteration that would likely end past the budget, so that
    ``train_seconds`` stays within it (the longest of the last 5 iterations, with a 25 % margin)."""

    def __init__(self, run: RunState):
        self.run = run

    def _check(self, trainer) -> None:
        run = self.run
        if trainer.iteration < run.cfg.train.iterations and run.dp.broadcast(not run.within_budget()):
            run.say(f"time budget of {run.cfg.train.max_minutes} min reached at iteration {trainer.iteration}")
            trainer.callbacks.request_stop("time budget")

    def on_run_start(self, trainer, run_dir, resumed) -> None:
        self._check(trainer)

    def on_iteration_end(self, trainer, metrics) -> None:
        self.run.recent.append(self.run.train_seconds - self.run.iteration_started)  # checkpoint writes included
        self._check(trainer)


class SampleGrids(Callback):
    """Every ``log.grid_every`` iterations: the rollout's decoded leaves as ``grids/iter_N.png`` (prompt
    and reward under each), also sent to the trackers that take images."""

    def __init__(self, run: RunState):
        self.run = run

    def on_step_end(self, trainer, result) -> None:
        run, every, it = self.run, self.run.cfg.log.grid_every, result.metrics["iteration"]
        if not (run.main and every and it % every == 0):
            return
        ro, path = result.rollout, run.run_dir / "grids" / f"iter_{it:06d}.png"
        save_sample_grid(path, result.images, ro.leaf_prompts, ro.tree_prompt[ro.leaf_tree].tolist(),
                         result.leaf_rewards)
        run.logger.log_image("samples", path, it)


def divergence(trainer, result) -> str | None:
    """What is no longer finite after iteration ``result`` (its samples, loss, gradient norm or the trainable
    weights; a NaN the reward alone produced is dropped and counted instead), else None. A learning rate
    far too large writes finite weights of magnitude 1e30 whose next rollout is NaN: the samples see it."""
    if result.images is not None and not bool(torch.isfinite(result.images).all()):
        return "the rollout's samples are NaN or infinite (the previous update broke the weights)"
    for key in ("loss", "grad_norm"):
        value = result.metrics.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key} is {value}"
    with torch.no_grad():  # this rank's slice of sharded weights (the caller sums the verdict over ranks)
        params = [(n, p.to_local() if is_sharded(p) else p) for n, p in trainer.policy.named_trainable_parameters()]
        finite = [torch.isfinite(p).all() for _, p in params]
        if finite and not bool(torch.stack([f.to(finite[0].device) for f in finite]).all()):  # one sync
            bad = next(n for (n, _), f in zip(params, finite) if not bool(f))
            return f"trainable weight {bad} holds NaN or infinite values"
    return None


class DivergenceGuard(Callback):
    """Stop the run with one error, every rank together, once an iteration left something non-finite
    (:func:`divergence`): after its metrics are logged, before any checkpoint could keep it."""

    def __init__(self, run: RunState):
        self.run, self.result = run, None

    def on_step_end(self, trainer, result) -> None:
        self.result = result

    def on_iteration_end(self, trainer, metrics) -> None:
        found = divergence(trainer, self.result)
        if self.run.dp.sum_scalar(float(found is not None)):
            raise UserError(f"training diverged at iteration {metrics['iteration']}: {found or 'another process saw it'}; "
                            f"nothing more is trained or saved (train.lr={self.run.cfg.train.lr:g}: try a smaller one)")


class Checkpoints(Callback):
    """A checkpoint every ``log.checkpoint_every`` iterations and after the last one (atomic; the time it
    takes counts as training). Where checkpoints gather tensors from the ranks (FSDP, DeepSpeed ZeRO)
    every rank takes part; the main process writes."""

    def __init__(self, run: RunState):
        self.run = run

    def _save(self, trainer, iteration: int) -> None:
        run = self.run
        state = trainer.state_dict()  # with sharded weights a collective (whole tensors)
        if run.main:
            path = save_checkpoint(run.run_dir, trainer.iteration,
                                   {"trainer": state, "train_seconds": run.train_seconds})
            trainer.callbacks.checkpoint(trainer, path, iteration)  # ckpt_N holds iterations 0..N-1

    def on_iteration_end(self, trainer, metrics) -> None:
        run, done = self.run, trainer.iteration
        if (run.main or run.gathers) and (done % run.cfg.log.checkpoint_every == 0 or done == run.cfg.train.iterations):
            start = run.clock()
            self._save(trainer, metrics["iteration"])
            run.train_seconds += run.clock() - start

    def on_train_end(self, trainer, summary) -> None:
        run = self.run
        last = latest_checkpoint(run.run_dir) if run.main else None
        stale = last is None or int(last.name.split("_")[1]) != trainer.iteration
        if (run.main or run.gathers) and (run.dp.broadcast(stale) if run.gathers else stale):
            self._save(trainer, trainer.iteration - 1)


class LoraExport(Callback):
    """A LoRA run of a diffusers model ends with ``RUN_DIR/lora/`` in diffusers' format (EMA weights when
    kept), which stock pipelines load (:mod:`flowgrpo.commands.export`)."""

    def __init__(self, run: RunState):
        self.run = run

    def on_train_end(self, trainer, summary) -> None:
        if self.run.cfg.model.train_mode != "lora" or not trainer.policy.exports_lora:
            return
        weights = trainer.engine.full(trainer.ema if trainer.ema is not None else trainer.policy.trainable_state_dict())
        if self.run.main:
            trainer.policy.save_lora(self.run.run_dir / "lora", weights)
