"""The OCR reward with the real PP-OCRv4 weights of the rapidocr-onnxruntime wheel (offline).

Text is rendered with the DejaVu fonts that matplotlib ships; images go in as [B, 3, H, W] floats
in [0, 1], as the trainer passes decoded leaves.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("rapidocr_onnxruntime")
matplotlib = pytest.importorskip("matplotlib")
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from flowgrpo.config import load_config  # noqa: E402
from flowgrpo.errors import ConfigError  # noqa: E402
from flowgrpo.rewards import build_reward  # noqa: E402
from flowgrpo.rewards.ocr import (  # noqa: E402
    OCRReward,
    levenshtein,
    normalize_text,
    ocr_text_score,
    quoted_text,
    to_bgr_uint8,
)

FONTS = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
SIZE = 512  # SD3.5's training resolution (square images are also the cheapest for the detector)

# (text, font file, text colour, background colour, tilt in degrees); "\n" renders two lines
CASES = [
    ("Hello World", "DejaVuSans.ttf", "black", "white", 0),
    ("OPEN 24 HOURS", "DejaVuSans-Bold.ttf", "white", (20, 40, 120), 0),
    ("Fresh Coffee", "DejaVuSerif.ttf", (90, 40, 10), (245, 230, 200), 6),
    ("Welcome\nHome", "DejaVuSans.ttf", "black", "white", 0),
    ("STOP", "DejaVuSans-Bold.ttf", "white", (200, 20, 20), 0),
    ("Joe's Diner!", "DejaVuSerif-Bold.ttf", "black", (255, 220, 120), -5),
    ("Gravity Lab 42", "DejaVuSansMono.ttf", (0, 90, 0), "white", 0),
    ("Sale 50% Off", "DejaVuSans.ttf", "black", (200, 230, 255), 3),
    ("Quiet Zone", "DejaVuSerif.ttf", "black", "white", 0),
    ("Pizza Night", "DejaVuSans-Bold.ttf", (240, 200, 0), (30, 30, 30), 0),
    ("Mountain View", "DejaVuSans.ttf", "black", (230, 230, 230), -4),
    ("Exit", "DejaVuSansMono-Bold.ttf", "white", (0, 120, 60), 0),
]
NOISE = 0.04  # std of the Gaussian pixel noise on every render (generated images are never clean)
# unrelated texts for the same images (each shares at most a letter or two with its image's text)
WRONG = ["Quick Fox", "Bike Lane", "Night Owl", "Pure Juice", "Exit", "Free Wifi", "Bakery", "Low Tide",
         "Back Soon", "Old Mill", "Bus Depot", "Jazz Club"]


def render(text: str, font: str = "DejaVuSans.ttf", fg="black", bg="white", tilt: float = 0.0,
           seed: int = 0) -> torch.Tensor:
    """``text`` centred on a SIZE x SIZE canvas at the largest size <= 64 px that fits, rotated by
    ``tilt`` degrees, plus Gaussian noise (std NOISE). Returns [3, H, W] in [0, 1]."""
    img = Image.new("RGB", (SIZE, SIZE), bg)
    draw = ImageDraw.Draw(img)
    for px in range(64, 23, -4):
        ttf = ImageFont.truetype(str(FONTS / font), px)
        box = draw.multiline_textbbox((0, 0), text, font=ttf, spacing=px // 2, align="center")
        if box[2] - box[0] <= SIZE - 48:
            break
    w, h = box[2] - box[0], box[3] - box[1]
    draw.multiline_text(((SIZE - w) // 2 - box[0], (SIZE - h) // 2 - box[1]), text, fill=fg, font=ttf,
                        spacing=px // 2, align="center")
    if tilt:
        img = img.rotate(tilt, resample=Image.BICUBIC, fillcolor=bg)
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255.0
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)) * NOISE
    return (x + noise).clamp(0, 1)


def prompt(text: str) -> str:
    return f'A storefront sign that says "{text.replace(chr(10), " ")}", photo'


@pytest.fixture(scope="module")
def reward():
    return OCRReward()


@pytest.fixture(scope="module")
def renders():
    return torch.stack([render(*case, seed=i) for i, case in enumerate(CASES)])  # [12, 3, 512, 512]


@pytest.fixture(scope="module")
def correct(reward, renders):
    return reward(renders, [prompt(c[0]) for c in CASES])


# --------------------------------------------------------------------------- the rule on strings


def test_levenshtein_by_hand():
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "") == 3 and levenshtein("", "") == 0
    assert levenshtein("kitten", "sitting") == 3  # k->s, e->i, +g
    assert levenshtein("flaw", "lawn") == 2  # -f, +n
    assert levenshtein("hallo", "hello") == levenshtein("hello", "hallo") == 1


@pytest.mark.parametrize("target,recognized,expected", [
    ("hello", "hallo", 1 - 1 / 5),  # one substitution in five characters
    ("sitting", "kitten", 1 - 3 / 7),
    ("Hello World", "HELLO   world", 1.0),  # case and spaces do not count
    ("Open", "We are open today", 1.0),  # the target inside a longer reading: distance 0
    ("ab", "xyzuvw", 0.0),  # distance 6 clamps to len("ab") = 2
    ("Hello", "", 0.0),  # nothing read
    ("Hi!", "Hi", 1 - 1 / 3),  # punctuation counts: "hi!" vs "hi"
    ("STOP!", "\uff33\uff34\uff2f\uff30\uff01", 1.0),  # full-width forms fold to ASCII (NFKC)
])
def test_score_rule_by_hand(target, recognized, expected):
    score, dist = ocr_text_score(target, recognized)
    assert score == pytest.approx(expected)
    assert 0.0 <= score <= 1.0 and dist >= 0


def test_case_sensitive_and_empty_target():
    assert ocr_text_score("Hello", "hello", case_sensitive=True)[0] == pytest.approx(1 - 1 / 5)
    assert ocr_text_score("Hello", "hello")[0] == 1.0
    assert normalize_text(" A b\tC ") == "abc"
    score, dist = ocr_text_score("   ", "abc")
    assert math.isnan(score) and dist == -1


@pytest.mark.parametrize("text,expected", [
    ('A sign that says "Hello World"', "Hello World"),
    ("A neon sign \u201cOpen Late\u201d on a wall", "Open Late"),
    ('Two signs: "Left" and "Right"', "Left Right"),
    ("A cat's poster reading 'Meow Time' in red", "Meow Time"),
    ("A banner \u2018Joe\u2019s Diner\u2019.", "Joe\u2019s Diner"),
    ('A "cat\'s" toy', "cat's"),
    ("A photo of a cat's toy", None),  # an apostrophe is not a quote
    ('An empty sign ""', None),
    ("A mountain lake at dawn", None),
])
def test_quoted_text(text, expected):
    assert quoted_text(text) == expected


def test_channels_go_to_rapidocr_as_bgr():
    red = torch.zeros(1, 3, 2, 2)
    red[:, 0] = 1.0
    arr = to_bgr_uint8(red)
    assert arr.shape == (1, 2, 2, 3) and arr.dtype == np.uint8 and arr.flags["C_CONTIGUOUS"]
    assert arr[0, 0, 0].tolist() == [0, 0, 255]


# --------------------------------------------------------------------------- real OCR


def test_correct_renders_score_high(correct, renders):
    scores = correct.scores
    assert scores.shape == (len(CASES),) and scores.dtype == torch.float32
    print(f"\nOCR correct text: mean {scores.mean():.3f} min {scores.min():.3f} over {len(CASES)} renders")
    assert torch.isfinite(scores).all()
    assert scores.mean() >= 0.9, scores.tolist()
    comp = correct.components
    assert set(comp) == {"ocr_edit_distance", "ocr_target_chars", "ocr_recognized_chars", "ocr_no_target",
                         "ocr_failed"}
    assert all(v.shape == (len(CASES),) for v in comp.values())
    assert (comp["ocr_no_target"] == 0).all() and (comp["ocr_failed"] == 0).all()
    # the two-line render reads in order: top line first
    assert comp["ocr_edit_distance"][3] == 0


def test_wrong_text_scores_low(reward, renders, correct):
    out = reward(renders, [prompt(w) for w in WRONG])
    print(f"\nOCR wrong text: max {out.scores.max():.3f} mean {out.scores.mean():.3f}")
    assert (out.scores <= 0.5).all(), out.scores.tolist()
    assert (out.scores < correct.scores).all()


def test_mixed_batch(reward, renders):
    blank = torch.ones(3, SIZE, SIZE)
    images = torch.stack([renders[0], renders[4], blank, renders[1], renders[2]])
    prompts = [prompt("Hello World"),
               prompt("GO"),  # wrong text
               prompt("Hello World"),  # blank image
               "A storefront at night",  # no quoted text: dropped
               "A bakery sign \u201cFresh Coffee\u201d"]  # curly quotes
    out = reward(images, prompts)
    s = out.scores
    assert s[0] >= 0.9 and s[4] >= 0.9
    assert s[1] <= 0.5 and s[2] <= 0.1
    assert math.isnan(s[3]) and out.components["ocr_no_target"].tolist() == [0, 0, 0, 1, 0]
    assert out.components["ocr_recognized_chars"][2] == 0  # nothing read on a blank image
    assert math.isnan(out.components["ocr_edit_distance"][3])


def test_ocr_failure_is_nan_for_that_sample_only(reward, renders, monkeypatch):
    real = reward.engine
    calls = []

    def flaky(image):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("onnxruntime exploded")
        return real(image)

    monkeypatch.setattr(reward, "engine", flaky)
    out = reward(renders[[4, 11, 4]], [prompt("STOP"), prompt("Exit"), prompt("STOP")])
    assert out.scores[0] >= 0.9 and out.scores[2] >= 0.9 and math.isnan(out.scores[1])
    assert out.components["ocr_failed"].tolist() == [0, 1, 0]


def test_built_from_the_registry_with_options():
    r = build_reward("ocr", min_confidence=0.3, case_sensitive=True, use_cls=False, threads=1)
    assert isinstance(r, OCRReward) and r.case_sensitive and r.min_confidence == 0.3
    with pytest.raises(ConfigError, match="min_confidence"):
        build_reward("ocr", confidence=0.3)


def test_sd35_ocr_recipe_loads_without_weights():
    cfg = load_config(recipe="sd35-ocr")  # validated: the adapter name stands in for the folder the run passes
    assert cfg.model.name == "sd3" and cfg.reward.weights == {"ocr": 1.0}
    # Flow-GRPO's evaluation on its OCR test file (shipped), every 60 iterations at 40 steps
    assert cfg.eval.evaluator == "bench" and cfg.eval.options["bench"] == "ocr" and cfg.eval.every == 60
    assert cfg.model.path is None and cfg.preset == "flow-grpo"
