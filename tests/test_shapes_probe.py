"""``flowgrpo shapes probe``: pass@k, the swap construction, the sensitivity measure on toy encoders,
the ceiling, and the command's output through the CLI (tiny sample counts)."""

from __future__ import annotations

import csv
import itertools
import json

import numpy as np
import pytest
import torch

from flowgrpo.shapes.probe import (ceiling, class_ceiling, colour_swap, order_swap, pair_sensitivity, pass_at_k,
                                   pass_at_k_brute, scene_key, swap_group, words_of)
from flowgrpo.shapes.relation_probe import (as_left_of, independent_placement_rates, placed_first_scene,
                                            placement_given_first, relation_holds_rate, relation_kind,
                                            relation_outcome, relation_prior, same_colour_pair)
from flowgrpo.shapes.prompts import parse_prompt
from flowgrpo.shapes.verify import Detection, detect, verify
from flowgrpo.shapes.world import FLIPPED, GRID, VOCAB, ObjectSpec, SceneSpec, place, relation_holds, render
from flowgrpo.shapes.world import draw as render_cells

RED_CIRCLE, BLUE_SQUARE = ObjectSpec("circle", "red"), ObjectSpec("square", "blue")


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            samples = [1] * c + [0] * (n - c)
            subsets = list(itertools.combinations(range(n), k))
            enumerated = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(enumerated, abs=1e-12)
            assert pass_at_k_brute(n, c, k) == pytest.approx(enumerated, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(n, 0, n + 1)


def test_pass_at_k_large_n_is_stable():
    assert pass_at_k(64, 1, 1) == pytest.approx(1 / 64)
    assert pass_at_k(64, 1, 64) == 1.0
    assert pass_at_k(64, 3, 16) == pytest.approx(pass_at_k_brute(64, 3, 16))


@pytest.mark.parametrize("rel", list(FLIPPED))
def test_order_swap_of_a_position_prompt_means_the_reversed_relation(rel):
    spec = SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), rel)
    twin = order_swap(spec)
    parsed = parse_prompt(twin.prompt)
    assert parsed.objects == (BLUE_SQUARE, RED_CIRCLE) and parsed.relation == rel
    assert sorted(twin.prompt.split()) == sorted(spec.prompt.split())  # the same words
    cells = [divmod(i, GRID) for i in range(GRID * GRID)]
    for a, b in itertools.permutations(cells, 2):  # "B rel A" holds exactly where "A flipped(rel) B" holds
        assert relation_holds(rel, b, a) == relation_holds(FLIPPED[rel], a, b)
    for seed in range(5):  # a scene drawn for the twin never satisfies the prompt
        assert verify(spec, render(twin, np.random.default_rng(seed)))["correct"] == 0.0


def test_colour_swap_exchanges_colours():
    spec = SceneSpec("color_attr", (RED_CIRCLE, BLUE_SQUARE))
    twin = colour_swap(spec)
    assert twin.prompt == "a blue circle and a red square"
    assert parse_prompt(twin.prompt).objects == (ObjectSpec("circle", "blue"), ObjectSpec("square", "red"))
    assert colour_swap(SceneSpec("color_attr", (RED_CIRCLE, ObjectSpec("square", "red")))) is None  # same colour
    assert colour_swap(SceneSpec("color_attr", (RED_CIRCLE, ObjectSpec("circle", "blue")))) is None  # = order swap
    assert colour_swap(SceneSpec("two_object", (ObjectSpec("circle"), ObjectSpec("square")))) is None
    assert order_swap(SceneSpec("counting", (ObjectSpec("circle", "red", 2),))) is None
    group = swap_group(SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), "above"))
    assert [g.prompt for g in group] == ["a red circle above a blue square", "a blue square above a red circle",
                                         "a blue circle above a red square", "a red square above a blue circle"]


# --------------------------------------------------------------------------- toy encoders

_EMB = torch.randn(len(VOCAB), 16, generator=torch.Generator().manual_seed(0))
_POS = torch.randn(12, 16, generator=torch.Generator().manual_seed(1)) * 4.0


def _ids(prompts):
    index = {w: i for i, w in enumerate(VOCAB)}
    return torch.tensor([[index[w] for w in words_of(p, 12)] for p in prompts])


def bag_encoder(prompts):
    """Order-blind: a token's state is its word's embedding, pooled = the mean."""
    h = _EMB[_ids(prompts)]
    return h, h.mean(1)


