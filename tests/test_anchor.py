"""The anchor term (flowgrpo.objectives.terms.anchor): it covers exactly the ODE steps, is zero while the policy equals
the base model, and pulls a drifted policy back."""

from __future__ import annotations

import numpy as np
import torch

from flowgrpo.objectives.terms.anchor import ode_anchor_loss, ode_depths
from flowgrpo.config import load_config
from flowgrpo.trainer.trainer import Trainer


def _trainer(model_dir, **extra):
    ov = [f"model.path={model_dir}", "data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=6",
          "strategy.window=2", "loss.grpo.anchor_beta=1.0", "loss.grpo.backend=reference", "train.ema=false",
          "reward.weights={test_brightness: 1.0}", "log.progress=false"] + [f"{k}={v}" for k, v in extra.items()]
    return Trainer(load_config("shapes", None, ov))


def _rollout(trainer, it=0):
    plan = trainer.strategy.plan(it)
    prompts = trainer.prompts.batch(it, 2)
    cond = trainer.policy.encode_prompts(prompts)
    ro = trainer.sampler.rollout(plan, prompts, 2, torch.Generator().manual_seed(0), cond=cond)
    return plan, cond, ro


def test_anchor_covers_the_ode_steps_and_is_zero_on_the_base_model(shapes_model_dir):
    trainer = _trainer(shapes_model_dir)
    plan, cond, ro = _rollout(trainer)
    # window of 2 SDE steps at the start of 6: depths 2..5 take ODE steps, depth 6 is the leaf
    assert ode_depths(ro, plan) == [2, 3, 4, 5]
    loss = ode_anchor_loss(trainer.policy, ro, plan, cond, 1.0, 2, np.random.default_rng(0))
    # zero up to float32 round-off (velocities agree to ~5e-7; the scene model's 3 text tokens take
    # another attention kernel path than the old 12 word tokens, which happened to agree bit for bit)
    assert loss is not None and float(loss.detach()) < 1e-10


def test_anchor_pulls_a_drifted_policy_back(shapes_model_dir):
    trainer = _trainer(shapes_model_dir)
    plan, cond, ro = _rollout(trainer)
    params = trainer.policy.trainable_parameters()
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn_like(p) * 1e-3)
    rng = np.random.default_rng(0)
    loss = ode_anchor_loss(trainer.policy, ro, plan, cond, 1.0, 4, rng)
    assert float(loss.detach()) > 0
    loss.backward()
    # one small gradient step against the anchor brings the policy closer to the base model
    with torch.no_grad():
        for p in params:
            p.sub_(1e-2 * p.grad)
            p.grad = None
    again = ode_anchor_loss(trainer.policy, ro, plan, cond, 1.0, 4, np.random.default_rng(0))
    assert float(again.detach()) < float(loss.detach())
    # frozen text encoder and reference copy get no gradient
    assert all(p.grad is None for p in trainer.policy.model.text_encoder.parameters())


def test_trainer_logs_the_anchor_term(shapes_model_dir):
    trainer = _trainer(shapes_model_dir)
    m = [trainer.iteration_step().metrics for _ in range(2)]
    assert m[0]["anchor_loss"] < 1e-10 and m[1]["anchor_loss"] > 1e-8  # the first: round-off, as above
