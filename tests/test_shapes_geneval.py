"""The shapes world speaks GenEval: prompts carry GenEval metadata, the verifier's parse goes to GenEval's
scorer, and every difference between the two verdicts on the shipped model's samples has a named cause."""

from __future__ import annotations

import numpy as np

from flowgrpo.rewards.geneval.shapes_world import (DISAGREEMENTS, explain_disagreement, geneval_verdict, parse_detections,
                                     spec_metadata)
from flowgrpo.shapes.prompts import parse_prompt
from flowgrpo.shapes.verify import Detection, detect, verify
from flowgrpo.shapes.world import all_specs, draw


def test_metadata_of_each_tag():
    assert spec_metadata(parse_prompt("two red circles")) == {
        "tag": "counting", "include": [{"class": "circle", "count": 2, "color": "red"}],
        "exclude": [{"class": "circle", "count": 3}], "prompt": "two red circles"}
    assert spec_metadata(parse_prompt("a blue square left of a red triangle")) == {
        "tag": "position", "include": [{"class": "triangle", "count": 1, "color": "red"},
                                       {"class": "square", "count": 1, "color": "blue", "position": ["left of", 0]}],
        "prompt": "a blue square left of a red triangle"}
    assert spec_metadata(parse_prompt("a circle and a square"))["include"] == [{"class": "circle", "count": 1},
                                                                              {"class": "square", "count": 1}]


def test_parsed_glyphs_become_detections():
    dets, colour_of = parse_detections([Detection("circle", "red", 1, 2), Detection("circle", "blue", 3, 0)])
    assert dets["circle"].dtype == np.float32 and dets["circle"].shape == (2, 5)
    assert dets["circle"][:, 4].tolist() == [1.0, 1.0] and dets["circle"][0, 0] >= 16 and dets["circle"][0, 2] <= 24
    assert colour_of("circle", dets["circle"][::-1]) == ["blue", "red"]


def test_drawn_scenes_pass_both_where_genevals_rules_can_say_so():
    rng = np.random.default_rng(0)
    for tag in ("single_object", "two_object", "counting", "colors", "color_attr", "position"):
        for spec in all_specs(tag):
            if len(spec.objects) == 2 and spec.objects[0].shape == spec.objects[1].shape:
                continue  # GenEval's per-class clauses cannot tell two circles apart (same_shape_pair)
            objs, cells = [], rng.permutation(16)
            for o in spec.objects:
                for _ in range(o.count):
                    objs.append([o.shape, o.color or "green", *divmod(int(cells[len(objs)]), 4)])
            if spec.relation is not None:  # one row or one column: inside GenEval's cone too
                axis = {"left of": (2, 1), "right of": (2, 3), "above": (1, 2), "below": (3, 2)}[spec.relation]
                objs[0][2:], objs[1][2:] = axis, (2, 2)
            img = draw([tuple(o) for o in objs])
            assert verify(spec, img)["correct"] == 1.0
            assert geneval_verdict(spec, img) == (True, ""), spec.prompt


def test_each_kind_of_disagreement():
    same = parse_prompt("a red circle left of a blue circle")
    img = draw([("circle", "red", 1, 0), ("circle", "blue", 1, 3)])
    assert verify(same, img)["correct"] == 1.0 and geneval_verdict(same, img)[0] is False
    assert explain_disagreement(same, detect(img), True, False) == "same_shape_pair"
    extra = parse_prompt("a circle and a square")
    img = draw([("circle", "red", 0, 0), ("square", "red", 0, 2), ("triangle", "red", 3, 3)])
    assert verify(extra, img)["correct"] == 0.0 and geneval_verdict(extra, img) == (True, "")
    assert explain_disagreement(extra, detect(img), False, True) == "extra_objects"
    cone = parse_prompt("a green square above a red circle")
    img = draw([("square", "green", 0, 3), ("circle", "red", 1, 0)])
    assert verify(cone, img)["correct"] == 1.0
    assert geneval_verdict(cone, img) == (False, "expected square above target, found right of target")
    assert explain_disagreement(cone, detect(img), True, False) == "position_cone"
    assert set(DISAGREEMENTS) == {"same_shape_pair", "extra_objects", "position_cone"}


def test_every_disagreement_on_base_model_samples_is_explained():
    import torch

    from flowgrpo.images import to_uint8
    from flowgrpo.shapes.evaluate import evaluate_policy
    from flowgrpo.shapes.model import ShapesFlowModel
    from flowgrpo.shapes.policy import ShapesPolicy

    torch.manual_seed(0)
    policy = ShapesPolicy(ShapesFlowModel.load(), guidance_scale=1.0, train_mode="frozen")
    res = evaluate_policy(policy, num_prompts=48, seeds_per_prompt=1, num_steps=10, return_images=True)
    for prompt, img in zip(res.prompts, to_uint8(res.images)):
        spec = parse_prompt(prompt)
        v, g = bool(verify(spec, img)["correct"]), geneval_verdict(spec, img)[0]
        assert v == g or explain_disagreement(spec, detect(img), v, g) is not None, prompt
