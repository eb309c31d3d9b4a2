"""Invariants of the pure-PyTorch reference GRPO loss. The fused op is tested in test_ops.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowgrpo.ops.reference import grpo_loss_ref
from flowgrpo.samplers import gaussian_log_prob


def inputs(n=6, shape=(3, 4, 4), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mean_old = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    std = (torch.rand(n, generator=g, dtype=torch.float64) * 0.3 + 0.05)
    eps = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    prev = mean_old + std.view(-1, 1, 1, 1) * eps
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    return {k: v.to(dtype) for k, v in dict(prev=prev, mean_old=mean_old, std=std, adv=adv, w=w, eps=eps).items()}


def np_loss(prev, mean, std, logp_old, adv, w, clip, mean_ref=None, kl_sigma=None, beta=0.0):
    """The clipped surrogate, Guard-free, with the KL term: an independent float64 formula in numpy."""
    n = prev.shape[0]
    x, mu = prev.reshape(n, -1), mean.reshape(n, -1)
    logp = (-((x - mu) ** 2) / (2 * std[:, None] ** 2) - np.log(std)[:, None] - 0.5 * np.log(2 * np.pi)).mean(1)
    r = np.exp(logp - logp_old)
    pol = w * np.maximum(-adv * r, -adv * np.clip(r, 1 - clip, 1 + clip))
    loss = pol.mean()
    kl = np.zeros(n)
    if mean_ref is not None:
        kl = ((mu - mean_ref.reshape(n, -1)) ** 2).mean(1) / (2 * kl_sigma**2)
        loss = loss + beta * kl.mean()
    return loss, logp, r, kl


def logp64(x, mu, std):
    """float64 Gaussian log-density, mean over non-batch dims (``gaussian_log_prob`` computes in float32)."""
    n = x.shape[0]
    x, mu, std = x.double().reshape(n, -1), mu.double().reshape(n, -1), std.double()
    return (-((x - mu) ** 2) / (2 * std[:, None] ** 2) - torch.log(std)[:, None] - 0.5 * math.log(2 * math.pi)).mean(1)


def test_ratio_is_one_when_mean_equals_mean_old():
    d = inputs()
    logp_old = gaussian_log_prob(d["prev"], d["mean_old"], d["std"])  # the sampler's own convention
    st = grpo_loss_ref(d["prev"], d["mean_old"].clone(), d["mean_old"], d["std"], logp_old, d["adv"], d["w"],
                             clip_range=1e-4)
    loss = st.loss
    assert (st.ratio - 1).abs().max().item() < 1e-6
    assert not st.clipped_high.any() and not st.clipped_low.any()
    # at r = 1 the surrogate is -mean(w * A)
    assert loss.item() == pytest.approx(-(d["w"] * d["adv"]).mean().item(), rel=1e-5, abs=1e-7)
    # the loss scores with the sampler's own density function: the same numbers, not just close ones
    assert torch.equal(st.logp, logp_old)


def test_float64_matches_independent_formula():
    d = inputs(dtype=torch.float64)
    g = torch.Generator().manual_seed(9)
    mean = d["mean_old"] + 0.01 * torch.randn(d["mean_old"].shape, generator=g, dtype=torch.float64)
    mean_ref = d["mean_old"] + 0.02 * torch.randn(d["mean_old"].shape, generator=g, dtype=torch.float64)
    logp_old = gaussian_log_prob(d["prev"].float(), d["mean_old"].float(), d["std"].float()).double()
    kl_sigma = d["std"] * 2
    st = grpo_loss_ref(d["prev"], mean, d["mean_old"], d["std"], logp_old, d["adv"], d["w"], clip_range=0.05,
                             mean_ref=mean_ref, kl_sigma=kl_sigma, beta=0.3)
    loss = st.loss
    assert loss.dtype == torch.float64
    n = {k: v.numpy() for k, v in d.items()}
    ref_loss, ref_logp, ref_r, ref_kl = np_loss(n["prev"], mean.numpy(), n["std"], logp_old.numpy(), n["adv"], n["w"],
                                                0.05, mean_ref.numpy(), kl_sigma.numpy(), 0.3)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(st.logp.numpy(), ref_logp, rtol=1e-12)
    np.testing.assert_allclose(st.ratio.numpy(), ref_r, rtol=1e-12)
    np.testing.assert_allclose(st.kl.numpy(), ref_kl, rtol=1e-12)
    # float32 inputs agree with the float64 truth to float32 accuracy
    st32 = grpo_loss_ref(d["prev"].float(), mean.float(), d["mean_old"].float(), d["std"].float(),
                                 logp_old.float(), d["adv"].float(), d["w"].float(), clip_range=0.05,
                                 mean_ref=mean_ref.float(), kl_sigma=kl_sigma.float(), beta=0.3)
    loss32 = st32.loss
    assert loss32.dtype == torch.float32
    assert loss32.item() == pytest.approx(ref_loss, rel=1e-4, abs=1e-5)


def _with_ratio(d, ratios):
    """logp_old chosen so that the ratio of each row is exactly ``ratios`` (mean = mean_old)."""
    logp = logp64(d["prev"], d["mean_old"], d["std"])
    return (logp - torch.log(torch.as_tensor(ratios, dtype=torch.float64))).to(d["prev"].dtype)


def test_clip_behaviour_and_gradients():
    d = inputs(n=6, dtype=torch.float64)
    eps = 0.1
    ratios = [1.5, 0.5, 1.5, 0.5, 1.05, 0.95]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    w = torch.ones(6, dtype=torch.float64)
    logp_old = _with_ratio(d, ratios)
    mean = d["mean_old"].clone().requires_grad_(True)
    st = grpo_loss_ref(d["prev"], mean, d["mean_old"], d["std"], logp_old, adv, w, clip_range=eps)
    loss = st.loss
    np.testing.assert_allclose(st.ratio.numpy(), ratios, rtol=1e-10)
    assert st.clipped_high.tolist() == [True, False, True, False, False, False]
    assert st.clipped_low.tolist() == [False, True, False, True, False, False]
    # per-row surrogate: max(-A r, -A clip(r)); A > 0 and r > 1 + eps is capped at -A (1 + eps), etc.
    per_row = [-(1 + eps), -0.5, 1.5, -(-1) * (1 - eps), -1.05, 0.95]
    assert loss.item() == pytest.approx(np.mean(per_row), rel=1e-10)
    loss.backward()
    gnorm = mean.grad.flatten(1).norm(dim=1)
    # the clipped branch is flat: no gradient where the clip is active against the advantage
    assert gnorm[0] == 0 and gnorm[3] == 0
    assert (gnorm[[1, 2, 4, 5]] > 0).all()


def test_gradient_matches_finite_differences():
    d = inputs(n=3, shape=(2, 2, 2), dtype=torch.float64)
    logp_old = _with_ratio(d, [1.02, 0.99, 1.0])
    mean = (d["mean_old"] + 0.01).requires_grad_(True)
    mean_ref = d["mean_old"] - 0.03

    def f(m):
        return grpo_loss_ref(d["prev"], m, d["mean_old"], d["std"], logp_old, d["adv"], d["w"], clip_range=0.2,
                             mean_ref=mean_ref, kl_sigma=d["std"], beta=0.5).loss

    assert torch.autograd.gradcheck(f, (mean,))


def test_kl_term():
    d = inputs(dtype=torch.float64)
    logp_old = _with_ratio(d, [1.0] * 6)
    g = torch.Generator().manual_seed(3)
    mean_ref = d["mean_old"] + 0.1 * torch.randn(d["mean_old"].shape, generator=g, dtype=torch.float64)
    kl_sigma = torch.full((6,), 0.2, dtype=torch.float64)
    st0 = grpo_loss_ref(d["prev"], d["mean_old"], d["mean_old"], d["std"], logp_old, d["adv"], d["w"],
                              clip_range=1e-4)
    base = st0.loss
    assert torch.all(st0.kl == 0)
    for beta in (0.01, 0.5):
        st = grpo_loss_ref(d["prev"], d["mean_old"], d["mean_old"], d["std"], logp_old, d["adv"], d["w"],
                                 clip_range=1e-4, mean_ref=mean_ref, kl_sigma=kl_sigma, beta=beta)
        loss = st.loss
        expected_kl = ((d["mean_old"] - mean_ref) ** 2).flatten(1).mean(1) / (2 * 0.2**2)
        torch.testing.assert_close(st.kl, expected_kl)
        assert loss.item() == pytest.approx(base.item() + beta * expected_kl.mean().item(), rel=1e-12)
    # the KL is zero at the reference, and beta = 0 disables it
    st_same = grpo_loss_ref(d["prev"], mean_ref, d["mean_old"], d["std"], logp_old, d["adv"], d["w"],
                               clip_range=1e-4, mean_ref=mean_ref, kl_sigma=kl_sigma, beta=1.0)
    assert torch.all(st_same.kl == 0)
    out0 = grpo_loss_ref(d["prev"], d["mean_old"], d["mean_old"], d["std"], logp_old, d["adv"], d["w"],
                             clip_range=1e-4, mean_ref=mean_ref, kl_sigma=kl_sigma, beta=0.0)
    loss0 = out0.loss
    assert loss0.item() == base.item()
    with pytest.raises(ValueError):
        grpo_loss_ref(d["prev"], d["mean_old"], d["mean_old"], d["std"], logp_old, d["adv"], d["w"],
                      clip_range=1e-4, mean_ref=mean_ref, beta=0.1)


def test_guard_normalized_log_ratio_identity():
    """GRPO-Guard's log r^ = s (logp - logp_old) + mse / (2 s) equals -mean((mu_old - mu) * eps)."""
    d = inputs(dtype=torch.float64)
    logp_old = logp64(d["prev"], d["mean_old"], d["std"])
    g = torch.Generator().manual_seed(4)
    mean = d["mean_old"] + 0.05 * torch.randn(d["mean_old"].shape, generator=g, dtype=torch.float64)
    st = grpo_loss_ref(d["prev"], mean, d["mean_old"], d["std"], logp_old, d["adv"], d["w"], clip_range=1e-4,
                          guard=True)
    expected = -((d["mean_old"] - mean) * d["eps"]).flatten(1).mean(1)
    torch.testing.assert_close(torch.log(st.ratio), expected, rtol=1e-4, atol=1e-9)
    # on policy the normalised ratio is 1 too
    st1 = grpo_loss_ref(d["prev"], d["mean_old"], d["mean_old"], d["std"], logp_old, d["adv"], d["w"],
                           clip_range=1e-4, guard=True)
    assert (st1.ratio - 1).abs().max().item() < 1e-9


def test_log_prob_scale_is_per_element_mean():
    """Doubling the latent (same per-element residuals, tiled) leaves logp unchanged: a mean, not a sum."""
    d = inputs(n=2, dtype=torch.float64)
    logp_old = torch.zeros(2, dtype=torch.float64)
    tile = lambda t: torch.cat([t, t], dim=1)  # noqa: E731
    a = grpo_loss_ref(d["prev"], d["mean_old"], d["mean_old"], d["std"], logp_old, d["adv"], d["w"], clip_range=0.1)
    b = grpo_loss_ref(tile(d["prev"]), tile(d["mean_old"]), tile(d["mean_old"]), d["std"], logp_old, d["adv"],
                         d["w"], clip_range=0.1)
    torch.testing.assert_close(a.logp, b.logp)
    assert math.isfinite(a.logp.sum().item())
