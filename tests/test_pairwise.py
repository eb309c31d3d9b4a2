"""Pref-GRPO pairwise rewards: win rates with ties and failed (unparseable) answers, order swapping, the shapes judge."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flowgrpo.rewards import REWARDS, build_reward
from flowgrpo.rewards.pairwise import (PairwiseJudgeBase, PairwiseReward, ShapesPairwiseJudge, parse_verdict,
                                       win_rates)
from flowgrpo.shapes.prompts import parse_prompt
from flowgrpo.shapes.world import render
from flowgrpo.trainer.trainer import Trainer

torch.set_num_threads(1)


def tagged(ids):
    """Images [n, 3, 4, 4] whose pixel (0, 0, 0) encodes an id (a judge can read who is who)."""
    imgs = torch.zeros(len(ids), 3, 4, 4)
    for k, i in enumerate(ids):
        imgs[k, 0, 0, 0] = i / 100
    return imgs


def ident(img):
    return int(round(float(img[0, 0, 0]) * 100))


class TableJudge(PairwiseJudgeBase):
    """Answers from a table keyed by (id of image a, id of image b); records every query."""

    def __init__(self, table):
        self.table = table
        self.queries = []

    def judge(self, prompt, image_a, image_b):
        a, b = ident(image_a), ident(image_b)
        self.queries.append((prompt, a, b))
        return self.table[(a, b)]


def test_parse_verdict():
    for text, want in [("a", "a"), (" B ", "b"), ("TIE", "tie"), ("Image A", "a"), ("image 2", "b"),
                       ("equal", "tie"), ("Answer: B", "b"), ("The better image is: A.", None),
                       ("winner: image b", "b"), ("answer: a, no wait answer: b", None), ("", None),
                       ("Answer: Image 2", "b"), ("answer: 1", "a"),
                       ("maybe", None), (None, None), (3, None)]:
        assert parse_verdict(text) == want, text


def test_win_rates_ties_and_failed_queries():
    # group of G = 4 (ids 0..3), all 6 pairs judged once with the lower index as image "a"
    table = {(0, 1): "a", (0, 2): "tie", (0, 3): "a", (1, 2): "b", (1, 3): "I cannot decide", (2, 3): "a"}
    judge = TableJudge(table)
    rates, stats = win_rates(tagged([0, 1, 2, 3]), ["p"] * 4, torch.zeros(4, dtype=torch.long), judge)
    # the unparseable (1, 3) is excluded, not a tie: credit / judged queries of each image
    # 0: (1 + .5 + 1) / 3; 1: (0 + 0) / 2; 2: (.5 + 1 + 1) / 3; 3: (0 + 0) / 2
    torch.testing.assert_close(rates, torch.tensor([2.5 / 3, 0.0, 2.5 / 3, 0.0]))
    assert sorted((a, b) for _, a, b in judge.queries) == sorted(table)
    assert stats["pairs"] == 6 and stats["judged"] == 5 and stats["ties"] == 1
    assert stats["failed"] == 1 and stats["unparseable"] == 1
    assert stats["failed_per_image"].tolist() == [0, 1, 0, 1]
    # with every answer readable each pair hands out exactly one point
    table[(1, 3)] = "tie"
    full, st = win_rates(tagged([0, 1, 2, 3]), ["p"] * 4, None, TableJudge(table))
    torch.testing.assert_close(full, torch.tensor([2.5, 0.5, 2.5, 0.5]) / 3)
    assert float(full.mean()) == pytest.approx(0.5) and st["failed"] == 0 and st["ties"] == 2


def test_failed_queries_are_dropped_not_ties():
    # None (the judge gave up after retries) and unreadable text both fail; an image whose every
    # query failed gets NaN (the trainer drops it), a singleton group still 0.5
    table = {(0, 1): None, (0, 2): "??", (1, 2): "b", (3, 4): "b"}
    rates, stats = win_rates(tagged(range(6)), ["p"] * 3 + ["q"] * 2 + ["r"], None, TableJudge(table))
    assert torch.isnan(rates[0]) and not torch.isnan(rates[1:]).any()
    torch.testing.assert_close(rates[1:], torch.tensor([0.0, 1.0, 0.0, 1.0, 0.5]))
    assert stats["failed"] == 2 and stats["unparseable"] == 1 and stats["judged"] == 2
    out = PairwiseReward(TableJudge(table))(tagged(range(6)), ["p"] * 3 + ["q"] * 2 + ["r"])
    assert out.components["failed"].tolist() == [2, 1, 1, 0, 0, 0]


def test_groups_are_judged_separately():
    judge = TableJudge({(a, b): "a" for a in range(10) for b in range(10)})
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    rates, stats = win_rates(tagged(range(6)), ["x", "x", "x", "y", "y", "z"], groups, judge)
    assert stats["pairs"] == 3 + 1 + 0 and len(judge.queries) == 4
    assert all(groups[a] == groups[b] for _, a, b in judge.queries)
    torch.testing.assert_close(rates, torch.tensor([1.0, 0.5, 0.0, 1.0, 0.0, 0.5]))  # singleton: 0.5
    # without group ids the prompt decides the group
    judge2 = TableJudge(judge.table)
    rates2, _ = win_rates(tagged(range(6)), ["x", "x", "x", "y", "y", "z"], None, judge2)
    torch.testing.assert_close(rates2, rates)


def test_order_swapping_removes_position_bias():
    # a judge that always prefers the first image it is shown
    always_a = TableJudge({(a, b): "a" for a in range(4) for b in range(4)})
    biased, st = win_rates(tagged(range(4)), ["p"] * 4, None, always_a)
    torch.testing.assert_close(biased, torch.tensor([3.0, 2.0, 1.0, 0.0]) / 3)
    assert st["position_bias"] == 1.0
    swapped = TableJudge(always_a.table)
    fair, st2 = win_rates(tagged(range(4)), ["p"] * 4, None, swapped, swap=True)
    torch.testing.assert_close(fair, torch.full((4,), 0.5))
    assert len(swapped.queries) == 12 and {(b, a) for _, a, b in swapped.queries} == {(a, b) for _, a, b in swapped.queries}
    # a consistent judge (higher id wins) gives the same win rates in both modes
    table = {(a, b): ("a" if a > b else "b") for a in range(4) for b in range(4) if a != b}
    one, _ = win_rates(tagged(range(4)), ["p"] * 4, None, TableJudge(table))
    two, _ = win_rates(tagged(range(4)), ["p"] * 4, None, TableJudge(table), swap=True)
    torch.testing.assert_close(one, two)
    torch.testing.assert_close(one, torch.tensor([0.0, 1.0, 2.0, 3.0]) / 3)
    # swap with an unparseable answer in one order: that order is excluded, the other still counts
    table[(0, 3)] = "??"
    mixed, st3 = win_rates(tagged(range(4)), ["p"] * 4, None, TableJudge(table), swap=True)
    torch.testing.assert_close(mixed, one)
    assert st3["unparseable"] == 1 and st3["failed"] == 1 and st3["judged"] == 11


def test_judge_batch_is_used():
    class Batched(PairwiseJudgeBase):
        def __init__(self):
            self.calls = 0

        def judge(self, prompt, a, b):
            raise AssertionError("judge_batch should be used")

        def judge_batch(self, queries):
            self.calls += 1
            return ["b"] * len(queries)

    j = Batched()
    rates, _ = win_rates(tagged(range(3)), ["p"] * 3, None, j, swap=True)
    assert j.calls == 1
    torch.testing.assert_close(rates, torch.full((3,), 0.5))
    rates, _ = win_rates(tagged(range(3)), ["p"] * 3, None, j)
    torch.testing.assert_close(rates, torch.tensor([0.0, 0.5, 1.0]))


def _img(arr):
    return torch.from_numpy(arr).permute(2, 0, 1).float() / 255


def test_shapes_judge_and_reward():
    prompt = "two red circles"
    good = _img(render(parse_prompt(prompt), np.random.default_rng(0)))
    other = _img(render(parse_prompt("a blue square"), np.random.default_rng(1)))
    blank = torch.zeros_like(good)
    judge = ShapesPairwiseJudge()
    assert judge.judge(prompt, good, blank) == "a"
    assert judge.judge(prompt, blank, good) == "b"
    assert judge.judge(prompt, blank, blank.clone()) == "tie"
    assert judge.judge("a photo of a cat", good, blank) == "tie"  # not a shapes prompt: no preference
    reward = build_reward("shapes_pairwise")
    assert "shapes_pairwise" in REWARDS.names()
    images = torch.stack([good, other, blank, good, blank])
    prompts = [prompt] * 3 + ["a photo of a cat"] * 2
    out = reward(images, prompts, groups=torch.tensor([0, 0, 0, 1, 1]))
    # group 0: good beats other and blank; other (a blue square: no red circle, one object) vs blank
    assert float(out.scores[0]) == 1.0 and float(out.scores[1:3].sum()) == pytest.approx(0.5)  # 3 points / 2
    torch.testing.assert_close(out.scores[3:], torch.full((2,), 0.5))  # unverifiable prompt -> ties
    assert set(out.components) >= {"ties", "failed"}
    assert out.components["ties"].tolist() == [0, 1, 1, 1, 1] and not out.components["failed"].any()
    # the trainer hands the leaves' group ids to every reward
    trainer = SimpleNamespace(rewards={"shapes_pairwise": reward}, cfg=SimpleNamespace(reward=SimpleNamespace(frame_stride=1)))
    scores, comps = Trainer.score(trainer, images, prompts, torch.tensor([0, 0, 0, 1, 1]))
    torch.testing.assert_close(scores["shapes_pairwise"], out.scores)
    assert "shapes_pairwise.failed" in comps


def test_pairwise_reward_wraps_any_judge():
    r = PairwiseReward(TableJudge({(a, b): "a" if a < b else "b" for a in range(3) for b in range(3)}), swap=True)
    out = r(tagged(range(3)), ["p"] * 3, groups=torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 0.5, 0.0]))
