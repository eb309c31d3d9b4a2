"""The shipped presets (``*.yaml`` beside this file): methods as validated data, and which one
``flowgrpo train`` runs by default. Reading them needs no model code; applying one to a config is
:func:`flowgrpo.config.load_config`."""

from __future__ import annotations

from importlib import resources

import yaml

from ..errors import ConfigError

#: the preset `flowgrpo train` runs without --preset (and load_config's default): the best recipe
#: measured on the shapes world, judged on held-out accuracy and image fidelity (docs/shapes_world.md)
DEFAULT_PRESET = "shapes-nft"


def preset_dir():
    """The folder of the shipped ``*.yaml`` presets (an importlib resource)."""
    return resources.files("flowgrpo.presets")


def preset_names() -> list[str]:
    """The shipped presets' names, sorted."""
    return sorted(p.name[:-5] for p in preset_dir().iterdir() if p.name.endswith(".yaml"))


def read_preset(name: str) -> dict:
    """Preset ``name`` as a mapping (its ``base`` not applied); a ConfigError lists the valid names."""
    path = preset_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(preset_names())}")
    return load_yaml_mapping(path.read_text(), f"preset {name}")


def load_yaml_mapping(text: str, what: str) -> dict:
    """``text`` parsed as YAML that must be a mapping (empty: ``{}``); one-line ConfigErrors naming ``what``."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold a mapping at the top level")
    return data
