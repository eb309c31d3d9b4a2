"""Model recipes (``*.yaml`` beside this file): the world or one model family a method runs on.

A recipe holds the settings that belong to a model and its task, never to a method: model,
resolution, steps, guidance, precision and memory switches, data, reward, group sizes, evaluation
and budget. Besides its config sections a recipe file has these keys:

* ``description``: one line (``flowgrpo recipes`` prints it);
* ``source``: where its numbers come from (papers, reference configs, model cards);
* ``base``: a recipe it extends (sections and ``methods`` merge key by key, ``needs`` per key);
* ``method``: the method preset run when no ``--preset`` is given (without one anywhere in the
  chain: :data:`~flowgrpo.presets.DEFAULT_PRESET`);
* ``default_for``: model names that get this recipe when a run names one and no recipe (the shapes
  world's own model and the tiny CPU test SD3; any other model gets :data:`FALLBACK_RECIPE`);
* ``needs``: ``{key: what the user must supply}``, keys a run must set itself (a model folder,
  a prompt file, a reward checkpoint), checked by ``flowgrpo train`` before anything loads;
* ``methods``: ``{preset: partial config}``, settings the references used for one method on this
  model, applied after the method preset.

Reading recipes needs no model code; composing one into a config is :mod:`flowgrpo.config.layers`.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..presets import read_chain, read_shipped, shipped_names

#: the recipe of the embedded shapes world, used when neither a recipe nor a model is named
SHAPES_RECIPE = "shapes"
#: the recipe used when no recipe is named and model.name is in no recipe's ``default_for``
FALLBACK_RECIPE = "diffusers"
#: the keys of a recipe file that are not config sections
META_KEYS = ("description", "source", "base", "method", "default_for", "needs", "methods")


def recipe_names() -> list[str]:
    """The shipped recipes' names, sorted."""
    return shipped_names("flowgrpo.recipes")


def read_recipe(name: str) -> dict:
    """Recipe ``name`` as a mapping (its ``base`` not applied); a ConfigError lists the valid names."""
    data = read_shipped("flowgrpo.recipes", name, "recipe")
    for key in ("needs", "methods"):
        if not isinstance(data.get(key, {}), dict):
            raise ConfigError(f"recipe {name}: '{key}' must be a mapping")
    return data


def recipe_chain(name: str) -> list[tuple[str, dict]]:
    """``[(name, mapping), ...]`` of recipe ``name`` and its bases, the furthest base first."""
    return read_chain(name, read_recipe, "recipe")


def recipe_for_model(model: str | None) -> str:
    """The recipe a run gets without ``--recipe``: the shapes world when no model is named, the recipe
    whose ``default_for`` lists ``model``, else the fallback (a real model's settings)."""
    if model is None:
        return SHAPES_RECIPE
    for name in recipe_names():
        if model in (read_recipe(name).get("default_for") or ()):
            return name
    return FALLBACK_RECIPE


def recipe_meta(name: str, key: str, default=None):
    """The nearest value of meta key ``key`` (``description``, ``source``, ``method``) in ``name``'s chain."""
    for _, data in reversed(recipe_chain(name)):
        if key in data:
            return data[key]
    return default


def recipe_needs(name: str) -> dict[str, str]:
    """``{key: what to supply}`` of ``name``'s chain (a nearer recipe's text wins per key)."""
    needs: dict[str, str] = {}
    for _, data in recipe_chain(name):
        needs.update(data.get("needs") or {})
    return needs
