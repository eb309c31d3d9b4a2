"""The shipped method presets: methods as validated data, and which one ``flowgrpo train`` runs by
default. Reading them needs no model code; applying one to a config is :func:`flowgrpo.config.load_config`.

* ``*.yaml`` beside this file: the papers' methods;
* ``worlds/<recipe>/*.yaml``: world presets, a method tuned on that recipe's world with settings
  measured there (``worlds/shapes/``: ``shapes-nft``, the default, and ``shapes``). They set only
  method keys, like any preset, and run on any recipe; ``flowgrpo presets`` lists them apart.

A preset name is one namespace over both: ``--preset NAME`` finds a world preset as it finds a paper's.
"""

from __future__ import annotations

from importlib import resources

from ..errors import ConfigError
from ..text_inputs import load_yaml

#: the preset `flowgrpo train` runs without --preset (and load_config's default): the best recipe
#: measured on the shapes world, judged on held-out accuracy and image fidelity (docs/shapes_world.md); a
#: world preset, ``worlds/shapes/shapes-nft.yaml``
DEFAULT_PRESET = "shapes-nft"


#: the folder (below this package) of the world presets, one folder per recipe: ``worlds/<recipe>/*.yaml``
WORLDS = "worlds"


def preset_dir():
    """The folder of the papers' ``*.yaml`` presets (an importlib resource); the world presets are in
    its :data:`WORLDS` folder."""
    return resources.files("flowgrpo.presets")


def _preset_files() -> dict:
    """``{name: (world, file)}`` of every shipped preset, in listing order: the papers' methods (world
    None) sorted, then each world's presets, by world then name; a ConfigError when two share a name."""
    root = preset_dir()
    files = {p.name[:-5]: (None, p) for p in _yaml_files(root)}
    worlds = root / WORLDS
    for world in sorted((w for w in worlds.iterdir() if w.is_dir()), key=lambda w: w.name) if worlds.is_dir() else ():
        for p in _yaml_files(world):
            name = p.name[:-5]
            if name in files:
                raise ConfigError(f"preset {name} is shipped twice: {_where(files[name][0])} and {_where(world.name)}")
            files[name] = (world.name, p)
    return files


def _yaml_files(folder) -> list:
    return sorted((p for p in folder.iterdir() if p.name.endswith(".yaml")), key=lambda p: p.name[:-5])


def _where(world: str | None) -> str:
    return "flowgrpo/presets" if world is None else f"flowgrpo/presets/{WORLDS}/{world}"


def preset_names() -> list[str]:
    """The shipped presets' names: the papers' methods sorted, then the world presets (by world, then
    name), the order ``flowgrpo presets`` lists them in."""
    return list(_preset_files())


def preset_world(name: str) -> str | None:
    """The recipe whose world preset ``name`` was tuned on (its folder ``worlds/<recipe>``), None for a
    paper's method; a ConfigError lists the valid names."""
    return _preset_file(name)[0]


def read_preset(name: str) -> dict:
    """Preset ``name`` as a mapping (its ``base`` not applied); a ConfigError lists the valid names."""
    return load_yaml_mapping(_preset_file(name)[1].read_text(), f"preset {name}")


def _preset_file(name: str) -> tuple:
    files = _preset_files()
    if not isinstance(name, str) or name not in files:
        raise ConfigError(f"unknown preset {name!r}; valid presets: {', '.join(files)}")
    return files[name]


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
    data = load_yaml(text, what) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must hold a mapping at the top level")
    return data
