"""Typed configuration fields: help strings, ``Literal`` choices and checked merges into dataclasses.

Shared by the run configuration (:mod:`flowgrpo.config`) and the per-strategy option dataclasses
(:mod:`flowgrpo.samplers.strategy_base`): one place knows how a YAML value is checked against a
field's type, so a bad key or value reads the same wherever it is written.

* :func:`help_field` declares a field with its default and help text (``metadata["help"]``).
* A field typed ``Literal["a", "b"]`` accepts exactly those values; :func:`merge_into` and
  :func:`check_choices` enforce it, :func:`choices_of` lists them for help screens.
* A numeric field declared with bounds (``help_field(0.9, "...", ge=0, lt=1)``) must be finite and
  within them; :func:`check_ranges` enforces it (a None value of an optional field is not checked).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import field
from typing import Any, Literal

from .errors import ConfigError


#: the bound keywords of :func:`help_field` and how a value is compared with each
BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def help_field(default: Any, help: str, *, gt: float | None = None, ge: float | None = None,
               lt: float | None = None, le: float | None = None, **kw) -> Any:
    """A dataclass field with ``default`` (lists and dicts are copied per instance) and ``help``.

    ``gt`` / ``ge`` / ``lt`` / ``le``: bounds of a numeric field (value > gt, >= ge, < lt, <= le),
    kept in ``metadata["range"]`` and checked by :func:`check_ranges`.
    """
    metadata = {"help": help}
    bounds = {k: v for k, v in (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None}
    if bounds:
        metadata["range"] = bounds
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def field_ranges(cls: Any, prefix: str = "") -> dict[str, dict[str, float]]:
    """``{"section.key": bounds}`` of every field of dataclass ``cls`` (nested ones flattened) declared
    with bounds (see :func:`help_field`)."""
    out: dict[str, dict[str, float]] = {}
    h = hints(cls)
    for f in dataclasses.fields(cls):
        hint = h[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out.update(field_ranges(hint, f"{prefix}{f.name}."))
        elif "range" in f.metadata:
            out[prefix + f.name] = f.metadata["range"]
    return out


def range_text(bounds: dict[str, float]) -> str:
    """``{"ge": 0, "lt": 1}`` -> ``">= 0 and < 1"``."""
    return " and ".join(f"{BOUNDS[k]} {v}" for k, v in bounds.items())


def check_range(key: str, value: float, bounds: dict[str, float]) -> None:
    """A :class:`~flowgrpo.errors.ConfigError` naming ``key`` unless the number ``value`` is finite and
    within ``bounds`` (``{"ge": 0, "lt": 1}``; NaN and inf are never within bounds)."""
    ok = math.isfinite(value) and all({"gt": value > b, "ge": value >= b, "lt": value < b, "le": value <= b}[k]
                                      for k, b in bounds.items())
    if not ok:
        what = range_text(bounds) if isinstance(value, int) else f"a finite number {range_text(bounds)}"
        raise ConfigError(f"config key '{key}' must be {what}, got {value!r}")


def check_ranges(cfg: Any, prefix: str = "") -> None:
    """Every bounded field of ``cfg`` (recursively) is a finite number within its bounds; else a
    :class:`~flowgrpo.errors.ConfigError` naming the key (:func:`check_range`)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_ranges(value, f"{prefix}{f.name}.")
            continue
        bounds = f.metadata.get("range")
        if bounds and value is not None and not isinstance(value, str):  # a str is a Literal's word ("auto")
            check_range(f"{prefix}{f.name}", value, bounds)