def order_encoder(prompts):
    """Sees order: position embeddings at the words' scale, pooled = the words' embeddings in order."""
    e = _EMB[_ids(prompts)]
    return e + _POS, e.flatten(1)


def test_sensitivity_tells_an_order_aware_encoder_from_a_bag_of_words():
    pairs = [("a red circle left of a blue square", "a blue square left of a red circle"),
             ("a red circle and a blue square", "a blue circle and a red square")]
    for row in pair_sensitivity(bag_encoder, pairs):
        assert row["pooled_cos"] == pytest.approx(1.0, abs=1e-6)
        assert row["token_cos_min"] == pytest.approx(1.0, abs=1e-6)
        assert row["token_change"] == pytest.approx(0.0, abs=1e-6)
    for row in pair_sensitivity(order_encoder, pairs):
        assert row["pooled_cos"] < 0.99 and row["token_cos_min"] < 0.99 and row["token_change"] > 0.1
    with pytest.raises(ValueError, match="not made of the same parts"):
        pair_sensitivity(bag_encoder, [("a red circle", "a blue circle")])


def test_ceiling_merges_only_what_the_encoder_cannot_tell_apart():
    specs = [SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), "left of"),
             SceneSpec("color_attr", (RED_CIRCLE, BLUE_SQUARE)),
             SceneSpec("counting", (ObjectSpec("triangle", "green", 3),))]
    blind = ceiling(bag_encoder, specs)
    assert blind["conditioning"] == blind["swap_blind"]
    assert blind["conditioning"]["position"] == 0.25  # 4 contradictory prompts, one scene
    assert blind["conditioning"]["color_attr"] == 0.5
    assert blind["conditioning"]["counting"] == 1.0
    sees = ceiling(order_encoder, specs, identity={"order_position": 0.0, "colour": 0.0})
    assert sees["conditioning"]["overall"] == 1.0 and sees["behavioural"]["overall"] == 1.0
    assert sees["swap_blind"]["position"] == 0.25
    # "a circle and a square" and "a square and a circle" are one scene: merging them costs nothing
    assert class_ceiling(swap_group(SceneSpec("two_object", (ObjectSpec("circle"), ObjectSpec("square"))))) == 1.0


def test_relation_outcome_and_scene_key():
    spec = SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), "left of")
    a, b = Detection("circle", "red", 0, 0), Detection("square", "blue", 3, 2)
    assert relation_outcome(spec, [a, b]) is True
    assert relation_outcome(order_swap(spec), [a, b]) is False
    assert relation_outcome(spec, [a]) is None and relation_outcome(spec, [a, a, b]) is None
    # the two misses: B straight below A shares A's column (a tie for "left of"); B left of A is reversed
    tie, rev = Detection("square", "blue", 3, 0), Detection("square", "blue", 0, 0)
    a2 = Detection("circle", "red", 1, 2)
    assert relation_kind(spec, [a, tie]) == "same_line" and relation_kind(spec, [a2, rev]) == "reversed"
    assert relation_kind(SceneSpec("position", spec.objects, "above"), [a, tie]) == "holds"
    rates = relation_holds_rate([(spec, [a, b]), (spec, [a, tie]), (spec, [a2, rev]), (spec, [a2, rev]), (spec, [a])])
    assert (rates["eligible"], rates["position_samples"]) == (4, 5)
    assert (rates["rate"], rates["same_line"], rates["reversed"]) == (0.25, 0.25, 0.5)
    assert (rates["prompt_mean"], rates["prompts"]) == (0.25, 1)  # one prompt: its own rate
    # split by colour: a red circle left of a red square, tied, beside the two-colour samples above
    red_pair = SceneSpec("position", (RED_CIRCLE, ObjectSpec("square", "red")), "left of")
    assert same_colour_pair(red_pair) and not same_colour_pair(spec)
    split = relation_holds_rate([(spec, [a, b]), (spec, [a2, rev]), (red_pair, [a, Detection("square", "red", 3, 0)])])
    assert split["same_colour"] == {"rate": 0.0, "same_line": 1.0, "reversed": 0.0, "eligible": 1}
    assert split["other_colours"] == {"rate": 0.5, "same_line": 0.0, "reversed": 0.5, "eligible": 2}
    assert split["eligible"] == 3 and split["rate"] == pytest.approx(1 / 3)
    # per prompt: the two-colour prompt holds 1 of 2, the one-colour prompt 0 of 1 -> (0.5 + 0) / 2
    assert split["prompts"] == 2 and split["prompt_mean"] == pytest.approx(0.25)
    # a prompt drawn many times moves the pooled rate, but enters the prompt mean once
    heavy = relation_holds_rate([(spec, [a, b])] * 30 + [(red_pair, [a, Detection("square", "red", 3, 0)])])
    assert heavy["rate"] == pytest.approx(30 / 31) and heavy["prompt_mean"] == pytest.approx(0.5)
    assert relation_holds_rate([])["prompt_mean"] is None
    img = render(spec, np.random.default_rng(0))
    assert scene_key(detect(img)) == scene_key(list(reversed(detect(img))))


