"""Centered Reward Distillation (``loss.objective=crd``) against a float64 derivation of Flow-Factory's
CRD trainer (X-GenGroup/Flow-Factory a0b2bc5, src/flow_factory/trainers/crd.py), written here row by
row from its formulas, on the full optimizer step of the shared update loop (tests/forward_harness.py).

The derivation centres within each prompt's group at each training time (the paper's within-prompt
centring; Flow-Factory centres over its gathered micro-batch, a deviation docs/objectives.md states),
and its hard-selection mode splits on the sign of A. Everything else is the trainer's: the implicit
reward with adaptive weights against the old policy, the [0, 1] advantage map, the A_max / beta scale,
the KL to the CFG-guided base model with the reward-adaptive weight, and the two decay schedules.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from forward_harness import GROUPS, SIZE, LinearPolicy, grad, make_cfg, rel, rows_data, train_step, world

from flowgrpo.objectives.crd import CRDObjective, CRDOptions


class GuidedLinearPolicy(LinearPolicy):
    """The harness's linear model with classifier-free guidance: the empty prompt's conditioning is 0,
    so v^g = v(0) + g (v(c) - v(0)); any pass made at the wrong guidance changes the step."""

    def encode_prompts(self, prompts):
        return object()  # the cond of these tests is a plain tensor: the guided pass reads 0 for the empty prompt

    def _guided(self, x, t, cond, g, w, b):
        v_c = self.apply(x, t, cond, w, b)
        return v_c if g in (None, 1.0) else self.apply(x, t, 0.0, w, b) + g * (v_c - self.apply(x, t, 0.0, w, b))

    def velocity(self, x, t, cond, guidance_scale=None):
        return self._guided(x, t, cond, guidance_scale, self.W, self.b)

    @torch.no_grad()
    def reference_velocity(self, x, t, cond, guidance_scale=None):
        return self._guided(x, t, cond, guidance_scale, *self.base)


def _v(xt, t, c, w, b, g=1.0):
    """The guided linear velocity of one row, float64 (g = 1: the conditional one)."""
    v_c = (xt @ w) * (1 + t) + b + c
    v_u = (xt @ w) * (1 + t) + b
    return v_c if g == 1.0 else v_u + g * (v_c - v_u)


def _weights(a, temp, sign):
    """The centring weights of one (group, time) set from its [0, 1] rewards a [n]."""
    n = len(a)
    if temp < 0:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    if temp == 0:
        pick = (a > 0.5) if sign > 0 else (a < 0.5)
        return pick.double() / pick.sum() if pick.any() else torch.full((n,), 1.0 / n, dtype=torch.float64)
    return torch.softmax(sign * a / temp, dim=0)


def _crd_authors(d, theta, old, base, o: CRDOptions):
    """Flow-Factory's CRD loss of one update, mean over the rows."""
    n = len(d["t"])
    r, a, kl = [], [], []
    for i in range(n):
        t, x0, eps, c = d["t"][i], d["x0"][i], d["eps"][i], d["cond"][i]
        xt = (1 - t) * x0 + t * eps
        u = eps - x0
        v = _v(xt, t, c, *theta)
        v_o = _v(xt, t, c, *(old if o.implicit_reference == "old" else base)).detach()
        w = (v - u).abs().mean().detach().clamp(min=1e-5) if o.adaptive_weights else 1.0
        w_o = (v_o - u).abs().mean().clamp(min=1e-5) if o.adaptive_weights else 1.0
        r.append(-(((v - u) ** 2 / w).mean() - ((v_o - u) ** 2 / w_o).mean()))
        adv = min(max(float(d["adv"][i]), -o.adv_clip), o.adv_clip)
        a.append(min(max(adv / o.adv_clip / 2 + 0.5, 0.0), 1.0))
        kl.append(((v - _v(xt, t, c, *base, g=o.kl_cfg).detach()) ** 2).mean())
    r, a = torch.stack(r), torch.tensor(a, dtype=torch.float64)
    total = 0.0
    for i in range(n):
        same = [j for j in range(n) if d["group"][j] == d["group"][i] and d["slot"][j] == d["slot"][i]]
        halves = []
        for sign in (1.0, -1.0):
            p = _weights(a[same], o.weight_temp, sign)
            a_c, r_c = (p * a[same]).sum(), (p * r[same].detach()).sum()
            x, y = o.beta * (r[i] - r_c), a[i] - a_c
            if o.loss_type == "bce":
                q = torch.sigmoid(y)
                halves.append(-(q * torch.nn.functional.logsigmoid(x) + (1 - q) * torch.nn.functional.logsigmoid(-x)))
            else:
                halves.append((x - y) ** 2)
        policy = 0.5 * (halves[0] + halves[1]) * o.adv_clip / max(o.beta, 1e-8)
        coef = 1.0
        if o.reward_adaptive_kl:
            c0 = o.kl_floor / o.kl_beta
            coef = c0 + a[i] * (1 - c0)
        total = total + policy + o.kl_beta * coef * kl[i]
    return total / n


