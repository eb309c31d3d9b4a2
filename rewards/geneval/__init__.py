"""GenEval (Ghosh et al., 2023) without mmcv: the official verdict as a pure function of detections
(:func:`evaluate_detections`), Flow-GRPO's reward-server scores (:func:`reward_server_scores`), the
models that produce detections and colours through pip-installable libraries
(:mod:`.detector`: transformers' Mask2Former; :mod:`.colour`: open_clip's CLIP ViT-L/14), and the
``geneval`` reward (:mod:`.reward`). Importing this package needs numpy only; the models import torch,
transformers and open_clip when built. docs/rewards.md#geneval says what differs from the official stack.
"""

from .order import descending_order
from .scorer import (COLOURS, RELATIONS, TAGS, ServerVerdict, evaluate_detections, judge, judge_reward_server,
                     relations, reward_server_scores, select_objects)

__all__ = ["COLOURS", "RELATIONS", "TAGS", "ServerVerdict", "descending_order", "evaluate_detections", "judge",
           "judge_reward_server", "relations", "reward_server_scores", "select_objects"]
