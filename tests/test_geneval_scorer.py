"""GenEval's scorer (flowgrpo.rewards.geneval.scorer) against an independent re-derivation of the official
rules, on random detection sets of every tag, plus hand-written cases whose official verdict was read off
djghosh13/geneval evaluation/evaluate_images.py (commit af4902f, ``ei:N`` = its line N) and
yifan123/reward-server reward_server/gen_eval.py (commit 92ac29f, ``rs:N``).

The reference below is written apart from the implementation: Python floats (float64) and explicit loops
over lists, where the implementation is vectorised numpy over pairs. Its tie rule is "equal scores: later
row first" (numpy 1.23's argsort is stable for up to 16 values), so random sets with more rows than that
draw distinct scores; the tie order beyond 16 rows is checked on its own against numpy 1.23.5's argsort.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from flowgrpo.rewards.geneval import COLOURS, evaluate_detections, reward_server_scores
from flowgrpo.rewards.geneval.order import _heapsort, descending_order, numpy123_argsort

CLASSES = ("cat", "dog", "tv remote", "cup")
SEEDS = (0, 1, 2, 3)
CASES_PER_SEED = 1500  # x 4 seeds = 6000 random detection sets, each judged under two rule settings


# --------------------------------------------------------------------------- the independent reference


def ref_order(scores: list[float]) -> list[int]:
    """Most confident first; equal scores later row first; NaN (never kept) first, as numpy sorts it last."""
    return sorted(range(len(scores)), key=lambda i: (-math.inf if scores[i] != scores[i] else -scores[i], -i))


def ref_iou(a, b) -> float:
    def area(x1, y1, x2, y2):
        return max(x2 - x1 + 1, 0) * max(y2 - y1 + 1, 0)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a[:4]) + area(*b[:4]) - inter
    return inter / union if union else 0


def ref_relations(a, b, t) -> set:
    def sign(v):
        return 1.0 if v > 0 else (-1.0 if v < 0 else 0.0)

    ox = (a[0] + a[2]) / 2 - (b[0] + b[2]) / 2
    oy = (a[1] + a[3]) / 2 - (b[1] + b[3]) / 2
    rx = max(abs(ox) - t * (abs(a[2] - a[0]) + abs(b[2] - b[0])), 0.0) * sign(ox)
    ry = max(abs(oy) - t * (abs(a[3] - a[1]) + abs(b[3] - b[1])), 0.0) * sign(oy)
    out = set()
    if abs(rx) < 1e-3 and abs(ry) < 1e-3:
        return out
    length = math.sqrt(ox * ox + oy * oy)
    for name, hit in (("left of", rx / length < -0.5), ("right of", rx / length > 0.5),
                      ("above", ry / length < -0.5), ("below", ry / length > 0.5)):
        if hit:
            out.add(name)
    return out


def ref_kept(meta, dets, thr=0.3, cthr=0.9, cap=16, nms=1.0) -> dict[str, list[list[float]]]:
    bar = cthr if meta["tag"] == "counting" else thr
    kept = {}
    for name, arr in dets.items():
        rows = [[float(v) for v in r] for r in np.asarray(arr).reshape(-1, 5)]
        todo = [i for i in ref_order([r[4] for r in rows]) if rows[i][4] > bar][:cap]
        keep = []
        while todo:
            best = todo.pop(0)
            keep.append(rows[best])
            if nms != 1:
                todo = [i for i in todo if ref_iou(rows[best], rows[i]) < nms]
        if keep:
            kept[name] = keep
    return kept


def ref_geneval(meta, dets, colour_fn, t=0.1, **sel):
    objects = ref_kept(meta, dets, **sel)
    ok, why, groups = True, [], []
    for clause in meta.get("include", []):
        name, n = clause["class"], clause["count"]
        found = objects.get(name, [])[:n]
        good = len(found) >= n
        if not good:
            why.append(f"expected {name}>={n}, found {len(found)}")
        if good and "color" in clause:
            cols = [colour_fn(name, r) for r in found]
            if cols.count(clause["color"]) < n:
                good = False
                tally = [f"{cols.count(c)} {c}" for c in COLOURS if c in cols]
                why.append(f"expected {clause['color']} {name}>={n}, found {cols.count(clause['color'])} "
                           f"{clause['color']}; and " + ", ".join(tally))
        if good and "position" in clause:
            rel, g = clause["position"]
            if groups[g] is None:
                good = False
                why.append(f"no target for {name} to be {rel}")
            else:
                pairs = [(a, b) for a in found for b in groups[g]]
                for a, b in pairs:
                    rels = ref_relations(a, b, t)
                    if rel not in rels:
                        good = False
                        why.append(f"expected {name} {rel} target, found {' and '.join(rels)} target")
                        break
        ok = ok and good
        groups.append(found if good else None)
    for clause in meta.get("exclude", []):
        n = len(objects.get(clause["class"], []))
        if n >= clause["count"]:
            ok = False
            why.append(f"expected {clause['class']}<{clause['count']}, found {n}")
    return ok, "\n".join(why)


def ref_server(meta, dets, colour_fn, t=0.1, **sel):
    objects = ref_kept(meta, dets, **sel)
    ok, why, groups, credit = True, [], [], []
    for clause in meta.get("include", []):
        name, n = clause["class"], clause["count"]
        found = objects.get(name, [])
        credit.append(1 - abs(n - len(found)) / n)
        good = len(found) == n
        if not good:
            why.append(f"expected {name}=={n}, found {len(found)}")
            if "color" in clause or "position" in clause:
                credit.append(0.0)
        if good and "color" in clause:
            cols = [colour_fn(name, r) for r in found]
            k = cols.count(clause["color"])
            credit.append(1 - abs(n - k) / n)
            if k != n:
                good = False
                tally = [f"{cols.count(c)} {c}" for c in COLOURS if c in cols]
                why.append(f"expected {clause['color']} {name}>={n}, found {k} {clause['color']}; and " + ", ".join(tally))
        if good and "position" in clause:
            rel, g = clause["position"]
            if groups[g] is None:
                good = False
                why.append(f"no target for {name} to be {rel}")
                credit.append(0.0)
            else:
                for a, b in [(a, b) for a in found for b in groups[g]]:
                    rels = ref_relations(a, b, t)
                    if rel not in rels:
                        good = False
                        why.append(f"expected {name} {rel} target, found {' and '.join(rels)} target")
                        credit.append(0.0)
                        break
                credit.append(1.0)
        ok = ok and good
        groups.append(found if good else None)
    return ok, (sum(credit) / len(credit) if credit else 0), "\n".join(why)


# --------------------------------------------------------------------------- random cases


def colour_of_row(name, row) -> str:
    """A colour that is a function of the row's values (so both sides see the same colours)."""
    return COLOURS[int(abs(row[0]) * 2 + abs(row[1]) * 3 + (0 if row[4] != row[4] else round(row[4] * 20))) % 10]


