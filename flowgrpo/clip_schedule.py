"""The ratio clip range of an iteration: fixed, or Dynamic-TreeRPO's reward-adaptive bound.

``loss.clip_adapt`` = c > 0 gives eps = eps_0 * (1 + c * (1 - q)), q = the iteration's mean reward
(the mean over reward names of each reward's mean over finite values) clamped to [0, 1]: a low
reward widens the trust region (exploration), a high one narrows it back to eps_0. Stateless, so a
resumed run computes the same bounds.
"""

from __future__ import annotations

from torch import Tensor


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