CASES = {
    "authors-default": {},
    "softmax": {"weight_temp": 0.3},
    "hard": {"weight_temp": 0.0},
    "bce": {"loss_type": "bce", "beta": 2.0},
    "base-reference": {"implicit_reference": "base", "adaptive_weights": False, "reward_adaptive_kl": False},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crd_step_equals_the_derivation(case):
    base, sets, forest = world(5)
    o = CRDOptions(timesteps=3, **CASES[case])
    cfg = make_cfg(crd=o)
    grads, rows = train_step(CRDObjective(cfg), GuidedLinearPolicy(*sets[0], *base), forest, cfg, {"old": sets[1]})
    assert len(grads) == 1
    d = rows_data(rows, forest)
    assert set(d["leaf"].tolist()) == set(range(GROUPS * SIZE))  # the zero-spread group trains too (rows=all)
    slots = {(int(g), int(k)): float(t) for g, k, t in zip(d["group"], d["slot"], d["t"])}
    assert all(slots[(int(g), int(k))] == float(t) for g, k, t in zip(d["group"], d["slot"], d["t"]))  # shared times
    theta = tuple(p.detach().clone().requires_grad_(True) for p in sets[0])
    want = grad(_crd_authors(d, theta, sets[1], base, o), theta)
    assert rel(grads[0], want) < 1e-5, rel(grads[0], want)
    if case == "authors-default":  # the test tells apart an unguided KL reference and a batch-wide centring
        unguided = grad(_crd_authors(d, theta, sets[1], base, CRDOptions(timesteps=3, kl_cfg=1.0)), theta)
        assert rel(unguided, want) > 1e-3
        whole = dict(d, group=torch.zeros_like(d["group"]))
        assert rel(grad(_crd_authors(whole, theta, sets[1], base, o), theta), want) > 1e-3


def test_crd_step_does_not_depend_on_the_micro_batch():
    """The centres come from the first pass over the whole minibatch: micro-batches of 1, 5 and 1000 rows
    make one step."""
    base, sets, forest = world(6)
    got = []
    for micro in (1, 5, 1000):
        cfg = make_cfg(micro=micro, crd=CRDOptions(timesteps=2))
        got.append(train_step(CRDObjective(cfg), GuidedLinearPolicy(*sets[0], *base), forest, cfg, {"old": sets[1]})[0][0])
    assert rel(got[0], got[2]) < 1e-6 and rel(got[1], got[2]) < 1e-6


def test_old_and_sampling_copies_follow_the_authors_schedules():
    base, sets, _ = world(7)
    policy = GuidedLinearPolicy(*sets[0], *base)
    obj = CRDObjective(make_cfg(crd=CRDOptions()))
    obj.setup(policy)
    # d_old(n) = min(0.25 + 0.005 n, 0.999); d_sampling(n) = 0 before 75, then min(0.0075 (n - 75), 0.999)
    assert [obj.old_schedule(n) for n in (0, 10, 200)] == pytest.approx([0.25, 0.30, 0.999])
    assert [obj.sampling_schedule(n) for n in (0, 74, 75, 175, 400)] == pytest.approx([0, 0, 0, 0.75, 0.999])
    start = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    with torch.no_grad():
        policy.W.add_(1.0)
    obj.steps = 100
    metrics = obj.after_update(SimpleNamespace(policy=policy))
    assert metrics == pytest.approx({"crd_old_decay": 0.75, "crd_rollout_decay": 0.1875})
    assert torch.allclose(obj.old.weights["W"], 0.75 * start["W"] + 0.25 * policy.W.detach())
    assert torch.allclose(obj.sampling.weights["W"], 0.1875 * start["W"] + 0.8125 * policy.W.detach())
    with obj.rollout_weights(policy):  # the rollouts are drawn by the sampling copy
        assert torch.equal(policy.W.detach(), obj.sampling.weights["W"])
    assert torch.equal(policy.W.detach(), start["W"] + 1.0)


def test_crd_preset_trains_the_shapes_world_from_the_cli(shapes_model_dir, tmp_path):
    from flowgrpo.cli import main

    rc = main(["train", "--preset", "crd", "--recipe", "shapes", f"model.path={shapes_model_dir}",
               "data.prompts_per_iteration=2", "data.trees_per_prompt=4", "sampler.num_steps=4", "loss.crd.timesteps=2",
               "train.iterations=2", "train.threads=1", "eval.evaluator=none", "log.progress=false", "log.trackers=[]",
               "reward.weights={test_brightness: 1.0}", f"log.out_dir={tmp_path}", "log.run_name=run"])
    assert rc == 0
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["kl"] >= 0 and math.isfinite(r["crd_match"])
        assert r["crd_rollout_decay"] == 0.0  # a copy of the trained weights for the first 75 steps
    # the old policy's decay grows 0.005 per optimizer step from 0.25
    assert 0.25 < rows[0]["crd_old_decay"] < rows[1]["crd_old_decay"] < 0.3


def test_crd_with_norm_guard_trains_a_bf16_sd3_lora(tmp_path):
    """The precision real checkpoints run in: a tiny SD3 in bfloat16 with LoRA, CRD's two passes, the
    KL's guided base pass and the NormGuard hinge (on top, to run it in bf16 as well)."""
    from flowgrpo.config import load_config
    from flowgrpo.trainer.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\na red circle on a white table\n")
    cfg = load_config("crd", None, ["model.name=sd3-tiny", "model.resolution=64", "model.max_sequence_length=16",
                                    "model.dtype=bfloat16", "model.train_mode=lora", "model.lora_rank=4",
                                    f"data.prompts={prompts}", "data.prompts_per_iteration=2", "data.trees_per_prompt=2",
                                    "sampler.num_steps=3", "train.iterations=2", "train.threads=1", "train.lr=1e-3",
                                    "log.progress=false", "eval.evaluator=none", "loss.crd.timesteps=2",
                                    "loss.crd.norm_guard_beta=0.1", "reward.weights={jpeg_compressibility: 1.0}"],
                      recipe="shapes")
    trainer = Trainer(cfg)
    assert trainer.policy.dtype == torch.bfloat16
    before = trainer.policy.trainable_state_dict()
    for _ in range(2):
        m = trainer.iteration_step().metrics
        assert all(math.isfinite(m[k]) for k in ("loss", "kl", "crd_match", "norm_ratio")) and m["grad_norm"] > 0
        assert m["norm_ratio"] > 0
    after = trainer.policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
