"""The name lists of README.md and docs/*.md (adapters, presets, recipes, rewards, objectives and the
default preset) equal what flowgrpo registers, so the docs cannot drift from the code again.

A doc marks each list it keeps with HTML comments, which Markdown does not render:
``<!-- registry:KIND -->`` ... ``<!-- /registry -->``, either inline (around part of a sentence or of
a table cell) or around whole lines (a table or a bullet list). The names of a list are the code
spans in the marked text, except that a table row (a line starting with ``|``) gives those of its
first cell only and a bullet item (``- `` or ``* ``) its first code span only, so the other columns
and the items' descriptions may name options, files or presets. A doc keeps at most one list of a kind, and
:data:`REQUIRED` names the lists that must exist, so deleting a marker fails as well.

The registries are read by a fresh interpreter (:func:`shipped_names`): a reward, objective or
model that a test registers at run time does not exist there, so only what flowgrpo ships counts,
whatever ran before in this process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: kind -> where its names come from (in failure messages)
SOURCES = {
    "adapters": "flowgrpo.policies.POLICIES",
    "presets": "flowgrpo/presets/*.yaml and flowgrpo/presets/worlds/*/*.yaml",
    "recipes": "flowgrpo/recipes/*.yaml",
    "rewards": "flowgrpo.rewards.REWARDS",
    "objectives": "flowgrpo.objectives.OBJECTIVES",
    "default-preset": "flowgrpo.presets.DEFAULT_PRESET",
}

#: doc (relative to the repository root) -> the lists it must keep
REQUIRED = {
    "README.md": {"adapters", "presets", "recipes", "rewards", "objectives", "default-preset"},
    "docs/cli.md": {"adapters"},
    "docs/design.md": {"adapters", "presets", "objectives"},
    "docs/objectives.md": {"objectives", "default-preset"},
    "docs/rewards.md": {"rewards"},
}

_SNAPSHOT = """
import json
from flowgrpo.objectives import OBJECTIVES
from flowgrpo.policies import POLICIES
from flowgrpo.presets import DEFAULT_PRESET, preset_names
from flowgrpo.recipes import recipe_names
from flowgrpo.rewards import REWARDS
print(json.dumps({"adapters": POLICIES.names(), "presets": preset_names(), "recipes": recipe_names(),
                  "rewards": REWARDS.names(), "objectives": OBJECTIVES.names(),
                  "default-preset": [DEFAULT_PRESET]}))
"""

_MARK = re.compile(r"<!--\s*(/?)registry(?::([^\s>]*))?\s*-->")
_CODE = re.compile(r"`([^`\n]+)`")


def shipped_names() -> dict[str, list[str]]:
    """kind -> the names a fresh interpreter finds registered (nothing a test added at run time)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _SNAPSHOT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def names_in(fragment: str) -> list[str]:
    """The code spans of a marked fragment, in order: of a table row its first cell's, of a bullet
    item its first one (the indented lines that continue an item give none)."""
    names: list[str] = []
    in_item = False
    for line in fragment.splitlines():
        text = line.strip()
        if text.startswith(("- ", "* ")):
            in_item = True
            names += _CODE.findall(text)[:1]
        elif in_item and text and line[:1].isspace():
            continue  # an item's continuation line: its description
        else:
            in_item = False
            if text.startswith("|"):
                text = text[1:].split("|", 1)[0]
            names += _CODE.findall(text)
    return names


def marked_lists(doc: str, text: str) -> tuple[dict[str, list[str]], list[str]]:
    """(kind -> names of the doc's marked list, problems with the markers as lines ``doc:line: ...``)."""
    lists: dict[str, list[str]] = {}
    problems: list[str] = []
    opened: tuple[str, int, int] | None = None  # (kind, end of the opening marker, its line)
    for m in _MARK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        closing, kind = m.group(1) == "/", m.group(2)
        if closing:
            if opened is None:
                problems.append(f"{doc}:{line}: <!-- /registry --> closes no list")
                continue
            kind, start, _ = opened
            opened = None
            if kind in lists:
                problems.append(f"{doc}:{line}: a second registry:{kind} list (keep one list of a kind per doc)")
            lists[kind] = names_in(text[start:m.start()])
            continue
        if opened is not None:
            problems.append(f"{doc}:{line}: registry:{kind} opens inside registry:{opened[0]} "
                            f"(line {opened[2]}), which is not closed")
        if kind not in SOURCES:
            problems.append(f"{doc}:{line}: unknown list kind {kind!r}; valid kinds: {', '.join(SOURCES)}")
            opened = None
            continue
        opened = (kind, m.end(), line)
    if opened is not None:
        problems.append(f"{doc}:{opened[2]}: registry:{opened[0]} is never closed by <!-- /registry -->")
    return lists, problems


