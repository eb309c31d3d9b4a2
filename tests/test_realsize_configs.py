"""The published transformer configurations build in the installed diffusers, on the meta device."""

import diffusers
import pytest
import torch

from flowgrpo.realsize.configs import (REAL_TRANSFORMERS, build_transformer, recipe_names, target_matches,
                                       transformer_config)

#: published sizes (billions of transformer parameters), to 2 % (model cards round: "2.5B" SD3.5-M
#: counts the text-free MMDiT at 2.24B in diffusers, "1.3B" Wan is 1.42B)
NOMINAL = {"sd35-medium": 2.24, "sd35-large": 8.06, "flux1-dev": 11.9, "flux1-kontext-dev": 11.9, "flux2-dev": 32.2,
           "qwen-image": 20.4, "qwen-image-edit": 20.4, "z-image": 6.15, "wan21-t2v-1.3b": 1.42,
           "wan21-t2v-14b": 14.3, "wan22-a14b": 14.3, "wan22-ti2v-5b": 5.0, "hunyuanvideo15": 8.33}


def test_every_recipe_listed():
    assert set(recipe_names()) == set(NOMINAL)


@pytest.mark.parametrize("recipe", list(NOMINAL))
def test_builds_on_meta_at_published_size(recipe):
    entry = transformer_config(recipe)
    assert hasattr(diffusers, entry.class_name) and entry.source
    model = build_transformer(recipe)
    params = list(model.parameters())
    assert all(p.device.type == "meta" for p in params)
    assert sum(p.numel() for p in params) / 1e9 == pytest.approx(NOMINAL[recipe], rel=0.02)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert any(target_matches(n, entry.lora_targets) for n in names), "LoRA targets match no layer"


def test_sd35_medium_published_numbers():
    cfg = transformer_config("sd35-medium").config
    assert (cfg["num_layers"], cfg["num_attention_heads"], cfg["attention_head_dim"]) == (24, 24, 64)
    assert cfg["dual_attention_layers"] == list(range(13)) and cfg["qk_norm"] == "rms_norm"
    assert (cfg["joint_attention_dim"], cfg["caption_projection_dim"], cfg["pooled_projection_dim"]) == (4096, 1536, 2048)


def test_wan22_a14b_has_two_experts_and_overrides():
    entry = transformer_config("wan22-a14b")
    assert entry.experts == ("transformer", "transformer_2") and entry.adapter == "pipeline"
    assert transformer_config("wan21-t2v-1.3b").adapter == "wan"
    small = build_transformer("wan21-t2v-1.3b", num_layers=1)
    assert len(small.blocks) == 1 and small.config.num_attention_heads == 12


def test_unknown_recipe_names_known_ones():
    with pytest.raises(KeyError, match="sd35-medium"):
        transformer_config("sd9")


def test_target_matching_follows_peft():
    assert target_matches("blocks.0.attn1.to_q", ["to_q"])
    assert not target_matches("blocks.0.attn1.norm_to_q", ["to_q"])
    assert target_matches("transformer_blocks.3.attn.to_q", r".*transformer_blocks\.\d+\.attn\.to_q")
    assert REAL_TRANSFORMERS["flux1-dev"].adapter == "flux"
