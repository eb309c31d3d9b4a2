"""Rewards (installed as ``flowgrpo.rewards``): score the decoded leaves of a rollout.

Built-in names are registered lazily, so heavy reward models load only when used.
"""

from .base import REWARDS, Reward, RewardOutput, check_options

REWARDS.register_lazy("shapes", "flowgrpo.rewards.shapes:ShapesReward")
REWARDS.register_lazy("shapes_correct", "flowgrpo.rewards.shapes:ShapesCorrectReward")
REWARDS.register_lazy("jpeg_compressibility", "flowgrpo.rewards.compressibility:JpegCompressibility")
REWARDS.register_lazy("jpeg_incompressibility", "flowgrpo.rewards.compressibility:JpegIncompressibility")
REWARDS.register_lazy("shapes_pairwise", "flowgrpo.rewards.pairwise:ShapesPairwiseReward")
# reward models (weights from a local path or the hub cache; never downloaded in tests)
REWARDS.register_lazy("hpsv2", "flowgrpo.rewards.hps:HPSv2Reward")
REWARDS.register_lazy("pickscore", "flowgrpo.rewards.pickscore:PickScoreReward")
REWARDS.register_lazy("clipscore", "flowgrpo.rewards.clipscore:CLIPScoreReward")
REWARDS.register_lazy("aesthetic", "flowgrpo.rewards.aesthetic:AestheticReward")
REWARDS.register_lazy("ocr", "flowgrpo.rewards.ocr:OCRReward")
# over HTTP: a flowgrpo reward server, and VLM judges at an OpenAI-compatible endpoint
REWARDS.register_lazy("remote", "flowgrpo.rewards.remote:RemoteReward")
REWARDS.register_lazy("judge", "flowgrpo.rewards.judge:PointwiseJudgeReward")
REWARDS.register_lazy("judge_pairwise", "flowgrpo.rewards.judge:PairwiseJudgeReward")


def build_reward(name: str, **options) -> Reward:
    """Instantiate the reward registered as ``name`` with ``options`` (its factory's keyword
    arguments; ``reward.options.<name>.<key>=...`` in a config). Unknown names and unknown options
    raise a :class:`~flowgrpo.errors.ConfigError` listing the valid ones."""
    factory = REWARDS.get(name)
    check_options(name, factory, options)
    return factory(**options)


__all__ = ["REWARDS", "Reward", "RewardOutput", "build_reward"]
