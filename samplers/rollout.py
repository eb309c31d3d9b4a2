"""The old import path of :class:`~flowgrpo.samplers.forest_sampler.ForestSampler`, kept working.

The sampler lives in :mod:`flowgrpo.samplers.forest_sampler` and the rollout it returns
(:class:`~flowgrpo.samplers.forest.Rollout`) in :mod:`flowgrpo.samplers.forest`.
"""

from .forest_sampler import ForestSampler

__all__ = ["ForestSampler"]
