"""Scoring benchmark images and summarising the scores into a benchmark's numbers.

:func:`build_scorer` turns a :class:`~flowgrpo.benches.suites.Bench` into a function from images
[B, 3, H, W] in [0, 1] and their prompt rows to one score per image; :func:`summarise` turns the
scores of one model into the benchmark's table (per tag and the headline, defined as its paper does).
Both are pure of the run loop, so the ``bench`` evaluator (during training) and ``flowgrpo eval
--bench`` (after it) compute the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from torch import Tensor

from ..errors import ConfigError
from .suites import Bench

#: scores [B] (float, NaN where the metric could not score an image) of images [B, 3, H, W] and their rows
Scorer = Callable[[Tensor, list[dict]], list[float]]


def build_scorer(bench: Bench, options: dict | None = None) -> Scorer:
    """The scorer of ``bench``: the reward named by its metric with ``bench.metric_options`` and the user's
    ``options`` (model weight paths, ...), called on the images and their prompts, and on each prompt's
    .jsonl line where the reward reads prompt metadata (GenEval's ``geneval``, whose official verdict
    the ``geneval`` benchmark asks for with ``score: geneval``)."""
    from ..rewards import build_reward
    from ..rewards.base import wants_metadata

    reward = build_reward(bench.metric, **{**bench.metric_options, **(options or {})})
    needs_metadata = wants_metadata(reward)

    def score(images: Tensor, rows: list[dict]) -> list[float]:
        import torch

        extra = {}
        if needs_metadata:
            if any("metadata" not in r for r in rows):
                raise ConfigError(f"the {bench.name} benchmark reads each prompt's metadata: give its .jsonl "
                                  f"prompt file ({bench.prompts})")
            extra["metadata"] = [r["metadata"] for r in rows]
        groups = torch.arange(len(rows))  # every image its own group: no pairwise comparison here
        out = reward(images, [r["prompt"] for r in rows], groups, **extra)
        return [float(s) for s in out.scores.detach().float().cpu()]

    return score


@dataclass
class BenchSummary:
    """One model's numbers on a benchmark.

    Attributes:
        headline: the benchmark's own number (GenEval: mean of per-tag accuracies; else the mean score).
        mean_score: mean over the scored images.
        accuracy: fraction of images whose score reaches the benchmark's threshold (None: no threshold).
        per_tag: tag -> the per-tag number the headline is made of (accuracy where there is a
            threshold, else mean score).
        stderr: standard error of the headline over images (prompt-clustered for several images per prompt).
        num_images: images scored; num_failed: images the metric could not score (NaN), counted wrong.
    """

    headline: float
    mean_score: float
    accuracy: float | None
    per_tag: dict[str, float]
    stderr: float
    num_images: int
    num_failed: int

    def to_json(self) -> dict:
        return dict(self.__dict__)


def summarise(bench: Bench, scores: list[float], rows: list[dict], prompt_ids: list[int]) -> BenchSummary:
    """The numbers of ``scores`` [N] (one per image; NaN: unscored) whose prompt rows are ``rows`` [N] and
    prompt indices ``prompt_ids`` [N] (images of one prompt share an index): see :class:`BenchSummary`."""
    if not scores:
        raise ConfigError(f"no images were scored for {bench.name}")
    s = np.asarray(scores, dtype=np.float64)
    failed = ~np.isfinite(s)
    value = (s >= bench.threshold).astype(np.float64) if bench.threshold is not None else s.copy()
    value[failed] = 0.0 if bench.threshold is not None else np.nan  # an unscored image is wrong, or left out
    tags = [r.get("tag", "default") for r in rows]
    per_tag = {t: float(np.nanmean(value[[i for i, u in enumerate(tags) if u == t]])) for t in sorted(set(tags))}
    headline = float(np.mean(list(per_tag.values()))) if bench.headline == "tag_mean_accuracy" \
        else float(np.nanmean(value))
    return BenchSummary(headline=headline, mean_score=float(np.nanmean(s)) if (~failed).any() else math.nan,
                        accuracy=float(np.mean(value)) if bench.threshold is not None else None, per_tag=per_tag,
                        stderr=_clustered_stderr(value, prompt_ids), num_images=len(scores),
                        num_failed=int(failed.sum()))


def _clustered_stderr(value: np.ndarray, prompt_ids: list[int]) -> float:
    """Standard error of the mean of ``value`` with the images of one prompt as one cluster (their
    scores are not independent draws: they share the prompt)."""
    ids = np.asarray(prompt_ids)
    # a prompt whose images all failed to score has no mean (not numpy's "mean of empty slice" warning)
    groups = [value[ids == p] for p in np.unique(ids)]
    means = np.array([np.nanmean(g) for g in groups if np.isfinite(g).any()])
    return float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else math.nan
