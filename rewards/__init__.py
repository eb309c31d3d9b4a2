"""Rewards (installed as ``flowgrpo.rewards``): score the decoded leaves of a rollout.

Built-in names are registered lazily, so heavy reward models load only when used. User code adds
its own with ``@REWARDS.register("mine")`` (a class whose instances follow :class:`Reward`), or a
config names any callable ``(images, prompts, **metadata) -> scores`` or class with that
``__call__`` by import path, ``reward.weights={"my_pkg.rewards:sharpness": 1.0}``
(:mod:`.callable`, docs/api.md).
"""

from flowgrpo.registry import Registry

from .base import Reward, RewardOutput, check_options
from .callable import CallableReward, as_reward, reward_plugin

REWARDS: Registry = Registry("reward", plugin=reward_plugin)

#: name -> "module:attr" of its factory; a module is imported only when its reward is built
_BUILT_IN = {
    "shapes": "shapes:ShapesReward",
    "shapes_correct": "shapes:ShapesCorrectReward",
    "jpeg_compressibility": "compressibility:JpegCompressibility",
    "jpeg_incompressibility": "compressibility:JpegIncompressibility",
    "shapes_pairwise": "pairwise:ShapesPairwiseReward",
    # image editing: an example reward that reads the reference image (wants_references)
    "edit_consistency": "edit:EditConsistencyReward",
    # reward models (weights from a local path or the hub cache; never downloaded in tests)
    "hpsv2": "hps:HPSv2Reward",
    "pickscore": "pickscore:PickScoreReward",
    "clipscore": "clipscore:CLIPScoreReward",
    "aesthetic": "aesthetic:AestheticReward",
    "ocr": "ocr:OCRReward",
    "geneval": "geneval.reward:GenEvalReward",  # GenEval (detector + CLIP colours), Flow-GRPO's reward-server score
    "imagereward": "imagereward:ImageRewardReward",
    "hpsv3": "hpsv3:HPSv3Reward",
    # video reward models: called once with the list of B videos [F, 3, H, W] (takes_videos)
    "videoalign": "videoalign:VideoAlignReward",
    "temporal_consistency": "temporal:TemporalConsistencyReward",
    # over HTTP: a flowgrpo reward server, and VLM judges at an OpenAI-compatible endpoint
    "remote": "remote:RemoteReward",
    "judge": "judge:PointwiseJudgeReward",
    "judge_pairwise": "judge:PairwiseJudgeReward",
    "unifiedreward": "judge:UnifiedRewardJudge",
}
for _name, _target in _BUILT_IN.items():
    REWARDS.register_lazy(_name, f"flowgrpo.rewards.{_target}")

def build_reward(name: str, **options) -> Reward:
    """Instantiate the reward registered as ``name`` with ``options`` (its factory's keyword
    arguments; ``reward.options.<name>.<key>=...`` in a config). Unknown names and unknown options
    raise a :class:`~flowgrpo.errors.ConfigError` listing the valid ones. A reward registered by user
    code or named by import path is a :class:`CallableReward` (it may return plain scores). Videos are
    scored frame by frame with :func:`flowgrpo.rewards.video.score_frames` (``reward.frame_stride``)."""
    factory = REWARDS.get(name)
    check_options(name, factory, options)
    reward = factory(**options)
    # a reward added by user code may return plain scores (the callable contract, :mod:`.callable`)
    return reward if name in _BUILT_IN else as_reward(reward, name)


def check_rewards_fit_model(rewards: dict[str, Reward], model_cfg) -> None:
    """Refuse, with one line, a reward that can read only one model's images (its ``images_of``,
    e.g. the shapes verifier reads only the shapes world) paired with another model: such a run
    would score every image NaN and train nothing."""
    from flowgrpo.errors import UserError
    from flowgrpo.policies import resolve_adapter

    adapter = None
    for name, reward in rewards.items():
        only = getattr(reward, "images_of", None)
        if only is None:
            continue
        adapter = adapter or resolve_adapter(model_cfg)[0]
        if adapter != only:
            raise UserError(f"reward {name!r} scores only the {only} model's images, not model.name="
                            f"{model_cfg.name!r} ({adapter}): choose rewards for this model with reward.weights=... "
                            f"(e.g. reward.weights={{pickscore: 1.0}}; valid: {', '.join(REWARDS.names())})")


__all__ = ["REWARDS", "CallableReward", "Reward", "RewardOutput", "build_reward", "check_rewards_fit_model"]
