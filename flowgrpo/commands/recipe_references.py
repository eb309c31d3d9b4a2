"""The recipes against the reference code they cite: ``flowgrpo/recipes/sources/references.yaml`` as rows, resolved and rendered.

Each run of the table is one reference configuration (Flow-GRPO's ``pickscore_sd3``, DanceGRPO's FLUX
LoRA script, ...) with the method preset and the recipes it sets; each row one config key with the
value the reference gives it, in flowgrpo's terms, and the file and line that set it. :func:`check`
resolves every row through the layers of ``flowgrpo config show`` (:func:`flowgrpo.config.compose_config`)
and names each one whose resolved value differs; a departure from the reference is a row with a
``deviation`` (its reason), never a silent difference. :func:`markdown` renders
``docs/recipe_references.md`` (``python -m flowgrpo.commands.recipe_references --write``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from urllib.parse import quote

import yaml

from ..errors import ConfigError
from ..presets import load_yaml_mapping

#: the table, beside the recipes
TABLE = "sources/references.yaml"
#: the rendered page, from the repository root
DOC = Path("docs") / "recipe_references.md"
#: the fields a row may have
ROW_FIELDS = ("key", "value", "at", "reference", "why", "deviation", "only", "measure")
#: the fields a run may have
RUN_FIELDS = ("name", "repository", "method", "recipes", "rows")


@dataclass(frozen=True)
class Row:
    """One recipe x method key of the table (a run's row for one of its recipes)."""

    run: str
    recipe: str
    method: str
    key: str
    value: object
    at: tuple[str, ...]
    repository: str
    commit: str
    reference: object = None
    why: str = ""
    deviation: str = ""
    measure: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.method} on {self.recipe}: {self.key}"


@functools.lru_cache(maxsize=1)
def load_table() -> dict:
    """``sources/references.yaml`` as a mapping, its runs and rows checked for their fields."""
    text = (resources.files("flowgrpo.recipes") / TABLE).read_text()
    table = load_yaml_mapping(text, f"flowgrpo/recipes/{TABLE}")
    repos = table.get("repositories") or {}
    for run in table.get("runs") or ():
        extra = set(run) - set(RUN_FIELDS)
        if extra or run.get("repository") not in repos:
            raise ConfigError(f"{TABLE}: run {run.get('name')!r} has fields {sorted(extra)} or an unknown repository")
        for row in run["rows"]:
            extra = set(row) - set(ROW_FIELDS)
            if extra or not {"key", "value", "at"} <= set(row):
                raise ConfigError(f"{TABLE}: run {run['name']!r}, row {row.get('key')!r}: fields {sorted(extra)} "
                                  "unknown, or key, value or at missing")
    return table


def rows() -> list[Row]:
    """Every row of the table, once per recipe of its run (``only`` narrows a row to some of them)."""
    table = load_table()
    out = []
    for run in table["runs"]:
        repo = table["repositories"][run["repository"]]
        for row in run["rows"]:
            for recipe in row.get("only") or run["recipes"]:
                out.append(Row(run=run["name"], recipe=recipe, method=run["method"], key=row["key"], value=row["value"],
                               at=tuple(row["at"].split("; ")), repository=repo["repository"], commit=repo["commit"],
                               reference=row.get("reference"), why=row.get("why", ""), deviation=row.get("deviation", ""),
                               measure=row.get("measure") or {}))
    return out


@functools.lru_cache(maxsize=None)
def resolved_config(recipe: str, method: str) -> dict:
    """The flattened configuration of ``method`` on ``recipe``, as ``config show`` composes it (not validated:
    a row names a reward that another part of flowgrpo may not have registered yet; the tests validate)."""
    from ..config import compose_config
    from ..config.layers import flatten

    return flatten(compose_config(method, recipe=recipe).config)


