"""Speed levers of the rollout and the update give the plain path's results up to float rounding.

* the sampler's ``merge_lora`` (the LoRA adapter folded into the base weights for a rollout):
  same chains and log-probs as the unmerged rollout, and the base weights restored bit for bit;
* ``loss.grpo.batched_reference`` (the KL reference means of a minibatch in few no-grad batches, reused
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
        "train.threads=1", "train.lr=1e-3", "log.progress=false", "loss.grpo.kl_beta=0.04", "loss.grpo.backend=reference", *extra],
        recipe="shapes")


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
        trainer = Trainer(_config(prompt_file, f"loss.grpo.batched_reference={str(batched).lower()}",
                                  f"train.inner_epochs={epochs}", "train.micro_batch=3"))
        _perturb_lora(trainer.policy)  # the policy differs from the reference: the KL term is not zero
        calls, ref = [], trainer.policy.reference_velocity
        trainer.policy.reference_velocity = lambda x, *a, **k: calls.append(len(x)) or ref(x, *a, **k)
        m = trainer.iteration_step().metrics
        runs[batched] = (m, trainer.policy.trainable_state_dict(), calls)
    (m_fast, w_fast, calls_fast), (m_plain, w_plain, calls_plain) = runs[True], runs[False]
    assert calls_fast == [3] * 4  # 2 prompts x 2 chains x 3 steps in batches of train.micro_batch, once
    assert calls_plain == [3] * 4 * epochs
    assert m_plain["kl"] > 0
    for key in ("loss", "kl", "grad_norm"):
        assert m_fast[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-8), key
    for n in w_plain:
        torch.testing.assert_close(w_fast[n], w_plain[n], rtol=1e-5, atol=1e-6)


def test_fold_rule_takes_tiny_layers_not_wide_ones():
    from flowgrpo.objectives.lora_fold import fold_wins

    assert fold_wins(tokens=4096, fan_in=64, fan_out=64, rank=32)  # the tiny SD3: rank is half the width
    assert fold_wins(tokens=4096, fan_in=64, fan_out=256, rank=32)
    assert not fold_wins(tokens=4096, fan_in=1536, fan_out=1536, rank=32)  # SD3.5-M's width
    assert not fold_wins(tokens=1, fan_in=64, fan_out=64, rank=32)  # building W + s B A costs more than one token


def test_folded_layer_matches_peft_and_auto_keeps_wide_layers():
    from peft import LoraConfig, get_peft_model

    from flowgrpo.objectives.lora_fold import lora_folded

    torch.manual_seed(0)
    for width, rank, mode in ((64, 32, "always"), (512, 2, "auto")):
        model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(width, width)),
                               LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["0"], init_lora_weights="gaussian"))
        _perturb_lora_params([p for p in model.parameters() if p.requires_grad])
        x = torch.randn(16, width)
        plain = model(x)
        grads_plain = torch.autograd.grad(plain.square().sum(), [p for p in model.parameters() if p.requires_grad])
        with lora_folded(model, mode) as patched:
            assert patched == 1
            fast = model(x)
            grads_fast = torch.autograd.grad(fast.square().sum(), [p for p in model.parameters() if p.requires_grad])
        assert "forward" not in vars(model.base_model.model[0])  # unpatched on exit
        if mode == "auto":  # fewer FLOPs through peft's path: it is taken, bit for bit
            assert torch.equal(fast, plain)
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
        for a, b in zip(grads_fast, grads_plain):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _perturb_lora_params(params, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def test_folded_update_matches_peft_update(prompt_file):
    """One iteration with the update's LoRA folded and one through peft: same loss, KL, gradient norm
    and adapter weights up to float rounding."""
    runs = {}
    for mode in ("always", "never"):
        torch.manual_seed(0)
        # adam_eps 1e-2: Adam's first step is ~lr * sign(g) for |g| >> eps, which would turn float noise
        # in a near-zero gradient element into a step of up to lr
        trainer = Trainer(_config(prompt_file, f"train.fold_lora={mode}", "train.adam_eps=1e-2"))
        _perturb_lora(trainer.policy)
        runs[mode] = (trainer.iteration_step().metrics, trainer.policy.trainable_state_dict())
    (m_fast, w_fast), (m_plain, w_plain) = runs["always"], runs["never"]
    assert m_plain["kl"] > 0
    for key in ("kl", "grad_norm"):
        assert m_fast[key] == pytest.approx(m_plain[key], rel=1e-4, abs=1e-8), key
    # on-policy the loss is beta * KL (4e-5 here) plus sum_i A_i * ratio_i / n with ratios 1 up to
    # float32 rounding and |A_i| ~ 1: that sum cancels to ~1e-7, so the loss agrees to rounding of
    # the advantages' scale, not to 1e-4 of its own small value (the KL and gradient norm above do)
    assert m_fast["loss"] == pytest.approx(m_plain["loss"], abs=1e-6)
    for n in w_plain:
        torch.testing.assert_close(w_fast[n], w_plain[n], rtol=1e-4, atol=1e-6)
