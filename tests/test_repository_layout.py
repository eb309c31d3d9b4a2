"""Code in the package, results as data (issue 45): ``benchmarks/results/`` holds data only (the scripts
that made it live in ``benchmarks/experiments/``), and the results pages (``docs/results.md``, the
index, and ``docs/results/*.md``, one page per topic) link only to files that exist."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DATA = ROOT / "benchmarks" / "results"
RESULTS_PAGES = [ROOT / "docs" / "results.md", *sorted((ROOT / "docs" / "results").glob("*.md"))]
#: a markdown link or image: [text](target) / ![alt](target), the target up to whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def code_files(folder: Path) -> list[str]:
    """Every ``.py`` or ``.sh`` file below ``folder``, relative to the repository root."""
    found = []
    for base, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        found += [str((Path(base) / f).relative_to(ROOT)) for f in files if f.endswith((".py", ".sh"))]
    return sorted(found)


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` (outside fenced code) whose file does not exist; the ``#anchor``
    is not checked, http(s) and mailto links are skipped."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"(https?|mailto):", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    return broken


def test_benchmark_results_hold_no_scripts():
    scripts = code_files(RESULTS_DATA)
    assert not scripts, ("benchmarks/results/ holds data only; move these scripts to the same place under "
                         f"benchmarks/experiments/: {scripts}")


def test_every_relative_link_of_the_results_pages_resolves():
    assert len(RESULTS_PAGES) > 1, "docs/results/ holds the results pages"
    broken = [f"{page.relative_to(ROOT)}: {b}" for page in RESULTS_PAGES for b in broken_links(page)]
    assert not broken, f"links to files that do not exist: {broken}"


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.png").write_bytes(b"")
    page.write_text("[ok](there.png) ![img](there.png#x) [web](https://example.org/none) [here](#a)\n"
                    "[gone](../missing/file.csv#top)\n```\n[in code](nowhere.md)\n```\n", encoding="utf-8")
    assert broken_links(page) == ["../missing/file.csv#top"]
