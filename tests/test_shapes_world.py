"""The shapes world: renderer and verifier agree, caption noise always violates its caption, prompts
round-trip, the held-out prompts are never trained on and the evaluation sets are fixed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from flowgrpo.data import PromptSource, load_prompt_file
from flowgrpo.evaluation import paired_gain
from flowgrpo.shapes.evaluate import heldout_prompts, score_shapes
from flowgrpo.rewards import build_reward
from flowgrpo.shapes.pretrain import make_batch, parse_noise
from flowgrpo.shapes.prompts import (FREE_COUNTING_SHARE, TrainingPrompts, factor_pairs, free_counting_specs,
                                     heldout_specs, is_heldout, parse_prompt, sample_train_spec, seen_specs,
                                     split_specs)
from flowgrpo.shapes.verify import UNKNOWN, detect, verify
from flowgrpo.shapes.world import (CELL, GRID, NUMBERS, SHAPES, TAGS, VOCAB, ObjectSpec, SceneSpec, all_specs, draw, place,
                                   render, sample_spec, wrong_scene)


def test_verifier_accepts_300_ground_truth_renders():
    rng = np.random.default_rng(0)
    failures = []
    tags = Counter()
    for i in range(300):
        spec = sample_spec(rng)
        tags[spec.tag] += 1
        img = render(spec, rng)
        assert img.shape == (32, 32, 3) and img.dtype == np.uint8
        r = verify(spec, img)
        if r["correct"] != 1.0 or r["score"] != 1.0:
            failures.append((i, spec.prompt, r))
    assert not failures, failures[:5]
    assert set(tags) == set(TAGS)


def test_detection_counts_objects_shapes_and_colours():
    rng = np.random.default_rng(1)
    spec = SceneSpec("counting", (ObjectSpec("triangle", "green", 3),))
    for _ in range(10):
        dets = detect(render(spec, rng))
        assert len(dets) == 3
        assert {d.shape for d in dets} == {"triangle"} and {d.color for d in dets} == {"green"}
    # cells are read where they are drawn, row-major
    dets = detect(draw([("circle", "red", 3, 0), ("square", "blue", 0, 2)]))
    assert [(d.shape, d.color, d.row, d.col) for d in dets] == [("square", "blue", 0, 2), ("circle", "red", 3, 0)]


def test_verifier_tolerates_small_noise_and_rejects_smears():
    rng = np.random.default_rng(6)
    spec = SceneSpec("color_attr", (ObjectSpec("circle", "red"), ObjectSpec("triangle", "yellow")))
    img = render(spec, rng).astype(np.float32)
    noisy = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
    assert verify(spec, noisy)["correct"] == 1.0
    # a cell that blends a red and a yellow glyph matches no template: an extra, unknown object
    blend = draw([("square", "red", 1, 1)]).astype(np.float32) * 0.5 + draw([("square", "yellow", 1, 1)]) * 0.5
    dets = detect(blend.astype(np.uint8))
    assert [d.shape for d in dets] == [UNKNOWN]
    smeared = img.copy()
    smeared[1 * CELL:2 * CELL, 2 * CELL:3 * CELL] = blend[1 * CELL:2 * CELL, 1 * CELL:2 * CELL]
    assert verify(spec, smeared.astype(np.uint8))["correct"] == 0.0


def test_wrong_scenes_always_violate_their_caption():
    rng = np.random.default_rng(7)
    for tag in TAGS:
        for spec in all_specs(tag):
            for _ in range(3):
                shown = wrong_scene(spec, rng)
                assert shown != spec
                assert verify(spec, draw(place(shown, rng)))["correct"] == 0.0, (spec.prompt, shown)


def test_verifier_rejects_wrong_images():
    rng = np.random.default_rng(2)
    blank = np.zeros((32, 32, 3), dtype=np.uint8)
    for _ in range(30):
        spec = sample_spec(rng)
        assert verify(spec, blank)["correct"] == 0.0
    # a render of one scene is wrong for a conflicting spec
    red_circle = render(SceneSpec("colors", (ObjectSpec("circle", "red"),)), rng)
    assert verify(SceneSpec("colors", (ObjectSpec("circle", "blue"),)), red_circle)["correct"] == 0.0
    assert verify(SceneSpec("colors", (ObjectSpec("square", "red"),)), red_circle)["correct"] == 0.0
    assert verify(SceneSpec("counting", (ObjectSpec("circle", "red", 2),)), red_circle)["correct"] == 0.0
    left = render(SceneSpec("position", (ObjectSpec("circle", "red"), ObjectSpec("square", "blue")), "left of"), rng)
    flipped = SceneSpec("position", (ObjectSpec("circle", "red"), ObjectSpec("square", "blue")), "right of")
    r = verify(flipped, left)
    assert r["correct"] == 0.0 and 0.0 < r["score"] < 1.0  # partial credit: the objects are right


def test_parse_prompt_round_trips():
    rng = np.random.default_rng(3)
    for _ in range(1000):
        spec = sample_spec(rng)
        assert parse_prompt(spec.prompt) == spec
        assert all(w in VOCAB for w in spec.prompt.split())
    assert parse_prompt("  A Blue   square LEFT OF a yellow triangle ") == SceneSpec(
        "position", (ObjectSpec("square", "blue"), ObjectSpec("triangle", "yellow")), "left of")
    for bad in ["a photo of a cat", "a red hexagon", "", "five circles", "a circle and a square and a triangle"]:
        with pytest.raises(ValueError):
            parse_prompt(bad)


def test_heldout_prompts_are_never_trained_on():
    for tag in TAGS:
        train, held = split_specs(tag)
        if tag == "single_object":  # three prompts: nothing can be held out
            assert train == held == all_specs(tag)
            continue
        assert set(train).isdisjoint(held) and set(train) | set(held) == set(all_specs(tag))
        assert 0 < len(held) <= max(1, round(0.25 * len(all_specs(tag))))
    rng = np.random.default_rng(8)
    x, captions = make_batch(rng, 600, drop_prob=0.0, noise=parse_noise("0.5"))
    assert x.shape == (600, 3, GRID * CELL, GRID * CELL) and float(x.min()) >= -1 and float(x.max()) <= 1
    assert not any(is_heldout(parse_prompt(c)) for c in captions)
    trained = [p for it in range(50) for p in PromptSource("shapes", seed=3).batch(it, 8)]
    assert not any(is_heldout(parse_prompt(p)) for p in trained)
    assert len({parse_prompt(p).tag for p in trained}) == len(TAGS)


def test_colour_free_counting_prompts_train_the_count_and_never_show_a_held_out_scene():
    free = free_counting_specs()
    assert len(set(free)) == len(NUMBERS) * len(SHAPES)
    assert all(parse_prompt(s.prompt) == s and s.objects[0].color is None for s in free)
    held = split_specs("counting")[1]
    assert held and all(o.color for s in held for o in s.objects) and not any(is_heldout(s) for s in free)
    rng = np.random.default_rng(11)
    assert FREE_COUNTING_SHARE == 0.0 and not any(sample_train_spec(rng, "counting") in free for _ in range(500))
    drawn = [sample_train_spec(rng, "counting", 0.25) for _ in range(3000)]
    assert abs(np.mean([s in free for s in drawn]) - 0.25) < 0.03
    assert set(free) <= set(drawn) and not any(is_heldout(s) for s in drawn)
    source = PromptSource("shapes", seed=1)
    source.world = TrainingPrompts(1.0)
    assert all(parse_prompt(p) in free for p in source.draw(0, 200).prompts if parse_prompt(p).tag == "counting")
    _, captions = make_batch(rng, 400, drop_prob=0.0, noise=parse_noise("0"), free_counting_share=1.0)
    assert any(parse_prompt(c) in free for c in captions)
    assert all(parse_prompt(c) in free for c in captions if parse_prompt(c).tag == "counting")
    # a colour-free group comes out in two colours at least, so none of its images satisfies a coloured
    # counting prompt (a held-out one included), while the verifier accepts it for its own caption
    rng = np.random.default_rng(12)
    for spec in free * 30:
        objs = place(spec, rng)
        assert len({colour for _, colour, _, _ in objs}) > 1
        img = draw(objs)
        assert verify(spec, img)["correct"] == 1.0
        assert not any(verify(h, img)["correct"] for h in all_specs("counting"))


def test_caption_noise_rate_matches_the_setting():
    rng = np.random.default_rng(9)
    noise = parse_noise("counting=0.0,position=1.0")
    assert noise["counting"] == 0.0 and noise["position"] == 1.0 and 0 < noise["colors"] < 1
    x, captions = make_batch(rng, 400, drop_prob=0.0, noise=noise)
    imgs = ((x.permute(0, 2, 3, 1).numpy() + 1) * 127.5).round().astype(np.uint8)
    ok = {t: [] for t in TAGS}
    for c, img in zip(captions, imgs):
        spec = parse_prompt(c)
        ok[spec.tag].append(verify(spec, img)["correct"])
    assert np.mean(ok["counting"]) == 1.0 and np.mean(ok["position"]) == 0.0
    assert abs(np.mean(ok["colors"]) - (1 - noise["colors"])) < 0.2
    with pytest.raises(SystemExit, match="valid tags"):
        parse_noise("countin=0.3")


def test_tag_weights_set_each_tags_share_of_the_batch():
    from flowgrpo.shapes.pretrain import DEFAULT_TAG_WEIGHTS

    weights = parse_noise("position=3,counting=0", DEFAULT_TAG_WEIGHTS, "--tag-weights")
    assert weights["position"] == 3.0 and weights["counting"] == 0.0 and weights["colors"] == 1.0
    _, captions = make_batch(np.random.default_rng(10), 800, drop_prob=0.0, noise=parse_noise("0"),
                             tag_weights=weights)
    tags = [parse_prompt(c).tag for c in captions]
    assert tags.count("counting") == 0
    assert abs(tags.count("position") / len(tags) - 3 / 7) < 0.06  # 3 shares of 1+1+0+1+3+1
    with pytest.raises(SystemExit, match="--tag-weights: unknown tag 'postion'"):
        parse_noise("postion=3", DEFAULT_TAG_WEIGHTS, "--tag-weights")


def test_heldout_prompts_are_interpolations_of_the_training_prompts():
    """Every pair of factors a held-out prompt combines in one group (count and colour, count and shape,
    colour and shape) was trained on somewhere: the random quarter had held out every "four yellow"
    prompt, which made "four" with "yellow" an extrapolation no model can learn from its data."""
    trained = set().union(*(factor_pairs(s) for t in TAGS for s in split_specs(t)[0]))
    held = [s for t in TAGS if t != "single_object" for s in split_specs(t)[1]]
    assert all(factor_pairs(s) <= trained for s in held)
    four_yellow = [s.prompt for s in held if s.objects[0].count == 4 and s.objects[0].color == "yellow"]
    assert four_yellow and len(four_yellow) < len(SHAPES)  # the others stay held out: still never trained on
    assert factor_pairs(parse_prompt("two red circles and a blue square")) == {
        (("count", 2), ("colour", "red")), (("count", 2), ("shape", "circle")), (("colour", "red"), ("shape", "circle")),
        (("count", 1), ("colour", "blue")), (("count", 1), ("shape", "square")), (("colour", "blue"), ("shape", "square"))}


def test_heldout_set_draws_every_prompt_before_repeating_one():
    for specs, which in ((heldout_specs(96), 1), (seen_specs(96), 0)):
        for tag in TAGS:
            drawn = Counter(s for s in specs if s.tag == tag)
            pool = split_specs(tag)[which]
            # 16 draws of the tag: each prompt of the pool once before any twice
            assert max(drawn.values()) - min(drawn.get(p, 0) for p in pool) <= 1 if len(pool) <= 16 \
                else max(drawn.values()) == 1


def test_heldout_set_is_fixed_and_balanced():
    a, b = heldout_specs(64), heldout_specs(64)
    assert a == b
    assert all(is_heldout(s) for s in a if s.tag != "single_object")
    assert not any(is_heldout(s) for s in seen_specs(64))
    counts = Counter(s.tag for s in a)
    assert set(counts) == set(TAGS)
    assert max(counts.values()) - min(counts.values()) <= 1
    assert Counter(s.tag for s in heldout_specs(60)) == {t: 10 for t in TAGS}
    # a shorter held-out set is a prefix of the longer one
    assert heldout_specs(12) == a[:12]
    prompts, seeds = heldout_prompts(8, 3)
    assert prompts == [s.prompt for s in a[:8] for _ in range(3)]
    assert seeds == list(range(1000, 1024)) and heldout_prompts(8, 3) == (prompts, seeds)


def test_paired_gain_standard_error():
    before = [0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
    after = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    gain, se = paired_gain(before, after)
    d = np.array(after) - np.array(before)  # [1, 0, 0, 1, -1, 1]
    assert gain == pytest.approx(1 / 3)
    assert se == pytest.approx(np.sqrt(((d - d.mean()) ** 2).sum() / 5) / np.sqrt(6))


def test_shapes_reward_and_score_on_renders():
    rng = np.random.default_rng(4)
    specs = [sample_spec(rng) for _ in range(12)]
    imgs = np.stack([render(s, rng) for s in specs])
    images = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255.0
    prompts = [s.prompt for s in specs]
    out = build_reward("shapes")(images, prompts)
    assert torch.all(out.scores == 1.0) and torch.all(out.components["correct"] == 1.0)
    res = score_shapes(prompts, images)
    assert res.accuracy == 1.0 and res.num_samples == 12 and res.correct == [1.0] * 12
    assert set(res.per_tag) == {s.tag for s in specs}
    # a prompt outside the world scores NaN (the trainer drops it) instead of crashing
    bad = build_reward("shapes")(images[:2], ["a photo of a cat", prompts[1]])
    assert torch.isnan(bad.scores[0]) and bad.scores[1] == 1.0


def test_strict_reward_is_the_correct_component():
    rng = np.random.default_rng(5)
    specs = [sample_spec(rng) for _ in range(8)]
    imgs = np.stack([render(s, rng) for s in specs])
    images = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255.0
    # pair every image with the next prompt: mostly wrong, so partial and strict credit differ
    prompts = [s.prompt for s in specs[1:] + specs[:1]]
    partial, strict = build_reward("shapes")(images, prompts), build_reward("shapes_correct")(images, prompts)
    assert torch.equal(strict.scores, partial.components["correct"])
    assert torch.equal(strict.components["partial"], partial.scores)
    assert set(strict.scores.tolist()) <= {0.0, 1.0} and not torch.equal(strict.scores, partial.scores)


def test_prompt_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("a red circle\n\n  two blue squares  \n")
    assert [r["prompt"] for r in load_prompt_file(txt)] == ["a red circle", "two blue squares"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a red circle", "tag": "colors"}\n{"prompt": "a square"}\n')
    assert load_prompt_file(jl) == [
        {"prompt": "a red circle", "tag": "colors", "metadata": {"prompt": "a red circle", "tag": "colors"}},
        {"prompt": "a square", "tag": "default", "metadata": {"prompt": "a square"}}]  # the line, for wants_metadata


@pytest.mark.parametrize("sigma", [0.5, "0-dim", "[B]"])
def test_the_shapes_policy_takes_sigma_as_the_other_adapters_do(sigma):
    """sigma as a float, a 0-dim tensor or one per sample gives the same velocity: the policy puts it on the
    latents' device, one per sample (the forward-process objectives hand over host tensors; on CUDA the
    shapes world failed there before)."""
    from flowgrpo.shapes.model import ShapesFlowModel, ShapesModelConfig
    from flowgrpo.shapes.policy import ShapesPolicy

    torch.manual_seed(0)
    policy = ShapesPolicy(ShapesFlowModel(ShapesModelConfig()), train_mode="full")
    cond = policy.encode_prompts(["a red circle", "two blue squares"])
    x = torch.randn(2, 3, 32, 32)
    given = {"0-dim": torch.tensor(0.5), "[B]": torch.full((2,), 0.5)}.get(sigma, sigma)
    with torch.no_grad():
        v = policy.velocity(x, given, cond)
        assert v.shape == x.shape
        assert torch.equal(v, policy.velocity(x, torch.full((2,), 0.5), cond))


def test_reversed_credit_ranks_a_tie_below_a_reversal_and_leaves_correct_strict():
    """The relation check: 1 when the relation holds, reversed_credit for a reversal (different columns,
    wrong way round), 0 for a tie (one column) or a missing object; ``correct`` counts only the first."""
    from flowgrpo.shapes.verify import Detection, score

    spec = parse_prompt("a red circle left of a blue square")
    a = Detection("circle", "red", 1, 0)
    scenes = {"holds": [a, Detection("square", "blue", 2, 3)], "reversed": [Detection("circle", "red", 1, 3),
              Detection("square", "blue", 2, 1)], "tie": [a, Detection("square", "blue", 3, 0)], "missing": [a]}
    for credit in (0.0, 0.5):
        s = {k: score(spec, d, reversed_credit=credit) for k, d in scenes.items()}
        assert [s[k]["correct"] for k in scenes] == [1.0, 0.0, 0.0, 0.0]
        # 3 count / total checks + the relation: the relation is a quarter of the score
        assert s["holds"]["score"] == 1.0 and s["tie"]["score"] == 0.75
        assert s["reversed"]["score"] == pytest.approx(0.75 + credit / 4)
    with pytest.raises(Exception, match="reversed_credit must be in"):
        build_reward("shapes", reversed_credit=1.0)
    assert build_reward("shapes", reversed_credit=0.5).reversed_credit == 0.5


def test_cell_noise_levels_lead_one_object_cell_and_leave_the_rest_at_sigma():
    """``--lead-prob``: at probability 1 exactly one occupied cell of every image is at sigma * u < sigma and
    every other pixel at sigma; at 0 the map is sigma everywhere."""
    import torch

    from flowgrpo.shapes.pretrain import cell_noise_levels

    x, _ = make_batch(np.random.default_rng(12), 64, drop_prob=0.0, noise=parse_noise("0"))
    sigma = torch.linspace(0.2, 0.99, 64)
    flat = cell_noise_levels(x, sigma, 0.0, torch.Generator().manual_seed(0))
    assert torch.equal(flat, sigma.view(-1, 1, 1, 1).expand(64, 1, 32, 32))
    lead = cell_noise_levels(x, sigma, 1.0, torch.Generator().manual_seed(0))
    occupied = (x > -1).any(1).view(64, GRID, CELL, GRID, CELL).any(4).any(2)  # [B, 4, 4]
    cells = lead[:, 0].view(64, GRID, CELL, GRID, CELL)
    assert torch.equal(cells.amin((2, 4)), cells.amax((2, 4)))  # one level per cell
    levels = cells[:, :, 0, :, 0]  # [B, 4, 4]
    below = levels < sigma.view(-1, 1, 1)
    assert torch.equal(below.sum((1, 2)), torch.ones(64, dtype=torch.long))  # one leading cell per image
    assert bool((below <= occupied).all())  # and it holds an object
    assert bool(((levels == sigma.view(-1, 1, 1)) | below).all())
