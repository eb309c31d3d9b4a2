"""A training run on disk: run directory, evaluation before/after, logging, checkpoints, resume.

RUN_DIR/
  config.yaml          the full resolved config (resume reads it back)
  .lock                held (flock) by the process writing the folder (flowgrpo.trainer.run_lock)
  base_weights.json    shapes runs: path and sha256 of the base weights (flowgrpo.trainer.base_weights)
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

Evaluation is whatever ``eval.evaluator`` selects (:mod:`flowgrpo.evaluation`); a model without an
evaluator trains without one: the eval_* entries are null and ``evaluation`` says why.

Multi-process runs (:mod:`flowgrpo.trainer.data_parallel`): every rank runs this loop on the same
clock (the main process's, broadcast each iteration) and holds the same weights; only the main
process writes the run directory, logs, prints and draws the progress bar. With whole weights on
every rank only the main process evaluates; a sharded model (FSDP, :mod:`flowgrpo.trainer.engines`)
needs every rank in each forward, so there every rank evaluates. Where checkpoints gather
tensors from the ranks (FSDP, DeepSpeed ZeRO) every rank takes part in writing them.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from datetime import datetime
from pathlib import Path

import torch
import yaml

from ..config import RunConfig, to_dict
from ..disk import write_problem, write_text_atomically
from ..errors import UserError
from ..evaluation import EvalResult, paired_gain
from ..output.plots import save_accuracy_curve, save_labeled_grid, save_reward_curve, save_sample_grid
from ..safe_load import load_tensors
from ..sharded_tensors import is_sharded
from .accelerator import start_trackers
from .base_weights import check_base_weights, record_base_weights
from .checkpoint import CONFIG_FILE, latest_checkpoint, load_latest_intact, save_checkpoint
from .metrics import MetricsLogger, json_safe, read_metrics
from .monitor import monitored_evaluator
from .progress import bar_fields, progress_bar
from .run_lock import LOCK_FILE, RunLock, lock_run_dir
from .trainer import GRPOTrainer

_GRID_PROMPTS = 16


def _write_json(path: Path, data: dict) -> None:
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


def _eval(trainer: GRPOTrainer, evaluator, use_ema: bool, split: str = "heldout", keep_images: bool = False) -> EvalResult:
    ctx = trainer.ema_weights() if use_ema else contextlib.nullcontext()
    with ctx:
        return evaluator.evaluate(trainer.policy, split=split, keep_images=keep_images)


def _grid_subset(res: EvalResult, seeds_per_prompt: int) -> tuple[torch.Tensor, list[str], list[float]]:
    idx = list(range(0, len(res.prompts), seeds_per_prompt))[:_GRID_PROMPTS]
    return res.images[idx], [res.prompts[i] for i in idx], [res.correct[i] for i in idx]


def _next_end(train_seconds: float, recent: list[float]) -> float:
    """When the next iteration would likely end: the longest of the last 5 iterations, +25 %."""
    return train_seconds + (1.25 * max(recent[-5:]) if recent else 0.0)


def _prepare_run_dir(cfg: RunConfig, run_dir: Path | None, resume: bool, dp, locks: list[RunLock]) -> Path:
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
            _record_config(path, cfg)
            if not resume:
                record_base_weights(path, cfg.model)  # shapes runs: which base the checkpoints belong to
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


def _record_config(run_dir: Path, cfg: RunConfig) -> None:
    """Write ``cfg`` as ``RUN_DIR/config.yaml`` (atomically) unless the file holds it already: a fresh
    run's resolved configuration, or a resumed run's with the budgets it changed, which a later
    ``--resume`` then keeps (:mod:`flowgrpo.commands.resume`)."""
    path = run_dir / CONFIG_FILE
    text = yaml.safe_dump(to_dict(cfg), sort_keys=False)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        if path.read_text(encoding="utf-8") == text:
            return
    write_text_atomically(path, text)


def train(cfg: RunConfig, run_dir: Path | None = None, resume: bool = False, trainer: GRPOTrainer | None = None) -> dict:
    """Run (or resume) training. Returns the summary dict (also written to RUN_DIR/summary.json).
    ``trainer``: one assembled from parts (:class:`~flowgrpo.trainer.trainer.Trainer`; default: the one
    ``cfg`` describes); its callbacks see every iteration, evaluation and checkpoint (:mod:`.callbacks`).
    The run folder is locked while the run writes it (:mod:`.run_lock`): a second run on it is refused."""
    locks: list[RunLock] = []
    try:
        return _train(cfg, run_dir, resume, trainer, locks)
    finally:
        for lock in locks:
            lock.release()


def _train(cfg: RunConfig, run_dir: Path | None, resume: bool, trainer: GRPOTrainer | None,
           locks: list[RunLock]) -> dict:
    """:func:`train`; ``locks`` receives the run folder's lock, held until :func:`train` releases it."""
    from ..policies.diffusers.common import show_library_progress

    show_library_progress(cfg.log.progress)  # diffusers' and transformers' own bars follow log.progress
    if trainer is None:
        trainer = GRPOTrainer(cfg)  # first, so that bad input fails before a run directory exists
    cfg = trainer.cfg  # the parts' config (a rewards part may have set reward.weights)
    events = trainer.callbacks
    dp = trainer.dp
    main = dp.is_main
    lockstep = trainer.engine.lockstep  # every rank takes part in evaluations (sharded weights)
    gathers = trainer.engine.collective_state  # every rank takes part in checkpoints and the LoRA export
    say = print if main else (lambda *a, **k: None)
    evaluator, eval_note = monitored_evaluator(cfg, trainer)  # eval.evaluator, measuring the monitors
    run_dir = _prepare_run_dir(cfg, run_dir, resume, dp, locks)
    train_seconds = 0.0
    start_iter = 0
    # the newest checkpoint that loads (a damaged newer one is passed over with a warning)
    loaded = load_latest_intact(run_dir) if resume else None
    if loaded is not None:
        trainer.load_state_dict(loaded.state["trainer"])
        train_seconds = loaded.state["train_seconds"]
        start_iter = trainer.iteration
        say(f"resumed from {loaded.path} at iteration {start_iter}")
    elif resume:  # e.g. killed before its first checkpoint: the run starts over, with its own config
        say(f"note: {run_dir} has no checkpoint yet; starting it again from iteration 0 with its config.yaml")
    logger = None
    if main:
        start_trackers(trainer.accelerator, cfg, run_dir, start_iter - 1 if resume else None)
        logger = MetricsLogger(run_dir, trainer.accelerator, resume_iteration=start_iter - 1 if resume else None)
        events.run_start(trainer, run_dir, resume)

    eval_before, before_images = None, None
    before_path = run_dir / "eval_before.json"
    # evaluation runs on the main process only (the others wait at the next collective), except in lock-step
    if evaluator is None:
        say(f"note: {eval_note}")
    elif not (main or lockstep):
        evaluator = None
    elif dp.broadcast(before_path.exists()) if lockstep else before_path.exists():
        if main:
            eval_before = json.loads(before_path.read_text())
    else:
        res = _eval(trainer, evaluator, use_ema=False, keep_images=True)
        seen = _eval(trainer, evaluator, use_ema=False, split="seen").to_json() if cfg.eval.seen else None
        if main:
            eval_before = res.to_json(with_correct=True)
            if seen is not None:
                eval_before["seen"] = seen
            _write_json(before_path, eval_before)
            before_images = _grid_subset(res, cfg.eval.seeds_per_prompt)
            try:  # torch's stream writer raises RuntimeError on a full disk
                torch.save(before_images, run_dir / "eval_before_grid.pt")
            except (OSError, RuntimeError) as exc:
                raise UserError(f"cannot write {run_dir / 'eval_before_grid.pt'}: {write_problem(exc, run_dir)}") from None
            events.evaluation(trainer, res, "before")
    curve = []
    if eval_before is not None:
        say(f"held-out accuracy before: {eval_before['accuracy']:.3f}")
        curve = [{"iteration": 0, "train_seconds": 0.0, "accuracy": eval_before["accuracy"],
                  "accuracy_unseen": eval_before.get("accuracy_unseen"), "fidelity": eval_before.get("fidelity")}] + [
            {"iteration": r["iteration"] + 1, "train_seconds": r["train_seconds"], "accuracy": r["eval_accuracy"],
             "accuracy_unseen": r.get("eval_accuracy_unseen"), "fidelity": r.get("eval_fidelity")}
            for r in read_metrics(run_dir) if "eval_accuracy" in r]
    eval_every_s = cfg.eval.every_minutes * 60 if cfg.eval.every_minutes and evaluator is not None else 0.0
    next_eval_s = len(curve) * eval_every_s if eval_every_s else float("inf")
    total = cfg.train.iterations
    # the training clock: wall-clock, or this process's CPU time (train.clock=cpu, for a shared machine)
    clock = time.process_time if cfg.train.clock == "cpu" else time.perf_counter
    objective = trainer.objective.name or cfg.loss.objective
    # kl_ref on the bar only where the loss runs the base model: GRPO measures its KL only with
    # loss.kl_beta > 0, the others whenever they take a reference pass (a KL or anchor term)
    ref_kl = cfg.loss.kl_beta > 0 if objective == "grpo" else trainer.objective.needs_reference
    with progress_bar(cfg.log.progress and main) as bar:
        task = bar.add_task(**bar_fields(objective, start_iter, total, train_seconds, cfg.train.max_minutes))
        recent: list[float] = []  # seconds of the latest iterations, checkpoint writes included
        while trainer.iteration < total and not dp.broadcast(events.stop_reason is not None):  # a callback's stop
            # stop before an iteration that would likely end past the budget, so that train_seconds
            # stays within it (the longest of the last 5 iterations, with a 25 % margin)
            if dp.broadcast(bool(cfg.train.max_minutes) and _next_end(train_seconds, recent) > cfg.train.max_minutes * 60):
                say(f"time budget of {cfg.train.max_minutes} min reached at iteration {trainer.iteration}")
                break
            spent_before = train_seconds
            t0 = clock()
            out = trainer.iteration_step()
            m = out.metrics
            it = m["iteration"]
            if main and cfg.log.grid_every and (it % cfg.log.grid_every == 0):
                ro = out.rollout
                save_sample_grid(run_dir / "grids" / f"iter_{it:06d}.png", out.images, ro.leaf_prompts,
                                 ro.tree_prompt[ro.leaf_tree].tolist(), out.leaf_rewards)
                logger.log_image("samples", run_dir / "grids" / f"iter_{it:06d}.png", it)
            # one clock for every rank (the main process's), so that time-based decisions agree
            train_seconds = dp.broadcast(train_seconds + clock() - t0)
            m["train_seconds"] = train_seconds
            next_end = _next_end(train_seconds, recent + [train_seconds - spent_before])
            budget_left = not cfg.train.max_minutes or next_end <= cfg.train.max_minutes * 60
            due = evaluator is not None and ((cfg.eval.every and (it + 1) % cfg.eval.every == 0)
                                             or train_seconds >= next_eval_s)
            if lockstep:  # the main process holds the evaluation curve: it decides
                due = dp.broadcast(due)
            if due and it + 1 < total and budget_left:  # the clock is paused: evaluation is not training
                res = _eval(trainer, evaluator, use_ema=cfg.train.ema)
                m.update(res.metrics())  # eval_accuracy, eval_accuracy_unseen, eval_fidelity, monitor.*
                curve.append({"iteration": it + 1, "train_seconds": train_seconds, "accuracy": res.accuracy,
                              "accuracy_unseen": res.accuracy_unseen, "fidelity": res.fidelity})
                while train_seconds >= next_eval_s:
                    next_eval_s += eval_every_s
                if main:
                    events.evaluation(trainer, res, "during")
            if main:
                logger.log(m)
                events.iteration_end(trainer, m)
            diverged = _divergence(trainer, out)
            if dp.sum_scalar(float(diverged is not None)):  # every rank stops together
                raise UserError(f"training diverged at iteration {it}: {diverged or 'another process saw it'}; "
                                f"nothing more is trained or saved (train.lr={cfg.train.lr:g}: try a smaller one)")
            done = trainer.iteration
            if (main or gathers) and (done % cfg.log.checkpoint_every == 0 or done == total):
                t1 = clock()
                state = trainer.state_dict()  # with sharded weights a collective (whole tensors)
                if main:
                    path = save_checkpoint(run_dir, done, {"trainer": state, "train_seconds": train_seconds})
                    events.checkpoint(trainer, path, it)  # numbered as the iteration it follows (ckpt_N: N done)
                train_seconds += clock() - t1
            recent.append(train_seconds - spent_before)
            bar.update(task, **bar_fields(objective, done, total, train_seconds, cfg.train.max_minutes, m, ref_kl))
    dp.barrier()
    mine = {"iterations": trainer.iteration, "train_seconds": train_seconds, "rank": dp.rank}
    if not (main or gathers or lockstep):
        return mine
    last = latest_checkpoint(run_dir) if main else None
    stale = last is None or int(last.name.split("_")[1]) != trainer.iteration
    if (main or gathers) and (dp.broadcast(stale) if gathers else stale):
        state = trainer.state_dict()
        if main:
            path = save_checkpoint(run_dir, trainer.iteration, {"trainer": state, "train_seconds": train_seconds})
            events.checkpoint(trainer, path, trainer.iteration - 1)
    if cfg.model.train_mode == "lora" and trainer.policy.exports_lora:  # diffusers' format, EMA weights (flowgrpo.commands.export)
        weights = trainer.engine.full(trainer.ema if trainer.ema is not None else trainer.policy.trainable_state_dict())
        if main:
            trainer.policy.save_lora(run_dir / "lora", weights)
    final = _final_results(trainer, evaluator) if evaluator is not None and (main or lockstep) else None
    if not main:
        return mine
    logger.close()
    records = read_metrics(run_dir)
    summary = {"preset": cfg.preset, "evaluation": evaluator.name if evaluator is not None else eval_note,
               "eval_before": None, "eval_after": None, "accuracy_gain": None, "gain_se": None,
               "eval_before_seen": None, "eval_after_seen": None, "eval_curve": curve}
    if evaluator is not None:
        summary.update(_final_evaluation(trainer, final, run_dir, eval_before, before_images, curve, records,
                                         train_seconds))
        events.evaluation(trainer, final[0], "after")
    else:
        save_reward_curve(run_dir / "reward_curve.png", records, [])
    summary.update({
        "iterations": trainer.iteration,
        "train_seconds": train_seconds,
        "nan_rewards_dropped": int(sum(r.get("nan_rewards_dropped", 0) for r in records)),
        "final_metrics": records[-1] if records else {},
    })
    _write_json(run_dir / "summary.json", summary)
    return summary


