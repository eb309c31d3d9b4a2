"""Rewards (installed as ``flowgrpo.rewards``): score the decoded leaves of a rollout.

Built-in names are registered lazily, so heavy reward models load only when used.
"""

from .base import REWARDS, Reward, RewardOutput, check_options

#: name -> "module:attr" of its factory; a module is imported only when its reward is built
_BUILT_IN = {
    "shapes": "shapes:ShapesReward",
    "shapes_correct": "shapes:ShapesCorrectReward",
    "jpeg_compressibility": "compressibility:JpegCompressibility",
    "jpeg_incompressibility": "compressibility:JpegIncompressibility",
    "shapes_pairwise": "pairwise:ShapesPairwiseReward",
    # reward models (weights from a local path or the hub cache; never downloaded in tests)
    "hpsv2": "hps:HPSv2Reward",
    "pickscore": "pickscore:PickScoreReward",
    "clipscore": "clipscore:CLIPScoreReward",
    "aesthetic": "aesthetic:AestheticReward",
    "ocr": "ocr:OCRReward",
    # over HTTP: a flowgrpo reward server, and VLM judges at an OpenAI-compatible endpoint
    "remote": "remote:RemoteReward",
    "judge": "judge:PointwiseJudgeReward",
    "judge_pairwise": "judge:PairwiseJudgeReward",
}
for _name, _target in _BUILT_IN.items():
    REWARDS.register_lazy(_name, f"flowgrpo.rewards.{_target}")

def build_reward(name: str, **options) -> Reward:
    """Instantiate the reward registered as ``name`` with ``options`` (its factory's keyword
    arguments; ``reward.options.<name>.<key>=...`` in a config). Unknown names and unknown options
    raise a :class:`~flowgrpo.errors.ConfigError` listing the valid ones. Videos are scored frame by
    frame with :func:`flowgrpo.rewards.video.score_frames` (``reward.frame_stride``)."""
    factory = REWARDS.get(name)
    check_options(name, factory, options)
    return factory(**options)


__all__ = ["REWARDS", "Reward", "RewardOutput", "build_reward"]
