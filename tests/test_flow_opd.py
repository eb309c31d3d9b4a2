"""Flow-OPD (``loss.objective=flow_opd``): the per-step loss against a float64 derivation from the
authors' released code, routing, the zero gradient of a teacher equal to the student, the one-line
refusals of bad teachers, and end-to-end runs with teachers made by 1-iteration runs.

The derivation (``_authors_loss``) is written from CostaliyA/Flow-OPD ``scripts/train_sd3_opd_mix.py``
(``reward_mode="kl_only"``, ``kl_reward_level="step_wise"``, ``kl_scale=-1``, ``kl_norm="none"``, MAR as
``train.beta`` times the KL to ``mar_lora``) and ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``
(the SDE mean, std_dev_t and the log-prob): only the rows' data (states, times, noise) come from
flowgrpo. Its ``detach`` switch is the paper's eq. 10 (the reward detached).
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flowgrpo.errors import ConfigError, UserError
from flowgrpo.objectives import teachers as teachers_mod
from flowgrpo.objectives.flow_opd import FlowOPDObjective, FlowOPDOptions
from flowgrpo.samplers.forest import TransitionBatch
from flowgrpo.samplers.plan import SamplingPlan, StepSpec
from forward_harness import DIM, LinearPolicy  # v = (x W)(1 + t) + b + c(prompt) in float64, base (W0, b0)

T, A_NOISE = 4, 0.7


def _authors_mean_std(x, v, sigma, sigma_next, sigma_max):
    """(prev_sample_mean, std_dev_t, transition std) of sd3_sde_with_logprob's SDE branch, float64."""
    sigma, dt = sigma.view(-1, 1), (sigma_next - sigma).view(-1, 1)
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * A_NOISE
    mean = x * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t.view(-1), (std_dev_t * torch.sqrt(-dt)).view(-1)


def _authors_log_prob(prev, mean, std):
    s = std.view(-1, 1)
    lp = -((prev - mean) ** 2) / (2 * s ** 2) - torch.log(s) - torch.log(torch.sqrt(torch.as_tensor(2 * math.pi)))
    return lp.mean(1)


def _authors_loss(d, w, b, teacher_of_row, teachers, anchor, *, beta, clip, detach):
    """The authors' per-step loss over the rows of ``d`` for student weights (w, b), float64."""
    apply = LinearPolicy.apply
    v = apply(d["x"], d["t"], d["cond"], w, b)
    mean, std_dev_t, _ = _authors_mean_std(d["x"], v, d["t"], d["t_next"], d["smax"])
    v_t = torch.stack([apply(d["x"][i:i + 1], d["t"][i:i + 1], d["cond"][i:i + 1], *teachers[int(k)])[0]
                       for i, k in enumerate(teacher_of_row)])
    mean_t, _, _ = _authors_mean_std(d["x"], v_t, d["t"], d["t_next"], d["smax"])
    kl_reward = ((mean - mean_t) ** 2).mean(1) / (2 * std_dev_t ** 2)
    if detach:
        kl_reward = kl_reward.detach()
    advantages = torch.clamp(-1.0 * kl_reward, -5.0, 5.0)
    log_prob = _authors_log_prob(d["prev"], mean, d["std"])
    ratio = torch.exp(log_prob - d["logp_old"])
    unclipped, clipped = -advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
    policy_loss = torch.mean(torch.maximum(unclipped, clipped))
    v_a = apply(d["x"], d["t"], d["cond"], *anchor)
    mean_a, _, _ = _authors_mean_std(d["x"], v_a, d["t"], d["t_next"], d["smax"])
    kl_loss = torch.mean(((mean - mean_a) ** 2).mean(1) / (2 * std_dev_t ** 2))
    return policy_loss + beta * kl_loss