def check_doc(doc: str, text: str, expected: dict[str, list[str]], required: set[str] = frozenset()) -> list[str]:
    """Every problem of one doc's marked lists against ``expected`` (kind -> registered names): marker
    errors, required lists that are absent, and per list the registered names it lacks, the names it
    gives that are not registered and the names it gives twice."""
    lists, problems = marked_lists(doc, text)
    for kind in sorted(required - set(lists)):
        problems.append(f"{doc}: no registry:{kind} list (expected {', '.join(expected[kind])})")
    for kind, names in lists.items():
        want = set(expected[kind])
        missing, unknown = sorted(want - set(names)), sorted(set(names) - want)
        twice = sorted({n for n in names if names.count(n) > 1})
        if not names:
            problems.append(f"{doc}: the registry:{kind} list names nothing (no `code` spans)")
        if missing:
            problems.append(f"{doc}: registry:{kind} lacks {', '.join(missing)} (registered in {SOURCES[kind]})")
        if unknown:
            problems.append(f"{doc}: registry:{kind} names {', '.join(unknown)}, not in {SOURCES[kind]} "
                            f"(registered: {', '.join(sorted(want))})")
        if twice:
            problems.append(f"{doc}: registry:{kind} names {', '.join(twice)} twice")
    return problems


def test_docs_lists_equal_the_registries():
    expected = shipped_names()
    docs = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    assert set(REQUIRED) <= set(docs), f"docs named in REQUIRED are gone: {sorted(set(REQUIRED) - set(docs))}"
    problems: list[str] = []
    for doc in docs:
        problems += check_doc(doc, (ROOT / doc).read_text(encoding="utf-8"), expected, REQUIRED.get(doc, set()))
    assert not problems, "the docs disagree with the registries:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- the checker itself
_EXPECTED = {"rewards": ["a", "b", "c"], "objectives": ["grpo", "nft"], "adapters": ["x"], "presets": ["p"],
             "recipes": ["r"], "default-preset": ["p"]}


def test_missing_and_unregistered_names_are_both_reported():
    text = "| reward | what |\n<!-- registry:rewards -->\n| `a` | uses `b` |\n| `zz` | x |\n<!-- /registry -->\n"
    problems = check_doc("d.md", text, _EXPECTED)
    # `b` stands in the second column only, so it does not count as listed
    assert problems == ["d.md: registry:rewards lacks b, c (registered in flowgrpo.rewards.REWARDS)",
                        "d.md: registry:rewards names zz, not in flowgrpo.rewards.REWARDS (registered: a, b, c)"]


def test_inline_list_and_required_lists():
    text = ("| objectives | <!-- registry:objectives -->`grpo` (ratios), `nft`<!-- /registry --> and `loss.x` |\n"
            "A sentence naming <!-- registry:adapters -->`x` and `x`<!-- /registry -->.\n")
    problems = check_doc("d.md", text, _EXPECTED, {"objectives", "rewards"})
    assert problems == ["d.md: no registry:rewards list (expected a, b, c)", "d.md: registry:adapters names x twice"]
    assert check_doc("d.md", text.replace("`x` and `x`", "`x`"), _EXPECTED, {"objectives"}) == []


def test_bullet_items_give_their_first_code_span():
    text = ("<!-- registry:rewards -->\n- `a`: reads `x`,\n  then `y`.\n* `b` (not `z`)\n\n"
            "`c`<!-- /registry -->\n")
    assert marked_lists("d.md", text) == ({"rewards": ["a", "b", "c"]}, [])


@pytest.mark.parametrize("text, problem", [
    ("<!-- registry:rewards -->`a`", "d.md:1: registry:rewards is never closed by <!-- /registry -->"),
    ("`a`<!-- /registry -->", "d.md:1: <!-- /registry --> closes no list"),
    ("\n<!-- registry:reward -->`a`<!-- /registry -->",
     "d.md:2: unknown list kind 'reward'; valid kinds: adapters, presets, recipes, rewards, objectives, default-preset"),
    ("<!-- registry:rewards -->`a`\n<!-- registry:presets -->`p`<!-- /registry -->",
     "d.md:2: registry:presets opens inside registry:rewards (line 1), which is not closed"),
    ("<!-- registry:presets -->`p`<!-- /registry --> <!-- registry:presets -->`p`<!-- /registry -->",
     "d.md:1: a second registry:presets list (keep one list of a kind per doc)"),
    ("<!-- registry:presets --> none <!-- /registry -->", "d.md: the registry:presets list names nothing (no `code` spans)"),
])
def test_marker_mistakes_are_named(text, problem):
    assert problem in check_doc("d.md", text, _EXPECTED)
