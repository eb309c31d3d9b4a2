"""Policy adapters: one interface (:class:`Policy`) over every supported flow model.

Factories take a :class:`~flowgrpo.config.ModelConfig` and return a :class:`Policy`; heavy model
code is imported only when its name is asked for.
"""

from ..registry import Registry
from .base import Conditioning, Policy

POLICIES: Registry[Policy] = Registry("model")
POLICIES.register_lazy("shapes", "flowgrpo.shapes.policy:build_shapes_policy")
POLICIES.register_lazy("sd3", "flowgrpo.policies.sd3:build_sd3_policy")
POLICIES.register_lazy("sd3-tiny", "flowgrpo.policies.sd3_tiny:build_tiny_sd3_policy")


def build_policy(model_cfg) -> Policy:
    """Instantiate the policy named by ``model_cfg.name``."""
    return POLICIES.build(model_cfg.name, model_cfg)


__all__ = ["Conditioning", "POLICIES", "Policy", "build_policy"]
