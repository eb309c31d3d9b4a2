"""The evaluators' contract and names: :class:`EvalResult` (what every evaluator returns), the
:class:`Evaluator` protocol, :data:`EVALUATORS` (name -> where the evaluator lives, imported when
named), an evaluator's options (:func:`evaluator_options`) and the paired gain of two evaluations.

A leaf below every evaluator and below the config (which checks ``eval.evaluator`` against the
names), so that a world's own evaluator (the shapes world's, which the rewards' layer sits above) and
the evaluators of :mod:`flowgrpo.evaluation` share one contract without an import cycle;
:mod:`flowgrpo.evaluation` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from torch import Tensor

from .registry import Registry

#: name -> evaluator factory ``(eval_cfg, shift: float) -> Evaluator``
EVALUATORS: Registry = Registry("evaluator")
EVALUATORS.register_lazy("shapes", "flowgrpo.shapes.evaluate:ShapesEvaluator")
EVALUATORS.register_lazy("unigenbench", "flowgrpo.unigenbench.evaluator:UniGenBenchEvaluator")
EVALUATORS.register_lazy("edit", "flowgrpo.evaluation.edit:EditEvaluator")
EVALUATORS.register_lazy("bench", "flowgrpo.evaluation.bench:BenchEvaluator")

#: the prefix of a tag's accuracy in a ``metrics.jsonl`` line (``eval_accuracy.counting``)
TAG_METRIC = "eval_accuracy."


@dataclass
class EvalResult:
    """The outcome of one evaluation.

    Attributes:
        accuracy: fraction of samples judged correct (the headline number).
        per_tag: accuracy per prompt category.
        score: mean partial score in [0, 1] (credit for partly right samples), or None.
        fidelity: mean image fidelity in [0, 1], how cleanly the samples are drawn whatever they
            show (1 = as clean as the world's own renders; lower with background texture or noisy
            glyphs; :mod:`flowgrpo.shapes.fidelity`), or None where the evaluator does not measure it.
        num_samples: samples evaluated (prompts x seeds).
        accuracy_unseen: accuracy on prompts never trained on (None where the split has none).
        num_unseen: samples behind ``accuracy_unseen``.
        correct: [num_samples] per-sample verdicts (1.0 / 0.0), in (prompt, seed) order; two
            evaluations of the same split pair up sample by sample (:func:`paired_gain`).
        prompts, images: the evaluated prompts and images [N, 3, H, W] in [0, 1], when kept.
        monitors: the reward-hacking monitors measured on the held-out samples (name -> value, e.g.
            ``dark_share``, ``reward.pickscore``, ``velocity_norm``; :mod:`flowgrpo.monitors`), or empty.
        accuracy_se: standard error of ``accuracy`` over the evaluation's noise seeds, the prompts held
            fixed (:func:`seed_standard_error`): how far another seed set would move it; None where the
            evaluator does not estimate it.
    """

    accuracy: float
    per_tag: dict[str, float]
    num_samples: int
    score: float | None = None
    accuracy_unseen: float | None = None
    num_unseen: int = 0
    correct: list[float] = field(default_factory=list)
    prompts: list[str] | None = None
    images: Tensor | None = None
    fidelity: float | None = None  # last, so that positional construction keeps its meaning
    monitors: dict[str, float] = field(default_factory=dict)
    accuracy_se: float | None = None

    def to_json(self, with_correct: bool = False) -> dict:
        """The JSON record of ``summary.json`` / ``eval_*.json`` (no images, no prompts)."""
        out = {"accuracy": self.accuracy, "accuracy_unseen": self.accuracy_unseen, "num_unseen": self.num_unseen,
               "accuracy_se": self.accuracy_se, "score": self.score, "fidelity": self.fidelity, "per_tag": dict(self.per_tag),
               "num_samples": self.num_samples, "monitors": dict(self.monitors)}
        if with_correct:
            out["correct"] = list(self.correct)
        return out

    def metrics(self) -> dict:
        """The entries of an evaluation during training in its ``metrics.jsonl`` line: ``eval_accuracy``,
        ``eval_accuracy_se``, ``eval_accuracy_unseen``, ``eval_fidelity``, each tag's accuracy as
        ``eval_accuracy.<tag>`` (:data:`TAG_METRIC`; the tag that lags shows while the run trains) and each
        monitor as ``monitor.<name>``."""
        return {"eval_accuracy": self.accuracy, "eval_accuracy_se": self.accuracy_se,
                "eval_accuracy_unseen": self.accuracy_unseen, "eval_fidelity": self.fidelity,
                **{TAG_METRIC + tag: v for tag, v in self.per_tag.items()},
                **{f"monitor.{k}": v for k, v in self.monitors.items()}}


def per_tag_from_metrics(line: dict) -> dict[str, float]:
    """The per-tag accuracies of a ``metrics.jsonl`` line written by :meth:`EvalResult.metrics` (tag ->
    accuracy; empty for a line without an evaluation, or from a run before tags were logged)."""
    return {key[len(TAG_METRIC):]: v for key, v in line.items() if key.startswith(TAG_METRIC)}


class Evaluator(Protocol):
    """Generates and scores a fixed split with a policy."""

    name: str

    def evaluate(self, policy, split: str = "heldout", keep_images: bool = False) -> EvalResult:
        """Evaluate ``policy`` on ``split`` ("heldout": prompts never trained on; "seen": training prompts)."""
        ...


def evaluator_options(eval_cfg, defaults: dict, evaluator: str) -> dict:
    """``eval.options`` over an evaluator's ``defaults``; a ConfigError names unknown keys and the valid ones,
    and refuses ``eval.seen`` (these evaluators have their own prompt files, no training prompts)."""
    from .errors import ConfigError

    opts = dict(eval_cfg.options or {})
    unknown = sorted(set(opts) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown eval.options {', '.join(unknown)} for the {evaluator} evaluator; "
                          f"valid: {', '.join(defaults)}")
    if eval_cfg.seen:
        raise ConfigError(f"eval.evaluator={evaluator} has no training prompts to compare with: set eval.seen=false")
    return {**defaults, **opts}


def seeded_drawing_options(opts: dict, eval_cfg) -> tuple[int, int]:
    """``(seed, batch_size)`` of an evaluator that draws from :func:`~flowgrpo.output.drawing.noise_seed`
    (bench, edit): ``eval.options.seed`` an integer in 0..2^40 - 1, ``eval.options.batch_size`` one >= 1,
    and ``eval.seeds_per_prompt`` / ``eval.num_prompts`` within the ranges whose seeds stay distinct;
    else a ConfigError naming the key (a string seed was a ValueError traceback, batch size 0 one from
    ``range``)."""
    from .errors import ConfigError
    from .output.drawing import MAX_IMAGES_PER_PROMPT, MAX_PROMPTS, MAX_SEED

    values = {}
    for key, low, high in (("seed", 0, MAX_SEED), ("batch_size", 1, None)):
        value = opts[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            need = f"an integer in {low}..2^40 - 1" if high else f"an integer >= {low}"
            raise ConfigError(f"eval.options.{key} must be {need}, got {value!r}")
        values[key] = value
    if eval_cfg.seeds_per_prompt > MAX_IMAGES_PER_PROMPT:
        raise ConfigError(f"eval.seeds_per_prompt must be at most {MAX_IMAGES_PER_PROMPT} for this evaluator "
                          f"(its noise seeds would repeat), got {eval_cfg.seeds_per_prompt}")
    if eval_cfg.num_prompts > MAX_PROMPTS:
        raise ConfigError(f"eval.num_prompts must be at most {MAX_PROMPTS} for this evaluator, got {eval_cfg.num_prompts}")
    return values["seed"], values["batch_size"]


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean and standard error of the per-sample change ``after - before`` (same prompts and seeds)."""
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    if len(d) < 2:
        return float(d.mean()) if len(d) else 0.0, float("nan")
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