def _divergence(trainer: GRPOTrainer, out) -> str | None:
    """What is no longer finite after iteration ``out`` (its samples, loss, gradient norm or the trainable
    weights; a NaN the reward alone produced is dropped and counted instead), else None. A learning rate
    far too large writes finite weights of magnitude 1e30 whose next rollout is NaN: the samples see it."""
    if out.images is not None and not bool(torch.isfinite(out.images).all()):
        return "the rollout's samples are NaN or infinite (the previous update broke the weights)"
    for key in ("loss", "grad_norm"):
        value = out.metrics.get(key)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{key} is {value}"
    with torch.no_grad():  # this rank's slice of sharded weights (the caller sums the verdict over ranks)
        params = [(n, p.to_local() if is_sharded(p) else p) for n, p in trainer.policy.named_trainable_parameters()]
        finite = [torch.isfinite(p).all() for _, p in params]
        if finite and not bool(torch.stack([f.to(finite[0].device) for f in finite]).all()):  # one sync
            bad = next(n for (n, _), f in zip(params, finite) if not bool(f))
            return f"trainable weight {bad} holds NaN or infinite values"
    return None


def _final_results(trainer: GRPOTrainer, evaluator) -> tuple[EvalResult, dict | None]:
    """The evaluation after training: held-out (with images) and, with ``eval.seen``, seen prompts."""
    cfg = trainer.cfg
    res = _eval(trainer, evaluator, use_ema=cfg.train.ema, keep_images=True)
    seen = _eval(trainer, evaluator, use_ema=cfg.train.ema, split="seen").to_json() if cfg.eval.seen else None
    return res, seen


