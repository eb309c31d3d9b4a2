"""Every command shown with its output in the docs prints that output.

A fenced block whose first line is ``$ flowgrpo ...`` or ``$ python examples/...`` is a command and
what it printed. The test runs the command (from the repository root, in a scratch folder for the
examples) and requires every shown line to appear in its output (stdout and stderr), in order; a
line ``...`` stands for any number of lines. Numbers may differ by :data:`ATOL` (training on another
CPU rounds differently); the words around them may not. Found stale before: docs/api.md's output of
``examples/custom_reward.py`` still showed the previous base model's rewards (0.6875 where the run
prints 0.8125).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, run_cli

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
#: how far a printed number may be from the documented one
ATOL = 0.02
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """(where, command, shown output lines) of every command block in the docs."""
    found = []
    for doc in DOCS:
        for match in re.finditer(r"^```[a-z]*\n(.*?)^```", doc.read_text(), re.M | re.S):
            lines = match.group(1).splitlines()
            if lines and lines[0].startswith(("$ flowgrpo ", "$ python examples/")):
                where = f"{doc.name}:{doc.read_text()[:match.start()].count(chr(10)) + 1}"
                found.append((where, lines[0][2:], lines[1:]))
    return found


def same_line(shown: str, printed: str) -> bool:
    """Whether ``printed`` is ``shown`` up to :data:`ATOL` on each number (and trailing spaces)."""
    a, b = shown.rstrip(), printed.rstrip()
    if NUMBER.sub("#", a) != NUMBER.sub("#", b):
        return False
    return all(abs(float(x) - float(y)) <= ATOL for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)))


def missing_lines(shown: list[str], printed: list[str]) -> list[str]:
    """The shown lines not found in ``printed`` in order (``...`` skips any number of lines; without it the
    next shown line must be the next printed one)."""
    i, free, missing = 0, True, []
    for line in shown:
        if line.strip() == "...":
            free = True
            continue
        j = i
        while j < len(printed) and not same_line(line, printed[j]):
            if not free:
                j = len(printed)
                break
            j += 1
        if j == len(printed):
            missing.append(line)
        else:
            i = j + 1
        free = False
    return missing


def test_the_docs_show_commands():
    assert {c.split()[0] for _, c, _ in shown_commands()} >= {"flowgrpo", "python"}


@pytest.mark.parametrize("where,command,shown", shown_commands(), ids=[w for w, _, _ in shown_commands()])
def test_a_documented_command_prints_what_the_docs_show(where, command, shown, tmp_path):
    argv = shlex.split(command)
    if argv[0] == "flowgrpo":
        proc = run_cli(argv[1:], cwd=ROOT)
    else:  # an example: its files go to a scratch folder
        proc = subprocess.run([sys.executable, str(ROOT / argv[1]), *argv[2:]], cwd=tmp_path, env=cli_env(),
                              capture_output=True, text=True, timeout=600)
    printed = (proc.stdout + proc.stderr).splitlines()
    missing = missing_lines(shown, printed)
    assert not missing, f"{where}: `{command}` no longer prints {missing}; it printed:\n" + "\n".join(printed[-40:])


def test_the_comparison_catches_a_changed_number_and_a_changed_word():
    printed = ["iteration 0: reward=0.8125  dropped=0", "done"]
    assert missing_lines(["...", "iteration 0: reward=0.81  dropped=0"], printed) == []
    assert missing_lines(["iteration 0: reward=0.6875  dropped=0"], printed)
    assert missing_lines(["iteration 0: rewards=0.8125  dropped=0"], printed)
    assert missing_lines(["done", "iteration 0: reward=0.8125  dropped=0"], printed)  # order
    assert missing_lines(["iteration 0: reward=0.8125  dropped=0", "x", "done"], printed)
