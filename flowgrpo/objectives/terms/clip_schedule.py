"""The ratio clip range of an iteration: fixed, or Dynamic-TreeRPO's reward-adaptive bound.

``loss.grpo.clip_adapt`` = c > 0 gives eps = eps_0 * (1 + c * (1 - q)), q = the iteration's mean reward
(the mean over reward names of each reward's mean over finite values) clamped to [0, 1]: a low
reward widens the trust region (exploration), a high one narrows it back to eps_0. Stateless, so a
resumed run computes the same bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...fields import help_field as _f
from .base import LossTerm


@dataclass
class ClipOptions:
    clip_range: float = _f(1e-4, "PPO clip epsilon on the importance ratio", gt=0.0)
    clip_adapt: float = _f(0.0, "reward-adaptive clip (Dynamic-TreeRPO): eps = clip_range * (1 + clip_adapt * (1 - clamp(mean reward, 0, 1))); 0 = fixed", ge=0.0)


def clip_range_for(base: float, adapt: float, rewards: dict[str, Tensor] | None) -> float:
    """The clip epsilon for an iteration with leaf ``rewards`` ({name: [L]}); ``base`` when ``adapt`` = 0."""
    if adapt <= 0 or not rewards:
        return base
    means = []
    for r in rewards.values():
        r = r.float()
        fin = r.isfinite()
        if fin.any():
            means.append(float(r[fin].mean()))
    if not means:
        return base
    q = min(max(sum(means) / len(means), 0.0), 1.0)
    return base * (1.0 + adapt * (1.0 - q))


class ClipSchedule(LossTerm):
    """The iteration's ratio clip epsilon (:func:`clip_range_for`); always active (a fixed clip when clip_adapt = 0)."""

    name = "clip"
    Options = ClipOptions

    @property
    def active(self) -> bool:
        return True

    def value(self, rewards: dict[str, Tensor] | None) -> float:
        """The clip epsilon for an iteration with leaf ``rewards`` ({name: [L]})."""
        return clip_range_for(self.opt.clip_range, self.opt.clip_adapt, rewards)
