"""The SD3 adapter trains end to end on a tiny random SD3 (no hub): LoRA moves, the base does not."""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.trainer.trainer import Trainer


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("a photo of a cat\na red circle on a white table\na mountain lake at dawn\n")
    return f


def test_tiny_sd3_trains_two_iterations(prompt_file):
    cfg = load_config("shapes", None, [
        "model.name=sd3-tiny", "model.train_mode=lora", "model.resolution=64", "model.max_sequence_length=16", "model.lora_rank=4",
        "model.lora_alpha=8", "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompt_file}",
        "data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=3", "sampler.strategy=flow_grpo", "sampler.shift=3.0",
        "train.iterations=2", "train.threads=1", "train.lr=1e-3", "log.progress=false",
    ], recipe="shapes")
    trainer = Trainer(cfg)
    policy = trainer.policy
    assert tuple(policy.latent_shape) == (16, 8, 8)
    lora_before = policy.trainable_state_dict()
    assert lora_before and all("lora" in k for k in lora_before)
    trainable_ids = {id(p) for p in policy.trainable_parameters()}
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if id(p) not in trainable_ids}
    # a few named base weights of every component, checked explicitly as well
    picks = [n for n in base if n.startswith("transformer.") and "base_layer.weight" in n][:3]
    picks += [next(n for n in base if n.startswith(prefix)) for prefix in ("vae.", "text_encoder.", "text_encoder_3.")]
    assert len(picks) == 6

    metrics = [trainer.iteration_step().metrics for _ in range(2)]
    assert trainer.iteration == 2
    m0 = metrics[0]
    assert m0["onpolicy_ratio_maxdev"] < 1e-6
    assert m0["transitions"] == 2 * 2 * 3 and m0["zero_std_ratio"] == 0.0
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and math.isfinite(m["reward.jpeg_compressibility"])

    lora_after = policy.trainable_state_dict()
    assert lora_after.keys() == lora_before.keys()
    changed = [k for k in lora_before if not torch.equal(lora_before[k], lora_after[k])]
    assert changed, "no LoRA weight changed"
    assert any("lora_B" in k for k in changed) and any("lora_A" in k for k in changed)
    params = dict(policy.named_parameters())
    for n, t in base.items():
        assert torch.equal(params[n].detach(), t), f"base weight {n} changed"
    for n in picks:
        assert not params[n].requires_grad
    # the EMA follows the adapter, not the base
    assert set(trainer.ema) == set(lora_after)