def colour_of_rows(name, rows):
    return [colour_of_row(name, [float(v) for v in r]) for r in rows]


TIE_SCORES = (0.1, 0.3, 0.5, 0.89, 0.9, 0.95, 1.0)


def random_rows(rng, n: int) -> np.ndarray:
    """n rows on a half-pixel grid: zero-size and reversed boxes, tied scores and scores exactly on the
    thresholds (up to 16 rows), distinct scores above 16 rows, now and then a NaN score."""
    x1, y1 = rng.integers(0, 64, n) / 2, rng.integers(0, 64, n) / 2
    w, h = rng.choice([0, 0.5, 1, 2.5, 5, 10, 20], n), rng.choice([0, 0.5, 1, 2.5, 5, 10, 20], n)
    flip = rng.random(n) < 0.05
    x2 = np.where(flip, x1 - w, x1 + w)
    if n > 16:
        s = rng.permutation(np.linspace(0.25, 1.0, n))
    else:
        s = rng.choice(TIE_SCORES, n) if rng.random() < 0.7 else rng.random(n)
        if n and rng.random() < 0.05:
            s[rng.integers(n)] = np.nan
    return np.stack([x1, y1, x2, y1 + h, s], axis=1)


def margin_pair(rng) -> dict[str, np.ndarray]:
    """A cat and a dog whose centre offset sits exactly on the 0.1 x (sum of sizes) margin on one axis, or
    whose shrunk offset over the offset length is exactly 0.5 (a 3-4-5 triangle)."""
    if rng.random() < 0.5:
        size = rng.choice([5.0, 10.0, 20.0])  # 0.1 * size is exact in float64
        off = 0.1 * size * rng.choice([-1, 1])
        dog = [10.0, 10.0, 10.0 + size, 10.0 + size]
        cat = [dog[0] + off, 10.0 + rng.choice([0.0, 4.0]), dog[0] + off, 10.0 + rng.choice([0.0, 4.0])]
        cat[2] = cat[0]
        cat = [cat[0] + size / 2, cat[1] + size / 2, cat[2] + size / 2, cat[3] + size / 2]
    else:
        dog, sx = [0.0, 0.0, 0.0, 0.0], rng.choice([-1, 1])
        cat = [sx * 3 - 2.5, 4.0, sx * 3 + 2.5, 4.0]  # centre (3, 4), width 5: shrunk x / length = 0.5
    return {"cat": np.array([cat + [0.95]]), "dog": np.array([dog + [0.95]])}


