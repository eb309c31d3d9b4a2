"""GenEval's models on tiny random configs: the Mask2Former detector, the CLIP colour rule and the ``geneval``
reward end to end (output shapes, determinism, the scorer's verdict, one-line errors for missing weights),
and prompt metadata reaching the rewards that read it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowgrpo.errors import UserError
from flowgrpo.rewards import build_reward
from flowgrpo.rewards.geneval import COLOURS, judge, select_objects
from flowgrpo.rewards.geneval.colour import TEMPLATES, ColourClassifier, masked_crop
from flowgrpo.rewards.geneval.detector import (OBJECT_NAMES, Mask2FormerDetector, load_mask2former, mask_boxes,
                                               resized_size)

open_clip = pytest.importorskip("open_clip")
transformers = pytest.importorskip("transformers")

TINY = "flowgrpo-geneval-tiny-clip"
CAT = OBJECT_NAMES.index("cat")
SCALE = {"max_size": 96, "min_size": 64}  # the detector's input scale in these tests (mmdet: 1333 / 800)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    d = tmp_path_factory.mktemp("geneval_clip")
    cfg = {"embed_dim": 24, "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    (d / f"{TINY}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(d)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = open_clip.create_model(TINY, pretrained=None)
    torch.save(model.state_dict(), d / "clip.pt")
    return d / "clip.pt"


@pytest.fixture(scope="module")
def tiny_detector(tmp_path_factory):
    """A tiny random Swin + Mask2Former with 80 labels, biased so that every query reads "cat" with a
    probability near 1 (random weights otherwise score every class near 1/81, under any threshold)."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    swin = SwinConfig(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                      window_size=4, out_features=["stage1", "stage2", "stage3", "stage4"])
    cfg = Mask2FormerConfig(backbone_config=swin, num_labels=80, hidden_dim=32, mask_feature_size=32, feature_size=32,
                            num_queries=6, encoder_layers=1, decoder_layers=2, dim_feedforward=32, num_attention_heads=2,
                            encoder_feedforward_dim=32, common_stride=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Mask2FormerForUniversalSegmentation(cfg)
    with torch.no_grad():
        model.class_predictor.bias[CAT] += 12.0
    d = tmp_path_factory.mktemp("geneval_m2f")
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def images():
    g = torch.Generator().manual_seed(0)
    x = F.interpolate(torch.rand(3, 3, 12, 10, generator=g), size=(48, 40), mode="bilinear", align_corners=False)
    return (x * 255).round() / 255


def test_resize_and_mask_boxes_as_mmdet():
    assert resized_size(512, 512) == (800, 800) and resized_size(768, 1024) == (800, 1067)
    assert resized_size(1024, 1024) == (800, 800)
    m = torch.zeros(2, 5, 6, dtype=torch.bool)
    m[0, 1:3, 2:5] = True
    assert mask_boxes(m).tolist() == [[2.0, 1.0, 5.0, 3.0], [0.0, 0.0, 0.0, 0.0]]  # one past the last pixel; empty: 0


def test_detector_rows_masks_and_determinism(tiny_detector, images):
    det = Mask2FormerDetector(load_mask2former(tiny_detector), torch.device("cpu"), max_per_image=20,
                              image_scale=(96, 64))
    first, again = det(images), det(images)
    for d, e in zip(first, again):
        assert set(d.rows) <= set(OBJECT_NAMES) and sum(len(r) for r in d.rows.values()) == 20
        for name, rows in d.rows.items():
            masks = d.masks[name]
            assert rows.dtype == np.float32 and rows.shape[1] == 5 and masks.shape == (len(rows), 48, 40)
            assert masks.dtype == bool and ((rows[:, 4] >= 0) & (rows[:, 4] <= 1)).all()
            assert np.array_equal(rows[:, :4], mask_boxes(torch.from_numpy(masks)).numpy())
            assert np.array_equal(rows, e.rows[name]) and np.array_equal(masks, e.masks[name])
    assert max(first[0].rows["cat"][:, 4]) > 0.3  # the biased class clears GenEval's threshold


def test_masked_crop_composites_on_gray_and_rounds_the_box():
    img = np.full((6, 6, 3), 200, np.uint8)
    mask = np.zeros((6, 6), bool)
    mask[1:4, 1:4] = True
    crop = np.asarray(masked_crop(img, [0.5, 0.5, 4.5, 3.5, 0.9], mask))  # PIL rounds half to even: (0, 0, 4, 4)
    assert crop.shape == (4, 4, 3)
    assert (crop[1:4, 1:4] == 200).all() and (crop[0] == 153).all() and (crop[:, 0] == 153).all()


def test_colour_rule_matches_an_independent_zero_shot(tiny_clip):
    clf = ColourClassifier(TINY, str(tiny_clip), torch.device("cpu"), batch_size=2)
    rng = np.random.default_rng(0)
    crops = [masked_crop(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8), [2, 3, 17, 19, 1.0],
                         rng.random((20, 24)) > 0.3) for _ in range(5)]
    names = ["cat", "tv remote", "cat", "cup", "dog"]
    got = clf(crops, names)
    model = open_clip.create_model(TINY, pretrained=None)
    model.load_state_dict(torch.load(tiny_clip, weights_only=True))
    model.eval()
    tok = open_clip.get_tokenizer(TINY)
    _, _, preprocess = open_clip.create_model_and_transforms(TINY, pretrained=None)
    want = []
    with torch.no_grad():
        for crop, name in zip(crops, names):
            image = F.normalize(model.encode_image(preprocess(crop)[None]), dim=-1)[0]
            best = []
            for c in COLOURS:
                t = F.normalize(model.encode_text(tok([s.format(c=c, name=name) for s in TEMPLATES])), dim=-1).mean(0)
                best.append(float(image @ (t / t.norm())))
            want.append(COLOURS[int(np.argmax(best))])
    assert got == want and clf(crops, names) == got
    assert TEMPLATES[1].format(c="red", name="cat") == "a photo of a red-colored cat"


