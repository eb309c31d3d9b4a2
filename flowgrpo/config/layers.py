"""Configuration layers: which keys a method preset and a recipe own, how they compose, and which
layer set each resolved value.

A run's configuration is built, each layer over the one before:

    defaults <- recipe (with its bases) <- method preset (with its bases)
             <- the recipe's settings for that method <- config file <- key=value overrides

* A **method preset** (``flowgrpo/presets``: the papers' methods, and in ``worlds/<recipe>/`` the
  methods tuned on one world) sets only :data:`METHOD_KEYS`: the sampling strategy and its options,
  advantages, the loss, and the training keys that define a method. Nothing about the model, data,
  reward models, evaluation or budget.
* A **recipe** (``flowgrpo/recipes``) sets everything else: the world or one model family. It may
  not set method keys at its top level; what a reference used for one method on its model goes under
  its ``methods: {preset: {...}}``, the layer after the preset.
* :data:`GROUP_KEYS` belong to both: a recipe sets its group size, and a method whose group is made
  of trees (BranchGRPO, TempFlow-GRPO, ...) sets how many trees a prompt gets.

Without a recipe, the recipe is :data:`~flowgrpo.recipes.SHAPES_RECIPE` unless the config file or
the overrides name a model outside its ``default_for`` (the shapes model and the tiny CPU test SD3),
which gets :data:`~flowgrpo.recipes.FALLBACK_RECIPE` (a real model's settings, never the toy world's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, UserError
from ..presets import DEFAULT_PRESET, load_yaml_mapping, preset_names, read_chain, read_preset
from ..recipes import META_KEYS, recipe_chain, recipe_for_model, recipe_meta, recipe_names, recipe_needs
from ..text_inputs import load_yaml
from .renames import new_keys

#: the keys (or whole sections) a method preset may set; ``strategy`` is sampler.strategy's options.
#: ``reward.combine`` / ``reward.renormalize`` are how several rewards make one advantage (MixGRPO and
#: Pref-GRPO normalise each first), not which reward models run.
METHOD_KEYS = (
    "sampler.strategy", "sampler.sde_kind", "sampler.noise_level", "sampler.cps_log_prob", "sampler.shared_group_noise",
    "strategy", "advantage", "loss", "reward.combine", "reward.renormalize",
    "train.timestep_fraction", "train.timestep_order", "train.inner_epochs",
)
#: group-shape keys that a method preset and a recipe may both set: for chains the recipe's value is the
#: GRPO group; a tree method sets the trees per prompt its group is built from (its leaves do the rest)
GROUP_KEYS = ("data.trees_per_prompt",)
#: the layers in order, as :func:`compose` labels each resolved key's source
LAYERS = ("default", "recipe", "preset", "recipe-method", "file", "override")


def _covered(key: str, owned: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in owned)


def _leaf_keys(data: dict, prefix: str = "") -> list[str]:
    """Dotted keys of a nested mapping (a dict value is descended into)."""
    out: list[str] = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        out += _leaf_keys(v, key + ".") if isinstance(v, dict) and v else [key]
    return out


def method_key_violations(data: dict) -> list[str]:
    """The keys of a method preset's mapping that are not method keys (``description`` and ``base`` aside)."""
    keys = _leaf_keys({k: v for k, v in data.items() if k not in ("description", "base")})
    return [k for k in keys if not _covered(k, METHOD_KEYS + GROUP_KEYS)]


def check_method_preset(name: str, data: dict) -> None:
    """A ConfigError naming the first key of preset ``name`` that a method preset may not set."""
    bad = method_key_violations(data)
    if bad:
        raise ConfigError(f"preset {name} sets '{bad[0]}', which is not a method key (a method preset sets only "
                          f"{', '.join(METHOD_KEYS + GROUP_KEYS)}); model, data, reward, evaluation and budget "
                          "settings belong in a recipe (flowgrpo/recipes)")


def check_recipe(name: str, data: dict) -> None:
    """A ConfigError naming the first method key recipe ``name`` sets at its top level (they go under
    ``methods: {preset: ...}``) or the first ``methods`` entry that names no preset."""
    settings = {k: v for k, v in data.items() if k not in META_KEYS}
    bad = [k for k in _leaf_keys(settings) if _covered(k, METHOD_KEYS)]
    if bad:
        raise ConfigError(f"recipe {name} sets the method key '{bad[0]}' at its top level; put it under "
                          f"'methods: {{<preset>: ...}}' so it applies to that method only")
    for preset in data.get("methods") or {}:
        read_preset(preset)  # a ConfigError listing the valid presets


