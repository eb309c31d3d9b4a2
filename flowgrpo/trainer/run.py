"""A training run on disk: run directory, evaluation before/after, logging, checkpoints, resume.

RUN_DIR/
  config.yaml          the full resolved config (resume reads it back)
  .lock                held (flock) by the process writing the folder (flowgrpo.trainer.run_lock)
  base_weights.json    path and sha256 of a fingerprinted base (the shapes world's; flowgrpo.trainer.base_weights)
  metrics.jsonl        one line per iteration
  tensorboard/         TensorBoard events (log.trackers; mlruns/ and wandb/ for those trackers)
  checkpoints/ckpt_N/  atomic checkpoints (trainable weights, optimizer, EMA, iteration, clock)
  lora/                LoRA runs of diffusers models: pytorch_lora_weights.safetensors (EMA weights
                       when train.ema is on) for the stock pipeline's load_lora_weights (flowgrpo.commands.export)
  grids/               rollout sample grids during training
  eval_before.json     held-out evaluation of the base model
  monitors.jsonl/.png  reward-hacking monitors at each evaluation, their alarms (flowgrpo.trainer.monitor)
  before_after.png     held-out samples before (top) and after (bottom) training
  reward_curve.png     reward against iteration with held-out accuracy points
  accuracy_curve.png   held-out accuracy (+-1 s.e. band) and image fidelity against training minutes
  summary.json         eval_before/after (held-out), eval_*_seen, accuracy_gain, gain_se,
                       eval_curve, iterations, train_seconds, ...

The loop below is the recipe; each concern around it is a part (a :class:`~flowgrpo.callbacks.Callback`
on the events users' callbacks see): the time budget, sample grids, the divergence guard, checkpoints
and the LoRA export (:mod:`.run_parts`), and the evaluation schedule, curves and before/after grid
(:mod:`flowgrpo.evaluation.in_training`). Evaluation is whatever ``eval.evaluator`` selects; a model
without an evaluator trains without one: the eval_* entries are null and ``evaluation`` says why.

Multi-process runs (:mod:`flowgrpo.trainer.data_parallel`): every rank runs this loop on the same
clock (the main process's, broadcast each iteration) and holds the same weights; only the main
process writes the run directory, logs, prints and draws the progress bar (:mod:`.run_state`).
"""

from __future__ import annotations

import time
from pathlib import Path

from ..config import RunConfig
from ..evaluation.in_training import InTrainingEvaluation
from .core_share import cores_used, shared_core_note
from .monitor import monitored_evaluator
from .progress import bar_fields, progress_bar
from .lr_schedule import LearningRateSchedule
from .run_parts import Checkpoints, DivergenceGuard, LoraExport, SampleGrids, TimeBudget
from .run_state import RunState, open_run
from .trainer import Trainer


def run_parts(run: RunState, evaluator, eval_note: str) -> list:
    """The loop's parts, in the order each event runs them: at the start the evaluation before training,
    then the budget check and the first learning rate; after an iteration grids, then an evaluation, then
    the divergence guard, the checkpoint, the budget and the next learning rate; at the end the last
    checkpoint, the export, then the evaluation after."""
    return [SampleGrids(run), DivergenceGuard(run), Checkpoints(run), LoraExport(run),
            InTrainingEvaluation(run, evaluator, eval_note), TimeBudget(run), LearningRateSchedule(run)]


def _fire(parts: list, event: str, *args) -> None:
    for part in parts:
        getattr(part, event)(*args)


def train(cfg: RunConfig, run_dir: Path | None = None, resume: bool = False, trainer: Trainer | None = None) -> dict:
    """Run (or resume) training. Returns the summary dict (also written to RUN_DIR/summary.json).
    ``trainer``: one assembled from parts (:class:`~flowgrpo.trainer.trainer.Trainer`; default: the one
    ``cfg`` describes); its callbacks see every iteration, evaluation and checkpoint (:mod:`flowgrpo.callbacks`).
    The run folder is locked while the run writes it (:mod:`.run_lock`): a second run on it is refused."""
    from ..policies.diffusers.common import show_library_progress
    from ..realsize.forecast import print_memory_forecast
    from ..memory_floor import check_memory_floor

    show_library_progress(cfg.log.progress)  # diffusers' and transformers' own bars follow log.progress
    if trainer is None:
        trainer = Trainer(cfg)  # first, so that bad input fails before a run directory exists
    cfg, events = trainer.cfg, trainer.callbacks  # the parts' config (a rewards part may set reward.weights)
    evaluator, eval_note = monitored_evaluator(cfg, trainer)  # eval.evaluator, measuring the monitors
    trees = cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt  # before the run folder:
    check_memory_floor(cfg, trainer.policy, evaluator, trainer.accelerator.device,
                       share=len(trainer.dp.tree_shard(trees)) / trees)
    with open_run(trainer, run_dir, resume) as run:
        parts = run_parts(run, evaluator, eval_note)
        if run.main:
            events.run_start(trainer, run.run_dir, resume)
            print_memory_forecast(trainer)  # the figure this run needs per GPU, checked against the free memory
            if trainer.micro_batch_fit is not None:
                print(trainer.micro_batch_fit.line(), flush=True)
        _fire(parts, "on_run_start", trainer, run.run_dir, resume)
        label = trainer.objective.name or cfg.loss.objective
        total, budget = cfg.train.iterations, cfg.train.max_minutes
        with progress_bar(cfg.log.progress and run.main) as bar:
            task = bar.add_task(**bar_fields(label, trainer.iteration, total, run.train_seconds, budget))
            while trainer.iteration < total and not run.dp.broadcast(events.stop_reason is not None):
                run.iteration_started, start = run.train_seconds, run.clock()
                cpu = time.process_time()
                result = trainer.iteration_step()
                run.add_seconds(run.clock() - start)  # grids and evaluations after this are not training
                result.metrics["train_seconds"] = run.train_seconds
                # beside iter_s, the share of a core the iteration got; measured here, not in iteration_step,
                # whose metrics callers compare across runs after dropping the timings they know by name
                result.metrics["cpu_s"] = time.process_time() - cpu
                _fire(parts, "on_step_end", trainer, result)  # grids; an evaluation adds its metrics
                if run.main:
                    events.step_end(trainer, result)
                    run.logger.log(result.metrics)
                    events.iteration_end(trainer, result.metrics)
                _fire(parts, "on_iteration_end", trainer, result.metrics)  # divergence, checkpoint, budget
                bar.update(task, **bar_fields(label, trainer.iteration, total, run.train_seconds, budget,
                                              result.metrics, trainer.objective.needs_reference))
        run.dp.barrier()
        mine = {"iterations": trainer.iteration, "train_seconds": run.train_seconds, "rank": run.dp.rank}
        if not (run.main or run.gathers or run.lockstep):
            return mine
        summary: dict = {"preset": cfg.preset}
        _fire(parts, "on_train_end", trainer, summary)  # last checkpoint, LoRA export, evaluation after training
        if not run.main:
            return mine
        records = run.records()
        summary.update({"iterations": trainer.iteration, "train_seconds": run.train_seconds,
                        "nan_rewards_dropped": int(sum(r.get("nan_rewards_dropped", 0) for r in records)),
                        "final_metrics": records[-1] if records else {}})
        run.write_json("summary.json", summary)
        note = shared_core_note(cfg.train.clock, cfg.train.threads, cores_used(records))
        if note:
            print(note, flush=True)
        events.train_end(trainer, summary)
        return summary