METADATA = [
    {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}], "prompt": "a photo of a red cat"},
    {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]},
    {"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}]},
]


def test_reward_end_to_end(tiny_detector, tiny_clip, images):
    opts = dict(detector=str(tiny_detector), clip_model=TINY, clip_pretrained=str(tiny_clip), device="cpu", **SCALE)
    reward = build_reward("geneval", batch_size=3, **opts)
    out = reward(images, ["p"] * 3, metadata=METADATA)
    assert out.scores.shape == (3,) and set(out.components) == {"partial", "strict", "geneval"}
    assert torch.equal(out.scores, out.components["partial"]) and torch.isfinite(out.scores).all()
    one = build_reward("geneval", batch_size=1, score="geneval", **opts)(images, ["p"] * 3, metadata=METADATA)
    assert torch.equal(one.scores, out.components["geneval"])  # batch size and score choice change nothing else
    for k in out.components:
        assert torch.equal(one.components[k], out.components[k])
    # the verdict is evaluate_detections' on the detector's output with the colour rule's colours
    found = reward.detect(images)
    from flowgrpo.images import to_uint8

    for i, (d, meta) in enumerate(zip(found, METADATA)):
        sel = select_objects(d.rows, meta["tag"])
        objects = {c: d.rows[c][idx] for c, idx in sel.items()}

        def colour_of(name, rows, d=d, sel=sel, i=i):
            crops = [masked_crop(to_uint8(images)[i], rows[j], d.masks[name][sel[name][j]]) for j in range(len(rows))]
            return reward.colours(crops, [name] * len(crops))

        assert float(judge(meta, objects, colour_of)[0]) == float(out.components["geneval"][i])
    nan = reward(images[:1], ["p"], metadata=[{"no": "tag"}])
    assert torch.isnan(nan.scores).all()
    jpeg = build_reward("geneval", jpeg_quality=75, **opts)(images, ["p"] * 3, metadata=METADATA)
    assert jpeg.scores.shape == (3,) and torch.isfinite(jpeg.scores).all()