def _world(seed=0, rows=12):
    """Weights (student, base, 3 teachers, the rollout's old) and rows at every step of a T-step grid,
    each rollout x' drawn from the old policy's SDE step."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w0, b0 = rnd(DIM, DIM) * 0.3, rnd(DIM) * 0.1
    student = (w0 + 0.1 * rnd(DIM, DIM), b0 + 0.1 * rnd(DIM))
    teachers = [(w0 + 0.3 * rnd(DIM, DIM), b0 + 0.3 * rnd(DIM)) for _ in range(3)]
    old = (student[0] + 0.02 * rnd(DIM, DIM), student[1] + 0.02 * rnd(DIM))
    sigmas = torch.linspace(1, 0, T + 1, dtype=torch.float64)
    plan = SamplingPlan(sigmas.float(), [StepSpec(sde=True, noise_level=A_NOISE, sde_kind="flow_grpo")] * T)
    step = torch.arange(rows) % (T - 1)  # steps 0 .. T-2 (sigma = 1 included; into 0 is deterministic)
    prompt = torch.arange(rows) % 3
    cond = rnd(3, DIM) * 0.5
    x = rnd(rows, DIM)
    t, t_next = sigmas.float().double()[step], sigmas.float().double()[step + 1]
    smax = sigmas.float().double()[1]
    v_old = LinearPolicy.apply(x, t, cond[prompt], *old)
    mean_old, _, std = _authors_mean_std(x, v_old, t, t_next, smax)
    prev = mean_old + std.view(-1, 1) * rnd(rows, DIM)
    logp_old = _authors_log_prob(prev, mean_old, std)
    batch = TransitionBatch(sample=x.float(), prev_sample=prev.float(), mean_old=mean_old.float(), std=std.float(),
                            log_prob_old=logp_old.float(), sigma=t.float(), sigma_next=t_next.float(), step=step,
                            tree=torch.arange(rows), prompt=prompt, advantages=torch.zeros(rows),
                            node=torch.arange(rows))
    d = dict(x=batch.sample.double(), prev=batch.prev_sample.double(), std=batch.std.double(),
             logp_old=batch.log_prob_old.double(), t=t, t_next=t_next, smax=smax, cond=cond[prompt])
    return SimpleNamespace(w0=w0, b0=b0, student=student, teachers=teachers, plan=plan, batch=batch, cond=cond, d=d,
                           keys=["counting", "colors", "position"])


def _objective(world, monkeypatch, tmp_path, routes, default="", anchor=None, **opts):
    """A FlowOPDObjective over ``world`` whose teachers are its weight sets, named by (empty) run folders."""
    sets = {}
    for i, wb in enumerate(world.teachers + ([anchor] if anchor is not None else [])):
        folder = tmp_path / f"teacher{i}"
        folder.mkdir(exist_ok=True)
        (folder / "config.yaml").write_text("{}\n")
        sets[str(folder)] = {"W": wb[0].clone(), "b": wb[1].clone()}
    monkeypatch.setattr(teachers_mod, "load_teacher", lambda path, key, policy, cfg: sets[path])
    name = lambda i: str(tmp_path / f"teacher{i}")  # noqa: E731
    opt = FlowOPDOptions(teachers={k: name(i) for k, i in routes.items()},
                         default_teacher=name(default) if default != "" else "",
                         anchor_teacher=name(len(world.teachers)) if anchor is not None else "", **opts)
    policy = LinearPolicy(*world.student, world.w0, world.b0)
    obj = FlowOPDObjective(opt, SimpleNamespace(name="linear"))
    obj.setup(policy)
    return obj, policy


def _ctx(world, policy, iteration=0):
    levels = [SimpleNamespace(x=torch.zeros(3, DIM)), SimpleNamespace(x=torch.zeros(len(world.batch), DIM))]
    rollout = SimpleNamespace(levels=levels, transitions=lambda *a, **k: world.batch)
    collected = SimpleNamespace(iteration=iteration, plan=world.plan, rollout=rollout, prompt_keys=world.keys,
                                cond=SimpleNamespace(index=lambda rows: world.cond[rows]))
    return SimpleNamespace(collected=collected, credit=SimpleNamespace(steps=list(range(T))), policy=policy,
                           device=torch.device("cpu"), dtype=torch.float64, autocast=contextlib.nullcontext,
                           rng=np.random.default_rng(0), lockstep=False)


def _loss_and_grad(obj, policy, ctx):
    rows = obj.rows(ctx)
    micro = obj.micro_loss(ctx, rows)
    grads = torch.autograd.grad(micro.loss, [policy.W, policy.b], allow_unused=True)
    return micro, [torch.zeros_like(p) if g is None else g for g, p in zip(grads, (policy.W, policy.b))]


def _rel(a, b):
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b))


@pytest.mark.parametrize("gradient", ["through", "detached"])
@pytest.mark.parametrize("clip", [1e-4, 0.2])
def test_loss_and_gradient_equal_the_authors_float64_derivation(gradient, clip, monkeypatch, tmp_path):
    world = _world()
    routes = {"counting": 0, "colors": 1, "position": 2}
    obj, policy = _objective(world, monkeypatch, tmp_path, routes, anchor=world.teachers[0], cold_start="none",
                             anchor_beta=0.04, clip_range=clip, reward_gradient=gradient)
    micro, got = _loss_and_grad(obj, policy, _ctx(world, policy))
    w, b = world.student[0].clone().requires_grad_(True), world.student[1].clone().requires_grad_(True)
    teacher_of_row = torch.tensor([routes[world.keys[p]] for p in world.batch.prompt.tolist()])
    want_loss = _authors_loss(world.d, w, b, teacher_of_row, world.teachers, world.teachers[0], beta=0.04, clip=clip,
                              detach=gradient == "detached")
    want = torch.autograd.grad(want_loss, [w, b])
    assert abs(float(micro.loss.detach()) - float(want_loss.detach())) < 1e-5 * abs(float(want_loss.detach()))
    assert _rel(got, want) < 1e-5, _rel(got, want)
    assert float(micro.stats["opd_kl"].min()) > 0


def test_the_two_gradients_differ_and_a_teacher_equal_to_the_student_gives_none(monkeypatch, tmp_path):
    world = _world(1)
    world.teachers = [world.student] * 3
    for gradient in ("through", "detached"):
        obj, policy = _objective(world, monkeypatch, tmp_path, {"counting": 0}, default=1, cold_start="none",
                                 anchor_beta=0.0, clip_range=0.2, reward_gradient=gradient)
        micro, grads = _loss_and_grad(obj, policy, _ctx(world, policy))
        assert float(micro.stats["opd_kl"].abs().max()) == 0.0
        assert all(float(g.abs().max()) == 0.0 for g in grads)
    world = _world(1)
    got = {}
    for gradient in ("through", "detached"):
        obj, policy = _objective(world, monkeypatch, tmp_path, {"counting": 0}, default=1, cold_start="none",
                                 anchor_beta=0.0, clip_range=0.2, reward_gradient=gradient)
        got[gradient] = _loss_and_grad(obj, policy, _ctx(world, policy))[1]
        assert all(float(g.abs().max()) > 0 for g in got[gradient])
    assert _rel(got["detached"], got["through"]) > 1e-3


def test_routing_picks_each_prompts_teacher(monkeypatch, tmp_path):
    world = _world(2)
    obj, policy = _objective(world, monkeypatch, tmp_path, {"colors": 2, "counting": 0}, default=1, cold_start="none")
    paths = obj.teachers.paths
    routed = [paths[k] for k in obj.teachers.route(["counting", "colors", "position", "colors"]).tolist()]
    assert routed == [str(tmp_path / f"teacher{i}") for i in (0, 2, 1, 2)]
    ctx = _ctx(world, policy)
    rows = obj.rows(ctx)
    x, who = rows.sample.double(), obj._teacher
    v = obj._teacher_velocities(ctx, rows, x, rows.prompt)
    for i in range(len(rows)):
        teacher = {"counting": 0, "colors": 2, "position": 1}[world.keys[int(rows.prompt[i])]]
        assert paths[int(who[i])] == str(tmp_path / f"teacher{teacher}")
        want = LinearPolicy.apply(x[i:i + 1], rows.sigma[i:i + 1], world.cond[rows.prompt[i:i + 1]], *world.teachers[teacher])
        assert torch.allclose(v[i].double(), want[0], atol=1e-6)
    assert torch.equal(policy.W.detach(), world.student[0])  # the live weights are back
    ctx.lockstep = True  # sharded engines: every teacher on every row, the same velocities kept
    assert torch.equal(obj._teacher_velocities(ctx, rows, x, rows.prompt), v)


def test_a_prompt_without_a_teacher_and_no_teachers_are_refused(monkeypatch, tmp_path):
    world = _world(3)
    obj, _ = _objective(world, monkeypatch, tmp_path, {"counting": 0}, cold_start="none")
    with pytest.raises(UserError) as err:
        obj.teachers.route(["counting", "colors"])
    assert "'colors'" in str(err.value) and "loss.flow_opd.default_teacher" in str(err.value)
    with pytest.raises(ConfigError, match="loss.flow_opd.teachers is empty"):
        FlowOPDObjective(FlowOPDOptions(), SimpleNamespace(name="x")).setup(LinearPolicy(*world.student, world.w0, world.b0))


def test_merge_cold_start_averages_the_teachers(monkeypatch, tmp_path):
    world = _world(4)
    _, policy = _objective(world, monkeypatch, tmp_path, {"counting": 0, "colors": 1}, default=2)
    assert torch.allclose(policy.W.detach(), sum(t[0] for t in world.teachers) / 3, atol=1e-12)


def test_sft_cold_start_clones_the_teachers_in_turn(monkeypatch, tmp_path):
    world = _world(5)
    obj, policy = _objective(world, monkeypatch, tmp_path, {"counting": 0, "colors": 1}, default=2,
                             cold_start="sft", sft_iterations=2)
    with obj.rollout_weights(policy):  # iteration 0 rolls out as teacher 0
        assert torch.equal(policy.W.detach(), world.teachers[0][0])
    assert torch.equal(policy.W.detach(), world.student[0])
    micro, grads = _loss_and_grad(obj, policy, _ctx(world, policy, iteration=0))
    rows = obj.rows(_ctx(world, policy, iteration=0))
    assert set(rows.prompt.tolist()) == {0}  # only the prompts routed to teacher 0
    x = rows.sample.double()
    v = policy.velocity(x, rows.sigma, world.cond[rows.prompt]).detach()
    vt = LinearPolicy.apply(x, rows.sigma, world.cond[rows.prompt], *world.teachers[0])
    assert abs(float(micro.loss.detach()) - float(((v - vt) ** 2).mean())) < 1e-6
    assert obj.sft_teacher(1) == 1 and obj.sft_teacher(2) is None
