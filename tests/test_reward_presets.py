"""Reward scales in the shipped presets and recipes, and the default of ``clipscore``.

``sum_then_normalize`` adds the weighted raw rewards before the z-score, so a reward whose scores
are 100 times smaller than another's barely moves the advantage: ``sd35-pickscore`` summed raw
PickScore (18-24) and HPS (0.2-0.35) one to one. Every preset or recipe that sums several rewards must weigh
them onto one order of magnitude (or z-score each first: ``normalize_then_sum``).
"""

from __future__ import annotations

import json

import pytest
import torch

from flowgrpo.config import load_config, preset_names, recipe_names
from flowgrpo.rewards import build_reward

#: typical magnitude of a reward's score (the middle of its usual range), by reward name
TYPICAL_SCALE = {
    "shapes": 0.5,                 # verifier partial credit in [0, 1]
    "shapes_correct": 0.5,         # 0 or 1
    "shapes_pairwise": 0.5,        # win rate in [0, 1]
    "judge": 0.5,                  # "Score: N" / 10, or yes/no as 1/0
    "judge_pairwise": 0.5,         # win rate in [0, 1]
    "ocr": 0.5,                    # 1 - edit distance / length, in [0, 1]
    "hpsv2": 0.28,                 # raw cosine, 0.2-0.35
    "pickscore": 21.0,             # logit_scale (~100) x cosine, 18-24
    "clipscore": 0.7,              # 2.5 x max(cos, 0) with cos about 0.2-0.35 (ViT-L/14)
    "aesthetic": 5.5,              # LAION aesthetic predictor, 1-10 scale, usually 4.5-6.5
    "jpeg_compressibility": 100.0,  # -(JPEG kB) of a 512 x 512 image at quality 95: tens to a few hundred
    "jpeg_incompressibility": 100.0,
}
#: "one order of magnitude": the largest weighted scale over the smallest
MAX_RATIO = 10.0


@pytest.mark.parametrize("preset,recipe", [(p, "shapes") for p in preset_names()] +
                         [(None, r) for r in recipe_names()])
def test_summed_rewards_share_a_scale(preset, recipe):
    cfg = load_config(preset, recipe=recipe) if preset else load_config(recipe=recipe)  # else: the recipe's method
    preset = preset or f"recipe {recipe}"
    weights = cfg.reward.weights
    if len(weights) < 2:
        return
    if cfg.reward.combine == "normalize_then_sum":
        # each reward is z-scored within its group and the weighted sum is the advantage: a global
        # std would be silently ignored (flowgrpo.advantages.group)
        assert cfg.advantage.std == "group", f"{preset}: advantage.std {cfg.advantage.std} has no effect here"
        return
    unknown = sorted(set(weights) - set(TYPICAL_SCALE))
    assert not unknown, f"{preset}: add the typical score of {unknown} to TYPICAL_SCALE"
    weighted = {name: abs(w) * TYPICAL_SCALE[name] for name, w in weights.items()}
    ratio = max(weighted.values()) / min(weighted.values())
    print(f"{preset}: weight x typical score = {weighted} (ratio {ratio:.1f})")
    assert ratio <= MAX_RATIO, (f"{preset} sums {weighted} (weight x typical score) before normalising: "
                                f"scale the weights or use reward.combine: normalize_then_sum")


@pytest.mark.parametrize("recipe", [r for r in recipe_names() if r.startswith("sd35-")])
def test_flow_grpo_on_sd35_recipes_uses_the_global_std(recipe):
    """Flow-GRPO's SD3.5 configs (general_ocr_sd3, pickscore_sd3, geneval_sd3) all set
    sample.global_std = True: per-prompt mean, std over the whole batch."""
    assert load_config("flow-grpo", recipe=recipe).advantage.std == "global"


# --------------------------------------------------------------------------- clipscore's default


TINY = "flowgrpo-tiny-clip-presets"
PROMPTS = ["a red cube on a wooden table", "two dogs playing in the snow", "an astronaut riding a horse",
           "a bowl of fruit, oil painting"]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A registered tiny open_clip architecture and its random weights (nothing downloads)."""
    open_clip = pytest.importorskip("open_clip")
    d = tmp_path_factory.mktemp("tiny_clip")
    cfg = {"embed_dim": 24,
           "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
           "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    (d / f"{TINY}.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(d)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = open_clip.create_model(TINY, pretrained=None)
    torch.save(model.state_dict(), d / "clip_tiny.pt")
    return d / "clip_tiny.pt"


def _cosine(reward, images, prompts):
    """Cosine of the L2-normalised embeddings, computed here from the reward's model and pixels."""
    with torch.no_grad():
        img = reward.model.encode_image(reward.tensor_pixels(images))
        txt = reward.model.encode_text(reward.tokenizer(prompts))
    return torch.nn.functional.cosine_similarity(img, txt, dim=-1)


def test_clipscore_defaults_to_the_published_metric(tiny_clip):
    g = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, 64, 64, generator=g)
    paper = build_reward("clipscore", model_name=TINY, pretrained=str(tiny_clip), device="cpu")
    cos_paper = _cosine(paper, images, ["A photo depicts " + p for p in PROMPTS])
    out = paper(images, PROMPTS)
    # CLIPScore (Hessel et al. 2021): w = 2.5, clamped at 0, captions prefixed "A photo depicts "
    assert torch.allclose(out.scores, 2.5 * cos_paper.clamp(min=0), atol=1e-6), (out.scores, cos_paper)
    assert torch.allclose(out.components["cosine"], cos_paper, atol=1e-6)

    raw = build_reward("clipscore", model_name=TINY, pretrained=str(tiny_clip), device="cpu", formula="cosine")
    cos = _cosine(raw, images, PROMPTS)
    raw_scores = raw(images, PROMPTS).scores
    assert torch.allclose(raw_scores, cos, atol=1e-6)  # the raw cosine: no prefix, no clamp, no 2.5
    assert bool((raw_scores < 0).any()) and bool((raw_scores > 0).any())  # (the clamp would matter here)