def random_metadata(rng) -> dict:
    tag = ("single_object", "two_object", "counting", "colors", "position", "color_attr")[rng.integers(6)]
    a, b = rng.choice(len(CLASSES), 2, replace=False)
    a, b = CLASSES[a], CLASSES[b]
    colour = lambda: COLOURS[rng.integers(len(COLOURS))]  # noqa: E731
    if tag == "single_object":
        return {"tag": tag, "include": [{"class": a, "count": 1}]}
    if tag == "two_object":
        return {"tag": tag, "include": [{"class": a, "count": 1}, {"class": b, "count": 1}]}
    if tag == "counting":
        n = int(rng.integers(1, 5))
        return {"tag": tag, "include": [{"class": a, "count": n}], "exclude": [{"class": a, "count": n + 1}]}
    if tag == "colors":
        return {"tag": tag, "include": [{"class": a, "count": int(rng.integers(1, 3)), "color": colour()}]}
    if tag == "position":
        rel = ("left of", "right of", "above", "below")[rng.integers(4)]
        return {"tag": tag, "include": [{"class": b, "count": int(rng.integers(1, 3))},
                                        {"class": a, "count": int(rng.integers(1, 3)), "position": [rel, 0]}]}
    return {"tag": tag, "include": [{"class": a, "count": 1, "color": colour()}, {"class": b, "count": 1, "color": colour()}]}


SETTINGS = ({}, {"nms_threshold": 0.5, "max_objects": 3}, {"threshold": 0.5, "nms_threshold": 0.0},
            {"position_threshold": 0.25, "counting_threshold": 0.5}, {"position_threshold": 0.0})


def random_case(rng):
    meta = random_metadata(rng)
    if meta["tag"] == "position" and rng.random() < 0.15:
        dets = margin_pair(rng)
        meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                               {"class": "cat", "count": 1, "position": [meta["include"][1]["position"][0], 0]}]}
    else:
        dets = {}
        for name in CLASSES:
            n = int(rng.choice([0, 1, 1, 2, 2, 3, 4, 6, 17, 24])) if rng.random() < 0.9 else 0
            if n or rng.random() < 0.5:  # an absent class, or one with an empty [0, 5] array
                dets[name] = random_rows(rng, n)
    settings = SETTINGS[rng.integers(len(SETTINGS))]
    return meta, dets, settings


