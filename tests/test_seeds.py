"""Every random stream's salt is written once, in flowgrpo.seeds (exact resume depends on them)."""

from __future__ import annotations

import re
from pathlib import Path

from flowgrpo import seeds

ROOT = Path(__file__).resolve().parent.parent


def test_salts_are_distinct():
    salts = {name: v for name, v in vars(seeds).items() if name.isupper() and isinstance(v, int)}
    assert len(salts) >= 6 and len(set(salts.values())) == len(salts), salts


def test_no_literal_salt_outside_the_seeds_module():
    """A generator seeded from a list ending in a number literal (``default_rng([seed, k, 97])``) hides a
    salt: it belongs in flowgrpo/seeds.py under a name."""
    literal = re.compile(r"(default_rng|derive_seed)\(\[?[^)\]]*,\s*\d+\s*[\])]")
    found = []
    for folder in ("flowgrpo", "samplers", "rewards"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "seeds.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if literal.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
