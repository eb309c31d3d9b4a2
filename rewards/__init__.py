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
    raise a :class:`~flowgrpo.errors.ConfigError` listing the valid ones.

    One option every reward takes: ``frame_stride`` (int >= 1, default 1), popped before the
    factory's options are checked. The reward is always wrapped in
    :class:`~flowgrpo.rewards.video.FrameWise`: videos [B, F, 3, H, W] are scored on frames
    0, s, 2s, ... and averaged per video; images [B, 3, H, W] pass through unchanged.
    """
    from .clip_common import positive_int
    from .video import FrameWise

    stride = positive_int(f"reward {name!r} option frame_stride", options.pop("frame_stride", 1))
    factory = REWARDS.get(name)
    check_options(name, factory, options)
    return FrameWise(factory(**options), stride)


__all__ = ["REWARDS", "Reward", "RewardOutput", "build_reward"]