def same(a, b) -> bool:
    """Equal values, floats to 1e-12 relative (1/3 written in YAML), mappings and lists element-wise."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def check(table: list[Row] | None = None) -> list[str]:
    """One line per problem: a row whose resolved value is not its ``value``, a key the configuration does
    not have, or a ``reference`` value other than ``value`` with neither ``why`` nor ``deviation``."""
    problems = []
    for row in rows() if table is None else table:
        flat = resolved_config(row.recipe, row.method)
        if row.key not in flat:
            problems.append(f"{row.where}: no such config key")
        elif not same(flat[row.key], row.value):
            problems.append(f"{row.where} resolves to {flat[row.key]!r}, the table says {row.value!r} ({row.run}, "
                            f"{row.at[0]}){'' if row.deviation else ': not a stated deviation'}")
        converted = row.reference is not None and not isinstance(row.reference, str) and not same(row.reference, row.value)
        if converted and not (row.why or row.deviation):  # a text reference is the reference's spelling of the value
            problems.append(f"{row.where}: reference {row.reference!r} differs from {row.value!r} with no why or deviation")
    return problems


# --------------------------------------------------------------------------- rendering
def _text(value) -> str:
    """A value as YAML's flow style writes it (``[a, b]``, ``{hpsv2: 1.0}``, ``true``)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _link(row: Row, source: str) -> str:
    path, _, lines = source.rpartition(":")
    first, _, last = lines.partition("-")
    anchor = f"#L{first}" + (f"-L{last}" if last else "")
    url = f"https://github.com/{row.repository}/blob/{row.commit}/{quote(path)}{anchor}"
    return f"[{source.replace('*', chr(92) + '*')}]({url})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*") if text else ""


def markdown() -> str:
    """The page ``docs/recipe_references.md``: per run, each key with the reference's value, flowgrpo's and
    the source line; then the stated deviations."""
    table = load_table()
    every = rows()
    deviations = [r for r in every if r.deviation]
    out = ["# Recipes against the code they cite", "",
           "<!-- generated by `python -m flowgrpo.commands.recipe_references --write` from "
           f"flowgrpo/recipes/{TABLE}; do not edit -->", "",
           "Each recipe's settings for a method come from a reference implementation where one exists. This page "
           "lists every key a reference sets, per recipe and method: the reference's value (in its own spelling "
           "where it differs), the value flowgrpo resolves (`flowgrpo config show --preset METHOD --recipe "
           "RECIPE`), and the file and line of the reference that set it. `tests/test_recipe_references.py` "
           "resolves every row and fails on any difference that is not a stated deviation, and counts the "
           "LoRA layers on the real-size transformer (meta device) where a row says how many.", "",
           f"{len(every)} recipe x method keys, {len(deviations)} of them stated deviations.", "",
           "| repository | commit |", "|---|---|"]
    for repo in table["repositories"].values():
        out.append(f"| [{repo['repository']}](https://github.com/{repo['repository']}) | `{repo['commit']}` |")
    for run in table["runs"]:
        mine = [r for r in every if r.run == run["name"]]
        recipes = ", ".join(f"`{r}`" for r in run["recipes"])
        out += ["", f"## {_cell(run['name'])}: `{run['method']}` on {recipes}", "",
                "| key | reference | flowgrpo | source | note |", "|---|---|---|---|---|"]
        done = set()
        for row in mine:
            only = [r.recipe for r in mine if r.key == row.key and same(r.value, row.value)]
            ident = (row.key, _text(row.value))
            if ident in done:
                continue
            done.add(ident)
            ref = _text(row.reference if row.reference is not None else row.value)
            notes = [", ".join(only) + " only" if len(only) < len(run["recipes"]) else "", _cell(row.why),
                     f"**deviation**: {_cell(row.deviation)}" if row.deviation else "",
                     "measured: " + ", ".join(f"{k} {v:,}" for k, v in row.measure.items()) if row.measure else ""]
            source = "; ".join(_link(row, s) for s in row.at)
            out.append(f"| `{row.key}` | {_cell(ref)} | {_cell(_text(row.value))} | {source} | "
                       f"{'; '.join(n for n in notes if n)} |")
    out += ["", "## Stated deviations", ""]
    seen = set()
    for row in deviations:
        if (row.run, row.key, row.deviation) in seen:
            continue
        seen.add((row.run, row.key, row.deviation))
        recipes = ", ".join(r.recipe for r in deviations if (r.run, r.key, r.deviation) == (row.run, row.key, row.deviation))
        out.append(f"- {_cell(row.run)} ({row.method} on {recipes}), `{row.key}`: {_cell(row.deviation)}.")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``--write``: render the page into docs/recipe_references.md; otherwise print the problems (exit 1 if any)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if "--write" in args:
        DOC.write_text(markdown())
        print(f"{DOC}: {len(rows())} rows")
        return 0
    problems = check()
    print("\n".join(problems) or f"{len(rows())} rows resolve as the table says")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
