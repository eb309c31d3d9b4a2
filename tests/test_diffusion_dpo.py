"""Diffusion-DPO (``loss.objective=diffusion_dpo``) against a float64 derivation from the paper's
Bradley-Terry form and its closed-form gradient, the online pairs, the offline pairs file (its
one-line errors and a training run from it), and the on-policy start (loss log 2) in the trainer."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowgrpo.errors import UserError
from flowgrpo.objectives.diffusion_dpo import diffusion_dpo_loss, online_pairs, read_pairs_file
from flowgrpo.trainer.trainer import Trainer
from conftest import BRIGHTNESS

D = (3, 4, 4)


def _pair_inputs(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda: torch.randn(n, *D, generator=g, dtype=torch.float64)  # noqa: E731
    x_w, x_l, eps = r(), r(), r()
    u_w, u_l = eps - x_w, eps - x_l
    v_w, v_l = u_w + 0.3 * r(), u_l + 0.3 * r()
    ref_w, ref_l = u_w + 0.3 * r(), u_l + 0.3 * r()
    return u_w, u_l, v_w, v_l, ref_w, ref_l


def _reference(u_w, u_l, v_w, v_l, ref_w, ref_l, beta):
    """The paper's DPO in float64: implicit rewards beta * log(p_theta / p_ref) with the Gaussian
    denoising proxy log p ~ -||v - u||^2 / 2 per element, a Bradley-Terry likelihood of chosen over
    rejected, written with softplus."""
    def log_ratio(v, ref, u):
        mse = lambda a: F.mse_loss(a, u, reduction="none").flatten(1).mean(1)  # noqa: E731
        return -(mse(v) - mse(ref)) / 2

    margin = beta * (log_ratio(v_w, ref_w, u_w) - log_ratio(v_l, ref_l, u_l))
    return F.softplus(-margin)


@pytest.mark.parametrize("beta", [1.0, 500.0, 5000.0])
def test_loss_and_gradient_match_the_bradley_terry_derivation(beta):
    u_w, u_l, v_w, v_l, ref_w, ref_l = _pair_inputs()
    a_w, a_l = v_w.clone().requires_grad_(True), v_l.clone().requires_grad_(True)
    ref = _reference(u_w, u_l, a_w, a_l, ref_w, ref_l, beta)
    g_w, g_l = torch.autograd.grad(ref.sum(), (a_w, a_l))
    b_w, b_l = v_w.clone().requires_grad_(True), v_l.clone().requires_grad_(True)
    err = lambda v, u: ((v - u) ** 2).flatten(1).mean(1)  # noqa: E731
    loss, z = diffusion_dpo_loss(err(b_w, u_w), err(b_l, u_l), err(ref_w, u_w), err(ref_l, u_l), beta)
    h_w, h_l = torch.autograd.grad(loss.sum(), (b_w, b_l))
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-300)
    torch.testing.assert_close(h_w, g_w, rtol=1e-10, atol=1e-300)
    torch.testing.assert_close(h_l, g_l, rtol=1e-10, atol=1e-300)
    # the closed form: dL/dv_w = beta sigmoid(-z) (v_w - u_w) / D, dL/dv_l = -beta sigmoid(-z) (v_l - u_l) / D
    s = torch.sigmoid(-z.detach()).view(-1, 1, 1, 1)
    n = u_w[0].numel()
    torch.testing.assert_close(h_w, beta * s * (v_w - u_w) / n, rtol=1e-10, atol=1e-300)
    torch.testing.assert_close(h_l, -beta * s * (v_l - u_l) / n, rtol=1e-10, atol=1e-300)


def test_at_the_reference_the_loss_is_log_2_and_pulls_chosen_toward_the_target():
    u_w, u_l, v_w, v_l, _, _ = _pair_inputs(seed=1)
    b_w = v_w.clone().requires_grad_(True)
    err = lambda v, u: ((v - u) ** 2).flatten(1).mean(1)  # noqa: E731
    loss, z = diffusion_dpo_loss(err(b_w, u_w), err(v_l, u_l), err(v_w, u_w), err(v_l, u_l), 5000.0)
    assert torch.allclose(loss.detach(), torch.full_like(loss, math.log(2)), rtol=0, atol=1e-15)
    (g,) = torch.autograd.grad(loss.sum(), b_w)
    assert float((g * (v_w - u_w)).sum()) > 0  # descending reduces the chosen image's error


def test_online_pairs():
    adv = torch.tensor([0.5, -1.0, 2.0, 2.0, 0.0, 0.0, float("nan"), 1.0, -1.0])
    group = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    # group 0: best 2, worst 1; group 1: best 3 over the tie 4 = 5 (first of the tied worst); group 2: NaN left out
    assert online_pairs(adv, group, "best_worst").tolist() == [[2, 1], [3, 4], [7, 8]]
    assert online_pairs(adv, group, "all").tolist() == [[0, 1], [2, 0], [2, 1], [3, 4], [3, 5], [7, 8]]
    flat = torch.tensor([0.3, 0.3, 0.3])
    assert online_pairs(flat, torch.zeros(3, dtype=torch.long), "all").shape == (0, 2)
    # with ties (Flow-Factory's argmax / argmin of a flat group): a flat group of >= 2 finite leaves pairs its
    # first leaf with itself, in either mode; a group of one finite leaf still gives none
    assert online_pairs(flat, torch.zeros(3, dtype=torch.long), "all", ties=True).tolist() == [[0, 0]]
    adv2 = torch.tensor([1.0, 0.0, 0.4, 0.4, float("nan"), 0.2, 0.7, 0.7])
    group2 = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert online_pairs(adv2, group2, "best_worst", ties=True).tolist() == [[0, 1], [2, 2], [6, 6]]
    assert online_pairs(adv2, group2, "all", ties=True).tolist() == [[0, 1], [2, 2], [6, 6]]
    assert online_pairs(adv2, group2, "best_worst").tolist() == [[0, 1]]


def test_tie_pairs_add_log_2_to_the_mean_and_halve_the_gradient_with_half_the_groups_flat():
    """4 groups of 3, 2 of them without reward spread: with ties (the authors', Flow-Factory) the mean runs over
    4 pairs, 2 of them chosen == rejected (z = 0: loss log 2, zero gradient), so the loss mean is
    (sum of the 2 real pairs' losses + 2 log 2) / 4 and the gradient exactly 0.5x the one without ties."""
    adv = torch.tensor([1.0, -0.5, -0.5, 0.2, 0.2, 0.2, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    group = torch.arange(4).repeat_interleave(3)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(12, *D, generator=g, dtype=torch.float64)
    a0, b0 = torch.randn(*D, generator=g, dtype=torch.float64), torch.randn(*D, generator=g, dtype=torch.float64)
    a = (a0 + 0.05 * torch.randn(*D, generator=g, dtype=torch.float64)).requires_grad_(True)
    b = (b0 + 0.05 * torch.randn(*D, generator=g, dtype=torch.float64)).requires_grad_(True)

    def step(ties):
        pairs = online_pairs(adv, group, "best_worst", ties=ties)
        losses = []
        for w, lo in pairs.tolist():
            gen = torch.Generator().manual_seed(1000 * w + lo)  # a pair's own noise and time, as the objective
            eps = torch.randn(*D, generator=gen, dtype=torch.float64)
            t = torch.rand((), generator=gen, dtype=torch.float64)
            err = lambda x, p, q: ((p * ((1 - t) * x + t * eps) + q - (eps - x)) ** 2).mean().view(1)  # noqa: E731
            loss, _ = diffusion_dpo_loss(err(x0[w], a, b), err(x0[lo], a, b), err(x0[w], a0, b0), err(x0[lo], a0, b0),
                                         5000.0)
            losses.append(loss)
        losses = torch.cat(losses)
        return pairs, losses, torch.autograd.grad(losses.mean(), (a, b))

    p_tie, l_tie, g_tie = step(True)
    p_no, l_no, g_no = step(False)
    assert p_tie.tolist() == [[0, 1], [3, 3], [8, 6], [9, 9]] and p_no.tolist() == [[0, 1], [8, 6]]
    tie = p_tie[:, 0] == p_tie[:, 1]
    assert torch.equal(l_tie[tie], torch.full((2,), math.log(2), dtype=torch.float64))
    torch.testing.assert_close(l_tie[~tie], l_no, rtol=0, atol=0)
    torch.testing.assert_close(l_tie.mean(), (l_no.sum() + 2 * math.log(2)) / 4, rtol=1e-15, atol=0)
    for h_tie, h_no in zip(g_tie, g_no):
        assert float(h_no.norm()) > 0
        torch.testing.assert_close(h_tie, 0.5 * h_no, rtol=1e-12, atol=1e-300)


def _png(path, value):
    from PIL import Image

    Image.fromarray(np.full((32, 32, 3), value, dtype=np.uint8)).save(path)


@pytest.fixture
def pairs_file(tmp_path):
    lines = []
    for i, prompt in enumerate(["a red circle", "a blue square", "a green triangle", "two yellow circles",
                                "a red square left of a blue circle"]):
        _png(tmp_path / f"w{i}.png", 200)
        _png(tmp_path / f"l{i}.png", 30)
        lines.append(json.dumps({"prompt": prompt, "chosen": f"w{i}.png", "rejected": f"l{i}.png"}))
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(lines) + "\n")
    return f


@pytest.mark.parametrize("line,message", [
    ("{not json", r"pairs.jsonl:3: not a JSON object"),
    ('["a", "b"]', r"pairs.jsonl:3: not a JSON object"),
    ('{"prompt": "x", "chosen": "w0.png"}', r"pairs.jsonl:3: missing or empty 'rejected'"),
    ('{"prompt": "x", "chosen": "w0.png", "rejected": "gone.png"}', r"pairs.jsonl:3: rejected image .*gone.png.* does not exist"),
])
def test_a_malformed_pairs_file_is_one_line_naming_the_line(pairs_file, line, message):
    rows = pairs_file.read_text().splitlines()
    pairs_file.write_text("\n".join(rows[:2] + [line] + rows[2:]) + "\n")
    with pytest.raises(UserError, match=message) as exc:
        read_pairs_file(pairs_file)
    assert "\n" not in str(exc.value)
    pairs_file.write_text("\n".join(rows) + "\n")
    pairs = read_pairs_file(pairs_file)
    assert len(pairs) == 5 and pairs[4].rejected == pairs_file.parent / "l4.png"


def test_a_missing_pairs_file_is_a_one_line_error(tmp_path, tiny_config):
    with pytest.raises(UserError, match="loss.diffusion_dpo.pairs_file: no file"):
        Trainer(tiny_config(**{"loss.objective": "diffusion_dpo", "loss.diffusion_dpo.pairs_file": str(tmp_path / "no.jsonl")}))


def test_offline_pairs_train_the_shapes_world(tiny_config, pairs_file):
    cfg = tiny_config(**{"loss.objective": "diffusion_dpo", "loss.diffusion_dpo.pairs_file": str(pairs_file),
                         "loss.diffusion_dpo.offline_pairs": 3, "loss.diffusion_dpo.timesteps": 2,
                         "train.lr": 1e-3, "sampler.strategy": "ode", "reward.weights": f"{{{BRIGHTNESS}: 1.0}}"})
    trainer = Trainer(cfg)
    before = trainer.policy.trainable_state_dict()
    m = trainer.iteration_step().metrics
    assert m["rows"] == 6  # 3 pairs x 2 times
    # one step: every row at the reference, up to the float32 rounding of the base model's copy (its
    # velocities differ from the live weights' by ~1e-6, which beta / 2 = 2500 multiplies)
    assert m["loss"] == pytest.approx(math.log(2), abs=3e-3)
    after = trainer.policy.trainable_state_dict()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 0
    m1 = trainer.iteration_step().metrics
    assert m1["kl"] > 0 and m1["loss"] != pytest.approx(math.log(2), abs=1e-2)


def test_online_pairs_train_from_the_first_step_at_log_2(tiny_config):
    cfg = tiny_config(**{"loss.objective": "diffusion_dpo", "loss.diffusion_dpo.pairs": "all", "train.lr": 1e-3,
                         "sampler.strategy": "ode", "reward.weights": f"{{{BRIGHTNESS}: 1.0}}"})
    trainer = Trainer(cfg)
    res = trainer.iteration_step()
    m = res.metrics
    adv, group = res.advantages.leaf_advantages.tolist(), res.rollout.leaf_groups.tolist()
    expected = sum(1 for i in range(len(adv)) for j in range(len(adv))
                   if group[i] == group[j] and adv[i] > adv[j])  # every strictly ordered pair of a group
    flat = [gr for gr in set(group) if len({a for a, h in zip(adv, group) if h == gr}) == 1
            and group.count(gr) >= 2]
    expected += len(flat)  # pairs_with_ties (default): one tie pair per group without spread
    assert m["rows"] == expected > 0 and m["grad_norm"] > 0
    # at the reference (up to float32 rounding, see above)
    assert m["loss"] == pytest.approx(math.log(2), abs=3e-3) and m["dpo_logit"] == pytest.approx(0.0, abs=6e-3)
