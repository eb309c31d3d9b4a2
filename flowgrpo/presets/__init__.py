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
    return shipped_names("flowgrpo.presets")


def read_preset(name: str) -> dict:
    """Preset ``name`` as a mapping (its ``base`` not applied); a ConfigError lists the valid names."""
    return read_shipped("flowgrpo.presets", name, "preset")


def shipped_names(package: str) -> list[str]:
    """The names of the ``*.yaml`` files shipped in ``package``, sorted."""
    return sorted(p.name[:-5] for p in resources.files(package).iterdir() if p.name.endswith(".yaml"))


def read_shipped(package: str, name: str, kind: str) -> dict:
    """``package``'s ``name.yaml`` as a mapping; a ConfigError naming the valid ``kind`` names otherwise."""
    path = resources.files(package) / f"{name}.yaml"
    if not isinstance(name, str) or not name or not path.is_file():
        raise ConfigError(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(shipped_names(package))}")
    return load_yaml_mapping(path.read_text(), f"{kind} {name}")


def read_chain(name: str, read, kind: str) -> list[tuple[str, dict]]:
    """``[(name, mapping), ...]`` of ``name`` (read by ``read``) and its ``base`` chain, the furthest
    base first; a ConfigError when the chain loops."""
    chain: list[tuple[str, dict]] = []
    seen: list[str] = []
    while name:
        if name in seen:
            raise ConfigError(f"{kind} inheritance loops: {' -> '.join(seen + [name])}")
        seen.append(name)
        data = read(name)
        chain.insert(0, (name, data))
        name = data.get("base")
    return chain


def load_yaml_mapping(text: str, what: str) -> dict:
    """``text`` parsed as YAML that must be a mapping (empty: ``{}``); one-line ConfigErrors naming ``what``."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold a mapping at the top level")
    return data
