"""UniGenBench prompt files: the four shipped sets, any newer CSV, and the rows that are malformed.

A prompt file is a CSV with the columns ``index, prompt_en, sub_dims_en`` (English) or
``index, prompt_zh, sub_dims_zh`` (Chinese). ``sub_dims_*`` is a JSON object whose checkpoint list
(``Testpoints`` / ``考点``) and per-checkpoint descriptions (``Testpoint Description`` / ``考点对应描述``)
drive the judge. A row that cannot be judged as written (bad JSON, lists of different lengths, a
checkpoint with no definition, a duplicate or non-integer index, an empty prompt) is reported as a
:class:`RowProblem` naming the file, line and what is wrong, and skipped; it never stops a run.
The shipped ``test_prompts_en_long.csv`` has one such row (index 509: a missing comma in its JSON).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .protocol import LANGUAGES, data_path, protocol
from ..text_inputs import loads_json

#: set name -> shipped prompt file (600 prompts each)
SETS = {"en": "test_prompts_en.csv", "zh": "test_prompts_zh.csv",
        "en_long": "test_prompts_en_long.csv", "zh_long": "test_prompts_zh_long.csv"}


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark prompt: its ``index`` (image names are ``{index}_{j}.png``), the text, and the
    checkpoints (testpoint names) with their descriptions, one each, in the file's order."""

    index: int
    prompt: str
    testpoints: tuple[str, ...]
    descriptions: tuple[str, ...]
    category: str = ""


@dataclass(frozen=True)
class RowProblem:
    """A malformed row: the file, the line its record starts on, its index cell and what is wrong."""

    file: str
    line: int
    index: str
    problem: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} (index {self.index or '?'}): {self.problem}; row skipped"


@dataclass
class PromptSet:
    """The prompts of one file. ``name``: the set name (en, zh, en_long, zh_long); ``language``:
    which judge template applies; ``problems``: the malformed rows that were skipped."""

    name: str
    language: str
    source: Path
    prompts: list[BenchPrompt]
    problems: list[RowProblem] = field(default_factory=list)

    def limited(self, limit: int | None) -> list[BenchPrompt]:
        """The first ``limit`` prompts (all when None); a UserError for a ``limit`` below 1."""
        if limit is None:
            return list(self.prompts)
        if limit < 1:
            raise UserError(f"--limit must be at least 1 (the number of prompts to take), got {limit}")
        return self.prompts[:limit]


def set_language(name: str) -> str:
    """The language ("en" | "zh") of a set name."""
    if name not in SETS:
        raise UserError(f"unknown UniGenBench set {name!r}; valid: {', '.join(SETS)}")
    return name.split("_")[0]


def _detect_language(header: list[str], path: Path) -> str:
    for lang in LANGUAGES:
        p = protocol(lang)
        if {"index", p.prompt_column, p.dims_column} <= set(header):
            return lang
    raise UserError(f"{path}: not a UniGenBench prompt file: the header {header} lacks the columns "
                    "index, prompt_en, sub_dims_en (English) or index, prompt_zh, sub_dims_zh (Chinese)")


def _string_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _parse_row(row: dict, lang: str) -> tuple[BenchPrompt | None, str]:
    """(prompt, "") for a good row, (None, what is wrong) for a malformed one."""
    p = protocol(lang)
    try:
        index = int(str(row["index"]).strip())
    except ValueError:
        return None, f"index {row['index']!r} is not an integer"
    text = row.get(p.prompt_column) or ""  # as written: the judge sees the official scripts' text
    if not text.strip():
        return None, f"{p.prompt_column} is empty"
    try:
        dims = loads_json(row.get(p.dims_column) or "")
    except json.JSONDecodeError as e:
        return None, f"{p.dims_column} is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(dims, dict):
        return None, f"{p.dims_column} is not a JSON object"
    tps, descs = dims.get(p.testpoints_key), dims.get(p.descriptions_key)
    if not _string_list(tps) or not tps:
        return None, f"{p.dims_column} has no list of strings under {p.testpoints_key!r}"
    if not _string_list(descs) or len(descs) != len(tps):
        return None, (f"{p.dims_column}: {p.descriptions_key!r} must be a list of strings as long as "
                      f"{p.testpoints_key!r} ({len(tps)})")
    unknown = [t for t in tps if t not in p.definitions]
    if unknown:
        return None, f"checkpoint {unknown[0]!r} has no definition in the {lang} judge protocol"
    category = next((v for k, v in dims.items() if k in ("Primary Categories", "一级垂类") and isinstance(v, str)), "")
    return BenchPrompt(index, text, tuple(tps), tuple(descs), category), ""


def read_prompt_file(path: str | Path, name: str | None = None) -> PromptSet:
    """Read a UniGenBench CSV; malformed rows land in ``problems`` (never an exception).

    Raises UserError only for a file that is missing, unreadable or has no UniGenBench header."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                raise UserError(f"{path}: the prompt file is empty")
            lang = _detect_language([h.strip() for h in header], path)
            header = [h.strip() for h in header]
            prompts, problems, seen = [], [], set()
            line = reader.line_num + 1
            for cells in reader:
                start, line = line, reader.line_num + 1
                if not any(c.strip() for c in cells):
                    continue
                index_cell = cells[0].strip() if cells else ""
                if len(cells) != len(header):
                    problems.append(RowProblem(path.name, start, index_cell,
                                               f"{len(cells)} cells where the header has {len(header)}"))
                    continue
                prompt, problem = _parse_row(dict(zip(header, cells)), lang)
                if prompt is not None and prompt.index in seen:
                    prompt, problem = None, f"index {prompt.index} appears more than once"
                if prompt is None:
                    problems.append(RowProblem(path.name, start, index_cell, problem))
                    continue
                seen.add(prompt.index)
                prompts.append(prompt)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UserError(f"cannot read the prompt file {path}: {e}") from None
    if not prompts:
        raise UserError(f"{path}: no usable prompt ({len(problems)} malformed rows)")
    return PromptSet(name or path.stem, lang, path, prompts, problems)


def load_prompt_set(name: str, csv_path: str | Path | None = None) -> PromptSet:
    """The prompts of set ``name`` (en | zh | en_long | zh_long): the shipped file, or ``csv_path``
    (a newer file of the same language) when given."""
    lang = set_language(name)
    ps = read_prompt_file(csv_path if csv_path else data_path(SETS[name]), name)
    if ps.language != lang:
        raise UserError(f"{ps.source} holds {ps.language} prompts, but --set {name} needs {lang} ones")
    return ps
