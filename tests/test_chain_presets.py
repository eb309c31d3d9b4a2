"""The chain-method presets run end to end: 2 iterations on the shapes world (random tiny model) and
on the tiny random SD3.

Every expectation below is derived from the method definitions (the SDE kinds' transition std, each
method's choice of SDE / trained / ODE steps) and the overrides,
not read back from the code: the plan of each iteration (which steps are SDE and trained, with
which SDE kind and noise level, which ODE solver elsewhere, how many steps after compression), the
transition std of every SDE edge of the rollout, the number of model calls and of transitions in
the update, the on-policy ratio at the first update, and exact reproducibility of a repeated run.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import math

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.trainer.run import train
from flowgrpo.trainer.trainer import Trainer

torch.set_num_threads(1)

PRESETS = ["flow-grpo", "dance-grpo", "mix-grpo", "mix-grpo-flash", "mix-grpo-flash-star", "pref-grpo"]
EXPECTED_STRATEGY = {"flow-grpo": "flow_grpo", "dance-grpo": "dance_grpo", "mix-grpo": "mix_grpo",
                     "mix-grpo-flash": "mix_grpo_flash", "mix-grpo-flash-star": "mix_grpo_flash_star",
                     "pref-grpo": "flow_grpo"}

PROMPTS, GROUP, T = 2, 4, 6  # the overrides below
TREES = PROMPTS * GROUP

# Plan of iterations 0 and 1 per preset, one letter per step: S = SDE (trained), E = Euler ODE,
# D = DPM-Solver++2 ODE on the compressed tail. With T = 6, window w = 2 and shift_every = 1:
#   MixGRPO: the window starts at l = iteration.
#   Flash: Euler before the window, then round_half_up(r * (T - l - w)) dpm2 steps with r = 0.4:
#          l = 0 -> round(1.6) = 2, l = 1 -> round(1.2) = 1.
#   Flash*: l = 0 always, r = 0.2 -> round(0.8) = 1.
PLANS = {
    "flow-grpo": ("SSSSSS", "SSSSSS"),
    "pref-grpo": ("SSSSSS", "SSSSSS"),
    "dance-grpo": ("SSSSSS", "SSSSSS"),
    "mix-grpo": ("SSEEEE", "ESSEEE"),
    "mix-grpo-flash": ("SSDD", "ESSD"),
    "mix-grpo-flash-star": ("SSD", "SSD"),
}
# (sde_kind, noise level) of the SDE steps: a = 0.7 for Flow-GRPO-style steps, eta = 0.3 for DanceGRPO
SDE = {p: ("flow_grpo", 0.7) for p in PRESETS} | {"dance-grpo": ("dance", 0.3)}
# SDE steps entering the update: all of them, except DanceGRPO's random 60 %: round(0.6 * 6) = 4
TRAINED = {"dance-grpo": 4}
TIMING = {"rollout_s", "collect_s", "train_s", "iter_s"}


def overrides(model_dir, preset, world, prompt_file=None):
    ov = [f"model.path={model_dir}", f"data.prompts_per_iteration={PROMPTS}", f"data.trees_per_prompt={GROUP}",
          f"sampler.num_steps={T}", "eval.num_prompts=2", "eval.seeds_per_prompt=1", "eval.num_steps=2",
          "train.threads=1", "log.progress=false", "log.trackers=[]", "loss.grpo.backend=reference"]
    if preset.startswith("mix-grpo"):
        ov.append("strategy.window=2")  # T = 6: leave room for the window to move and a compressed tail
        if preset != "mix-grpo-flash-star":
            ov.append("strategy.shift_every=1")
    if world == "sd3":
        ov += ["model.name=sd3-tiny", "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompt_file}"]
    elif preset == "pref-grpo":
        # a random model draws nothing the verifier reads, so the pairwise judge ties everywhere: a
        # continuous reward beside it gives the groups signal
        ov.append("reward.weights={shapes_pairwise: 1.0, test_brightness: 1.0}")
    else:
        ov.append("reward.weights={test_brightness: 1.0}")
    return ov


def reward_names(preset, world):
    if world == "sd3":
        return {"jpeg_compressibility"}
    return {"shapes_pairwise", "test_brightness"} if preset == "pref-grpo" else {"test_brightness"}


def expected_grid(policy, cfg):
    """The full T-step grid rollouts should start from: the policy's own (SD3: its scheduler's)."""
    if hasattr(policy, "sigma_grid"):
        return policy.sigma_grid(T, cfg.sampler.shift)
    from flowgrpo.samplers import sigma_grid  # policies without the hook use the shifted uniform grid

    return sigma_grid(T, cfg.sampler.shift)


def transition_std(kind, a, sig, i):
    """The transition std s = sigma_t * sqrt(-Delta) of step i, float64. flow_grpo: sigma_t = a sqrt(s / (1 - s))
    with the next grid point in the denominator at s = 1; dance: sigma_t = eta."""
    s, sn = float(sig[i]), float(sig[i + 1])
    if kind == "dance":
        sigma_t = a
    else:
        sigma_t = a * math.sqrt(s / (1 - (float(sig[1]) if s >= 1 else s)))
    return sigma_t * math.sqrt(s - sn)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("a red circle left of a blue square\ntwo green triangles\na photo of a cat\n")
    return p


def test_presets_describe_themselves():
    for preset in PRESETS:
        cfg = load_config(preset)
        assert cfg.description and cfg.model.name == "shapes" and cfg.data.prompts == "shapes"
        assert cfg.sampler.strategy == EXPECTED_STRATEGY[preset]
    assert load_config("pref-grpo").reward.weights == {"shapes_pairwise": 1.0}
    assert load_config("pref-grpo").reward.combine == "normalize_then_sum"
    dance = load_config("dance-grpo")
    assert dance.sampler.shared_group_noise and dance.train.timestep_order == "random"
    assert dance.train.timestep_fraction == 0.6 and dance.loss.grpo.kl_beta == 0.0
    assert load_config("flow-grpo").loss.grpo.kl_beta > 0  # Flow-GRPO keeps a KL to the base model


def run_two(cfg):
    trainer = Trainer(cfg)
    results = [trainer.iteration_step() for _ in range(2)]
    return trainer, results


@pytest.mark.parametrize("world", ["shapes", "sd3"])
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_two_iterations(preset, world, shapes_model_dir, prompt_file):
    cfg = load_config(preset, None, overrides(shapes_model_dir, preset, world, prompt_file), recipe="shapes")
    trainer, results = run_two(cfg)
    assert trainer.iteration == 2
    grid = expected_grid(trainer.policy, cfg)
    kind, level = SDE[preset]
    for it, res in enumerate(results):
        m, plan, rollout = res.metrics, trainer.strategy.plan(it), res.rollout
        letters = PLANS[preset][it]
        # --- plan structure
        assert plan.num_steps == len(letters)
        sde_steps = [i for i, c in enumerate(letters) if c == "S"]
        assert plan.trained_steps() == sde_steps
        for i, c in enumerate(letters):
            spec = plan.steps[i]
            assert spec.sde == (c == "S"), (it, i)
            if c == "S":
                assert (spec.sde_kind, spec.noise_level) == (kind, level), (it, i)
            else:
                assert spec.solver == {"E": "euler", "D": "dpm2"}[c], (it, i)
        # the grid: the full one up to the end of the last SDE step, then (Flash) a tail down to 0
        end = sde_steps[-1] + 1
        torch.testing.assert_close(plan.sigmas[: end + 1].float(), grid[: end + 1].float(), rtol=0, atol=1e-6)
        if len(letters) == T:
            torch.testing.assert_close(plan.sigmas.float(), grid.float(), rtol=0, atol=1e-6)
        assert float(plan.sigmas[-1]) == 0.0 and bool((plan.sigmas[1:] < plan.sigmas[:-1]).all())

        # --- the rollout: a chain per tree, SDE edges exactly at the S steps with the std above
        assert len(rollout.levels) == len(letters) + 1
        assert all(len(level_) == TREES for level_ in rollout.levels)
        for d, c in enumerate(letters):
            child = rollout.levels[d + 1]
            assert bool(child.sde_mask().all()) if c == "S" else not bool(child.sde_mask().any()), (it, d)
            if c == "S":
                want = torch.full((TREES,), transition_std(kind, level, plan.sigmas.double(), d), dtype=torch.float64)
                torch.testing.assert_close(child.std.double(), want, rtol=1e-5, atol=0)
        # initial noise: shared inside a group for DanceGRPO only
        x0 = rollout.levels[0].x.flatten(1)
        groups = rollout.tree_group
        for g in groups.unique():
            members = x0[groups == g]
            same = bool((members == members[0]).all())
            assert same == (preset == "dance-grpo"), (it, int(g))
        assert not torch.equal(x0[groups == 0][0], x0[groups == 1][0])

        # --- metrics: model calls, rewards, update size
        assert m["nfe_rollout"] == TREES * len(letters)  # one call per node per step, guidance off
        names = reward_names(preset, world)
        reward_keys = {k for k in m if k.startswith("reward.")}
        assert {f"reward.{n}" for n in names} <= reward_keys  # every configured reward, then its components
        assert all(k.split(".")[1] in names for k in reward_keys), reward_keys
        assert all(math.isfinite(m[f"reward.{n}"]) for n in names)
        if "shapes_pairwise" in names:
            # each judged pair hands out one point in total, so a group's win rates average to 1/2
            assert m["reward.shapes_pairwise"] == pytest.approx(0.5, abs=1e-6)
        assert m["zero_std_ratio"] == 0.0 and m["nan_rewards_dropped"] == 0
        trained = TRAINED.get(preset, len(sde_steps))
        assert m["trained_steps"] == trained
        assert m["transitions"] == TREES * trained
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert results[0].metrics["onpolicy_ratio_maxdev"] < 1e-5  # no update yet: r = 1 exactly in fp32
    if preset == "mix-grpo":
        assert trainer.strategy.window_start(1) == 1

    # --- a second run with the same config reproduces every metric and the trained weights
    if world == "shapes" or preset in ("flow-grpo", "mix-grpo-flash"):
        again, results2 = run_two(cfg)
        for r1, r2 in zip(results, results2):
            assert {k: v for k, v in r1.metrics.items() if k not in TIMING} == \
                   {k: v for k, v in r2.metrics.items() if k not in TIMING}
            assert torch.equal(r1.images, r2.images)
        w1, w2 = trainer.policy.trainable_state_dict(), again.policy.trainable_state_dict()
        assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_train_run_directory(shapes_model_dir, tmp_path):
    cfg = load_config("mix-grpo-flash", None, overrides(shapes_model_dir, "mix-grpo-flash", "shapes") +
                      ["train.iterations=2", "log.checkpoint_every=1", "log.grid_every=0"], recipe="shapes")
    summary = train(cfg, tmp_path / "run")
    assert summary["iterations"] == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in lines] == [0, 1]
    assert all(r["transitions"] == TREES * 2 for r in lines)  # the 2-step window, every tree
