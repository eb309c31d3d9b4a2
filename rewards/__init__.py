"""Rewards (installed as ``flowgrpo.rewards``): score the decoded leaves of a rollout.

Built-in names are registered lazily, so heavy reward models load only when used.
"""

from .base import REWARDS, Reward, RewardOutput

REWARDS.register_lazy("shapes", "flowgrpo.rewards.shapes:ShapesReward")
REWARDS.register_lazy("shapes_correct", "flowgrpo.rewards.shapes:ShapesCorrectReward")
REWARDS.register_lazy("jpeg_compressibility", "flowgrpo.rewards.compressibility:JpegCompressibility")
REWARDS.register_lazy("jpeg_incompressibility", "flowgrpo.rewards.compressibility:JpegIncompressibility")
REWARDS.register_lazy("shapes_pairwise", "flowgrpo.rewards.pairwise:ShapesPairwiseReward")


def build_reward(name: str) -> Reward:
    """Instantiate the reward registered as ``name`` (unknown names list the valid ones)."""
    return REWARDS.build(name)


__all__ = ["REWARDS", "Reward", "RewardOutput", "build_reward"]
