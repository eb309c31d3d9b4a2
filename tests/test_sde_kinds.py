"""The SDE kinds own their math; plans turn zero-variance steps into ODE steps everywhere; every
preset trains with every SDE kind without a NaN or infinite loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowgrpo.config import load_config, preset_names
from flowgrpo.samplers.forest import TransitionBatch
from flowgrpo.samplers.plan import SamplingPlan, StepSpec
from flowgrpo.samplers.recompute import transition_log_prob_std, transition_means, transition_sigma_t
from flowgrpo.samplers.schedule import sigma_grid
from flowgrpo.samplers.sde import DEFAULT_NOISE_LEVEL, SDE_KINDS, sde_kind
from flowgrpo.samplers.steps import sde_step

KINDS = list(SDE_KINDS)


def _sigma_t_ref(kind: str, s: float, sn: float, a: float, smax: float) -> float:
    """float64 sigma_t from the SDE kinds' formulas, written independently of samplers/sde.py."""
    if kind == "flow_grpo":
        return a * math.sqrt(s / (1 - (smax if s >= 1 else s)))
    if kind == "dance":
        return a
    return sn * math.sin(a * math.pi / 2)


@pytest.mark.parametrize("kind", KINDS)
def test_sigma_t_and_std_match_float64_formulas(kind):
    sig = sigma_grid(10, 3.0).double()
    a = 0.6
    s, sn = sig[:-1], sig[1:]
    st = sde_kind(kind).sigma_t(s, sn, a, sig[1].expand(10))
    std = sde_kind(kind).std(s, sn, a, sig[1].expand(10))
    for i in range(10):
        ref = _sigma_t_ref(kind, float(s[i]), float(sn[i]), a, float(sig[1]))
        assert float(st[i]) == pytest.approx(ref, rel=1e-12)
        ref_std = ref if kind == "cps" else ref * math.sqrt(float(s[i] - sn[i]))
        assert float(std[i]) == pytest.approx(ref_std, rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_the_step_std_is_the_kinds_std(kind):
    """sde_step and the kind object agree (one owner of the math)."""
    x = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    v = torch.randn(3, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    out = sde_step(x, v, 0.7, 0.5, noise_level=0.8, kind=kind, sigma_max=0.9)
    k = sde_kind(kind)
    s, sn = torch.full((3,), 0.7), torch.full((3,), 0.5)
    torch.testing.assert_close(out.std, k.std(s, sn, 0.8, torch.full((3,), 0.9)))
    torch.testing.assert_close(out.sigma_t, k.sigma_t(s, sn, 0.8, torch.full((3,), 0.9)))


def test_default_noise_level_is_written_once():
    from flowgrpo.config import SamplerConfig

    assert SamplerConfig().noise_level == StepSpec().noise_level == DEFAULT_NOISE_LEVEL


def _tree_program(kind: str) -> SamplingPlan:
    """A TempFlow-style program: ODE main chain with SDE children at every step, the last into sigma' = 0."""
    t = 4
    sde = StepSpec(sde=True, branch=2, lane=1, sde_kind=kind)
    ode = StepSpec(sde=False)
    main = [((ode,) if i < t - 1 else ()) + (sde,) for i in range(t)]
    return SamplingPlan(sigma_grid(t), [StepSpec(sde=True, sde_kind=kind)] * t, rules={0: main, 1: [(ode,)] * t})


def test_cps_into_zero_is_an_ode_step_in_chains_and_tree_programs():
    chain = SamplingPlan(sigma_grid(4), [StepSpec(sde=True, sde_kind="cps")] * 4)
    assert [s.sde for s in chain.steps] == [True, True, True, False]
    prog = _tree_program("cps")
    assert [s.sde for s in prog.steps] == [True, True, True, False]
    last = prog.rule(0, 3)
    assert len(last) == 1 and not last[0].sde and last[0].branch == 1  # one child: two would be identical
    assert prog.trained_steps() == [0, 1, 2]
    # the other kinds keep a stochastic last step (their std into sigma' = 0 is positive)
    assert _tree_program("flow_grpo").rule(0, 3)[0].sde


def test_recompute_matches_the_rollout_step():
    """The loss's recomputed means / sigma_t / scoring std are the rollout step's, row by row."""
    sig = sigma_grid(6, 2.0)
    specs = [StepSpec(sde=True, sde_kind=k, noise_level=a) for k, a in
             (("flow_grpo", 0.7), ("dance", 0.3), ("cps", 0.5), ("flow_grpo", 0.9), ("cps", 0.6), ("dance", 0.4))]
    specs[4] = StepSpec(sde=True, sde_kind="cps", noise_level=0.6, log_prob="mse")
    plan = SamplingPlan(sig, specs)
    g = torch.Generator().manual_seed(3)
    m = 12
    step = torch.arange(m) % 5
    x = torch.randn(m, 2, 3, 3, generator=g)
    v = torch.randn(m, 2, 3, 3, generator=g)
    rows = [sde_step(x[i:i + 1], v[i:i + 1], sig[step[i]], sig[step[i] + 1], noise_level=specs[step[i]].noise_level,
                     kind=specs[step[i]].sde_kind, sigma_max=sig[1], generator=g, log_prob=specs[step[i]].log_prob)
            for i in range(m)]
    z = torch.zeros(m)
    batch = TransitionBatch(sample=x, prev_sample=torch.cat([r.prev_sample for r in rows]),
                            mean_old=torch.cat([r.mean for r in rows]), std=torch.cat([r.std for r in rows]),
                            log_prob_old=torch.cat([r.log_prob for r in rows]), sigma=sig[step], sigma_next=sig[step + 1],
                            step=step, tree=torch.arange(m), prompt=torch.zeros(m, dtype=torch.long), advantages=z,
                            node=torch.arange(m))
    torch.testing.assert_close(transition_means(batch, v, plan), batch.mean_old)
    torch.testing.assert_close(transition_sigma_t(batch, plan), torch.cat([r.sigma_t for r in rows]))
    scoring = transition_log_prob_std(batch, plan)
    assert torch.allclose(scoring[step == 4], torch.full(((step == 4).sum(),), 1 / math.sqrt(2)))
    torch.testing.assert_close(scoring[step != 4], batch.std[step != 4])


# --------------------------------------------------------------------------- every preset x every SDE kind

#: presets that train only with inputs a user names (Flow-OPD's teacher runs): their SDE kinds are
#: tested where those inputs are made (tests/test_flow_opd_runs.py)
NEEDS_INPUTS = {"flow-opd"}


def _shapes_presets() -> list[str]:
    """Every method preset (on the embedded shapes world, the recipe without a model named)."""
    return [p for p in preset_names() if load_config(p).model.name == "shapes" and p not in NEEDS_INPUTS]


_METHOD_PRESETS = _shapes_presets()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("preset", _METHOD_PRESETS)
def test_every_preset_and_sde_kind_gives_a_finite_loss(preset, kind, shapes_model_dir):
    """One iteration with a stochastic reward (JPEG size of noisy images varies by sample) on a short
    grid, so that branch points reach the last step: the loss and every metric are finite."""
    from flowgrpo.trainer.trainer import Trainer

    overrides = [f"model.path={shapes_model_dir}", f"sampler.sde_kind={kind}", "sampler.num_steps=4",
                 "data.prompts_per_iteration=1", "train.micro_batch=512", "log.progress=false",
                 "reward.weights={jpeg_compressibility: 1.0}"]
    if kind == "dance":
        overrides.append("sampler.noise_level=0.3")
    strategy = load_config(preset).sampler.strategy  # with the preset's bases
    opts = {"branch_grpo": ["strategy.splits=[0, 3]", "strategy.depth_prune=0"],
            "branch_grpo_mix": ["strategy.splits=[0, 3]", "strategy.window=1"],
            "tree_rpo": ["strategy.window=2"], "tempflow_grpo": ["strategy.branch_steps=[0, 3]", "strategy.branch=2"],
            "g2rpo": ["strategy.first_steps=4", "strategy.branch=2"],
            "mix_grpo": ["strategy.window=2"], "mix_grpo_flash": ["strategy.window=2"],
            "mix_grpo_flash_star": ["strategy.window=2"]}
    overrides += opts.get(strategy or "", [])
    cfg = load_config(preset, None, overrides)
    trainer = Trainer(cfg)
    m = trainer.iteration_step().metrics
    assert "loss" in m, f"{preset}/{kind}: no transition was trained"
    bad = {k: v for k, v in m.items() if isinstance(v, float) and not np.isfinite(v) and k != "reward_mean"}
    assert not bad, f"{preset}/{kind}: non-finite metrics {bad}"