def hints(obj_or_cls: Any) -> dict[str, Any]:
    """Resolved type hints of a dataclass instance or class."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return typing.get_type_hints(cls)


def choices_of(hint: Any) -> tuple | None:
    """The allowed values of a ``Literal`` hint (also inside ``X | None``), else None."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for a in typing.get_args(hint):
            found = choices_of(a)
            if found is not None:
                return found
    return None


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a field type and return it (ints are accepted for floats).

    Raises :class:`~flowgrpo.errors.ConfigError` naming ``key`` and, for a ``Literal``, the choices.
    """
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise ConfigError(f"config key '{key}' = {value!r} is not one of: {', '.join(map(str, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors, kinds = [], []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
                kinds.append(f"one of: {', '.join(map(str, typing.get_args(a)))}" if typing.get_origin(a) is Literal
                             else getattr(typing.get_origin(a) or a, "__name__", str(a)))
        if len(kinds) > 1:  # e.g. int | Literal["auto"]: name every form the key takes
            raise ConfigError(f"config key '{key}' expects {' or '.join(kinds)}, got {type(value).__name__} {value!r}")
        raise ConfigError(errors[0] if errors else f"bad value for config key '{key}': {value!r}")
    base = origin or hint
    if base is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        number = as_number(value)  # YAML 1.1 (PyYAML) reads 1e-4 as a string: accept what users write
        if number is not None:
            return number
    if base is bool and not isinstance(value, bool):
        raise ConfigError(f"config key '{key}' expects true/false, got {value!r}")
    if base in (int, float) and isinstance(value, bool):
        raise ConfigError(f"config key '{key}' expects {base.__name__}, got {value!r}")
    if base in (int, float, str, bool, list, dict) and not isinstance(value, base):
        raise ConfigError(f"config key '{key}' expects {base.__name__}, got {type(value).__name__} {value!r}")
    if base is list and typing.get_args(hint):
        item = typing.get_args(hint)[0]
        return [coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    return value


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a number (not a bool) or a string that reads as one (``"1e-4"``,
    which YAML 1.1 leaves a string), else None. NaN and inf are returned as such (ranges refuse them)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def near_miss(key: str, names: list[str], prefix: str = "") -> str:
    """``"; did you mean 'train.lr'?"`` for the closest of ``names`` to an unknown ``key`` (difflib), else ``""``."""
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    return f"; did you mean '{prefix}{close[0]}'?" if close else ""


def _nested_miss(cfg: Any, key: str) -> str:
    """For a top-level ``key`` that names no section: ``"; did you mean 'train.lr'?"`` where ``key`` is
    (close to) a key inside a section, else ``""``."""
    inner: dict[str, list[str]] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for sub in dataclasses.fields(value):
                inner.setdefault(sub.name, []).append(f"{f.name}.{sub.name}")
    close = difflib.get_close_matches(key, list(inner), n=1, cutoff=0.75)
    return "; did you mean " + " or ".join(f"'{k}'" for k in inner[close[0]]) + "?" if close else ""


def merge_into(cfg: Any, data: dict, prefix: str = "") -> None:
    """Merge a nested dict into dataclass ``cfg`` in place, refusing unknown keys and wrong types.

    Nested dataclass fields are merged recursively; every other value replaces the field's value.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix[:-1] or '<root>'}' must be a mapping, got {type(data).__name__}")
    h = hints(cfg)
    names = [f.name for f in dataclasses.fields(cfg)]
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in names:
            where = f" under {prefix[:-1]!r}" if prefix else ""
            guess = near_miss(key, names, prefix) or ("" if prefix else _nested_miss(cfg, key))
            raise ConfigError(f"unknown config key '{full}'; valid keys{where}: {', '.join(names)}{guess}")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current) and not isinstance(current, type):
            merge_into(current, value, full + ".")
        else:
            setattr(cfg, key, coerce(value, h[key], full))


def check_choices(cfg: Any, prefix: str = "") -> None:
    """Check every ``Literal`` field of ``cfg`` (recursively), e.g. after values were set in code."""
    h = hints(cfg)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_choices(value, f"{prefix}{f.name}.")
        elif choices_of(h[f.name]) is not None:
            coerce(value, h[f.name], f"{prefix}{f.name}")
