"""Signal curriculum: draw the prompts whose groups still teach something more often.

A GRPO-style group whose samples all get the same reward (all right or all wrong) has zero advantage
everywhere and trains nothing: on the shapes world 39 % of the default's groups were such groups on
average, mostly the easy tags once solved. DAPO drops such groups and samples again, paying for the
extra rollouts; this curriculum spends no extra rollout. It keeps, per prompt *key* (a tag such as
``counting``, or the prompt itself), an exponential moving average ``s_k`` of whether the key's
groups had reward spread, and draws keys with probability proportional to

    w_k = max(s_k, floor).

``s_k`` starts at 1 (an unseen key is assumed to teach), so every key is tried before it is
down-weighted, and ``floor`` keeps a solved key in the mix so that it is not forgotten. A key whose
groups are all wrong is down-weighted as well: it gives no gradient either, and comes back when the
policy starts to get it partly right (each of its groups is still observed at rate ``floor``).

The state is a dict of floats, identical on every rank (the observations are the whole iteration's)
and saved in checkpoints, so a resumed run draws the same prompts as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


@dataclass
class SignalCurriculum:
    """Per-key signal rates and the sampling weights they give.

    Attributes:
        floor: the smallest weight of a key, in (0, 1] (1 = uniform sampling).
        rate: the moving average's step per observed group, in (0, 1].
        signal: key -> moving-average signal rate in [0, 1] (keys never observed are absent: rate 1).
    """

    floor: float = 0.1
    rate: float = 0.2
    signal: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if not 0.0 < self.floor <= 1.0:
            raise ValueError(f"curriculum floor must be in (0, 1], got {self.floor}")
        if not 0.0 < self.rate <= 1.0:
            raise ValueError(f"curriculum rate must be in (0, 1], got {self.rate}")

    def weights(self, keys: list[str]) -> np.ndarray:
        """Sampling probabilities [K] of ``keys`` (they sum to 1)."""
        w = np.array([max(self.signal.get(k, 1.0), self.floor) for k in keys], dtype=np.float64)
        return w / w.sum()

    def observe(self, keys: list[str], has_signal: list[bool]) -> None:
        """Record one iteration's groups, in order: group g of key ``keys[g]`` had reward spread or not."""
        for k, s in zip(keys, has_signal):
            prev = self.signal.get(k, 1.0)
            self.signal[k] = prev + self.rate * (float(s) - prev)

    def state_dict(self) -> dict:
        return {"signal": dict(self.signal)}

    def load_state_dict(self, state: dict) -> None:
        self.signal = {str(k): float(v) for k, v in state.get("signal", {}).items()}


def groups_with_signal(leaf_groups: Tensor, leaf_mask: Tensor, num_groups: int) -> list[bool]:
    """Per group [G]: whether any of its leaves trains (``leaf_mask`` [L] of the advantage estimator:
    a valid reward in a group with spread); ``leaf_groups`` [L] long group ids in [0, G)."""
    hits = torch.zeros(num_groups).index_add_(0, leaf_groups.long().cpu(), leaf_mask.float().cpu())
    return (hits > 0).tolist()