def seed_standard_error(correct: list[float], groups: list[str]) -> float:
    """Standard error of ``mean(correct)`` when the prompts are held fixed and only the noise seeds
    would change: ``sqrt(s_w^2 / N)``, with ``s_w^2`` the within-prompt variance of the verdicts,
    pooled over prompts (``groups``: each sample's prompt, samples of one prompt pooled wherever they
    stand). Between-prompt differences are left out on purpose: every evaluation uses the same
    prompts, so only the seeds move it. Where no prompt has two samples the within-prompt variance
    cannot be told apart, and the variance over all samples (ddof 1) stands in. NaN below 2 samples.

    Args:
        correct: [N] per-sample scores (1.0 / 0.0 verdicts, or partial scores).
        groups: [N] the prompt (or any grouping key) of each sample.
    """
    x = np.asarray(correct, dtype=np.float64)
    if len(x) != len(groups):
        raise ValueError(f"{len(x)} verdicts but {len(groups)} group keys")
    if len(x) < 2:
        return float("nan")
    index: dict = {}
    codes = np.array([index.setdefault(g, len(index)) for g in groups])
    counts = np.bincount(codes)
    if counts.max() < 2:
        return float(x.std(ddof=1) / np.sqrt(len(x)))
    means = np.bincount(codes, weights=x) / counts
    within = float(((x - means[codes]) ** 2).sum() / (len(x) - len(counts)))
    return float(np.sqrt(within / len(x)))
