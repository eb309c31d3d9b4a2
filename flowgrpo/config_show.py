"""``flowgrpo config show``: the fully resolved configuration as YAML, each key annotated with the
layer that set it (``default``, ``recipe:NAME``, ``preset:NAME``, ``recipe-method:RECIPE/PRESET``,
``file:NAME``, ``override``; :mod:`flowgrpo.config_layers`).

The text is a valid config file: fed back with ``--config`` it gives the same configuration. The
strategy options the run leaves unset are listed with their defaults (marked ``default``).
"""

from __future__ import annotations

import dataclasses

from .config_help import format_value


#: source comments line up at this column; longer lines (descriptions) carry theirs after two spaces
_ALIGN = 56


def resolved_strategy_options(cfg) -> dict:
    """Every option of ``cfg.sampler.strategy``: the config's values over the strategy's defaults."""
    from .samplers.strategies import options_class
    from .samplers.strategy_base import parse_options

    return dataclasses.asdict(parse_options(options_class(cfg.sampler.strategy), cfg.strategy, cfg.sampler.num_steps))


def render(composed) -> str:
    """``composed`` (a :class:`~flowgrpo.config_layers.Composed`) as annotated YAML lines."""
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
    from .config import compose_config, validate

    composed = compose_config(preset, config_file, overrides, recipe)
    validate(composed.config)
    print(f"# recipe {composed.recipe}, preset {composed.config.preset or '(none)'}; "
          "each key's comment names the layer that set it")
    print(render(composed), end="")
    return 0
