"""Rewards overlapped with sampling (reward.waves, reward.overlap): wave splits, merging, same numbers."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import BRIGHTNESS, TinyPolicy

from flowgrpo.config import SamplerConfig
from flowgrpo.errors import ConfigError, UserError
from flowgrpo.rewards import REWARDS, RewardOutput
from flowgrpo.samplers.forest import concat_rollouts
from flowgrpo.samplers.forest_sampler import ForestSampler
from flowgrpo.samplers.strategies import build_strategy
from flowgrpo.trainer.trainer import Trainer
from flowgrpo.trainer.waves import collect_in_waves, wave_ranges

TIMING = ("rollout_s", "collect_s", "train_s", "iter_s", "train_seconds")
THREADED = "test_threads_seen"
FAILING = "test_fails_on_second_call"
_seen_threads: list[str] = []

if THREADED not in REWARDS:

    @REWARDS.register(THREADED)
    class ThreadRecordingReward:
        """Brightness; records the name of the thread that scores."""

        name = THREADED

        def __call__(self, images, prompts, groups=None):
            _seen_threads.append(threading.current_thread().name)
            return RewardOutput(images.float().flatten(1).mean(1))

if FAILING not in REWARDS:

    @REWARDS.register(FAILING)
    class FailingReward:
        """Scores the first wave, then raises (a reward that breaks mid-iteration)."""

        name = FAILING

        def __init__(self):
            self.calls = 0

        def __call__(self, images, prompts, groups=None):
            self.calls += 1
            if self.calls > 1:
                raise UserError("test reward: the scorer broke on wave 2")
            return RewardOutput(images.float().flatten(1).mean(1))


def test_waves_cut_on_group_boundaries_into_about_equal_parts():
    assert wave_ranges(range(0, 12), 3, 2) == [range(0, 6), range(6, 12)]
    assert wave_ranges(range(0, 12), 3, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    assert wave_ranges(range(0, 12), 3, 1) == [range(0, 12)]
    assert wave_ranges(range(0, 12), 3, 9) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]  # 4 groups
    assert wave_ranges(range(0, 12), 3, 10**8) == wave_ranges(range(0, 12), 3, 9)  # was 1e8 loop turns (a hang)
    assert wave_ranges(range(4, 9), 4, 3) == [range(4, 8), range(8, 9)]  # a shard that starts mid-group
    assert wave_ranges(range(1, 3), 4, 2) == [range(1, 3)]  # inside one group: no cut
    for trees, per, w in ((range(0, 64), 8, 3), (range(5, 40), 5, 4)):
        parts = wave_ranges(trees, per, w)
        assert [t for r in parts for t in r] == list(trees)
        assert all(r.start % per == 0 for r in parts[1:])
    with pytest.raises(ValueError):
        wave_ranges(range(0, 4), 2, 0)


@pytest.mark.parametrize("name,steps,options", [("flow_grpo", 4, {}), ("g2rpo", 6, {"branch": 2, "first_steps": 2}),
                                                ("branch_grpo", 4, {"splits": [0, 2]})])
def test_waves_merge_into_the_monolithic_rollout(name, steps, options):
    """Per-tree noise streams and a copied generator state: the merged waves are the one-batch forest
    node for node (G2RPO's leaves sit at several depths, so a wave's leaves are spread out)."""
    plan = build_strategy(SamplerConfig(strategy=name, num_steps=steps), options).plan(0)
    sampler = ForestSampler(TinyPolicy(), max_micro_batch=1)  # one node per call: bitwise equal
    prompts, per = ["a", "b", "c"], 2
    state = torch.Generator().manual_seed(7).get_state()

    def roll(trees=None):
        g = torch.Generator()
        g.set_state(state)
        return sampler.rollout(plan, prompts, per, g, trees=trees)

    whole = roll()
    parts = [roll(r) for r in wave_ranges(range(6), per, 3)]
    merged, positions = concat_rollouts(parts)
    assert merged.nfe == whole.nfe and merged.num_leaves == whole.num_leaves
    for d, (a, b) in enumerate(zip(merged.levels, whole.levels)):
        for f in ("x", "tree", "parent", "mean", "std", "log_prob", "pos", "lane", "sde", "train"):
            va, vb = getattr(a, f), getattr(b, f)
            assert (va is None) == (vb is None), (d, f)
            if va is not None:
                assert torch.equal(va, vb), (name, d, f)
    leaves = merged.leaves.x
    for ro, pos in zip(parts, positions):
        assert torch.equal(leaves[pos], ro.leaves.x)
    assert sorted(torch.cat(positions).tolist()) == list(range(merged.num_leaves))


def _run(tiny_config, iterations=2, **extra):
    cfg = tiny_config(**{"reward.weights": f"{{{BRIGHTNESS}: 1.0}}", "data.prompts_per_iteration": 4,
                         "data.trees_per_prompt": 3, "sampler.max_micro_batch": 1, "train.lr": 1e-3, **extra})
    trainer = Trainer(cfg)
    metrics = []
    for _ in range(iterations):
        m = trainer.iteration_step().metrics
        metrics.append({k: v for k, v in m.items() if k not in TIMING})
    return metrics, trainer.policy.trainable_state_dict()


def test_overlapped_waves_train_exactly_as_serial_waves_and_as_one_batch(tiny_config):
    overlapped, w_over = _run(tiny_config, **{"reward.waves": 3})
    serial, w_serial = _run(tiny_config, **{"reward.waves": 3, "reward.overlap": False})
    one, w_one = _run(tiny_config)
    assert overlapped == serial == one
    for k in w_one:
        assert torch.equal(w_over[k], w_serial[k]) and torch.equal(w_over[k], w_one[k]), k


def test_the_waves_are_scored_on_the_worker_thread_and_its_errors_reach_the_caller(tiny_config):
    _seen_threads.clear()
    _run(tiny_config, iterations=1, **{"reward.weights": f"{{{THREADED}: 1.0}}", "reward.waves": 2})
    assert len(_seen_threads) == 2 and all(n.startswith("flowgrpo-score") for n in _seen_threads)
    _seen_threads.clear()
    _run(tiny_config, iterations=1, **{"reward.weights": f"{{{THREADED}: 1.0}}", "reward.waves": 2,
                                       "reward.overlap": False})
    assert _seen_threads == [threading.main_thread().name] * 2
    with pytest.raises(UserError, match="broke on wave 2"):
        _run(tiny_config, iterations=1, **{"reward.weights": f"{{{FAILING}: 1.0}}", "reward.waves": 2})


def test_collect_in_waves_places_each_waves_scores_at_its_leaves():
    plan = build_strategy(SamplerConfig(strategy="g2rpo", num_steps=6), {"branch": 2, "first_steps": 2}).plan(0)
    sampler = ForestSampler(TinyPolicy(), max_micro_batch=64)

    def sample(trees):
        return sampler.rollout(plan, ["a", "b"], 2, torch.Generator().manual_seed(3), trees=trees)

    def score(ro):  # the tree id as reward: checks the placement, not the model
        tree = ro.leaf_tree.float()
        return ro.leaves.x.cpu(), {"tree": tree}, {"tree.double": 2 * tree}

    out = collect_in_waves(wave_ranges(range(4), 2, 2), sample, score, overlap=True)
    assert torch.equal(out.rewards["tree"], out.rollout.leaf_tree.float())
    assert torch.equal(out.components["tree.double"], 2 * out.rollout.leaf_tree.float())
    assert torch.equal(out.images, out.rollout.leaves.x.cpu())


def test_waves_are_refused_under_a_lock_step_engine(tiny_config, monkeypatch):
    """FSDP / ZeRO gather weights on every model call: ranks whose shards cut into different numbers
    of waves would hang, so the combination is refused up front, naming the key."""
    import flowgrpo.trainer.accelerator as acc

    class FakeFSDPEngine:
        name = "fsdp"
        lockstep = True

    monkeypatch.setattr(acc, "weight_engine", lambda accelerator, dp: FakeFSDPEngine())
    with pytest.raises(ConfigError, match=r"reward.waves=2 .*FakeFSDPEngine.*reward.waves=1"):
        Trainer(tiny_config(**{"reward.waves": 2}))
