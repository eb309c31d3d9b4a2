"""A training run on disk: run directory, evaluation before/after, logging, checkpoints, resume.

RUN_DIR/
  config.yaml          the full resolved config (resume reads it back)
  metrics.jsonl        one line per iteration
  tensorboard/         TensorBoard events
  checkpoints/ckpt_N/  atomic checkpoints (trainable weights, optimizer, EMA, iteration, clock)
  grids/               rollout sample grids during training
  eval_before.json     held-out evaluation of the base model
  before_after.png     held-out samples before (top) and after (bottom) training
  reward_curve.png     reward against iteration with held-out accuracy points
  summary.json         eval_before, eval_after, iterations, train_seconds, ...
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import torch
import yaml

from ..config import RunConfig, apply_dict, to_dict, validate
from ..errors import UserError
from ..evaluate import evaluate_policy
from ..plots import save_grid, save_labeled_grid, save_reward_curve
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .metrics import MetricsLogger, read_metrics
from .trainer import GRPOTrainer

_GRID_PROMPTS = 16


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=float))
    tmp.replace(path)


def make_run_dir(cfg: RunConfig) -> Path:
    name = cfg.log.run_name or f"{cfg.preset or 'run'}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.log.out_dir) / name
    if (run_dir / "checkpoints").exists():
        raise UserError(f"run directory {run_dir} already holds checkpoints; use --resume {run_dir} or another log.run_name")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def load_run_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = RunConfig()
    apply_dict(cfg, yaml.safe_load(path.read_text()))
    validate(cfg)
    return cfg


def _eval(trainer: GRPOTrainer, use_ema: bool) -> dict:
    cfg = trainer.cfg
    ctx = trainer.ema_weights() if use_ema else _null()
    with ctx:
        res = evaluate_policy(trainer.policy, cfg.eval.num_prompts, cfg.eval.seeds_per_prompt, cfg.eval.num_steps,
                              cfg.sampler.shift, return_images=True)
    return res


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _grid_subset(res: dict, seeds_per_prompt: int) -> tuple[torch.Tensor, list[str], list[float]]:
    idx = list(range(0, len(res["prompts"]), seeds_per_prompt))[:_GRID_PROMPTS]
    return res["images"][idx], [res["prompts"][i] for i in idx], [res["correct"][i] for i in idx]


def _public(res: dict) -> dict:
    return {k: v for k, v in res.items() if k not in ("images", "prompts", "correct")}


def _progress(enabled: bool, total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"), disable=not enabled, transient=False)


def train(cfg: RunConfig, run_dir: Path | None = None, resume: bool = False) -> dict:
    """Run (or resume) training. Returns the summary dict (also written to RUN_DIR/summary.json)."""
    trainer = GRPOTrainer(cfg)  # first, so that bad input fails before a run directory exists
    if resume:
        assert run_dir is not None
        run_dir = Path(run_dir)
    else:
        run_dir = run_dir or make_run_dir(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    train_seconds = 0.0
    start_iter = 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        trainer.load_state_dict(state["trainer"])
        train_seconds = state["train_seconds"]
        start_iter = trainer.iteration
        print(f"resumed from {ckpt} at iteration {start_iter}")
    logger = MetricsLogger(run_dir, cfg.log.tensorboard, resume_iteration=start_iter - 1 if resume else None)

    before_path = run_dir / "eval_before.json"
    if before_path.exists():
        eval_before = json.loads(before_path.read_text())
        before_images = None
    else:
        res = _eval(trainer, use_ema=False)
        eval_before = _public(res)
        _write_json(before_path, eval_before)
        before_images = _grid_subset(res, cfg.eval.seeds_per_prompt)
        torch.save(before_images, run_dir / "eval_before_grid.pt")
    print(f"held-out accuracy before: {eval_before['accuracy']:.3f}")

    eval_points = [(0, eval_before["accuracy"])] + [
        (r["iteration"] + 1, r["eval_accuracy"]) for r in read_metrics(run_dir) if "eval_accuracy" in r]
    total = cfg.train.iterations
    with _progress(cfg.log.progress, total) as bar:
        task = bar.add_task("train", total=total, completed=start_iter, info="")
        while trainer.iteration < total:
            if cfg.train.max_minutes and train_seconds >= cfg.train.max_minutes * 60:
                print(f"time budget of {cfg.train.max_minutes} min reached at iteration {trainer.iteration}")
                break
            t0 = time.perf_counter()
            out = trainer.iteration_step()
            m = out.metrics
            it = m["iteration"]
            if cfg.log.grid_every and (it % cfg.log.grid_every == 0):
                n = min(len(out.images), 8 * min(8, cfg.data.group_size))
                save_grid(run_dir / "grids" / f"iter_{it:06d}.png", out.images[:n], ncol=min(8, cfg.data.group_size), scale=2)
            if cfg.eval.every and (it + 1) % cfg.eval.every == 0 and it + 1 < total:
                res = _eval(trainer, use_ema=cfg.train.ema)
                m["eval_accuracy"] = res["accuracy"]
                eval_points.append((it + 1, res["accuracy"]))
            train_seconds += time.perf_counter() - t0
            m["train_seconds"] = train_seconds
            logger.log(m)
            done = trainer.iteration
            if done % cfg.log.checkpoint_every == 0 or done == total:
                t1 = time.perf_counter()
                save_checkpoint(run_dir, done, {"trainer": trainer.state_dict(), "train_seconds": train_seconds})
                train_seconds += time.perf_counter() - t1
            info = (f"reward {m.get('reward_mean', float('nan')):.3f}  kl {m.get('approx_kl', 0):.2e}  "
                    f"clip {m.get('clipfrac_high', 0) + m.get('clipfrac_low', 0):.2f}")
            bar.update(task, completed=done, info=info)
    if latest_checkpoint(run_dir) is None or int(latest_checkpoint(run_dir).name.split("_")[1]) != trainer.iteration:
        save_checkpoint(run_dir, trainer.iteration, {"trainer": trainer.state_dict(), "train_seconds": train_seconds})
    logger.close()

    res = _eval(trainer, use_ema=cfg.train.ema)
    eval_after = _public(res)
    print(f"held-out accuracy after:  {eval_after['accuracy']:.3f}")
    eval_points.append((trainer.iteration, eval_after["accuracy"]))
    records = read_metrics(run_dir)
    save_reward_curve(run_dir / "reward_curve.png", records, eval_points)
    if before_images is None and (run_dir / "eval_before_grid.pt").exists():
        before_images = torch.load(run_dir / "eval_before_grid.pt", weights_only=False)
    if before_images is not None:
        after = _grid_subset(res, cfg.eval.seeds_per_prompt)
        imgs = torch.cat([before_images[0], after[0]])
        save_labeled_grid(run_dir / "before_after.png", imgs, before_images[1] + after[1], before_images[2] + after[2],
                          ncol=8, title="held-out samples: top two rows before, bottom two rows after GRPO "
                                         "(green frame = verifier says correct)")
    summary = {
        "preset": cfg.preset,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "accuracy_gain": eval_after["accuracy"] - eval_before["accuracy"],
        "iterations": trainer.iteration,
        "train_seconds": train_seconds,
        "nan_rewards_dropped": int(sum(r.get("nan_rewards_dropped", 0) for r in records)),
        "final_metrics": records[-1] if records else {},
    }
    _write_json(run_dir / "summary.json", summary)
    return summary
