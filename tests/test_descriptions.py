"""Preset and recipe descriptions quote the resolved configuration, never a number written beside it.

A description names the values it quotes as ``{section.key}`` placeholders, filled where it is shown
(``flowgrpo presets``, ``flowgrpo recipes``, ``config show``). Found stale before: ``config show
--preset mix-grpo --recipe flux1-dev`` said "sliding forward every 10 iterations" above a resolved
``shift_every: 25``; the hunyuanvideo15 recipe quoted DanceGRPO's eta 0.25 though its own method
runs at 0.7 (0.25 is its ``dance-grpo`` setting).
"""

from __future__ import annotations

import re

import pytest

from flowgrpo.cli import main
from flowgrpo.config import compose_config, preset_names, read_preset
from flowgrpo.config.layers import RECIPE_METHOD
from flowgrpo.config.show import PLACEHOLDER, fill_description, recipe_description
from flowgrpo.errors import ConfigError
from flowgrpo.recipes import read_recipe, recipe_meta, recipe_names

#: a quantity a config key sets: a number before a unit, or after the name of a setting
QUOTED_SETTING = [
    re.compile(r"(?<![\w.+\-^])\d+(?:\.\d+)?(?:e-?\d+)?\s*-?(?:px|steps?|samples|prompts|frames|iterations|min)\b"),
    re.compile(r"\b(?:r|alpha|lr|KL|CFG|guidance|eta|beta|weight|clip|tau|K|G|c|a)(?:\s*=\s*|\s+)\d"),
]


def outside_parentheses(text: str) -> str:
    """``text`` without its (possibly nested) parenthesised parts: the papers' own values live there."""
    out, depth = [], 0
    for ch in text:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def descriptions():
    yield from ((f"preset {n}", read_preset(n).get("description", "")) for n in preset_names())
    yield from ((f"recipe {n}", recipe_meta(n, "description", "")) for n in recipe_names())


@pytest.mark.parametrize("owner,text", list(descriptions()), ids=lambda v: v if v.startswith(("preset", "recipe")) else "")
def test_no_setting_is_written_as_a_number(owner, text):
    bare = outside_parentheses(PLACEHOLDER.sub("", text))
    found = [m.group(0) for pattern in QUOTED_SETTING for m in pattern.finditer(bare)]
    assert not found, f"{owner} quotes {found} as numbers: name them as {{section.key}} placeholders"


def combinations():
    """(recipe, preset): each recipe with its own method and every method its ``methods:`` section sets."""
    for recipe in recipe_names():
        yield recipe, RECIPE_METHOD
        for preset in read_recipe(recipe).get("methods") or {}:
            yield recipe, preset


@pytest.mark.parametrize("recipe,preset", list(combinations()))
def test_every_placeholder_resolves_on_every_recipe_and_method(recipe, preset):
    cfg = compose_config(preset, None, [], recipe).config
    for text in (cfg.description, recipe_meta(recipe, "description", "")):
        filled = fill_description(text, cfg)
        assert not PLACEHOLDER.search(filled) and filled.strip()


def test_config_show_quotes_the_recipe_methods_value(capsys):
    assert main(["config", "show", "--preset", "mix-grpo", "--recipe", "flux1-dev"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  shift_every: 25 ", out, re.M)
    described = out.splitlines()[1]  # the header comment under the first line
    assert described.startswith("# MixGRPO") and "every 25 iterations" in described, described
    assert "every 10 iterations" not in out  # the description key keeps its placeholder
    # an override shows in the text as in the key
    assert main(["config", "show", "--preset", "mix-grpo", "strategy.shift_every=7"]) == 0
    assert "every 7 iterations" in capsys.readouterr().out


def test_a_recipe_quotes_its_own_method_not_anothers():
    text = recipe_description("hunyuanvideo15")
    assert "0.25" not in text and "53 frames" in text


def test_an_unknown_placeholder_is_named():
    cfg = compose_config(RECIPE_METHOD, None, [], "shapes").config
    with pytest.raises(ConfigError, match=r"placeholder \{sampler.nope\} names no config key"):
        fill_description("at {sampler.nope} steps", cfg)