def _mean_scene(spec: SceneSpec, draws: int = 400) -> torch.Tensor:
    """The average of many clean renders of ``spec`` in [-1, 1]: the ideal x0 prediction at sigma -> 1."""
    rng = np.random.default_rng(0)
    imgs = np.stack([render(spec, rng) for _ in range(draws)]).astype(np.float32)
    return torch.from_numpy(imgs.mean(0)).permute(2, 0, 1) / 127.5 - 1.0


def test_relation_prior_reads_the_mean_scene_the_right_way_and_a_flat_one_as_blind():
    """An x0 predictor that returns the prompt's mean scene leans the relation's way for every prompt,
    in all four relations; the same predictor fed the prompt's order swap leans the wrong way for
    every prompt; one that returns the position-independent mean (the relation ignored) is blind."""
    specs = [SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), r) for r in FLIPPED]
    specs += [order_swap(s) for s in specs]
    by_prompt = {s.prompt: s for s in specs}

    def ideal(prompts, sigma, x):
        return torch.stack([_mean_scene(by_prompt[p]) for p in prompts])

    def swapped(prompts, sigma, x):
        return torch.stack([_mean_scene(order_swap(by_prompt[p])) for p in prompts])

    def blind(prompts, sigma, x):  # every cell the same mixture of A and B
        scene = _mean_scene(by_prompt[prompts[0]])
        cells = scene.view(3, GRID, 8, GRID, 8).mean((1, 3), keepdim=True).expand(3, GRID, 8, GRID, 8)
        return cells.reshape(3, 32, 32).expand(len(prompts), 3, 32, 32) + 0.01 * x

    right = relation_prior(ideal, specs, draws=2)
    assert right["n"] == 8 and right["leans_right_way"] == 1.0 and right["strength"] > 0.3
    wrong = relation_prior(swapped, specs, draws=2)
    assert wrong["leans_right_way"] == 0.0 and wrong["strength"] < -0.3
    assert abs(relation_prior(blind, specs, draws=2)["strength"]) < 0.02


def _first_cell(x, spec):
    """The cell of the clearest copy of A's glyph in a state [3, 32, 32] (the drawn-first object)."""
    from flowgrpo.shapes.world import CELL, draw

    a = spec.objects[0]
    tpl = torch.from_numpy(draw([(a.shape, a.color, 0, 0)])[:CELL, :CELL]).permute(2, 0, 1).float() / 127.5 - 1.0
    cells = x.view(3, GRID, CELL, GRID, CELL).permute(1, 3, 0, 2, 4)
    return divmod(int(((cells - tpl) ** 2).mean((-3, -2, -1)).flatten().argmin()), GRID)


@pytest.mark.parametrize("coordinated", [True, False])
def test_placement_given_first_tells_a_coordinating_finisher_from_a_blind_one(coordinated):
    """A finisher that keeps A where it was drawn and puts B in a random cell where the relation holds
    is never on A's line; one that puts B in a random free cell is on it 3 times in 15, and on the
    relation's side 8 times in 15 (A is drawn only where the relation can hold: for "left of" in
    columns 0-2, with 12, 8 and 4 of the 15 other cells to its right)."""
    from flowgrpo.shapes.world import draw

    specs = [SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), r) for r in FLIPPED]
    by_prompt = {s.prompt: s for s in specs}
    rng = np.random.default_rng(0)

    def finish(prompts, x, sigma):
        assert sigma == 0.9 and x.shape == (len(prompts), 3, 32, 32)
        out = []
        for p, xi in zip(prompts, x):
            spec = by_prompt[p]
            a = _first_cell(xi, spec)
            free = [divmod(k, GRID) for k in range(GRID * GRID) if divmod(k, GRID) != a]
            if coordinated:
                free = [c for c in free if relation_holds(spec.relation, a, c)]
            b = free[rng.integers(len(free))]
            out.append(draw([("circle", "red", *a), ("square", "blue", *b)]))
        return np.stack(out)

    res = placement_given_first(finish, detect, specs, sigma=0.9, draws=8)
    assert res["n"] == 4 * 12 * 8 and res["kept_first"] == 1.0 and res["eligible"] == res["n"]
    if coordinated:
        assert res["same_line"] == 0.0 and res["holds"] == 1.0
    else:
        assert res["same_line"] == pytest.approx(0.2, abs=0.05) and res["holds"] == pytest.approx(8 / 15, abs=0.07)


