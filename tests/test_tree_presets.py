"""The tree-method presets (issue 3) train end to end: shapes world (random tiny model) and tiny SD3.

Each preset runs 2 iterations of :class:`Trainer` shrunk to seconds (6 steps, 2 prompts, smaller
trees through strategy overrides); the first update is fully on-policy, so its importance ratio is 1.
The reference loss backend is used: the fused op's JIT build is not what these tests are about.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.config import load_config, read_preset
from flowgrpo.samplers.strategies import build_strategy
from flowgrpo.objectives.terms.sft import BestPathSFT
from flowgrpo.trainer.trainer import Trainer

PRESETS = {
    # preset: (overrides that shrink it, expected leaves per tree after shrinking)
    "branch-grpo": (["strategy.splits=[0, 2]", "strategy.depth_prune=1"], 4),
    "branch-grpo-mix": (["strategy.splits=[0, 2]", "strategy.window=2"], 4),
    "tree-rpo": (["strategy.window=2"], 4),
    "tempflow-grpo": (["strategy.branch=2", "strategy.branch_steps=[0, 2]"], 4),
    "g2rpo": (["strategy.branch=3", "strategy.first_steps=1"], 6),
}
ESTIMATOR = {"branch-grpo": "branch_grpo", "branch-grpo-mix": "branch_grpo", "tree-rpo": "branch_grpo",
             "tempflow-grpo": "tempflow", "g2rpo": "g2rpo"}
COMMON = ["sampler.num_steps=6", "data.prompts_per_iteration=2", "data.trees_per_prompt=1", "train.threads=1",
          "loss.grpo.backend=reference"]


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_is_documented_and_builds_its_plan(preset):
    raw = read_preset(preset)
    assert "paper" in raw["description"].lower()
    cfg = load_config(preset)
    assert cfg.advantage.estimator == ESTIMATOR[preset]
    plan = build_strategy(cfg.sampler, cfg.strategy).plan(0)
    assert plan.trained_steps() and plan.leaves_per_tree >= 4


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a photo of a cat\na red bicycle\na bowl of fruit\n")
    return path


def _run(cfg, leaves_per_tree: int):
    trainer = Trainer(cfg)
    results = [trainer.iteration_step() for _ in range(2)]
    trees = cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt
    for res in results:
        m = res.metrics
        assert res.rollout.num_leaves == trees * leaves_per_tree == res.images.shape[0]
        assert m["nfe_rollout"] == res.rollout.plan.nfe(trees)
        assert m["transitions"] > 0 and math.isfinite(m["loss"])
    assert results[0].metrics["onpolicy_ratio_maxdev"] < 1e-6  # first update: ratio = 1 exactly
    assert trainer.iteration == 2
    return results


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_trains_on_the_shapes_world(preset, shapes_model_dir):
    extra, leaves = PRESETS[preset]
    cfg = load_config(preset, None, [f"model.path={shapes_model_dir}", *COMMON, *extra,
                                     "reward.weights={shapes: 1.0, jpeg_compressibility: 0.01}"], recipe="shapes")
    _run(cfg, leaves)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_trains_the_tiny_sd3(preset, prompt_file):
    extra, leaves = PRESETS[preset]
    cfg = load_config(preset, None, ["model.name=sd3-tiny", f"data.prompts={prompt_file}", *COMMON, *extra,
                                     "reward.weights={jpeg_compressibility: 1.0}"], recipe="shapes")
    results = _run(cfg, leaves)
    assert results[0].rollout.leaves.x.shape[1:] == (16, 8, 8)


def test_tree_rpo_hooks_run_in_the_trainer(shapes_model_dir):
    """The adaptive clip bound and the SFT term of the tree-rpo preset reach the update."""
    extra, leaves = PRESETS["tree-rpo"]
    cfg = load_config("tree-rpo", None, [f"model.path={shapes_model_dir}", *COMMON, *extra,
                                         "reward.weights={jpeg_compressibility: 1.0}"], recipe="shapes")
    assert cfg.loss.grpo.clip_adapt == 1.0 and cfg.loss.grpo.sft_beta == 0.1  # the preset sets both
    trainer = Trainer(cfg)
    calls = {"sft": []}
    value0 = BestPathSFT.value

    def sft(self, *a, **k):
        calls["sft"].append(value0(self, *a, **k))
        return calls["sft"][-1]

    BestPathSFT.value = sft
    try:
        res = trainer.iteration_step()
    finally:
        BestPathSFT.value = value0
    # jpeg compressibility is not on [0, 1]: the clamped mean makes eps eps_0 or 2 eps_0
    assert res.metrics["clip_range"] in (pytest.approx(1e-4), pytest.approx(2e-4))
    assert any(a is not None and float(a.detach()) > 0 for a in calls["sft"])
    assert torch.isfinite(torch.tensor(res.metrics["loss"]))