def _split(settings):
    sel = {k: v for k, v in settings.items() if k != "position_threshold"}
    ref_sel = {"thr": sel.get("threshold", 0.3), "cthr": sel.get("counting_threshold", 0.9),
               "cap": sel.get("max_objects", 16), "nms": sel.get("nms_threshold", 1.0)}
    return ref_sel, settings.get("position_threshold", 0.1)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_detection_sets_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    tags, correct = {}, 0
    for _ in range(CASES_PER_SEED):
        meta, dets, settings = random_case(rng)
        ref_sel, t = _split(settings)
        for kw, ref_kw in ((settings, dict(ref_sel, t=t)), ({}, {})):  # the case's setting and the defaults
            got = evaluate_detections(meta, dets, colour_of_rows, **kw)
            want = ref_geneval(meta, dets, colour_of_row, **ref_kw)
            assert got == want, (meta, dets, kw)
            server = reward_server_scores(meta, dets, colour_of_rows, **kw)
            ok, score, why = ref_server(meta, dets, colour_of_row, **ref_kw)
            assert (server.strict, server.reason) == (ok, why) and server.score == pytest.approx(score, abs=1e-12)
            correct += got[0]
        tags[meta["tag"]] = tags.get(meta["tag"], 0) + 1
    # every tag drawn many times, and both verdicts common (the cases are not all trivially wrong)
    assert len(tags) == 6 and min(tags.values()) > CASES_PER_SEED // 10
    assert 0.1 < correct / (2 * CASES_PER_SEED) < 0.9


# --------------------------------------------------------------------------- tie order beyond 16 rows


