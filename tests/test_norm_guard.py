"""NormGuard (arXiv 2606.27771, from its abstract: no code or equations of the paper were reachable):
the hinge beta max(0, ||v|| / ||v_ref|| - 1 - margin) per row, against a float64 derivation written
here, alone and as the term nft, awm and dgpo add to their loss; and a `flowgrpo train` run of the
shapes world with it switched on."""

from __future__ import annotations

import json
import math

import pytest
import torch
from forward_harness import LinearPolicy, each_row, grad, make_cfg, rel, rows_data, train_step, world

from flowgrpo.objectives.awm import AWMObjective
from flowgrpo.objectives.dgpo import DGPOObjective
from flowgrpo.objectives.nft import NFTObjective
from flowgrpo.objectives.options import AWMOptions, DGPOOptions, NFTOptions
from flowgrpo.objectives.terms.norm_guard import NormGuard, NormGuardOptions


def _hinge(v, v_ref, beta, margin):
    """beta max(0, |v| / |v_ref| - 1 - margin) of one row, float64, written from the formula."""
    excess = math.sqrt(float((v.detach() ** 2).sum())) / math.sqrt(float((v_ref ** 2).sum())) - 1 - margin
    if excess <= 0:
        return v.sum() * 0.0
    return beta * ((v ** 2).sum().sqrt() / (v_ref ** 2).sum().sqrt() - 1 - margin)


@pytest.mark.parametrize("margin", [0.0, 0.05])
def test_the_term_equals_the_hinge_and_its_gradient_in_float64(margin):
    g = torch.Generator().manual_seed(0)
    v_ref = torch.randn(16, 4, 3, 3, generator=g, dtype=torch.float64)
    v = (v_ref * (1 + 0.15 * torch.randn(16, 1, 1, 1, generator=g, dtype=torch.float64))
         + 0.1 * torch.randn(16, 4, 3, 3, generator=g, dtype=torch.float64)).requires_grad_(True)
    term = NormGuard(NormGuardOptions(norm_guard_beta=0.3, norm_guard_margin=margin))
    got, ratio = term.value(v, v_ref)
    (got_grad,) = torch.autograd.grad(got.sum(), v)
    want = torch.stack([_hinge(v[i], v_ref[i], 0.3, margin) for i in range(16)])
    (want_grad,) = torch.autograd.grad(want.sum(), v)
    active = int((want > 0).sum())
    assert 3 <= active <= 13  # both sides of the hinge are exercised
    assert float((got.detach() - want.detach()).abs().max()) <= 1e-12 * float(want.detach().abs().max())
    assert float((got_grad - want_grad).norm() / want_grad.norm()) < 1e-12
    # rows at or under the reference's norm (plus the margin) have no loss and no gradient
    quiet = ratio <= 1 + margin
    assert torch.all(got[quiet] == 0) and torch.all(got_grad[quiet] == 0)


def test_the_gradient_shrinks_the_velocity_without_turning_it():
    v_ref = torch.randn(2, 8, dtype=torch.float64)
    v = (1.3 * v_ref).requires_grad_(True)
    loss, ratio = NormGuard(NormGuardOptions(norm_guard_beta=1.0)).value(v, v_ref)
    assert ratio.tolist() == pytest.approx([1.3, 1.3])
    (g,) = torch.autograd.grad(loss.sum(), v)
    cos = torch.nn.functional.cosine_similarity(g, v.detach(), dim=1)
    assert cos.tolist() == pytest.approx([1.0, 1.0])  # along v: descent shortens it
    assert NormGuard(NormGuardOptions()).active is False and NormGuard(NormGuardOptions()).references == frozenset()


def _hinge_mean(d, theta, base, beta):
    """The mean over the rows of the hinge of the trained velocity against the base model's."""
    total = 0.0
    for _i, _t, _x0, _eps, _xt, (v, v_ref) in each_row(d, theta, base):
        total = total + _hinge(v, v_ref.detach(), beta, 0.0)
    return total / len(d["t"])


@pytest.mark.parametrize("name", ["nft", "awm", "dgpo"])
def test_each_forward_objective_adds_the_hinge_to_its_step(name):
    """The step with the hinge on minus the step without it is the gradient of the mean hinge."""
    make = {"nft": (NFTObjective, NFTOptions, {"timesteps": 3}),
            "awm": (AWMObjective, AWMOptions, {"timesteps": 3, "ema_kl_beta": 0.0}),
            "dgpo": (DGPOObjective, DGPOOptions, {"timesteps": 3})}[name]
    cls, options, extra = make
    base, sets, forest = world(4)
    steps = {}
    for beta in (0.0, 0.5):
        opt = options(norm_guard_beta=beta, **extra)
        cfg = make_cfg(**{name: opt})
        weights = {"old": sets[1]} if name == "nft" else None
        steps[beta] = train_step(cls(cfg), LinearPolicy(*sets[0], *base), forest, cfg, weights)
    (with_grads, rows), (without_grads, _) = steps[0.5], steps[0.0]
    d = rows_data(rows, forest)
    theta = tuple(p.detach().clone().requires_grad_(True) for p in sets[0])
    want = grad(_hinge_mean(d, theta, base, 0.5), theta)
    got = [a - b for a, b in zip(with_grads[0], without_grads[0])]
    assert rel(got, want) < 1e-6, rel(got, want)


def test_nft_with_norm_guard_trains_the_shapes_world_from_the_cli(shapes_model_dir, tmp_path):
    from flowgrpo.cli import main

    rc = main(["train", "--preset", "shapes-nft", f"model.path={shapes_model_dir}", "data.prompts_per_iteration=2",
               "data.trees_per_prompt=4", "sampler.num_steps=4", "loss.nft.timesteps=2", "train.iterations=2",
               "train.threads=1", "eval.evaluator=none", "log.progress=false", "log.trackers=[]",
               "reward.weights={test_brightness: 1.0}",  # reward spread on a random model: every group trains
               "loss.nft.norm_guard_beta=0.1", f"log.out_dir={tmp_path}", "log.run_name=run"])
    assert rc == 0
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:  # the term ran on every update: the norm ratio is logged, finite and positive
        assert math.isfinite(r["loss"]) and r["norm_ratio"] > 0 and math.isfinite(r["norm_ratio"])