def test_placed_first_scene_noises_a_s_cell_less_than_the_rest():
    spec = SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), "left of")
    noise = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(0))
    x = placed_first_scene(spec, (2, 1), 0.9, 0.0, noise)
    assert _first_cell(x, spec) == (2, 1)
    clean = torch.from_numpy(render_cells([("circle", "red", 2, 1)])).permute(2, 0, 1).float() / 127.5 - 1.0
    assert torch.equal(x[:, 16:24, 8:16], clean[:, 16:24, 8:16])  # A's cell at lead sigma 0: A exactly
    rest = torch.ones(3, 32, 32, dtype=torch.bool)
    rest[:, 16:24, 8:16] = False
    assert torch.allclose(x[rest], (0.1 * clean + 0.9 * noise)[rest], atol=1e-6)


def test_probe_command_writes_json_and_csv(tmp_path, monkeypatch):
    from flowgrpo.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "probe"
    rc = main(["shapes", "probe", "--out", str(out), "--json", str(tmp_path / "p.json"), "--prompts", "6",
               "--seeds", "1", "--passk-prompts", "1", "--n", "4", "--steps", "2"])
    assert rc == 0
    res = json.loads((out / "probe.json").read_text())
    assert res == json.loads((tmp_path / "p.json").read_text())
    assert set(res) >= {"sensitivity", "same_seed_identity", "pass_at_k", "pass_at_k_prompts", "ceiling",
                        "relation_holds", "settings", "model"}
    assert set(res["sensitivity"]) == {"order_position", "order_and", "colour"}
    for st in res["sensitivity"]["order_position"].values():
        assert set(st) == {"mean", "min", "max", "n"}
    assert set(res["pass_at_k"]["overall"]) == {"pass@1", "pass@4"}
    assert 0.0 <= res["same_seed_identity"]["order_position"]["identical"] <= 1.0
    assert set(res["ceiling"]) >= {"conditioning", "swap_blind", "behavioural", "threshold"}
    rows = list(csv.DictReader((out / "probe.csv").open()))
    assert {r["section"] for r in rows} == {"sensitivity", "same_seed_identity", "pass_at_k", "ceiling",
                                           "relation_holds", "relation_prior", "placement_given_first"}
    rel = res["relation_holds"]  # the colour split adds up to the whole
    assert rel["same_colour"]["eligible"] + rel["other_colours"]["eligible"] == rel["eligible"]
    assert {r["key"] for r in rows if r["section"] == "relation_holds"} == {
        "position", "position.if_independent", "position.same_colour", "position.other_colours"}
    assert 0.0 <= res["relation_prior"]["leans_right_way"] <= 1.0 and res["relation_prior"]["n"] >= 1
    placed = res["placement_given_first"]
    assert placed["n"] >= 12 and 0.0 <= placed["kept_first"] <= 1.0 and placed["eligible"] <= placed["n"]


def test_probe_command_rejects_a_folder_without_weights(tmp_path):
    from flowgrpo.cli import main

    assert main(["shapes", "probe", "--weights", str(tmp_path), "--out", str(tmp_path)]) == 2


def test_as_left_of_maps_every_relation_onto_left_of():
    for rel in ("left of", "right of", "above", "below"):
        for a in range(GRID * GRID):
            for b in range(GRID * GRID):
                ca, cb = divmod(a, GRID), divmod(b, GRID)
                assert relation_holds(rel, ca, cb) == (as_left_of(rel, *ca)[1] < as_left_of(rel, *cb)[1])
                # a tie stays a tie: the relation's axis is the mapped column
                axis = 1 if rel in ("left of", "right of") else 0
                assert (ca[axis] == cb[axis]) == (as_left_of(rel, *ca)[1] == as_left_of(rel, *cb)[1])