def preset_chain(name: str) -> list[tuple[str, dict]]:
    """``[(name, mapping), ...]`` of method preset ``name`` and its bases, the furthest base first, each
    checked to set only method keys."""
    if name not in preset_names() and name in recipe_names():
        raise ConfigError(f"{name!r} is a recipe, not a method preset: pass it as --recipe {name} (recipe={name!r}); "
                          f"valid presets: {', '.join(preset_names())}")
    chain = read_chain(name, read_preset, "preset")
    for preset, data in chain:
        check_method_preset(preset, data)
    return chain


# --------------------------------------------------------------------------- overrides


def parse_override(text: str) -> dict:
    """``"train.lr=1e-4"`` -> ``{"train": {"lr": 1e-4}}`` (the value is parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    try:
        value = load_yaml(raw, f"override {key.strip()}") if raw.strip() else ""
    except ConfigError as exc:
        if "is not valid YAML" not in str(exc):  # an alias bomb or nesting too deep: refused
            raise
        value = raw  # not YAML: the text itself (a path, a name)
    if isinstance(value, str) and _looks_float(raw):
        value = float(raw)  # YAML 1.1 reads "1e-4" as a string
    out: dict = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def deep_merge(into: dict, data: dict) -> None:
    """Merge nested mapping ``data`` into ``into`` in place (mappings key by key, anything else replaced)."""
    for k, v in data.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            deep_merge(into[k], v)
        else:
            into[k] = v


def _looks_float(raw: str) -> bool:
    try:
        float(raw)
        return True
    except ValueError:
        return False


# --------------------------------------------------------------------------- provenance


def flatten(cfg) -> dict:
    """``{"section.key": value}`` of a RunConfig: nested dataclasses are descended into, ``strategy``
    gives one key per option, every other value (dicts and lists included) is one leaf."""
    out: dict = {}

    def walk(obj, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                walk(value, f"{prefix}{f.name}.")
            elif prefix == "" and f.name == "strategy":
                out.update({f"strategy.{k}": v for k, v in value.items()})
            else:
                out[prefix + f.name] = value

    walk(cfg, "")
    return out


@dataclass
class Composed:
    """A composed RunConfig and, per flattened key, the layer that set it (``"preset:mix-grpo"``; a key
    missing from ``sources`` holds its default)."""

    config: object
    sources: dict = field(default_factory=dict)
    recipe: str = ""

    def source(self, key: str) -> str:
        """The layer (``kind:name``) that set ``key``, ``"default"`` when none did."""
        return self.sources.get(key, "default")


def _apply_layer(composed: Composed, apply, data: dict, label: str) -> None:
    """Apply one layer's mapping with ``apply(config, mapping)`` and record ``label`` for every key it
    wrote or changed."""
    before = flatten(composed.config)
    apply(composed.config, {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()})
    after = flatten(composed.config)
    written = {_flat_key(new, after) for k in _leaf_keys(data) for new in new_keys(k)}  # an old key: its new place
    for key in list(composed.sources):
        if key not in after:  # e.g. strategy options reset by another sampler.strategy
            del composed.sources[key]
    for key, value in after.items():
        if key in written or key not in before or before[key] != value:
            composed.sources[key] = label


def _flat_key(key: str, flat: dict) -> str | None:
    """The key of ``flat`` that dotted ``key`` writes into (``reward.weights.hpsv2`` -> ``reward.weights``)."""
    while key not in flat and "." in key:
        key = key.rsplit(".", 1)[0]
    return key if key in flat else None


def named_model(config_file: str | None, overrides: list[str]) -> str | None:
    """The ``model.name`` the config file or the overrides set (the last one wins), else None."""
    name = None
    if config_file and Path(config_file).is_file():
        data = load_yaml_mapping(Path(config_file).read_text(), f"config file {config_file}")
        if isinstance(data.get("model"), dict) and "name" in data["model"]:
            name = data["model"]["name"]
    for ov in overrides:
        model = parse_override(ov).get("model")
        if isinstance(model, dict) and "name" in model:
            name = model["name"]
    return name


def pick_recipe(recipe: str | None, config_file: str | None = None, overrides: list[str] = ()) -> str:
    """``recipe``, or without one the recipe for the model the file or overrides name
    (:func:`~flowgrpo.recipes.recipe_for_model`: the shapes world, or a real model's fallback)."""
    if recipe and recipe not in recipe_names() and recipe in preset_names():
        raise ConfigError(f"{recipe!r} is a method preset, not a recipe: pass it as --preset {recipe}; "
                          f"valid recipes: {', '.join(recipe_names())}")
    return recipe or recipe_for_model(named_model(config_file, list(overrides)))


def default_preset(recipe: str) -> str:
    """The method preset run on ``recipe`` when none is named: its ``method``, else DEFAULT_PRESET."""
    return recipe_meta(recipe, "method", DEFAULT_PRESET)


#: load_config's preset argument meaning "the recipe's default method" (None: no method preset at all)
RECIPE_METHOD = "<recipe's method>"


def compose(new_config, apply, preset: str | None = RECIPE_METHOD, config_file: str | None = None,
            overrides: list[str] = (), recipe: str | None = None) -> Composed:
    """Compose the layers (module docstring) into ``new_config()``, unvalidated, with each key's source.

    ``apply(config, mapping)`` merges one layer (the run configuration's rules:
    :func:`flowgrpo.config.apply_dict`); :func:`flowgrpo.config.compose_config` binds both."""
    if isinstance(overrides, (str, bytes)) or not all(isinstance(o, str) for o in overrides):
        # a bare string was read character by character ("override 't' must look like key.sub=value")
        raise TypeError(f"overrides is a list of 'key.sub=value' strings, got {overrides!r}"
                        + (f"; wrap it: [{overrides!r}]" if isinstance(overrides, str) else ""))
    recipe = pick_recipe(recipe, config_file, overrides)
    composed = Composed(new_config(), recipe=recipe)
    for name, data in recipe_chain(recipe):
        check_recipe(name, data)
        _apply_layer(composed, apply, {k: v for k, v in data.items() if k not in META_KEYS}, f"recipe:{name}")
    composed.config.recipe = recipe
    if preset == RECIPE_METHOD:
        preset = default_preset(recipe)
    if preset:
        chain = preset_chain(preset)
        for name, data in chain:
            _apply_layer(composed, apply, {k: v for k, v in data.items() if k != "base"}, f"preset:{name}")
        methods: dict = {}
        for _, data in recipe_chain(recipe):
            deep_merge(methods, data.get("methods") or {})
        for name, _ in chain:
            if methods.get(name):
                _apply_layer(composed, apply, methods[name], f"recipe-method:{recipe}/{name}")
        composed.config.preset = preset
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        data = load_yaml_mapping(path.read_text(), f"config file {path}")
        for name, base in preset_chain(data.pop("base")) if data.get("base") else ():
            _apply_layer(composed, apply, {k: v for k, v in base.items() if k != "base"}, f"preset:{name}")
        _apply_layer(composed, apply, data, f"file:{path.name}")
    if overrides:  # the overrides form one layer, whatever their order
        merged: dict = {}
        for ov in overrides:
            deep_merge(merged, parse_override(ov))
        _apply_layer(composed, apply, merged, "override")
    composed.sources.setdefault("recipe", f"recipe:{recipe}")  # what the run was composed of, unless a file
    if preset:                                                  # or an override wrote the field itself
        composed.sources.setdefault("preset", f"preset:{preset}")
    return composed


#: a needed key that another key also satisfies: a pipeline folder as model.path with the adapter as model.name
_ALTERNATIVES = {"model.name": ("model.path",)}


def check_needs(composed: Composed) -> None:
    """A UserError when the run leaves a key its recipe ``needs`` at the recipe's (or the default) value,
    naming every such key and what to pass; a reward's needs count only while that reward is used."""
    cfg = composed.config
    missing = []
    for key, what in recipe_needs(composed.recipe).items():
        parts = key.split(".")
        if parts[:2] == ["reward", "options"] and parts[2] not in cfg.reward.weights:
            continue
        supplied = any(composed.source(_flat_key(k, composed.sources) or k).split(":")[0] in ("file", "override")
                       for k in (key, *_ALTERNATIVES.get(key, ())))
        if parts[:2] == ["reward", "options"]:
            supplied = supplied and parts[3] in (cfg.reward.options.get(parts[2]) or {})
        if not supplied:
            missing.append(f"{key}=<{what}>")
    if missing:
        raise UserError(f"recipe {composed.recipe} needs {' '.join(missing)}")