def test_missing_weights_and_metadata_are_one_line_errors(tiny_detector, tmp_path):
    with pytest.raises(UserError, match=r"reward.options.geneval.detector: no such folder '.*nope'"):
        build_reward("geneval", detector=str(tmp_path / "nope"), device="cpu")
    missing = tmp_path / "clip.pt"
    with pytest.raises(UserError, match=r"reward.options.geneval.clip_pretrained: no such file '.*clip.pt'") as err:
        build_reward("geneval", detector=str(tiny_detector), clip_model=TINY, clip_pretrained=str(missing), device="cpu")
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="needs option"):
        build_reward("geneval")


def test_metadata_reaches_the_rewards_that_read_it(tmp_path, tiny_detector, tiny_clip, images):
    from flowgrpo.data import PromptSource
    from flowgrpo.rewards.base import check_metadata
    from flowgrpo.rewards.callable import CallableReward
    from flowgrpo.rewards.video import score_frames

    path = tmp_path / "geneval.jsonl"
    path.write_text("".join(json.dumps(dict(m, prompt=m.get("prompt", f"p{i}"))) + "\n" for i, m in enumerate(METADATA)))
    drawn = PromptSource(str(path), seed=1).draw(0, 5)
    assert [m["prompt"] for m in drawn.metadata] == drawn.prompts and drawn.metadata[0]["include"]
    seen = []

    def reads(images, prompts, metadata):
        seen.append(metadata)
        return [1.0] * len(prompts)

    score_frames(CallableReward(reads), images[:2], ["a", "b"], metadata=drawn.metadata[:2])
    assert seen == [drawn.metadata[:2]]
    txt = tmp_path / "p.txt"
    txt.write_text("a photo of a cat\n")
    assert PromptSource(str(txt)).draw(0, 2).metadata is None
    with pytest.raises(UserError, match="reward 'g' reads each prompt's metadata"):
        check_metadata({"g": CallableReward(reads)}, str(txt), PromptSource(str(txt)).has_metadata)
    reward = build_reward("geneval", detector=str(tiny_detector), clip_model=TINY, clip_pretrained=str(tiny_clip),
                          device="cpu", **SCALE)
    with pytest.raises(UserError, match="needs each prompt's GenEval metadata"):
        reward(images, ["p"] * 3)


def test_the_trainer_hands_each_leaf_its_prompts_line(tiny_config, tmp_path):
    """A reward that reads metadata gets, for every leaf, the .jsonl line of that leaf's prompt; the shapes
    world's GenEval metadata makes it a GenEval reward on shapes images."""
    from flowgrpo.rewards.geneval.shapes_world import geneval_verdict, spec_metadata
    from flowgrpo.shapes.prompts import parse_prompt
    from flowgrpo.trainer.trainer import Trainer
    from flowgrpo.images import to_uint8

    path = tmp_path / "shapes_geneval.jsonl"
    prompts = ["a red circle", "two blue squares", "a green triangle left of a red square"]
    path.write_text("".join(json.dumps(spec_metadata(parse_prompt(p))) + "\n" for p in prompts))
    seen = []

    def geneval_on_shapes(images, prompts, metadata):
        seen.append((list(prompts), [m["prompt"] for m in metadata]))
        return [float(geneval_verdict(parse_prompt(m["prompt"]), img)[0]) for m, img in zip(metadata, to_uint8(images))]

    trainer = Trainer.from_config(tiny_config(**{"data.prompts": str(path)}), rewards={"g": geneval_on_shapes})
    col = trainer.collect(0)
    assert seen and all(p == m for p, m in seen) and len(seen[0][0]) == col.rewards["g"].numel()
    with pytest.raises(UserError, match="reward 'g' reads each prompt's metadata, and data.prompts='shapes' gives none"):
        Trainer.from_config(tiny_config(), rewards={"g": geneval_on_shapes})