def _final_evaluation(trainer: GRPOTrainer, final: tuple[EvalResult, dict | None], run_dir: Path, eval_before: dict,
                      before_images, curve: list[dict], records: list[dict], train_seconds: float) -> dict:
    """Write the accuracy and reward curves and the before/after grid of the evaluation after
    training (``final``, from :func:`_final_results`). Returns the summary's evaluation entries."""
    cfg = trainer.cfg
    res, eval_after_seen = final
    eval_after = res.to_json()
    gain, gain_se = paired_gain(eval_before["correct"], res.correct) if "correct" in eval_before else (
        eval_after["accuracy"] - eval_before["accuracy"], float("nan"))
    print(f"held-out accuracy after:  {eval_after['accuracy']:.3f}  (gain {gain:+.3f} +- {gain_se:.3f} s.e., paired)")
    curve.append({"iteration": trainer.iteration, "train_seconds": train_seconds, "accuracy": eval_after["accuracy"],
                  "accuracy_unseen": eval_after.get("accuracy_unseen"), "fidelity": eval_after.get("fidelity")})
    save_accuracy_curve(run_dir / "accuracy_curve.png", curve, eval_after["num_samples"])
    save_reward_curve(run_dir / "reward_curve.png", records, [(c["iteration"], c["accuracy"]) for c in curve])
    if before_images is None and (run_dir / "eval_before_grid.pt").exists():
        before_images = load_tensors(run_dir / "eval_before_grid.pt", "evaluation grid")
    if before_images is not None:
        _save_before_after(run_dir / "before_after.png", before_images, _grid_subset(res, cfg.eval.seeds_per_prompt),
                           eval_before["accuracy"], eval_after["accuracy"],
                           eval_before.get("fidelity"), eval_after.get("fidelity"))
    return {
        "eval_before": {k: v for k, v in eval_before.items() if k not in ("correct", "seen")},
        "eval_after": eval_after,
        "accuracy_gain": gain,
        "gain_se": gain_se,
        "eval_before_seen": eval_before.get("seen"),
        "eval_after_seen": eval_after_seen,
    }


def _save_before_after(path: Path, before, after, acc_before: float, acc_after: float,
                       fid_before: float | None = None, fid_after: float | None = None) -> None:
    """Rows alternate before / after, so each prompt's two images stand one above the other. The
    title gives accuracy and, where both evaluations measured it, image fidelity before -> after."""
    order, n = [], len(after[1])
    for start in range(0, n, 8):
        order += [("b", i) for i in range(start, min(n, start + 8))]
        order += [("a", i) for i in range(start, min(n, start + 8))]
    src = {"b": before, "a": after}
    imgs = torch.stack([src[k][0][i] for k, i in order])
    labels = [("before: " if k == "b" else "after: ") + src[k][1][i] for k, i in order]
    verdicts = [src[k][2][i] for k, i in order]
    both = fid_before is not None and fid_after is not None  # runs from before fidelity existed have none
    fidelity = f"; fidelity {fid_before:.2f} -> {fid_after:.2f}" if both else ""
    save_labeled_grid(path, imgs, labels, verdicts, ncol=8,
                      title=f"held-out prompts, same seeds: rows alternate before / after training; accuracy "
                            f"{acc_before:.2f} -> {acc_after:.2f}{fidelity} (green frame = verifier says correct, "
                            f"red = wrong)")
