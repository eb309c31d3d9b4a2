"""Image fidelity of the shapes world: clean drawing scores 1, texture and noise score visibly lower.

Fidelity (flowgrpo.shapes.fidelity) measures how cleanly an image is drawn, whatever it shows; it is
the evaluation's guard against RL runs that gain accuracy while the background picks up texture.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from flowgrpo.evaluation import EvalResult
from flowgrpo.shapes.evaluate import evaluate_policy, score_shapes
from flowgrpo.shapes.fidelity import fidelity_parts, image_fidelity, to_uint8
from flowgrpo.shapes.model import ShapesFlowModel
from flowgrpo.shapes.policy import ShapesPolicy
from flowgrpo.shapes.world import CELL, COLORS, IMAGE_SIZE, draw, render, sample_spec


def _renders(n: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """Clean renders of random scenes [n, 3, 32, 32] in [0, 1] and their prompts."""
    rng = np.random.default_rng(seed)
    specs = [sample_spec(rng) for _ in range(n)]
    imgs = np.stack([render(s, rng) for s in specs])
    return torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 255.0, [s.prompt for s in specs]


def _sinusoid(amplitude: float) -> torch.Tensor:
    """A fixed grey diagonal texture [32, 32] of the given amplitude (period 8 pixels)."""
    yy, xx = torch.meshgrid(torch.arange(IMAGE_SIZE), torch.arange(IMAGE_SIZE), indexing="ij")
    return amplitude * torch.sin(2 * math.pi * (xx + yy).float() / 8.0)


def _noise(images: torch.Tensor, std: float) -> torch.Tensor:
    return std * torch.randn(images.shape, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def base_eval():
    policy = ShapesPolicy(ShapesFlowModel.load(), guidance_scale=1.0, train_mode="frozen")
    return evaluate_policy(policy, num_prompts=16, seeds_per_prompt=2, num_steps=20, return_images=True)


def test_the_shipped_base_model_draws_with_full_fidelity(base_eval):
    # measured: 1.000 mean, every image >= 0.998 (256 held-out samples: mean 0.99996, min 0.9986)
    fid = image_fidelity(base_eval.images)
    assert fid.shape == (32,)
    assert fid.mean() >= 0.95 and fid.min() >= 0.9
    assert base_eval.fidelity == pytest.approx(float(fid.mean()))
    assert base_eval.to_json()["fidelity"] == base_eval.fidelity
    # fidelity is about drawing, accuracy about the prompt: the base model is far from accurate
    assert base_eval.accuracy < 0.9


def test_clean_renders_score_one():
    images, _ = _renders(64, seed=0)
    fid, background, foreground = fidelity_parts(to_uint8(images))
    assert np.all(fid >= 0.98) and np.all(background >= 0.98) and np.all(foreground >= 0.98)
    # an empty canvas has no foreground: its fidelity is the background's
    fid, background, foreground = fidelity_parts(np.zeros((1, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8))
    assert fid[0] == background[0] == 1.0 and np.isnan(foreground[0])


@pytest.mark.parametrize("source", ["renders", "base_model"])
def test_background_texture_and_noise_lower_fidelity(source, base_eval):
    images = _renders(64, seed=1)[0] if source == "renders" else base_eval.images
    clean = image_fidelity(images).mean()
    # measured on the 256 held-out base-model samples: sinusoid 0.08 -> 0.637, noise 0.05 -> 0.509,
    # noise 0.02 -> 0.882 (from 1.000)
    textured = image_fidelity((images + _sinusoid(0.08)).clamp(0, 1))
    noisy = image_fidelity((images + _noise(images, 0.05)).clamp(0, 1))
    faint = image_fidelity((images + _noise(images, 0.02)).clamp(0, 1))
    assert clean - textured.mean() >= 0.25 and clean - noisy.mean() >= 0.3
    assert clean - faint.mean() >= 0.05
    # every single textured image is worse than every clean one would be
    assert textured.max() < 0.8 and noisy.max() < 0.8
    # texture on the empty background alone shows up in the background part
    tex = (images + _sinusoid(0.08)).clamp(0, 1)
    _, background, _ = fidelity_parts(to_uint8(tex))
    assert background.mean() <= 0.85


def test_noisy_glyphs_lower_foreground_fidelity_only():
    images, _ = _renders(16, seed=2)
    arr = to_uint8(images).astype(np.int16)
    fg = arr.max(-1) > 0  # glyph pixels of a clean render (the canvas is black)
    rng = np.random.default_rng(0)
    arr[fg] += rng.choice(np.array([-40, 40], np.int16), size=(int(fg.sum()), 3))
    fid, background, foreground = fidelity_parts(np.clip(arr, 0, 255).astype(np.uint8))
    assert np.all(background >= 0.98) and np.all(foreground <= 0.2)
    assert np.allclose(fid, (background + foreground) / 2)


def test_fidelity_ignores_the_prompt():
    images, prompts = _renders(12, seed=3)
    right = score_shapes(prompts, images)
    wrong = score_shapes(prompts[1:] + prompts[:1], images)  # every image under another image's prompt
    assert right.accuracy == 1.0 and wrong.accuracy < 1.0
    assert right.fidelity == wrong.fidelity and right.fidelity >= 0.98


def test_fidelity_range_shape_and_determinism():
    images, _ = _renders(8, seed=4)
    batch = torch.cat([images, (images + _noise(images, 0.05)).clamp(0, 1),
                       torch.rand(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1))])
    a, b = image_fidelity(batch), image_fidelity(batch.clone())
    assert a.shape == (24,) and a.dtype == np.float64
    assert np.all((a >= 0) & (a <= 1)) and np.array_equal(a, b)
    assert a[16:].max() < 0.3  # uniform noise is nothing like the world
    # per-image: a batch scores each image as it would alone
    assert np.array_equal(image_fidelity(batch[5:6]), a[5:6])
    # out-of-range values are clamped like the evaluator does
    assert np.array_equal(image_fidelity(images * 1.5 - 0.25), image_fidelity((images * 1.5 - 0.25).clamp(0, 1)))
    with pytest.raises(ValueError, match="32, 32, 3"):
        image_fidelity(torch.zeros(1, 3, 16, 16))


def test_a_smeared_cell_is_unfaithful():
    # a glyph whose colour is an even blend of two palette colours is far from every template
    blend = tuple((np.array(COLORS["red"]) + np.array(COLORS["blue"])) // 2)
    img = draw([("square", "red", 1, 1)])
    smeared = img.copy()
    smeared[CELL:2 * CELL, CELL:2 * CELL][img[CELL:2 * CELL, CELL:2 * CELL].max(-1) > 0] = blend
    fid, _, foreground = fidelity_parts(np.stack([img, smeared]))
    assert fid[0] == 1.0 and foreground[1] == 0.0 and fid[1] <= 0.55


def test_eval_result_json_has_fidelity():
    res = EvalResult(accuracy=0.5, per_tag={}, num_samples=2, fidelity=0.75)
    assert json.loads(json.dumps(res.to_json()))["fidelity"] == 0.75
    assert EvalResult(accuracy=0.5, per_tag={}, num_samples=2).to_json()["fidelity"] is None


def test_curve_and_before_after_figures_with_and_without_fidelity(tmp_path):
    from flowgrpo.output.plots import save_accuracy_curve
    from flowgrpo.evaluation.in_training import save_before_after as _save_before_after

    old = [{"iteration": 0, "train_seconds": 0.0, "accuracy": 0.4, "accuracy_unseen": 0.3},
           {"iteration": 5, "train_seconds": 60.0, "accuracy": 0.6, "accuracy_unseen": None}]
    new = [dict(c, fidelity=f) for c, f in zip(old, (1.0, 0.6))]
    save_accuracy_curve(tmp_path / "old.png", old, 32)  # summaries from before fidelity existed
    save_accuracy_curve(tmp_path / "new.png", new, 32)
    images, prompts = _renders(4, seed=5)
    grid = (images, prompts, [1.0, 0.0, 1.0, 0.0])
    _save_before_after(tmp_path / "ba_old.png", grid, grid, 0.4, 0.6)
    _save_before_after(tmp_path / "ba_new.png", grid, grid, 0.4, 0.6, 1.0, 0.6)
    for name in ("old", "new", "ba_old", "ba_new"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
