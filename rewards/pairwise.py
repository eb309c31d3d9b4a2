"""Pairwise preference rewards (Pref-GRPO): judge pairs within a group, reward = win rate.

A **pairwise judge** (:class:`PairwiseJudge`; subclass :class:`PairwiseJudgeBase`) answers which
of two images better follows a prompt::

    judge.judge(prompt, image_a, image_b) -> "a" | "b" | "tie" | None (failed) | other text
    judge.judge_batch([(prompt, image_a, image_b), ...]) -> one answer per query

``image_a`` / ``image_b`` are float tensors [3, H, W] in [0, 1]. :func:`win_rates` always calls
``judge_batch``; the base class loops over ``judge``, an HTTP multimodal-LLM judge sends the
queries concurrently. Free-text answers are mapped with :func:`parse_verdict`.

**Win-rate transform**: in a group of G images of one prompt all G(G-1)/2 pairs are judged; a win
gives 1 to the winner and 0 to the loser, a tie 0.5 to each. A query answered None or with text
:func:`parse_verdict` cannot read has **failed**: it is excluded (not a tie) and counted in the
stats' ``failed``. r_i = credit_i / judged_i over the judged queries involving image i, so with
no failures r_i = wins_i / (G - 1); an image none of whose pairs was judged gets NaN (the trainer
drops it), a member of a singleton group 0.5. The trainer then z-scores r within the group as usual.
The reference judges every pair once in a fixed order (i < j: the lower index is image "a");
``swap=True`` judges both orders (each order then weighs half a pair), removing position bias at
twice the cost.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from flowgrpo.images import to_uint8

from .base import RewardOutput

VERDICTS = ("a", "b", "tie")


class PairwiseJudge(Protocol):
    """Compares two images for one prompt; see the module docstring for the answer protocol."""

    def judge(self, prompt: str, image_a: Tensor, image_b: Tensor) -> str | None: ...

    def judge_batch(self, queries: Sequence[tuple[str, Tensor, Tensor]]) -> list[str | None]: ...


class PairwiseJudgeBase(ABC):
    """Base class of pairwise judges: implement :meth:`judge`; :meth:`judge_batch` loops over it
    (override it to answer many queries at once)."""

    @abstractmethod
    def judge(self, prompt: str, image_a: Tensor, image_b: Tensor) -> str | None:
        """"a" if ``image_a`` follows ``prompt`` better, "b" if ``image_b`` does, "tie", or None (failed)."""

    def judge_batch(self, queries: Sequence[tuple[str, Tensor, Tensor]]) -> list[str | None]:
        """One answer per (prompt, image_a, image_b) query, in order."""
        return [self.judge(p, a, b) for p, a, b in queries]


_ALIASES = {
    "a": "a", "image a": "a", "first": "a", "1": "a", "image 1": "a", "left": "a",
    "b": "b", "image b": "b", "second": "b", "2": "b", "image 2": "b", "right": "b",
    "tie": "tie", "equal": "tie", "same": "tie", "draw": "tie", "both": "tie", "neither": "tie",
}


def parse_verdict(answer) -> str | None:
    """Map a judge's answer to "a" | "b" | "tie", or None when it cannot be parsed.

    Accepts the canonical answers and a few common spellings ("Image A", "first", "2", "equal"),
    case- and punctuation-insensitive. A free-text answer is searched for a line such as
    "Answer: B" or "Answer: Image 2"; anything ambiguous is unparseable (None), which the win rate
    excludes as a failed query.
    """
    if not isinstance(answer, str):
        return None
    text = answer.strip().lower()
    norm = re.sub(r"[^a-z0-9 ]+", " ", text)
    norm = re.sub(r"\s+", " ", norm).strip()
    if norm in _ALIASES:
        return _ALIASES[norm]
    m = re.findall(r"(?:answer|verdict|winner|better)\s*(?:is)?\s*[:=]?\s*(image [ab12]|[ab12]|tie)\b", norm)
    if m and len(set(m)) == 1:
        return _ALIASES[m[0]]
    return None


_CREDIT = {"a": (1.0, 0.0), "b": (0.0, 1.0), "tie": (0.5, 0.5)}  # (credit to image a, to image b)


def _ask(judge: PairwiseJudge, queries: list[tuple[str, Tensor, Tensor]]) -> tuple[list[str | None], int]:
    """Parsed verdicts (None: failed) and how many answers were text that could not be parsed."""
    if not queries:
        return [], 0
    answers = list(judge.judge_batch(queries))
    if len(answers) != len(queries):
        raise ValueError(f"judge_batch returned {len(answers)} answers for {len(queries)} pairs")
    verdicts = [parse_verdict(a) for a in answers]
    return verdicts, sum(v is None and a is not None for a, v in zip(answers, verdicts))


def win_rates(images: Tensor, prompts: Sequence[str], groups: Tensor | None, judge: PairwiseJudge,
              swap: bool = False) -> tuple[Tensor, dict]:
    """Per-image win rate within its group over the judged queries (failed ones are excluded).

    Args:
        images: [L, 3, H, W] in [0, 1]; prompts: [L]; groups: [L] long group ids (None: group by prompt).
        judge: a :class:`PairwiseJudge`. swap: judge both orders of every pair.

    Returns: (rates [L] float32 in [0, 1]: NaN for an image with no judged query, 0.5 for a member
    of a singleton group; stats with ``pairs``, ``queries``, ``judged``, ``ties``, ``failed``
    (queries answered None or unparseably; ``unparseable`` counts the latter), ``position_bias``
    (fraction of judged queries answered "a" minus the fraction answered "b") and per-image
    ``ties_per_image`` / ``failed_per_image`` arrays [L]).
    """
    n = len(prompts)
    if groups is None:
        ids: dict[str, int] = {}
        groups = torch.tensor([ids.setdefault(p, len(ids)) for p in prompts], dtype=torch.long)
    groups = torch.as_tensor(groups).long().cpu()
    if groups.shape != (n,) or images.shape[0] != n:
        raise ValueError(f"images ({images.shape[0]}), prompts ({n}) and groups ({tuple(groups.shape)}) disagree")
    pairs: list[tuple[int, int]] = []
    for g in groups.unique().tolist():
        members = (groups == g).nonzero(as_tuple=True)[0].tolist()
        pairs += [(i, j) for k, i in enumerate(members) for j in members[k + 1:]]
    order = pairs + ([(j, i) for i, j in pairs] if swap else [])  # (image "a", image "b") of each query
    verdicts, unparseable = _ask(judge, [(prompts[i], images[i], images[j]) for i, j in order])
    credit, judged, ties, failed = (np.zeros(n) for _ in range(4))
    for (i, j), v in zip(order, verdicts):
        if v is None:
            failed[[i, j]] += 1
            continue
        ci, cj = _CREDIT[v]
        credit[i] += ci
        credit[j] += cj
        judged[[i, j]] += 1
        ties[[i, j]] += v == "tie"
    size = torch.bincount(groups)[groups].numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        rates = np.where(size > 1, np.where(judged > 0, credit / judged, np.nan), 0.5)
    ok = [v for v in verdicts if v is not None]
    stats = {
        "pairs": len(pairs),
        "queries": len(verdicts),
        "judged": len(ok),
        "ties": sum(v == "tie" for v in ok),
        "failed": len(verdicts) - len(ok),
        "unparseable": unparseable,
        "position_bias": (sum(v == "a" for v in ok) - sum(v == "b" for v in ok)) / max(1, len(ok)),
        "ties_per_image": ties,
        "failed_per_image": failed,
    }
    return torch.tensor(rates, dtype=torch.float32), stats


class PairwiseReward:
    """A reward whose score is the win rate of each leaf within its group (it needs ``groups``).

    The trainer calls ``reward(images, prompts, groups=leaf_group_ids)``. Components (for logging):
    per sample the number of tied and of failed queries that involved it (``ties``, ``failed``), and
    the batch's ``position_bias``.
    """

    name = "pairwise"

    def __init__(self, judge: PairwiseJudge, swap: bool = False):
        self.judge = judge
        self.swap = swap

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        rates, stats = win_rates(images, prompts, groups, self.judge, self.swap)
        comps = {"ties": torch.as_tensor(stats["ties_per_image"], dtype=torch.float32),
                 "failed": torch.as_tensor(stats["failed_per_image"], dtype=torch.float32),
                 "position_bias": torch.full((len(rates),), float(stats["position_bias"]))}
        return RewardOutput(rates, comps)


# --------------------------------------------------------------------------- the shapes world's judge


class ShapesPairwiseJudge(PairwiseJudgeBase):
    """Judges two shapes-world images against the prompt's spec with the verifier's partial credit
    (:func:`flowgrpo.shapes.verify.verify`): the higher score wins; scores within ``tol`` tie.
    A prompt that is not a shapes prompt cannot be verified: neither image is better, a "tie".
    """

    def __init__(self, tol: float = 1e-9):
        self.tol = tol
        self._cache: dict = {}

    def score(self, prompt: str, image: Tensor) -> float:
        from flowgrpo.shapes.prompts import parse_prompt
        from flowgrpo.shapes.verify import verify

        return float(verify(parse_prompt(prompt), to_uint8(image))["score"])

    def judge(self, prompt: str, image_a: Tensor, image_b: Tensor) -> str:
        try:
            sa, sb = self._score_cached(prompt, image_a), self._score_cached(prompt, image_b)
        except ValueError:
            return "tie"
        if abs(sa - sb) <= self.tol:
            return "tie"
        return "a" if sa > sb else "b"

    def _score_cached(self, prompt: str, image: Tensor) -> float:
        # each image takes part in G - 1 pairs; parse it once per call of the reward
        key = (prompt, image.data_ptr(), image.storage_offset(), tuple(image.shape))
        if key not in self._cache:
            self._cache[key] = self.score(prompt, image)
        return self._cache[key]

    def judge_batch(self, queries):
        """Answers every query, scoring each image once (the score cache lives for one batch)."""
        try:
            return super().judge_batch(queries)
        finally:
            self._cache.clear()


class ShapesPairwiseReward(PairwiseReward):
    """Pref-GRPO on the shapes world: win rate under :class:`ShapesPairwiseJudge` (one order per pair)."""

    name = "shapes_pairwise"
    images_of = "shapes"  # see ShapesReward.images_of

    def __init__(self, swap: bool = False):
        super().__init__(ShapesPairwiseJudge(), swap=swap)
