"""Evaluation during a training run: before it, on a schedule while it trains, after it; the curves,
the before/after grid and the summary's evaluation entries.

:class:`InTrainingEvaluation` is one of the run loop's parts (a :class:`~flowgrpo.callbacks.Callback`,
:mod:`flowgrpo.trainer.run_parts`). It writes ``eval_before.json`` (and the images of its grid,
``eval_before_grid.pt``, so that a resumed run still draws the grid), adds each evaluation's metrics to
its iteration's ``metrics.jsonl`` line, and at the end ``accuracy_curve.png``, ``reward_curve.png``,
``before_after.png`` and the ``eval_*`` entries of ``summary.json``. Evaluation runs on the main process
only (the others wait at the next collective), except with sharded weights (FSDP), where every rank
takes part in each forward. The training clock is paused while it evaluates.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..disk import write_problem
from ..errors import UserError
from ..evaluators import per_tag_from_metrics
from ..output.plots import save_accuracy_curve, save_labeled_grid, save_reward_curve
from ..safe_load import load_tensors
from ..callbacks import Callback
from . import EvalResult, paired_gain
from ..text_inputs import loads_json

#: prompts in the before/after grid (each with its first seed)
GRID_PROMPTS = 16
#: what a curve point holds of an evaluation besides ``per_tag`` (its ``to_json`` keys; ``eval_<key>`` in
#: ``metrics.jsonl``)
CURVE_KEYS = ("accuracy", "accuracy_se", "accuracy_unseen", "fidelity")


def _point(iteration: int, train_seconds: float, record: dict, prefix: str = "") -> dict:
    """A curve point from an evaluation's JSON record (``prefix`` "eval_": from a metrics line), with
    its ``per_tag`` accuracies (empty where a resumed run's older lines logged none)."""
    per_tag = per_tag_from_metrics(record) if prefix else dict(record.get("per_tag") or {})
    return {"iteration": iteration, "train_seconds": train_seconds,
            **{key: record.get(prefix + key) for key in CURVE_KEYS}, "per_tag": per_tag}


def _se_text(record: dict) -> str:
    """`` +- 0.014 s.e. (seeds)`` from an evaluation record that has the seed standard error, else ``""``."""
    se = record.get("accuracy_se")
    return f" +- {se:.3f} s.e. (seeds)" if se is not None and se == se else ""


def _grid_subset(res: EvalResult, seeds_per_prompt: int) -> tuple[torch.Tensor, list[str], list[float]]:
    idx = list(range(0, len(res.prompts), seeds_per_prompt))[:GRID_PROMPTS]
    return res.images[idx], [res.prompts[i] for i in idx], [res.correct[i] for i in idx]


class InTrainingEvaluation(Callback):
    """``eval.evaluator`` before, during (``eval.every`` iterations / ``eval.every_minutes`` of training)
    and after a run; without an evaluator (``note`` says why) only the reward curve is drawn."""

    def __init__(self, run, evaluator, note: str):
        """``run``: the run's :class:`~flowgrpo.trainer.run_state.RunState`; ``evaluator``: ``eval.evaluator``'s
        (None: ``note`` says why there is none)."""
        self.run, self.note = run, note
        # only the main process evaluates, except in lock-step (every rank in each sharded forward)
        self.evaluator = evaluator if (run.main or run.lockstep) else None
        self.has_evaluator = evaluator is not None
        self.before: dict | None = None
        self.before_images = None
        self.curve: list[dict] = []
        self.every_s = 0.0
        self.next_s = float("inf")

    def _evaluate(self, split: str = "heldout", keep_images: bool = False, use_ema: bool | None = None) -> EvalResult:
        """``split`` with the EMA weights where the run keeps them (``use_ema``: None = ``train.ema``)."""
        trainer = self.run.trainer
        use_ema = self.run.cfg.train.ema if use_ema is None else use_ema
        with trainer.ema_weights() if use_ema else contextlib.nullcontext():
            return self.evaluator.evaluate(trainer.policy, split=split, keep_images=keep_images)

    def on_run_start(self, trainer, run_dir: Path, resumed: bool) -> None:
        run, cfg = self.run, self.run.cfg
        path = run_dir / "eval_before.json"
        if not self.has_evaluator:
            run.say(f"note: {self.note}")
        # a process that does not evaluate (not main, not lock-step) has self.evaluator None: it skips both
        elif self.evaluator is not None and (run.dp.broadcast(path.exists()) if run.lockstep else path.exists()):
            if run.main:
                self.before = loads_json(path.read_text())
        elif self.evaluator is not None:
            res = self._evaluate(keep_images=True, use_ema=False)  # the base model
            seen = self._evaluate(split="seen", use_ema=False).to_json() if cfg.eval.seen else None
            if run.main:
                self._record_before(res, seen, run_dir)
        if self.before is not None:
            run.say(f"held-out accuracy before: {self.before['accuracy']:.3f}{_se_text(self.before)}")
            self.curve = [_point(0, 0.0, self.before)] + [
                _point(r["iteration"] + 1, r["train_seconds"], r, "eval_")
                for r in run.metrics_so_far() if "eval_accuracy" in r]
        if cfg.eval.every_minutes and self.evaluator is not None:
            self.every_s = cfg.eval.every_minutes * 60
            self.next_s = len(self.curve) * self.every_s

    def _record_before(self, res: EvalResult, seen: dict | None, run_dir: Path) -> None:
        self.before = res.to_json(with_correct=True)
        if seen is not None:
            self.before["seen"] = seen
        self.run.write_json("eval_before.json", self.before)
        self.before_images = _grid_subset(res, self.run.cfg.eval.seeds_per_prompt)
        try:  # torch's stream writer raises RuntimeError on a full disk
            torch.save(self.before_images, run_dir / "eval_before_grid.pt")
        except (OSError, RuntimeError) as exc:
            raise UserError(f"cannot write {run_dir / 'eval_before_grid.pt'}: {write_problem(exc, run_dir)}") from None
        self.run.trainer.callbacks.evaluation(self.run.trainer, res, "before")

    def on_step_end(self, trainer, result) -> None:
        run, cfg, it = self.run, self.run.cfg, result.metrics["iteration"]
        if self.evaluator is None:
            return
        due = bool(cfg.eval.every and (it + 1) % cfg.eval.every == 0) or run.train_seconds >= self.next_s
        if run.lockstep:  # the main process holds the evaluation curve: it decides
            due = run.dp.broadcast(due)
        if not (due and it + 1 < cfg.train.iterations and run.within_budget(run.train_seconds - run.iteration_started)):
            return
        res = self._evaluate(split="heldout")
        result.metrics.update(res.metrics())  # eval_accuracy, eval_accuracy_unseen, eval_fidelity, monitor.*
        self.curve.append(_point(it + 1, run.train_seconds, res.to_json()))
        while run.train_seconds >= self.next_s:
            self.next_s += self.every_s
        if run.main:
            trainer.callbacks.evaluation(trainer, res, "during")

    def on_train_end(self, trainer, summary: dict) -> None:
        run = self.run
        final = None
        if self.evaluator is not None:  # every rank of a lock-step run takes part
            res = self._evaluate(keep_images=True)
            seen = self._evaluate(split="seen").to_json() if run.cfg.eval.seen else None
            final = res, seen
        if not run.main:
            return
        records = run.records()
        summary.update({"evaluation": self.evaluator.name if self.evaluator is not None else self.note,
                        "eval_before": None, "eval_after": None, "accuracy_gain": None, "gain_se": None,
                        "eval_before_seen": None, "eval_after_seen": None, "eval_curve": self.curve})
        if final is None:
            save_reward_curve(run.run_dir / "reward_curve.png", records, [])
            return
        summary.update(self._after(final, records))
        trainer.callbacks.evaluation(trainer, final[0], "after")

    def _after(self, final: tuple[EvalResult, dict | None], records: list[dict]) -> dict:
        """Write the curves and the before/after grid of the evaluation after training; the summary's
        evaluation entries."""
        run, (res, after_seen), before = self.run, final, self.before
        after = res.to_json()
        gain, gain_se = paired_gain(before["correct"], res.correct) if "correct" in before else (
            after["accuracy"] - before["accuracy"], float("nan"))
        print(f"held-out accuracy after:  {after['accuracy']:.3f}{_se_text(after)}  "
              f"(gain {gain:+.3f} +- {gain_se:.3f} s.e., paired)")
        self.curve.append(_point(run.trainer.iteration, run.train_seconds, after))
        save_accuracy_curve(run.run_dir / "accuracy_curve.png", self.curve, after["num_samples"])
        save_reward_curve(run.run_dir / "reward_curve.png", records, [(c["iteration"], c["accuracy"]) for c in self.curve])
        images = self.before_images
        if images is None and (run.run_dir / "eval_before_grid.pt").exists():
            images = load_tensors(run.run_dir / "eval_before_grid.pt", "evaluation grid")
        if images is not None:
            save_before_after(run.run_dir / "before_after.png", images, _grid_subset(res, run.cfg.eval.seeds_per_prompt),
                              before["accuracy"], after["accuracy"], before.get("fidelity"), after.get("fidelity"))
        return {"eval_before": {k: v for k, v in before.items() if k not in ("correct", "seen")},
                "eval_after": after, "accuracy_gain": gain, "gain_se": gain_se,
                "eval_before_seen": before.get("seen"), "eval_after_seen": after_seen}


def save_before_after(path: Path, before, after, acc_before: float, acc_after: float,
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
