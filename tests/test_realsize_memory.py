"""Counts and activation accounting of flowgrpo.realsize on small configurations of the real classes."""

import dataclasses

import pytest
import torch

from flowgrpo.realsize.activations import Geometry, activation_bytes
from flowgrpo.realsize.configs import build_transformer, transformer_config
from flowgrpo.realsize.memory import (block_of, layout_bytes, layouts, parameter_count, training_state,
                                      wrap_lora)

#: SD3.5-Medium's layout (dual attention in block 0, RMS q/k norm) at toy widths
TINY_SD3 = {"sample_size": 8, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 2,
            "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 24,
            "caption_projection_dim": 16, "pooled_projection_dim": 12, "pos_embed_max_size": 16,
            "dual_attention_layers": [0], "qk_norm": "rms_norm"}
TINY_WAN = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 16,
            "out_channels": 16, "text_dim": 24, "freq_dim": 32, "ffn_dim": 32, "num_layers": 2, "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32}


def tiny_entry(recipe: str, config: dict):
    return dataclasses.replace(transformer_config(recipe), config=config)


@pytest.mark.parametrize("recipe,config", [("sd35-medium", TINY_SD3), ("wan21-t2v-1.3b", TINY_WAN)])
def test_meta_counts_equal_a_real_model(recipe, config):
    entry = tiny_entry(recipe, config)
    meta = build_transformer(entry)
    torch.manual_seed(0)
    real = build_transformer(entry, device="cpu", dtype=torch.float32)
    assert parameter_count(meta) == sum(p.numel() for p in real.parameters()) > 0
    # LoRA: the count on meta equals peft's trainable count on the real model
    wrap_lora(meta, entry, rank=4)
    wrap_lora(real, entry, rank=4)
    trainable = sum(p.numel() for p in real.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in meta.parameters() if p.requires_grad) > 0
    # and equals peft's own count of a PeftModel over the same targets
    from peft import LoraConfig, get_peft_model

    fresh = build_transformer(entry, device="cpu", dtype=torch.float32)
    peft_model = get_peft_model(fresh, LoraConfig(r=4, lora_alpha=8, target_modules=entry.lora_targets))
    assert peft_model.get_nb_trainable_parameters()[0] == trainable


def test_lora_targets_are_the_recipes_or_the_adapters_own():
    from flowgrpo.policies.base.lora import ATTENTION_QKVO
    from flowgrpo.policies.diffusers.sd3 import SD3_LORA_TARGETS
    from flowgrpo.policies.diffusers.wan import WAN_LORA_TARGETS
    from flowgrpo.policies.diffusers.generic.families import family_of

    assert transformer_config("sd35-medium").adapter_lora_targets == SD3_LORA_TARGETS
    assert transformer_config("sd35-medium").lora_targets[0] == "attn.to_q"  # Flow-GRPO's list (model.lora_targets)
    assert transformer_config("flux1-dev").lora_targets == list(ATTENTION_QKVO)  # DanceGRPO's, the named set's list
    assert transformer_config("wan21-t2v-1.3b").lora_targets == WAN_LORA_TARGETS  # model.lora_targets=default
    assert transformer_config("qwen-image").lora_targets == list(family_of("QwenImagePipeline").lora_targets)


def test_sd35_medium_wrapped_layers_per_block():
    state = training_state("sd35-medium", rank=32)
    # Flow-GRPO's targets: 24 MMDiT blocks x the 8 projections of their first attention, minus the last
    # block's context-side output projection (context_pre_only); attn2 and the feed-forward left out
    assert state.wrapped_layers == 24 * 8 - 1 == state.wrapped_by_block["transformer_blocks"]
    assert state.transformer_params == 2_243_171_520
    assert set(state.per_gpu) == {"1 GPU", "8 GPUs", "8 GPUs FSDP"}
    one, fsdp = state.per_gpu["1 GPU"], state.per_gpu["8 GPUs FSDP"]
    assert one["lora_weights"] == 4 * state.lora_params and one["adamw"] == 8 * state.lora_params
    assert fsdp["base_weights"] == -(-one["base_weights"] // 8) and fsdp["fsdp_gathered"] > 0


def test_two_experts_double_everything():
    one = training_state(tiny_entry("wan21-t2v-14b", TINY_WAN), gpus_list=(1,), rank=4, ema=True)
    two = training_state(tiny_entry("wan22-a14b", TINY_WAN), gpus_list=(1,), rank=4, ema=True)
    assert two.experts == 2
    assert two.transformer_params == 2 * one.transformer_params and two.lora_params == 2 * one.lora_params
    assert two.per_gpu["1 GPU"]["total"] == 2 * one.per_gpu["1 GPU"]["total"]


def test_layouts_and_layout_bytes():
    assert [name for name, _, _ in layouts((1, 8))] == ["1 GPU", "8 GPUs", "8 GPUs FSDP"]
    got = layout_bytes({"base_weights": 80, "ema": 9}, gpus=8, fsdp=True, block_bytes=5)
    assert got == {"base_weights": 10, "ema": 2, "fsdp_gathered": 10, "total": 22}
    assert block_of("transformer_blocks.3.attn.to_q") == "transformer_blocks" and block_of("proj_out") == "proj_out"


@pytest.mark.parametrize("recipe,config", [("sd35-medium", TINY_SD3), ("wan21-t2v-1.3b", TINY_WAN)])
def test_meta_activation_count_equals_the_cpu_count(recipe, config):
    entry = tiny_entry(recipe, config)
    geo = Geometry(resolution=64, frames=5 if "wan" in recipe else 1, text_tokens=7, batch=2)
    meta = activation_bytes(entry, geo, rank=4, dtype=torch.float32)
    cpu = activation_bytes(entry, geo, rank=4, dtype=torch.float32, device="cpu")
    assert (meta.outside, meta.blocks, meta.block_inputs) == (cpu.outside, cpu.blocks, cpu.block_inputs)
    assert len(meta.blocks) == 2 and meta.checkpointing < meta.no_checkpointing


def test_activations_are_linear_in_tokens_and_depth():
    entry = tiny_entry("sd35-medium", {**TINY_SD3, "dual_attention_layers": []})
    counts = {(r, d): activation_bytes(entry, Geometry(r, text_tokens=8), rank=4, num_layers=d)
              for r in (64, 128) for d in (2, 4)}
    per_block = {r: (counts[r, 4].no_checkpointing - counts[r, 2].no_checkpointing) / 2 for r in (64, 128)}
    assert per_block[64] > 0
    # 4x the image tokens (16 -> 64, 8 text tokens): each block's bytes grow by the token ratio (24 -> 72) at most
    assert 2.0 < per_block[128] / per_block[64] <= 72 / 24 + 1e-9
