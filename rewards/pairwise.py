"""Pairwise preference rewards (Pref-GRPO, DESIGN §4): judge pairs within a group, reward = win rate.

A **pairwise judge** answers which of two images better follows a prompt::

    judge.judge(prompt, image_a, image_b) -> "a" | "b" | "tie" | anything else (unparseable)

``image_a`` / ``image_b`` are float tensors [3, H, W] in [0, 1]. A judge may also offer
``judge_batch(list of (prompt, image_a, image_b)) -> list of answers`` to answer many pairs at once
(an HTTP multimodal-LLM judge sends them concurrently); :func:`win_rates` uses it when present.
Free-text answers can be mapped with :func:`parse_verdict`.

**Win-rate transform**: in a group of G images of one prompt all G(G-1)/2 pairs are judged; a win
gives 1 to the winner and 0 to the loser, a tie or an unparseable answer 0.5 to each, and
r_i = wins_i / (G - 1). The trainer then z-scores r within the group as usual. The reference judges
every pair once in a fixed order (i < j: the lower index is image "a"); ``swap=True`` judges both
orders and averages the two credits, removing position bias at twice the cost.
"""

from __future__ import annotations

import re
from typing import Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from .base import REWARDS, RewardOutput

VERDICTS = ("a", "b", "tie")


class PairwiseJudge(Protocol):
    """Compares two images for one prompt; see the module docstring for the answer protocol."""

    def judge(self, prompt: str, image_a: Tensor, image_b: Tensor) -> str: ...


_ALIASES = {
    "a": "a", "image a": "a", "first": "a", "1": "a", "image 1": "a", "left": "a",
    "b": "b", "image b": "b", "second": "b", "2": "b", "image 2": "b", "right": "b",
    "tie": "tie", "equal": "tie", "same": "tie", "draw": "tie", "both": "tie", "neither": "tie",
}


def parse_verdict(answer) -> str | None:
    """Map a judge's answer to "a" | "b" | "tie", or None when it cannot be parsed.

    Accepts the canonical answers and a few common spellings ("Image A", "first", "2", "equal"),
    case- and punctuation-insensitive. A free-text answer is searched for a final line such as
    "Answer: B"; anything ambiguous is unparseable (None), which the win rate counts as a tie.
    """
    if not isinstance(answer, str):
        return None
    text = answer.strip().lower()
    norm = re.sub(r"[^a-z0-9 ]+", " ", text)
    norm = re.sub(r"\s+", " ", norm).strip()
    if norm in _ALIASES:
        return _ALIASES[norm]
    m = re.findall(r"(?:answer|verdict|winner|better)\s*(?:is)?\s*[:=]?\s*(image a|image b|a|b|tie)\b", norm)
    if m and len(set(m)) == 1:
        return _ALIASES[m[0]]
    return None


def _credit(verdict: str | None) -> tuple[float, float]:
    """(credit to image a, credit to image b) for one verdict."""
    if verdict == "a":
        return 1.0, 0.0
    if verdict == "b":
        return 0.0, 1.0
    return 0.5, 0.5  # tie or unparseable


def _ask(judge, queries: list[tuple[str, Tensor, Tensor]]) -> list[str | None]:
    if not queries:
        return []
    if hasattr(judge, "judge_batch"):
        answers = list(judge.judge_batch(queries))
        if len(answers) != len(queries):
            raise ValueError(f"judge_batch returned {len(answers)} answers for {len(queries)} pairs")
    else:
        answers = [judge.judge(p, a, b) for p, a, b in queries]
    return [parse_verdict(a) for a in answers]


def win_rates(images: Tensor, prompts: Sequence[str], groups: Tensor | None, judge: PairwiseJudge,
              swap: bool = False) -> tuple[Tensor, dict]:
    """Per-image win rate within its group.

    Args:
        images: [L, 3, H, W] in [0, 1]; prompts: [L]; groups: [L] long group ids (None: group by prompt).
        judge: a :class:`PairwiseJudge`. swap: judge both orders of every pair and average.

    Returns: (rates [L] float32 in [0, 1]; a member of a singleton group gets 0.5, stats with
    ``pairs`` judged, ``ties`` and ``unparseable`` counts and ``position_bias`` (fraction of
    judged queries answered "a" minus the fraction answered "b")).
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
    queries = [(prompts[i], images[i], images[j]) for i, j in pairs]
    if swap:
        queries += [(prompts[i], images[j], images[i]) for i, j in pairs]
    verdicts = _ask(judge, queries)
    wins = np.zeros(n)
    for k, (i, j) in enumerate(pairs):
        ci, cj = _credit(verdicts[k])
        if swap:  # second query has j as "a"
            cj2, ci2 = _credit(verdicts[len(pairs) + k])
            ci, cj = (ci + ci2) / 2, (cj + cj2) / 2
        wins[i] += ci
        wins[j] += cj
    size = torch.bincount(groups)[groups].numpy()
    rates = np.where(size > 1, wins / np.maximum(size - 1, 1), 0.5)
    stats = {
        "pairs": len(pairs),
        "ties": sum(v == "tie" for v in verdicts),
        "unparseable": sum(v is None for v in verdicts),
        "position_bias": (sum(v == "a" for v in verdicts) - sum(v == "b" for v in verdicts)) / max(1, len(verdicts)),
    }
    return torch.tensor(rates, dtype=torch.float32), stats


class PairwiseReward:
    """A reward whose score is the win rate of each leaf within its group (it needs ``groups``).

    The trainer calls ``reward(images, prompts, groups=leaf_group_ids)``. Components (per sample, for
    logging): the number of unparseable answers and ties that involved the sample.
    """

    name = "pairwise"

    def __init__(self, judge: PairwiseJudge, swap: bool = False):
        self.judge = judge
        self.swap = swap

    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        rates, stats = win_rates(images, prompts, groups, self.judge, self.swap)
        n = len(rates)
        comps = {k: torch.full((n,), float(stats[k])) for k in ("ties", "unparseable", "position_bias")}
        return RewardOutput(rates, comps)


# --------------------------------------------------------------------------- the shapes world's judge


class ShapesPairwiseJudge:
    """Judges two shapes-world images against the prompt's spec with the verifier's partial credit
    (:func:`flowgrpo.shapes.verify.verify`): the higher score wins; scores within ``tol`` tie.
    A prompt that is not a shapes prompt gets an unparseable answer ("?"), i.e. a tie.
    """

    def __init__(self, tol: float = 1e-9):
        self.tol = tol
        self._cache: dict = {}

    def score(self, prompt: str, image: Tensor) -> float:
        from flowgrpo.shapes.prompts import parse_prompt
        from flowgrpo.shapes.verify import verify

        arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
        return float(verify(parse_prompt(prompt), arr)["score"])

    def judge(self, prompt: str, image_a: Tensor, image_b: Tensor) -> str:
        try:
            sa, sb = self._score_cached(prompt, image_a), self._score_cached(prompt, image_b)
        except ValueError:
            return "?"
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
        try:
            return [self.judge(p, a, b) for p, a, b in queries]
        finally:
            self._cache.clear()


@REWARDS.register("shapes_pairwise")
class ShapesPairwiseReward(PairwiseReward):
    """Pref-GRPO on the shapes world: win rate under :class:`ShapesPairwiseJudge` (one order per pair)."""

    name = "shapes_pairwise"

    def __init__(self, swap: bool = False):
        super().__init__(ShapesPairwiseJudge(), swap=swap)
