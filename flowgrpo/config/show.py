"""``flowgrpo config show``: the fully resolved configuration as YAML, each key annotated with the
layer that set it (``default``, ``recipe:NAME``, ``preset:NAME``, ``recipe-method:RECIPE/PRESET``,
``file:NAME``, ``override``; :mod:`flowgrpo.config.layers`).

The text is a valid config file: fed back with ``--config`` it gives the same configuration. The
strategy options the run leaves unset are listed with their defaults (marked ``default``).

Descriptions (a preset's ``description`` key, a recipe's meta ``description``) name the values they
quote as ``{section.key}`` placeholders, filled from the resolved configuration wherever they are
shown (:func:`fill_description`): a recipe's settings for a method (``methods:``) or an override
then show in the text as they do in the keys below it.
"""

from __future__ import annotations

import dataclasses
import re

from ..errors import ConfigError
from .help import format_value

#: a ``{section.key}`` placeholder of a description (``{strategy.window}``, ``{sampler.noise_level}``)
PLACEHOLDER = re.compile(r"\{([a-z_]+(?:\.[a-z_0-9]+)+)\}")


#: source comments line up at this column; longer lines (descriptions) carry theirs after two spaces
_ALIGN = 56


def resolved_strategy_options(cfg) -> dict:
    """Every option of ``cfg.sampler.strategy``: the config's values over the strategy's defaults."""
    from ..samplers.strategies import options_class
    from ..samplers.strategy_base import parse_options

    return dataclasses.asdict(parse_options(options_class(cfg.sampler.strategy), cfg.strategy, cfg.sampler.num_steps))


def config_value(cfg, key: str):
    """The resolved value of ``key`` (``section.key``; ``strategy.*`` over the strategy's defaults);
    KeyError when there is none."""
    section, _, rest = key.partition(".")
    if section == "strategy":
        return resolved_strategy_options(cfg)[rest]
    value = cfg
    for part in key.split("."):
        if isinstance(value, dict):
            value = value[part]
        elif dataclasses.is_dataclass(value) and part in {f.name for f in dataclasses.fields(value)}:
            value = getattr(value, part)
        else:
            raise KeyError(key)
    return value


def _quoted(value) -> str:
    if value is None:  # an unset list option means all of them (tempflow's branch_steps)
        return "all"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_quoted(v) for v in value)
    if isinstance(value, dict):  # reward.weights: the rewards' names
        return " + ".join(str(k) for k in value)
    return str(value)


def fill_description(text: str, cfg, owner: str = "description") -> str:
    """``text`` with each ``{section.key}`` placeholder replaced by the value ``cfg`` resolves for it
    (floats in ``%g``, lists joined by commas, a mapping as its keys, an unset option as ``all``); a ConfigError names ``owner`` and an unknown key."""
    def value(match: re.Match) -> str:
        try:
            return _quoted(config_value(cfg, match.group(1)))
        except KeyError:
            raise ConfigError(f"{owner}: placeholder {{{match.group(1)}}} names no config key") from None

    return PLACEHOLDER.sub(value, text or "")


def preset_description(name: str, recipe: str | None = None) -> str:
    """Preset ``name``'s description filled from its configuration on ``recipe`` (default: the shapes world)."""
    from .schema import compose_config

    cfg = compose_config(name, None, [], recipe).config
    return fill_description(cfg.description, cfg, f"the description of preset {name}")


def recipe_description(name: str) -> str:
    """Recipe ``name``'s description filled from its configuration with its own method."""
    from .schema import compose_config
    from .layers import RECIPE_METHOD
    from ..recipes import recipe_meta

    cfg = compose_config(RECIPE_METHOD, None, [], name).config
    return fill_description(recipe_meta(name, "description", ""), cfg, f"the description of recipe {name}")


def render(composed) -> str:
    """``composed`` (a :class:`~flowgrpo.config.layers.Composed`) as annotated YAML lines."""
    cfg = composed.config
    lines: list[str] = []
    rows: list[tuple[str, str | None]] = []  # (text, source or None for a section header)

    def walk(obj, prefix: str, indent: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            key = prefix + f.name
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                rows.append((f"{indent}{f.name}:", None))
                walk(value, key + ".", indent + "  ")
            elif key == "strategy":
                rows.append(("strategy:", None))
                for name, option in resolved_strategy_options(cfg).items():
                    rows.append((f"  {name}: {format_value(option)}", composed.source(f"strategy.{name}")))
            else:
                rows.append((f"{indent}{f.name}: {format_value(value)}", composed.source(key)))

    walk(cfg, "", "")
    width = max(len(text) for text, source in rows if source is not None and len(text) <= _ALIGN)
    for text, source in rows:
        lines.append(text if source is None else f"{text.ljust(width)}  # {source}")
    return "\n".join(lines) + "\n"


def show_config(preset, recipe, config_file, overrides) -> int:
    """Print the resolved, validated configuration of these layers with each key's source."""
    from .schema import compose_config
    from .validation import validate

    composed = compose_config(preset, config_file, overrides, recipe)
    missing = absent_model_folder(composed.config.model)
    validate(composed.config, model_folder_may_be_absent=missing is not None)
    cfg = composed.config
    print(f"# recipe {composed.recipe}, preset {cfg.preset or '(none)'}; each key's comment names the layer that set it")
    if cfg.description:  # the description's placeholders filled (the key below keeps them: the text is a config file)
        print(f"# {fill_description(cfg.description, cfg, f'the description of preset {cfg.preset}')}")
    if missing is not None:
        print(f"# model.name {missing} does not exist yet: shown with the recipe's settings; `flowgrpo train` "
              "needs a diffusers pipeline folder there")
    print(render(composed), end="")
    return 0


def absent_model_folder(model_cfg) -> str | None:
    """``model.name`` when it is neither an adapter name nor anything on disk (nor, for an ``owner/name``
    id, in the local hub cache): a folder the user has yet to download to. None otherwise."""
    from pathlib import Path

    from ..policies import POLICIES, resolve_adapter
    from ..errors import UserError

    name = model_cfg.name
    if name in POLICIES or Path(name).expanduser().exists():
        return None
    try:
        resolve_adapter(model_cfg)
    except UserError:
        return name
    return None