def tie_arrays():
    """Score arrays [N] with many ties (N 0..119, float32 and float64, some NaN, some presorted)."""
    rng = np.random.default_rng(20240117)
    out = []
    for t in range(1500):
        n, k = int(rng.integers(0, 120)), int(rng.integers(1, 6))
        a = (rng.integers(0, k, n) / 4).astype(np.float32 if t % 2 else np.float64)
        if t % 7 == 0 and n:
            a[rng.integers(0, n, max(1, n // 10))] = np.nan
        if t % 11 == 0:
            a = np.sort(a)[::-1].copy()
        out.append(a)
    return out


def test_tie_order_is_numpy_1_23s_argsort():
    # the digests of np.argsort(a) for a in tie_arrays() (and of kind="heapsort" below), computed under numpy 1.23.5 (GenEval pins 1.23.1;
    # the sort code is the same) on an x86-64 CPU with AVX2 and no AVX-512
    h = hashlib.sha256()
    for a in tie_arrays():
        h.update(numpy123_argsort(a).astype(np.int64).tobytes() + b"|")
    assert h.hexdigest() == "a29fd161f1b8fb69d6eb8680bd286accb117a5c19403516a5aa25f905513a2c4"
    # the introsort's fallback past its depth limit, numpy 1.23.5's argsort(kind="heapsort"), on a sub-range as
    # the introsort calls it (a 3-value prefix before the range)
    h = hashlib.sha256()
    for a in tie_arrays():
        v, idx = [9.0, 9.0, 9.0] + [float(x) for x in a], list(range(len(a) + 3))
        if len(a) > 1:
            _heapsort(v, idx, 3, len(a))
        h.update((np.asarray(idx[3:], dtype=np.int64) - 3).tobytes() + b"|")
    assert h.hexdigest() == "d5f15c4e40710e80ec03c07deba199538840a434cbb18fb6c2d0f3811705e212"
    for a in tie_arrays()[:300]:  # up to 16 values it is the stable order, reversed for most-confident-first
        if len(a) <= 16:
            assert descending_order(a).tolist() == np.argsort(a, kind="stable")[::-1].tolist()


# --------------------------------------------------------------------------- hand-written official verdicts


def rows(*r, dtype=np.float64):
    return np.array(r, dtype=dtype).reshape(-1, 5)


def fixed(colours):
    """A colour_of answering ``colours`` in turn, recording the rows it was asked about."""
    calls = []

    def colour_of(name, r):
        calls.append((name, np.asarray(r).copy()))
        return [colours.pop(0) for _ in range(len(r))]

    colour_of.calls = calls
    return colour_of


ONE_CAT = {"tag": "single_object", "include": [{"class": "cat", "count": 1}]}


def test_a_float32_score_of_exactly_0_3_is_not_kept():
    # ei:233 keeps score > threshold, compared in the rows' float32 (float32(0.3) > 0.3 would hold in float64)
    assert evaluate_detections(ONE_CAT, {"cat": rows([0, 0, 9, 9, 0.3], dtype=np.float32)}, None) == \
        (False, "expected cat>=1, found 0")
    assert evaluate_detections(ONE_CAT, {"cat": rows([0, 0, 9, 9, 0.30001], dtype=np.float32)}, None) == (True, "")


def test_the_counting_threshold_applies_to_the_counting_tag_only():
    # ei:230: COUNTING_THRESHOLD when metadata['tag'] == "counting", else THRESHOLD
    two = {"include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]}
    dets = {"cat": rows([0, 0, 9, 9, 0.95], [20, 0, 29, 9, 0.85])}
    assert evaluate_detections(dict(two, tag="counting"), dets, None) == (False, "expected cat>=2, found 1")
    assert evaluate_detections(dict(two, tag="two_object"), dets, None) == (True, "")
    assert evaluate_detections(dict(two, tag="Counting"), dets, None) == (True, "")  # exact string match


def test_colour_reads_the_most_confident_rows_and_ties_come_last_row_first():
    # ei:232 orders by np.argsort(scores)[::-1] (numpy 1.23: stable below 17 rows, so reversed ties put the
    # later row first); ei:176 takes the first `count`; ei:183 classifies exactly those
    meta = {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}]}
    c = fixed(["red"])
    assert evaluate_detections(meta, {"cat": rows([0, 0, 1, 1, 0.5], [5, 5, 6, 6, 0.7])}, c) == (True, "")
    assert c.calls[0][1].tolist() == [[5, 5, 6, 6, 0.7]]
    c = fixed(["blue"])
    assert evaluate_detections(meta, {"cat": rows([0, 0, 1, 1, 1.0], [5, 5, 6, 6, 1.0])}, c) == \
        (False, "expected red cat>=1, found 0 red; and 1 blue")
    assert c.calls[0][1].tolist() == [[5, 5, 6, 6, 1.0]]


def test_the_colour_reason_tallies_in_genevals_colour_order():
    # ei:187-189: found N <colour>; and then "k c" for each colour of COLORS (ei:76) that occurs
    meta = {"tag": "colors", "include": [{"class": "cup", "count": 2, "color": "blue"}]}
    out = evaluate_detections(meta, {"cup": rows([0, 0, 1, 1, 0.8], [3, 3, 4, 4, 0.9])}, fixed(["white", "red"]))
    assert out == (False, "expected blue cup>=2, found 0 blue; and 1 red, 1 white")


def test_position_exactly_at_half_is_no_relation():
    # ei:147-153: shrunk offset (3 - 0.1 * 5, 4) over |offset| 5 = (0.5, 0.8): dx > 0.5 fails, dy gives "below"
    meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": 1, "position": ["right of", 0]}]}
    dets = {"dog": rows([0, 0, 0, 0, 0.9]), "cat": rows([0.5, 4, 5.5, 4, 0.8])}
    assert evaluate_detections(meta, dets, None) == (False, "expected cat right of target, found below target")
    dets["cat"] = rows([0.6, 4, 5.5, 4, 0.8])  # a little further right: dx > 0.5
    assert evaluate_detections(meta, dets, None)[0] is True


def test_an_offset_on_the_margin_is_no_relation_at_all():
    # ei:147-149: |offset| 1 - 0.1 * (10 + 0) = 0 on x and 0 on y: the empty set, joined as "" (two spaces)
    meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": 1, "position": ["right of", 0]}]}
    dets = {"dog": rows([0, 0, 0, 0, 0.9]), "cat": rows([-4, 0, 6, 0, 0.8])}
    assert evaluate_detections(meta, dets, None) == (False, "expected cat right of target, found  target")
    # ei:148: strictly below 1e-3 on both axes is no relation; a shrunk offset of exactly 0.001 is one
    dets = {"dog": rows([0, 0, 0, 0, 0.9]), "cat": rows([0.001, 0, 0.001, 0, 0.8])}
    assert evaluate_detections(meta, dets, None) == (True, "")
    dets["cat"] = rows([0.0009, 0, 0.0009, 0, 0.8])
    assert evaluate_detections(meta, dets, None) == (False, "expected cat right of target, found  target")


def test_every_found_object_against_every_target():
    # ei:198-207: the first failing (object, target) pair names the reason, and the clause stops there
    meta = {"tag": "position", "include": [{"class": "dog", "count": 2},
                                           {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    dets = {"dog": rows([20, 0, 22, 2, 0.9], [0, 20, 2, 22, 0.8]), "cat": rows([0, 0, 2, 2, 0.9])}
    assert evaluate_detections(meta, dets, None) == (False, "expected cat left of target, found above target")


def test_no_target_when_the_target_clause_failed():
    # ei:193-196: a clause that did not match leaves None as its group
    meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    assert evaluate_detections(meta, {"cat": rows([0, 0, 2, 2, 0.9])}, None) == \
        (False, "expected dog>=1, found 0\nno target for cat to be left of")


def test_the_cap_comes_before_the_exclude_count_and_identical_boxes_survive_by_default():
    # ei:234 caps at MAX_OBJECTS before ei:217 counts; ei:241 skips overlap removal when the threshold is 1
    meta = {"tag": "counting", "include": [{"class": "cup", "count": 16}], "exclude": [{"class": "cup", "count": 17}]}
    many = {"cup": rows(*[[0, 0, 5, 5, 0.95]] * 20)}
    assert evaluate_detections(meta, many, None) == (True, "")
    assert evaluate_detections(meta, many, None, max_objects=20) == (False, "expected cup<17, found 20")
    assert evaluate_detections(meta, many, None, nms_threshold=0.5) == (False, "expected cup>=16, found 1")


def test_exclude_clauses():
    # ei:215-219
    meta = {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]}
    three = {"cat": rows([0, 0, 1, 1, 0.95], [5, 0, 6, 1, 0.95], [9, 0, 10, 1, 0.99])}
    assert evaluate_detections(meta, three, None) == (False, "expected cat<3, found 3")


def test_inputs_that_crash_the_official_script_raise():
    bad_group = {"tag": "position", "include": [{"class": "cat", "count": 1, "position": ["left of", 1]}]}
    with pytest.raises(ValueError, match="names include clause 1"):
        evaluate_detections(bad_group, {"cat": rows([0, 0, 1, 1, 0.9])}, None)
    with pytest.raises(ValueError, match="absent class"):
        evaluate_detections({"tag": "counting", "exclude": [{"class": "cat", "count": 0}]}, {}, None)
    with pytest.raises(ValueError, match=r"\[N, 5\]"):
        evaluate_detections(ONE_CAT, {"cat": np.zeros((2, 4))}, None)
    with pytest.raises(ValueError, match="returned 2 colours for 1 rows"):
        evaluate_detections({"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}]},
                            {"cat": rows([0, 0, 1, 1, 0.9])}, lambda name, r: ["red", "red"])


def test_reward_server_partial_credit():
    # rs:219 count credit; rs:254 + rs:258: a failed position appends 0 and then 1
    meta = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                           {"class": "cat", "count": 1, "position": ["left of", 0]}]}
    dets = {"dog": rows([0, 0, 2, 2, 0.9]), "cat": rows([20, 0, 22, 2, 0.9])}
    assert reward_server_scores(meta, dets, None) == (False, 0.75, "expected cat left of target, found right of target")
    # rs:219: 1 - |1 - 3| / 1 = -1 for three cats where one was asked; rs:220 needs exactly the count
    three = {"cat": rows([0, 0, 1, 1, 0.95], [5, 0, 6, 1, 0.95], [9, 0, 10, 1, 0.99])}
    assert reward_server_scores(ONE_CAT, three, None) == (False, -1.0, "expected cat==1, found 3")
    assert evaluate_detections(ONE_CAT, three, None) == (True, "")
    # rs:223-224: a wrong count adds a 0 for the colour it could not check; exclude clauses are not read
    meta = {"tag": "counting", "include": [{"class": "cat", "count": 2, "color": "red"}],
            "exclude": [{"class": "cat", "count": 3}]}
    assert reward_server_scores(meta, {"cat": three["cat"][:1]}, None).score == pytest.approx((0.5 + 0.0) / 2)
