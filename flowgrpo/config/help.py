"""``flowgrpo config explain [SECTION | SECTION.KEY]``: every configuration key with its type,
default, choices and help, read from the config dataclasses (and each strategy's option dataclass)."""

from __future__ import annotations

import dataclasses
import os
import types
import typing

from ..errors import UserError
from ..fields import choices_of


def describe_type(hint) -> tuple[str, list]:
    """(type as text, choices) of a field's type hint. ``Literal[...]`` gives its values as the
    choices; ``X | None`` reads ``X | None`` (and adds ``None`` to X's choices, if any)."""
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        values = list(choices_of(hint))
        return " | ".join(dict.fromkeys(type(v).__name__ for v in values)), values
    if origin in (typing.Union, types.UnionType):
        names, choices, optional = [], [], False
        for arg in typing.get_args(hint):
            if arg is type(None):
                optional = True
                continue
            name, arg_choices = describe_type(arg)
            names.append(name)
            choices += arg_choices
        if optional:
            names.append("None")
            choices += [None] if choices else []
        return " | ".join(names), choices
    if origin is not None:  # list[float], dict[str, float], ...
        args = ", ".join(describe_type(a)[0] for a in typing.get_args(hint))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]" if args else origin.__name__, []
    return getattr(hint, "__name__", str(hint).replace("typing.", "")), []


def format_value(value) -> str:
    """A default or choice as it is written in a YAML config or a key=value override."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return text[:-3].strip() if text.endswith("\n...") else text


def _field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def config_rows(cls, prefix: str = "") -> list[dict]:
    """One row per field of dataclass ``cls`` (nested dataclasses flattened to ``a.b``): key, type,
    default, choices (from a ``Literal`` type) and help (the field's ``metadata["help"]``)."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name, f.type)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            rows += config_rows(hint, f"{prefix}{f.name}.")
            continue
        type_text, choices = describe_type(hint)
        default = _field_default(f)
        rows.append({"key": prefix + f.name, "type": type_text,
                     "default": "(required)" if default is dataclasses.MISSING else format_value(default),
                     "choices": [format_value(c) for c in choices], "help": f.metadata.get("help", "")})
    return rows


def strategy_option_rows() -> dict[str, list[dict]]:
    """Per sampling strategy, the rows of its option dataclass (empty for a strategy without options)."""
    from ..samplers.strategies import STRATEGIES, options_class

    return {name: config_rows(options_class(name), "strategy.") for name in STRATEGIES.names()}


def _config_table(rows: list[dict]):
    from rich.table import Table
    from rich.text import Text

    table = Table()
    table.add_column("key", no_wrap=True, style="bold")
    table.add_column("type", no_wrap=True)
    table.add_column("default")
    table.add_column("choices")
    table.add_column("help")
    for r in rows:  # Text: brackets in defaults and help ([0, 3], Literal[...]) are not rich markup
        table.add_row(*(Text(x) for x in (r["key"], r["type"], r["default"], " | ".join(r["choices"]), r["help"])))
    return table


def explain_config(section: str | None = None) -> int:
    """Print every field of the run configuration (or of one section / key) as a table."""
    from rich.console import Console

    from .schema import RunConfig

    hints = typing.get_type_hints(RunConfig)
    sections = [f.name for f in dataclasses.fields(RunConfig)]
    wanted = sections
    if section:
        head = section.split(".")[0]
        if head not in sections:
            raise UserError(f"unknown config section {head!r}; valid sections: {', '.join(sections)}")
        wanted = [head]
    tables, top = [], []
    for name in wanted:
        rows = [r for r in config_rows(RunConfig) if r["key"] == name or r["key"].startswith(name + ".")]
        if isinstance(hints.get(name), type) and dataclasses.is_dataclass(hints[name]):
            tables.append((name, rows))
        else:
            top += rows
    if top:
        tables.append(("top-level keys", top))
    if "strategy" in wanted:
        opts = strategy_option_rows()
        tables += [(f"options of sampler.strategy={n}", r) for n, r in opts.items() if r]
        bare = [n for n, r in opts.items() if not r]
        if bare:
            tables.append((f"sampling strategies without options: {', '.join(bare)}", []))
    if section and "." in section:
        keys = list(dict.fromkeys(r["key"] for _, rows in tables for r in rows if r["key"].startswith(head + ".")))
        tables = [(t, [r for r in rows if r["key"] == section]) for t, rows in tables]
        tables = [(t, rows) for t, rows in tables if rows]
        if not tables:
            from .renames import RENAMED_KEYS, new_keys, renamed_text

            if section in RENAMED_KEYS:  # an old name users still write: say where it went
                raise UserError(f"config key {section!r} is now {renamed_text(section)} (the old name still loads, "
                                f"with a warning); run `flowgrpo config explain {new_keys(section)[0]}`")
            raise UserError(f"unknown config key {section!r}; valid keys under {head!r}: {', '.join(keys) or '(none)'}")
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=200)  # piped or captured: do not wrap the help text at 80 columns
    for title, rows in tables:
        console.print(title, style="bold", markup=False, highlight=False)
        if rows:
            console.print(_config_table(rows))
    return 0
