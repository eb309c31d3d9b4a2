"""The Python API and plug-ins (docs/api.md): callable rewards, import paths in config, a Trainer
from parts, callbacks.

The plug-ins live in a module of "user code" written to a temporary folder on ``sys.path``.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import BRIGHTNESS, tiny_overrides

import flowgrpo
from flowgrpo.advantages import ESTIMATORS
from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError, UserError
from flowgrpo.objectives import OBJECTIVES, build_objective
from flowgrpo.policies import build_policy
from flowgrpo.rewards import REWARDS, CallableReward, build_reward
from flowgrpo.rewards.video import score_frames
from flowgrpo.samplers.forest_sampler import ForestSampler
from flowgrpo.samplers.strategies import build_strategy, options_class
from flowgrpo.trainer.parts import build_prompts, build_rewards, model_grid
from flowgrpo.trainer.trainer import Trainer

MOD = "fg_api_plugins"
PLUGINS = '''
import numpy as np
import torch

from flowgrpo.advantages.group import group_zscore_estimator
from flowgrpo.objectives.grpo import GRPOObjective
from flowgrpo.samplers.chains import FlowGRPOStrategy


def sharpness(images, prompts, **metadata):
    """Mean absolute horizontal gradient [B]."""
    return (images[..., 1:] - images[..., :-1]).abs().flatten(1).mean(1)


def half_nan(images, prompts, groups):
    """Brightness as a list, None (unscorable) for every second image."""
    return [None if i % 2 else float(img.mean()) for i, img in enumerate(images)]


class Scaled:
    def __init__(self, scale=1.0):
        self.scale = scale

    def __call__(self, images, prompts):
        return (images.flatten(1).mean(1) * self.scale).numpy()


def takes_one(img):
    return img


def one_score(images, prompts):
    return [0.0]


NOT_CALLABLE = 3


class NotAnObjective:
    pass


class HalfGRPO(GRPOObjective):
    name = "half_grpo"

    def __init__(self, cfg, device=None):
        super().__init__(cfg.loss.grpo, device)


def my_estimator(rollout, rewards, cfg_adv, cfg_reward):
    return group_zscore_estimator(rollout, rewards, cfg_adv, cfg_reward)


class MyStrategy(FlowGRPOStrategy):
    pass


def video_mean(videos, prompts):
    return [float(v.mean()) for v in videos]


video_mean.takes_videos = True
'''


@pytest.fixture(scope="module", autouse=True)
def plugin_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_code")
    (folder / f"{MOD}.py").write_text(textwrap.dedent(PLUGINS))
    sys.path.insert(0, str(folder))
    yield
    sys.path.remove(str(folder))


def _error(override: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(None, None, [override])
    return str(exc.value)


# --------------------------------------------------------------------------- import paths in config


def test_bad_import_paths_are_one_line_naming_the_key():
    assert _error(f"reward.weights={{'{MOD}:takes_one': 1.0}}") == (
        f"config key 'reward.weights': reward '{MOD}:takes_one': function takes_one takes (img); "
        "a reward is called as (images, prompts, **metadata) -> scores [B]")
    assert _error("reward.weights={'no_such_pkg.rewards:sharp': 1.0}") == (
        "config key 'reward.weights': reward 'no_such_pkg.rewards:sharp': cannot import module "
        "'no_such_pkg.rewards': No module named 'no_such_pkg'")
    assert _error(f"reward.weights={{'{MOD}:missing': 1.0}}") == (
        f"config key 'reward.weights': reward '{MOD}:missing': module '{MOD}' has no attribute 'missing'")
    assert _error(f"reward.weights={{'{MOD}:NOT_CALLABLE': 1.0}}") == (
        f"config key 'reward.weights': reward '{MOD}:NOT_CALLABLE': int 3 is not callable; "
        "a reward is called as (images, prompts, **metadata) -> scores [B]")
    assert _error(f"loss.objective={MOD}:NotAnObjective") == (
        f"config key 'loss.objective': objective '{MOD}:NotAnObjective': class NotAnObjective is not a subclass of "
        "flowgrpo.objectives.Objective; an objective is an Objective subclass (flowgrpo.objectives.Objective) "
        "built as cls(cfg, device), cls(cfg) or cls(), or a function (cfg, device) -> Objective")
    assert _error(f"advantage.estimator={MOD}:Scaled").startswith(
        f"config key 'advantage.estimator': advantage estimator '{MOD}:Scaled': class Scaled is not a function")
    assert _error(f"sampler.strategy={MOD}:HalfGRPO").startswith(
        f"config key 'sampler.strategy': sampling strategy '{MOD}:HalfGRPO': class HalfGRPO is not a subclass of "
        "flowgrpo.samplers.Strategy")
    # every registered objective is offered, in order, and the import-path form is named
    assert _error("loss.objective=grpoo") == (
        "config key 'loss.objective': unknown objective 'grpoo'; valid choices: "
        f"{', '.join(sorted(OBJECTIVES.names()))} (or an import path 'package.module:attr')")
    assert {"grpo", "nft", "awm", "dgpo"} <= set(OBJECTIVES.names())
    for msg in (_error(f"loss.objective={MOD}:nothing"), _error("reward.weights={'a.b:c': 1}")):
        assert "\n" not in msg


def test_registries_take_import_paths():
    assert f"{MOD}:sharpness" in REWARDS and f"{MOD}:missing" not in REWARDS and "nope" not in REWARDS
    assert isinstance(build_reward(f"{MOD}:sharpness"), CallableReward)
    assert build_reward(f"{MOD}:Scaled", scale=2.0).fn.scale == 2.0
    with pytest.raises(ConfigError, match=f"unknown option.*nope for reward '{MOD}:Scaled'; valid options: scale"):
        build_reward(f"{MOD}:Scaled", nope=1)
    cfg = load_config(None, None, [f"loss.objective={MOD}:HalfGRPO", f"sampler.strategy={MOD}:MyStrategy",
                                   f"advantage.estimator={MOD}:my_estimator"])
    assert OBJECTIVES.build(cfg.loss.objective, cfg, None).name == "half_grpo"
    assert options_class(cfg.sampler.strategy).__name__ == "StrategyOptions"
    assert ESTIMATORS.get(cfg.advantage.estimator).__name__ == "estimate"
    with pytest.raises(ValueError, match="contains ':'"):
        REWARDS.register("a:b")


# --------------------------------------------------------------------------- callable rewards


def test_callable_reward_converts_lists_arrays_and_none():
    images = torch.rand(4, 3, 8, 8)
    out = CallableReward(lambda im, p: [1, None, 2.5, float("nan")])(images, list("abcd"))
    assert out.scores.dtype == torch.float32 and torch.isnan(out.scores[[1, 3]]).all()
    assert out.scores[[0, 2]].tolist() == [1.0, 2.5]
    seen = {}

    def with_groups(im, p, groups):
        seen["groups"] = groups
        return np.arange(len(p))

    groups = torch.tensor([0, 0, 1, 1])
    assert CallableReward(with_groups)(images, list("abcd"), groups=groups).scores.tolist() == [0, 1, 2, 3]
    assert seen["groups"] is groups
    with pytest.raises(UserError, match=r"^reward 'fg_api_plugins:one_score' returned scores of shape \(1,\) "
                                        r"for 4 images; it must return one score per image \[4\]$"):
        build_reward(f"{MOD}:one_score")(images, list("abcd"))
    with pytest.raises(UserError, match="returned float"):
        CallableReward(lambda im, p: 1.0, "x")(images, list("abcd"))


def test_video_rewards_see_strided_frames_or_whole_videos():
    videos = torch.rand(2, 5, 3, 4, 4)
    per_frame = score_frames(CallableReward(lambda im, p: im.flatten(1).mean(1)), videos, ["a", "b"], stride=2)
    expected = videos[:, [0, 2, 4]].flatten(2).mean(2).mean(1)
    torch.testing.assert_close(per_frame.scores, expected)
    whole = score_frames(build_reward(f"{MOD}:video_mean"), videos, ["a", "b"], stride=2)
    torch.testing.assert_close(whole.scores, videos[:, [0, 2, 4]].flatten(1).mean(1))


def test_reward_server_serves_a_reward_named_by_import_path():
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from flowgrpo.serve import ServerThread, create_app

    reward = build_reward(f"{MOD}:half_nan")
    images = torch.rand(4, 3, 16, 16)
    local = reward(images, list("abcd")).scores
    with ServerThread(create_app(reward, max_batch=4)) as srv:
        remote = build_reward("remote", url=srv.url)(images, list("abcd")).scores
    assert torch.isnan(remote[[1, 3]]).all()
    torch.testing.assert_close(remote[[0, 2]], local[[0, 2]], atol=3e-3, rtol=0)  # the PNG round trip: uint8


# --------------------------------------------------------------------------- a trainer from parts


def _metrics(trainer: Trainer, n: int = 2) -> list[dict]:
    timing = {"rollout_s", "collect_s", "train_s", "iter_s"}
    return [{k: v for k, v in trainer.iteration_step().metrics.items() if k not in timing} for _ in range(n)]


def test_trainer_from_parts_equals_trainer_from_config(tiny_config):
    cfg = tiny_config(**{"reward.weights": f"{{{BRIGHTNESS}: 1.0}}"})
    expected = _metrics(Trainer.from_config(cfg))
    torch.manual_seed(cfg.train.seed)  # as the trainer does before building rewards and policy
    rewards = build_rewards(cfg)
    policy = build_policy(cfg.model)
    parts = dict(policy=policy, rewards=rewards, objective=build_objective(cfg),
                 strategy=build_strategy(cfg.sampler, cfg.strategy, grid=model_grid(policy, cfg.sampler)),
                 sampler=ForestSampler(policy, cfg.sampler.max_micro_batch),
                 estimator=ESTIMATORS.get(cfg.advantage.estimator), prompts=build_prompts(cfg))
    assert _metrics(Trainer(cfg, **parts)) == expected


def test_plugins_by_path_train_as_their_built_in_twins(tiny_config):
    """An objective, strategy and estimator named by import path (GRPO, Flow-GRPO's chain and the group
    z-score underneath) give the built-ins' numbers."""
    base = {"reward.weights": f"{{{BRIGHTNESS}: 1.0}}", "sampler.strategy": "flow_grpo", "train.iterations": 1}
    expected = _metrics(Trainer.from_config(tiny_config(**base)), 1)
    cfg = tiny_config(**{**base, "loss.objective": f"{MOD}:HalfGRPO", "sampler.strategy": f"{MOD}:MyStrategy",
                         "advantage.estimator": f"{MOD}:my_estimator"})
    assert _metrics(Trainer.from_config(cfg), 1) == expected


