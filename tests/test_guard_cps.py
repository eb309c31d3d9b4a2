"""GRPO-Guard's ratio normalisation with CPS steps: right with the Gaussian log-prob, refused with "mse".

Guard's normalised log-ratio s (logp - logp_old) + mse / (2 s) equals -mean_D((mu_old - mu) eps), of
spread sqrt(mse / D) at every step, only when s is the std the transition was drawn with. The
mse convention (Flow-GRPO-Fast) scores every CPS step with 1/sqrt(2): Guard then leaves a factor
sqrt(2) s per step (s = sigma' sin(a pi / 2)), which is why ``loss.grpo.guard`` with
``sampler.cps_log_prob=mse`` is refused at config validation.
"""

import math

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.ops import grpo_loss_ref
from flowgrpo.samplers.schedule import sigma_grid
from flowgrpo.samplers.steps import sde_step

torch.set_num_threads(1)

T, N, SHAPE, A = 8, 1024, (3, 8, 8), 0.7


def guard_spread_over_closed_form(log_prob: str) -> list[float]:
    """Per CPS step (into sigma' > 0) of a T-step grid: std of Guard's log-ratio over N transitions
    after a velocity change dv, divided by the closed form's sqrt(mean(mse) / D)."""
    g = torch.Generator().manual_seed(0)
    sig = sigma_grid(T, 1.0).double()
    d = math.prod(SHAPE)
    out = []
    for i in range(T - 1):
        x = torch.randn(N, *SHAPE, generator=g, dtype=torch.float64)
        v = torch.randn(N, *SHAPE, generator=g, dtype=torch.float64)
        old = sde_step(x, v, sig[i], sig[i + 1], noise_level=A, kind="cps", generator=g, log_prob=log_prob)
        dv = 0.05 * torch.randn(N, *SHAPE, generator=g, dtype=torch.float64)
        new = sde_step(x, v + dv, sig[i], sig[i + 1], noise_level=A, kind="cps", prev_sample=old.prev_sample,
                       log_prob=log_prob)
        scoring = old.std if log_prob == "gaussian" else torch.full((N,), 1 / math.sqrt(2))
        ones = torch.ones(N, dtype=torch.float64)
        out_ = grpo_loss_ref(old.prev_sample.double(), new.mean.double(), old.mean.double(), scoring.double(),
                             old.log_prob.double(), ones, ones, clip_range=1e-4, guard=True)
        mse = ((new.mean - old.mean).double() ** 2).flatten(1).mean(1)
        out.append(float(torch.log(out_.ratio).std() / (mse.mean() / d).sqrt()))
    return out


def test_guard_on_cps_steps_equalises_the_spread_only_with_the_transition_std():
    gaussian = guard_spread_over_closed_form("gaussian")
    mse = guard_spread_over_closed_form("mse")
    s = [float(sigma_grid(T, 1.0)[i + 1]) * math.sin(A * math.pi / 2) for i in range(T - 1)]
    print("step  s       gaussian  mse    sqrt(2) s")
    for i in range(T - 1):
        print(f"{i:3d}  {s[i]:.3f}   {gaussian[i]:.3f}    {mse[i]:.3f}  {math.sqrt(2) * s[i]:.3f}")
    assert all(abs(r - 1) < 0.1 for r in gaussian)  # the closed form at every step
    for r, si in zip(mse, s):  # off by sqrt(2) s: the spread follows the step's noise again
        assert r == pytest.approx(math.sqrt(2) * si, rel=0.1)
    assert max(mse) / min(mse) > 5


def test_guard_with_the_mse_log_prob_is_refused_naming_both_keys():
    cps = ["sampler.sde_kind=cps"]
    with pytest.raises(ConfigError) as err:
        load_config("shapes", None, [*cps, "sampler.cps_log_prob=mse", "loss.grpo.guard=true"])
    msg = str(err.value)
    assert "\n" not in msg and "loss.grpo.guard" in msg and "sampler.cps_log_prob" in msg and "gaussian" in msg
    # each alone, and Guard's per-step reweighting (which reads only the grid), stay valid
    load_config("shapes", None, [*cps, "loss.grpo.guard=true"])
    load_config("shapes", None, [*cps, "sampler.cps_log_prob=mse"])
    load_config("shapes", None, [*cps, "sampler.cps_log_prob=mse", "loss.grpo.guard_reweight=true"])
