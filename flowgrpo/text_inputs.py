"""Reading YAML and JSON that a user or a shared folder supplies: config files, overrides, a run's
``config.yaml`` and JSON records, prompt files, a pipeline folder's indexes.

``yaml.safe_load`` builds no arbitrary objects, but two things still reach it from outside:

* **aliases** (``&a`` / ``*a``): a few hundred bytes can name 10^10 values by reference (the
  "billion laughs"); loading is cheap, but every later walk that copies (``dataclasses.asdict``
  when a run records its config, ``json.dumps``) expands them, and a run with such a file under
  ``eval.options`` hung writing its ``config.yaml``;
* **nesting**: ten thousand ``[`` end in a RecursionError traceback inside PyYAML's composer.

:func:`load_yaml` refuses both in one line naming the source; aliases that expand to a sane size
stay usable. JSON has no aliases, but the same nesting was a RecursionError traceback from
``json.loads`` wherever a run folder's records or a prompt file are read: :func:`loads_json` makes
it the ValueError every malformed record already is, so each reader's own one-line error applies.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from .errors import ConfigError

#: the most values (mappings, lists and scalars, each alias counted where it expands) a YAML text
#: may hold; the largest shipped recipe holds a few hundred
MAX_YAML_VALUES = 100_000


def expanded_size(data: Any, limit: int = MAX_YAML_VALUES) -> int:
    """How many values ``data`` holds once every shared reference is written out in full (counted
    once per place it appears), stopping early above ``limit``. Linear in the distinct objects."""
    memo: dict[int, int] = {}

    def size(node: Any) -> int:
        if id(node) in memo:
            return memo[id(node)]
        if isinstance(node, dict):
            children = [*node.keys(), *node.values()]
        elif isinstance(node, (list, tuple, set)):
            children = list(node)
        else:
            return 1
        total = 1
        for child in children:
            total += size(child)
            if total > limit:
                break
        memo[id(node)] = total
        return total

    return size(data)


def load_yaml(text: str, what: str) -> Any:
    """``text`` parsed by ``yaml.safe_load``; a ConfigError naming ``what`` for invalid YAML, nesting
    too deep for the parser, or more than :data:`MAX_YAML_VALUES` values once aliases expand."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except RecursionError:
        raise ConfigError(f"{what} nests too deeply to be read (lists or mappings inside each other "
                          "thousands of levels down)") from None
    try:
        n = expanded_size(data)
    except RecursionError:
        raise ConfigError(f"{what} nests too deeply to be read") from None
    if n > MAX_YAML_VALUES:
        raise ConfigError(f"{what} holds more than {MAX_YAML_VALUES:,} values once its aliases (*name) are "
                          "expanded; a config needs a few hundred (is it an alias bomb?)")
    return data


def loads_json(text: str | bytes) -> Any:
    """``json.loads(text)``, with nesting too deep for the decoder raised as the ``json.JSONDecodeError``
    (a ValueError) that any malformed text raises, not a RecursionError."""
    try:
        return json.loads(text)
    except RecursionError:
        doc = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        raise json.JSONDecodeError("nested too deeply (lists or objects inside each other thousands of levels "
                                   "down)", doc, 0) from None
