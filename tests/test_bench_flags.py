"""``flowgrpo bench``'s flags are checked before any benchmark runs (issue 43, own probing).

Before: ``ops --repeats -1`` ended in a ``StatisticsError`` traceback, ``ops --out FILE`` in a
``FileExistsError`` one, ``e2e --minutes -1`` in "no finished run", ``gpu --time-budget nan`` ran
every stage, ``memory --resolution -5`` (no ``--recipe``) ran the measured runs ignoring it, an
unknown ``--recipe`` was a ``KeyError`` traceback, a size the model cannot take a RuntimeError one,
``--markdown`` a file without markers exited 0 saying "NOT written", and a flag another benchmark
takes (``ops --minutes 3``) was silently ignored.
"""

from __future__ import annotations

import pytest

from flowgrpo.cli import main as cli_main


def _refused(capsys, *argv: str) -> str:
    assert cli_main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowgrpo: error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("argv, needle", [
    (("ops", "--repeats", "-1"), "--repeats must be in 0..10000"),
    (("ops", "--repeats", "10001"), "--repeats must be in 0..10000"),
    (("e2e", "--minutes", "-1"), "--minutes must be a finite number >= 0"),
    (("e2e", "--minutes", "nan"), "got nan"),
    (("gpu", "--time-budget", "inf"), "--time-budget must be a finite number >= 0"),
    (("memory", "--recipe", "sd35-medium", "--gpus", "-1"), "--gpus must be >= 0"),
    (("memory", "--recipe", "sd35-medium", "--micro-batch", "-1"), "--micro-batch must be >= 0"),
    (("memory", "--recipe", "sd35-medium", "--resolution", "1000"), "multiple of 16"),
    (("memory", "--recipe", "wan21-t2v-1.3b", "--frames", "6"), "4k + 1"),
    (("memory", "--resolution", "512"), "--resolution sizes a recipe: add --recipe NAME or --all"),
])
def test_out_of_range_flags_are_named(capsys, argv, needle):
    assert needle in _refused(capsys, *argv)


def test_a_flag_the_benchmark_does_not_take_is_refused_with_its_flags(capsys):
    err = _refused(capsys, "ops", "--minutes", "3")
    assert "bench ops does not take --minutes" in err and "--repeats, --out, --json" in err
    assert "bench samplers does not take --tiny (its flags: --out, --json)" in _refused(capsys, "samplers", "--tiny")
    assert "bench gpu does not take --all" in _refused(capsys, "gpu", "--all")


def test_an_unknown_recipe_lists_the_sized_ones(capsys):
    err = _refused(capsys, "memory", "--recipe", "sd3.5-medium")
    assert "'sd3.5-medium' is not a sized recipe" in err and "sd35-medium" in err and "wan22-a14b" in err


def test_output_paths_of_the_wrong_kind(capsys, tmp_path):
    a_file = tmp_path / "f.txt"
    a_file.write_text("x")
    assert "is a file; give a folder" in _refused(capsys, "ops", "--out", str(a_file))
    assert "is a folder; give a file path" in _refused(capsys, "ops", "--json", str(tmp_path))
    assert a_file.read_text() == "x"


def test_markdown_without_markers_is_refused_before_sizing_and_left_alone(capsys, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# no markers here\n")
    err = _refused(capsys, "memory", "--recipe", "sd35-medium", "--markdown", str(doc))
    assert "<!-- memory-table:begin -->" in err
    assert doc.read_text() == "# no markers here\n"


def test_markdown_with_markers_is_filled(capsys, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- memory-table:begin -->\nold\n<!-- memory-table:end -->\nafter\n")
    assert cli_main(["bench", "memory", "--recipe", "sd35-medium", "--markdown", str(doc),
                     "--json", str(tmp_path / "m.json")]) == 0
    text = doc.read_text()
    assert "old" not in text and "| sd35-medium" in text and text.endswith("after\n")


@pytest.mark.parametrize("argv, needle", [
    (("--recipe", "sd35-medium", "--resolution", "100000000"), "recipe sd35-medium cannot be sized at resolution"),
    (("--recipe", "wan21-t2v-1.3b", "--frames", "100001"), "recipe wan21-t2v-1.3b cannot be sized at frames 100001"),
])
def test_a_size_the_model_cannot_take_is_one_line(capsys, argv, needle):
    assert needle in _refused(capsys, "memory", *argv)