def test_a_rewards_part_replaces_reward_weights_and_runs_in_waves(tiny_config):
    cfg = tiny_config(**{"reward.waves": 2})
    trainer = Trainer.from_config(cfg, rewards={"dark": lambda images, prompts: 1 - images.flatten(1).mean(1)})
    assert trainer.cfg.reward.weights == {"dark": 1.0} and cfg.reward.weights == {"shapes": 1.0}
    col = trainer.collect(0)
    torch.testing.assert_close(col.rewards["dark"], 1 - col.images.flatten(1).mean(1))


def test_train_with_a_reward_by_path_nan_scores_and_callbacks(shapes_model_dir, tmp_path):
    """A run named entirely by config: the user's reward appears in the metrics; the NaN half of its
    scores is dropped and counted; every callback event fires."""
    events = []

    class Recorder(flowgrpo.Callback):
        def on_evaluation(self, trainer, result, stage):
            events.append(("evaluation", stage, result.accuracy))

        def on_checkpoint(self, trainer, path, iteration):
            events.append(("checkpoint", iteration, path.is_dir() and path.name == f"ckpt_{iteration + 1:06d}"))

        def on_iteration_end(self, trainer, metrics):
            events.append(("iteration", metrics["iteration"], True))

    metrics = []
    overrides = tiny_overrides(shapes_model_dir, **{
        "reward.weights": f"{{'{MOD}:half_nan': 1.0}}", "log.trackers": "[]", "log.checkpoint_every": 1,
        "log.out_dir": str(tmp_path), "log.run_name": "run", "log.grid_every": 0})
    summary = flowgrpo.train(overrides, callbacks=[Recorder(), lambda trainer, m: metrics.append(m)])
    assert [m["iteration"] for m in metrics] == [0, 1]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    key = f"reward.{MOD}:half_nan"
    assert all(math.isfinite(m[key]) and m[key] > 0 for m in logged)
    assert [m["nan_rewards_dropped"] for m in logged] == [4, 4]  # 8 samples per iteration, every second NaN
    assert summary["nan_rewards_dropped"] == 8
    # one numbering: each checkpoint carries the iteration it follows, as the metrics do
    assert [e[:2] for e in events] == [("evaluation", "before"), ("iteration", 0), ("checkpoint", 0), ("iteration", 1),
                                       ("checkpoint", 1), ("evaluation", "after")]
    assert all(e[2] is True for e in events if e[0] == "checkpoint")


