"""The run configuration, one package:

* :mod:`~flowgrpo.config.schema`: the dataclasses (:class:`RunConfig` and its sections), how a mapping
  is applied to them, :func:`load_config` / :func:`compose_config`;
* :mod:`~flowgrpo.config.validation`: :func:`validate`, the value checks beyond types;
* :mod:`~flowgrpo.config.layers`: which keys a method preset and a recipe own, how the layers compose
  (defaults <- recipe <- preset <- the recipe's settings for that method <- file <- overrides) and which
  layer set each value; overrides ``key.sub=value``;
* :mod:`~flowgrpo.config.renames`: keys that moved, still loaded at their new place with a warning;
* :mod:`~flowgrpo.config.help`: ``flowgrpo config explain``, every key with its type, default and help;
* :mod:`~flowgrpo.config.show`: ``flowgrpo config show``, the resolved configuration with each key's
  layer, and the filled descriptions of presets and recipes.

The typed field helpers (help strings, choices, ranges) that the config and every stage's option
dataclasses share stay :mod:`flowgrpo.fields`, a leaf below the stages this package imports.

This module re-exports the names code imports from ``flowgrpo.config``.
"""

from __future__ import annotations

from ..presets import DEFAULT_PRESET, preset_names, read_preset
from ..recipes import recipe_names
from .layers import RECIPE_METHOD, parse_override
from .renames import ConfigKeyRenamedWarning
from .schema import (
    RANGES,
    AdvantageConfig,
    EvalConfig,
    LossConfig,
    ModelConfig,
    RewardConfig,
    RunConfig,
    SamplerConfig,
    TrainConfig,
    apply_dict,
    apply_overrides,
    compose_config,
    load_config,
    to_dict,
)
from .validation import validate

__all__ = [
    "DEFAULT_PRESET", "RANGES", "RECIPE_METHOD", "AdvantageConfig", "ConfigKeyRenamedWarning", "EvalConfig",
    "LossConfig", "ModelConfig", "RewardConfig", "RunConfig", "SamplerConfig", "TrainConfig", "apply_dict",
    "apply_overrides", "compose_config", "load_config", "parse_override", "preset_names", "read_preset", "recipe_names", "to_dict",
    "validate",
]
