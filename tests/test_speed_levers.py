"""Speed levers of the rollout and the update give the plain path's results up to float rounding.

* the sampler's ``merge_lora`` (the LoRA adapter folded into the base weights for a rollout):
  same chains and log-probs as the unmerged rollout, and the base weights restored bit for bit;
* ``loss.batched_reference`` (the KL reference means of a minibatch in few no-grad batches, reused
  by every inner epoch): the same update as one reference call per micro-batch.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.samplers.lora_merge import lora_merged
from flowgrpo.trainer.trainer import Trainer


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("a photo of a cat\na red circle on a white table\na mountain lake at dawn\n")
    return f


def _config(prompt_file, *extra):
    return load_config("flow-grpo", None, [
        "model.name=sd3-tiny", "model.train_mode=lora", "model.resolution=64", "model.max_sequence_length=16",
        "model.lora_rank=8", "model.lora_alpha=16", "model.guidance_scale=4.5", "reward.weights={jpeg_compressibility: 1.0}",
        f"data.prompts={prompt_file}", "data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=3",
        "train.threads=1", "train.lr=1e-3", "log.progress=false", "loss.beta=0.04", "loss.backend=reference", *extra])


def _perturb_lora(policy, seed=0):
    """Non-zero adapter weights, so that folding them in changes the base weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def _rollout(trainer, merge: bool):
    trainer.sampler.merge_lora = merge
    plan = trainer.strategy.plan(0)
    gen = torch.Generator().manual_seed(7)
    return trainer.sampler.rollout(plan, ["a photo of a cat", "a mountain lake at dawn"], 2, gen)


def test_merged_lora_rollout_matches_plain(prompt_file):
    trainer = Trainer(_config(prompt_file))
    _perturb_lora(trainer.policy)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    plain, fast = _rollout(trainer, False), _rollout(trainer, True)
    for a, b in zip(plain.levels, fast.levels):
        torch.testing.assert_close(b.x, a.x, rtol=0, atol=1e-5)
        if a.log_prob is not None:
            torch.testing.assert_close(b.log_prob, a.log_prob, rtol=0, atol=1e-5)
    assert not torch.equal(plain.levels[-1].x, _rollout(trainer, False).levels[-1].x * 0)  # a real rollout
    for n, p in trainer.policy.named_parameters():  # restored bit for bit, marked unmerged
        assert torch.equal(p.detach(), before[n]), n
    with lora_merged(trainer.policy.denoiser) as folded:
        assert folded == 0  # gradients are enabled here: nothing is folded


def test_merge_folds_the_adapter_and_restores(prompt_file):
    trainer = Trainer(_config(prompt_file))
    _perturb_lora(trainer.policy)
    tr = trainer.policy.denoiser
    layer = next(m for m in tr.modules() if hasattr(m, "lora_A") and len(m.lora_A))
    w0 = layer.get_base_layer().weight.detach().clone()
    with torch.no_grad(), lora_merged(tr) as folded:
        assert folded > 0 and layer.merged
        assert not torch.equal(layer.get_base_layer().weight, w0)  # W + s B A inside
    assert not layer.merged and torch.equal(layer.get_base_layer().weight, w0)
    with torch.no_grad(), lora_merged(tr, enabled=False) as folded:
        assert folded == 0 and not layer.merged


def test_merge_skips_full_fine_tuning(prompt_file):
    trainer = Trainer(_config(prompt_file, "model.train_mode=full"))
    with torch.no_grad(), lora_merged(trainer.policy.denoiser) as folded:
        assert folded == 0


@pytest.mark.parametrize("epochs", [1, 2])
def test_batched_reference_matches_per_micro_batch(prompt_file, epochs):
    """Two trainers, same seeds: one update each, batched reference on and off; same loss, KL and weights."""
    runs = {}
    for batched in (True, False):
        torch.manual_seed(0)
        trainer = Trainer(_config(prompt_file, f"loss.batched_reference={str(batched).lower()}",
                                  f"train.inner_epochs={epochs}", "train.micro_batch=3"))
        _perturb_lora(trainer.policy)  # the policy differs from the reference: the KL term is not zero
        calls, ref = [], trainer.policy.reference_velocity
        trainer.policy.reference_velocity = lambda x, *a, **k: calls.append(len(x)) or ref(x, *a, **k)
        m = trainer.iteration_step().metrics
        runs[batched] = (m, trainer.policy.trainable_state_dict(), calls)
    (m_fast, w_fast, calls_fast), (m_plain, w_plain, calls_plain) = runs[True], runs[False]
    assert calls_fast == [12]  # 2 prompts x 2 chains x 3 steps in one call, reused by every epoch
    assert calls_plain == [3] * 4 * epochs
    assert m_plain["kl"] > 0
    for key in ("loss", "kl", "grad_norm"):
        assert m_fast[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-8), key
    for n in w_plain:
        torch.testing.assert_close(w_fast[n], w_plain[n], rtol=1e-5, atol=1e-6)
