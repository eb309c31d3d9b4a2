"""The harness of the float64 objective tests (tests/test_objectives_authors.py, tests/test_crd.py,
tests/test_norm_guard.py): a tiny linear velocity model, a forest of 3 groups x 4 samples whose middle
group has no reward spread, and one update of an objective through the shared update loop
(:func:`run_update`) with the gradient recorded instead of stepped. The derivations the tests compare
against are written in each test file; only the rows' data (times, noise) come from flowgrpo."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import torch

from flowgrpo.objectives.base import Credit
from flowgrpo.trainer.update_loop import run_update

DIM, GROUPS, SIZE, T = 6, 3, 4, 5


class LinearPolicy:
    """v = (x W) (1 + t) + b + c(prompt), float64; the base model is a separate frozen (W0, b0)."""

    latent_shape = (DIM,)

    def __init__(self, w, b, w0, b0):
        self.W, self.b = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        self.base = (w0.clone(), b0.clone())

    def named_trainable_parameters(self):
        return [("W", self.W), ("b", self.b)]

    def trainable_parameters(self):
        return [self.W, self.b]

    def trainable_state_dict(self):
        return {"W": self.W.detach().clone(), "b": self.b.detach().clone()}

    @torch.no_grad()
    def load_trainable_state_dict(self, sd):
        self.W.copy_(sd["W"])
        self.b.copy_(sd["b"])

    @staticmethod
    def apply(x, t, cond, w, b):
        return (x.double() @ w) * (1 + t.double().view(-1, 1)) + b + cond

    def velocity(self, x, t, cond, guidance_scale=None):
        return self.apply(x, t, cond, self.W, self.b)

    @torch.no_grad()
    def reference_velocity(self, x, t, cond, guidance_scale=None):
        return self.apply(x, t, cond, *self.base)


class GradEngine:
    """Records each step's gradient instead of stepping (the weights stay put)."""

    def __init__(self, params):
        self.params, self.grads = params, []

    def backward(self, loss):
        loss.backward()

    def accumulate(self):
        return contextlib.nullcontext()

    def idle_passes(self, micro):
        return 0

    def step(self, params, max_norm):
        self.grads.append([p.grad.detach().clone() for p in self.params])
        for p in self.params:
            p.grad = None
        return 1.0


def world(seed=0):
    """Weights (theta, base, and a third and fourth set for old / EMA copies) and a forest whose
    group 1 has no reward spread; advantages group-centred over the global std."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w0, b0 = rnd(DIM, DIM) * 0.3, rnd(DIM) * 0.1
    sets = [(w0 + 0.2 * rnd(DIM, DIM), b0 + 0.2 * rnd(DIM)) for _ in range(3)]
    n = GROUPS * SIZE
    group = torch.arange(GROUPS).repeat_interleave(SIZE)
    reward = rnd(n)
    reward[group == 1] = 0.7  # no spread
    mean = torch.stack([reward[group == k].mean() for k in range(GROUPS)])[group]
    adv = (reward - mean) / reward.std()
    adv[group == 1] = 0.0
    spread = torch.stack([reward[group == k].std() > 0 for k in range(GROUPS)])[group]
    forest = dict(x0=rnd(n, DIM), cond=rnd(GROUPS, DIM) * 0.5, group=group, reward=reward, adv=adv, mask=spread)
    return (w0, b0), sets, forest


def make_ctx(policy, forest, cfg):
    ro = SimpleNamespace(leaves=SimpleNamespace(x=forest["x0"]), leaf_tree=torch.arange(len(forest["x0"])),
                         tree_prompt=forest["group"], tree_group=forest["group"])
    cond = SimpleNamespace(index=lambda rows: forest["cond"][rows])
    collected = SimpleNamespace(iteration=0, plan=SimpleNamespace(sigmas=torch.linspace(1, 0, T + 1), num_steps=T),
                                cond=cond, rollout=ro, view=SimpleNamespace(local_leaves=torch.arange(len(ro.leaf_tree))),
                                rewards={"r": forest["reward"].float()})
    credit = Credit(advantages=SimpleNamespace(leaf_mask=forest["mask"], leaf_advantages=forest["adv"].float()),
                    edge_masks=[None], pruned_edges=None, steps=[], leaf_valid=torch.isfinite(forest["reward"]))
    return SimpleNamespace(cfg=cfg, policy=policy, collected=collected, credit=credit, device=torch.device("cpu"),
                           dtype=torch.float64, dp=SimpleNamespace(world=1), rng=np.random.default_rng(0),
                           autocast=contextlib.nullcontext, lockstep=False)


def make_cfg(micro=5, minibatches=1, **opts):
    return SimpleNamespace(train=SimpleNamespace(seed=0, micro_batch=micro, minibatches=minibatches, inner_epochs=1,
                                                 max_grad_norm=1e9), loss=SimpleNamespace(**opts))


def train_step(objective, policy, forest, cfg, weights=None):
    """(the step's gradient [dW, db], the rows the objective trained, the recorded ctx)."""
    ctx = make_ctx(policy, forest, cfg)
    objective.setup(policy)
    for copy in ("old", "ema"):  # the lagging copies start away from theta, so their terms have gradients
        if weights and copy in weights and getattr(objective, copy, None) is not None:
            getattr(objective, copy).weights = {"W": weights[copy][0].clone(), "b": weights[copy][1].clone()}
    rows = objective.rows(ctx)
    engine = GradEngine(policy.trainable_parameters())
    objective.rows = lambda _ctx, _r=rows: _r  # the loop asks again; the same rows
    run_update(ctx, objective, engine)
    return engine.grads, rows


def rows_data(rows, forest):
    """The rows' inputs in float64: x0 [R, D], eps, t [R], A [R], leaf, group, slot."""
    leaf = rows.leaf
    return dict(x0=forest["x0"][leaf], eps=rows.noise.double(), t=rows.t.double(), adv=forest["adv"][leaf],
                leaf=leaf, group=forest["group"][leaf], slot=rows.step, cond=forest["cond"][forest["group"][leaf]])


def grad(loss, policy_w):
    return torch.autograd.grad(loss, policy_w)


def assert_step(got, want, tol=1e-5):
    """Equal up to the objectives' float32 loss arithmetic (relative to each gradient's norm)."""
    assert rel(got, want) < tol, rel(got, want)


def rel(a, b):
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b))


def each_row(d, *weights):
    """Per row i: (t, x0, eps, x_t, [v under each weight set]) with x_t = (1 - t) x0 + t eps."""
    for i in range(len(d["t"])):
        t, x0, eps, c = d["t"][i], d["x0"][i], d["eps"][i], d["cond"][i]
        xt = (1 - t) * x0 + t * eps
        yield i, t, x0, eps, xt, [(xt @ w) * (1 + t) + b + c for w, b in weights]