def test_train_refuses_a_config_and_a_trainer_together(tiny_config):
    with pytest.raises(UserError, match="not both"):
        flowgrpo.train(["train.iterations=1"], trainer=object())


def test_import_flowgrpo_stays_light_and_exports_the_api():
    import subprocess

    code = ("import sys, flowgrpo; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert {'train', 'Trainer', 'Callback', 'load_config', 'CallableReward'} <= set(dir(flowgrpo)); "
            "assert flowgrpo.Trainer.__name__ == 'Trainer'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        flowgrpo.nope  # noqa: B018


def test_a_trainer_from_parts_resumes_its_run(tiny_config, tmp_path):
    def dark(images, prompts):
        return 1 - images.flatten(1).mean(1)

    extra = {"log.trackers": "[]", "eval.evaluator": "none", "log.grid_every": 0, "log.checkpoint_every": 1}
    flowgrpo.train(trainer=Trainer.from_config(tiny_config(**extra, **{"train.iterations": 1}), rewards={"dark": dark}),
                   run_dir=tmp_path / "run")
    seen = []
    summary = flowgrpo.train(trainer=Trainer.from_config(tiny_config(**extra), rewards={"dark": dark}),
                             resume=tmp_path / "run", callbacks=[lambda tr, m: seen.append(m["iteration"])])
    assert seen == [1] and summary["iterations"] == 2
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in logged] == [0, 1] and all("reward.dark" in m for m in logged)