def _cells_as_detections(spec, cells):
    return [Detection(o.shape, o.color, r, c) for o, (r, c) in zip(spec.objects, cells)]


def test_placement_null_separates_coupled_from_independent_placement():
    rng = np.random.default_rng(3)
    specs = [SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), rel) for rel in ("left of", "right of", "above", "below")]
    # the training scenes themselves: every sample holds, yet their marginals alone would give 0.886
    data = []
    for i in range(2000):
        spec = specs[i % 4]
        data.append((spec, _cells_as_detections(spec, [(r, c) for _, _, r, c in place(spec, rng)])))
    rates = relation_holds_rate(data)
    assert rates["rate"] == 1.0
    assert rates["if_independent"]["holds"] == pytest.approx(0.886, abs=0.02)
    assert sum(rates["if_independent"].values()) == pytest.approx(1.0)
    # the data's own marginals, exactly: uniform over valid cell pairs
    pa, pb = np.zeros(GRID * GRID), np.zeros(GRID * GRID)
    for a in range(GRID * GRID):
        for b in range(GRID * GRID):
            if a != b and relation_holds("left of", divmod(a, GRID), divmod(b, GRID)):
                pa[a] += 1
                pb[b] += 1
    exact = independent_placement_rates(pa / pa.sum(), pb / pb.sum())
    assert (exact["holds"], exact["same_line"], exact["reversed"]) == pytest.approx((31 / 35, 3 / 35, 1 / 35))
    # objects placed each from its own marginal, one a cell: the observed rate is the null's
    la = np.array([0.5, 0.3, 0.15, 0.05])  # A's column distribution in the left-of frame
    ind = []
    for i in range(4000):
        spec = specs[i % 4]
        while True:
            ca, cb = (int(rng.integers(GRID)), int(rng.choice(GRID, p=la))), (int(rng.integers(GRID)), int(rng.choice(GRID, p=la[::-1])))
            if ca != cb:
                break
        inv = {"left of": lambda r, c: (r, c), "right of": lambda r, c: (r, GRID - 1 - c),
               "above": lambda r, c: (c, r), "below": lambda r, c: (GRID - 1 - c, r)}[spec.relation]
        ind.append((spec, _cells_as_detections(spec, [inv(*ca), inv(*cb)])))
    rates = relation_holds_rate(ind)
    assert rates["rate"] == pytest.approx(rates["if_independent"]["holds"], abs=0.03)
    assert rates["same_line"] == pytest.approx(rates["if_independent"]["same_line"], abs=0.03)
    assert relation_holds_rate([])["if_independent"] == {"holds": None, "same_line": None, "reversed": None}


def test_swap_pairs_draw_twins_from_one_noise_and_other_pairs_from_others():
    """Twins share their seeds (so identity is measured); with a stride, no two pairs share a noise, since a
    shared noise makes every prompt's layout alike and the pooled relation rate hang on a few noises."""
    from flowgrpo.shapes.probe import passk_by_tag, same_seed_identity

    pairs = [(SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), "left of"),) * 2,
             (SceneSpec("position", (BLUE_SQUARE, RED_CIRCLE), "above"),) * 2]
    drawn = []

    def sample(prompts, seeds):
        drawn.extend(seeds)
        return np.stack([render(SceneSpec("position", (RED_CIRCLE, BLUE_SQUARE), "left of"),
                                np.random.default_rng(sd)) for sd in seeds])

    res = same_seed_identity(sample, pairs, [10, 11], seed_stride=2)
    assert drawn == [10, 11, 10, 11, 12, 13, 12, 13]  # pair 0 twins, then pair 1 twins on new noise
    assert res["n"] == 4 and res["identical"] == 1.0  # one prompt per twin here: identical scenes
    drawn.clear()
    same_seed_identity(sample, pairs, [10, 11])  # stride 0: every pair on the same noises
    assert drawn == [10, 11, 10, 11, 10, 11, 10, 11]
    drawn.clear()
    passk_by_tag(sample, [pairs[0][0], pairs[1][0]], n=3, base_seed=100)
    assert drawn == [100, 101, 102, 103, 104, 105]
