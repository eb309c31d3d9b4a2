"""flowgrpo: GRPO-style reinforcement learning for flow-matching image and video generators.

Data flow (one package per stage): ``flowgrpo.samplers`` produce rollouts (a forest of
transitions), ``flowgrpo.rewards`` score the leaves, ``flowgrpo.advantages`` assigns credit,
``flowgrpo.ops`` holds the GRPO loss (fused op + reference), ``flowgrpo.trainer`` orchestrates.

The Python API (:mod:`flowgrpo.api`, docs/api.md) is re-exported here on first use, so that
``import flowgrpo`` imports nothing heavy: ``flowgrpo.train``, ``flowgrpo.load_config``,
``flowgrpo.Trainer``, ``flowgrpo.Callback``, ``flowgrpo.CallableReward``, ``flowgrpo.RunConfig``.
"""

__version__ = "0.1.0"

_API = ("CallableReward", "Callback", "RunConfig", "Trainer", "config_from", "load_config", "train")
__all__ = list(_API)  # `from flowgrpo import *` takes the API (imported then, as on any first use)


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'flowgrpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
