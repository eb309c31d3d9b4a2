"""The benchmark prompt sets shipped in ``flowgrpo/benches/data`` (GenEval, Flow-GRPO's OCR, PickScore and
GenEval-style test prompts): present in the package, intact, readable by the runner's prompt reader, and
the default of ``flowgrpo eval --bench`` where ``--prompts`` is not given. Fast: no model is built."""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

import pytest

from flowgrpo.benches.suites import BENCHES, bench_names, bench_prompts, get_bench
from flowgrpo.errors import UserError
from flowgrpo.rewards.geneval import TAGS
from flowgrpo.data import load_prompt_file

DATA = Path(str(resources.files("flowgrpo.benches").joinpath("data")))

#: file -> (prompts, git blob id of the upstream file: byte-identical copies, see data/LICENSES.md)
SHIPPED = {
    "geneval_evaluation_metadata.jsonl": (553, "efc21c7e639cd45554a1e44fac87157211f16d51"),
    "geneval_object_names.txt": (80, "f4822dd01d0d1d2598d5e0190c121204e55925f1"),
    "flowgrpo_geneval_test_metadata.jsonl": (2212, "27cdaf5cc1356fe15aeadbb8df55682ca74228f0"),
    "flowgrpo_ocr_test.txt": (1018, "8deb4f8d8f2e863f45353354243669b3c991a6a2"),
    "flowgrpo_pickscore_test.txt": (2048, "45f05231b969fb5f74c8debd606b22cd3be27f8e"),
}
#: benchmark -> its shipped default prompt file (the others need --prompts)
DEFAULTS = {"geneval": "geneval_evaluation_metadata.jsonl", "ocr": "flowgrpo_ocr_test.txt",
            "pickscore": "flowgrpo_pickscore_test.txt"}
GENEVAL_METADATA = ["geneval_evaluation_metadata.jsonl", "flowgrpo_geneval_test_metadata.jsonl"]
PLAIN_PROMPTS = ["flowgrpo_ocr_test.txt", "flowgrpo_pickscore_test.txt"]


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _object_names() -> set[str]:
    return set((DATA / "geneval_object_names.txt").read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_file_is_in_the_package_whole_and_unchanged(name):
    path = DATA / name
    assert path.is_file(), f"{name} is missing from flowgrpo/benches/data"
    data = path.read_bytes()
    lines, blob = SHIPPED[name]
    assert len(data.decode("utf-8").splitlines()) == lines
    assert _git_blob_id(data) == blob, f"{name} differs from the upstream file (LICENSES.md names its commit)"


def test_licenses_note_names_every_shipped_file_and_both_licences():
    note = (DATA / "LICENSES.md").read_text(encoding="utf-8")
    for name in SHIPPED:
        assert f"`{name}`" in note
    assert note.count("Permission is hereby granted, free of charge") == 2
    assert "Copyright (c) 2023 Dhruba Ghosh" in note and "Copyright (c) 2025 Jie Liu" in note
    # nothing in the folder that the note does not account for
    assert {p.name for p in DATA.iterdir()} == {*SHIPPED, "LICENSES.md"}


def test_geneval_object_names_are_80_distinct_classes():
    names = (DATA / "geneval_object_names.txt").read_text(encoding="utf-8").splitlines()
    assert len(names) == len(set(names)) == 80 and all(n and n == n.strip() for n in names)


@pytest.mark.parametrize("name", GENEVAL_METADATA)
def test_geneval_metadata_parses_with_known_tags_and_classes(name):
    classes = _object_names()
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    tags = set()
    for lineno, line in enumerate(lines, start=1):
        obj = json.loads(line)
        where = f"{name}:{lineno}"
        assert isinstance(obj["prompt"], str) and obj["prompt"].strip(), where
        assert obj["tag"] in TAGS, where
        tags.add(obj["tag"])
        assert obj["include"], where
        for group in ("include", "exclude"):
            for item in obj.get(group, []):
                assert item["class"] in classes, f"{where}: unknown class {item['class']!r}"
                assert isinstance(item["count"], int) and item["count"] >= 1, where
    assert tags == set(TAGS)


def test_geneval_metadata_has_geneval_tag_counts():
    lines = (DATA / "geneval_evaluation_metadata.jsonl").read_text(encoding="utf-8").splitlines()
    counts = {t: 0 for t in TAGS}
    for line in lines:
        counts[json.loads(line)["tag"]] += 1
    assert counts == {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100,
                      "color_attr": 100}


@pytest.mark.parametrize("name", PLAIN_PROMPTS)
def test_plain_prompt_files_have_no_empty_lines(name):
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    assert lines and all(line.strip() for line in lines)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_runner_prompt_reader_reads_every_shipped_file(name):
    rows = load_prompt_file(DATA / name)
    assert len(rows) == SHIPPED[name][0]
    if name.endswith(".jsonl"):
        assert {r["tag"] for r in rows} == set(TAGS) and all("include" in r["metadata"] for r in rows)


@pytest.mark.parametrize("name", bench_names())
def test_bench_default_prompts_are_the_shipped_file(name):
    bench = get_bench(name)
    assert bench.shipped == DEFAULTS.get(name)
    if name in DEFAULTS:
        path = bench.shipped_prompts()
        assert path == DATA / DEFAULTS[name] and path.is_file()
        assert bench_prompts(bench, None) == str(path)
        assert "shipped" in bench.prompts
    else:
        assert bench.shipped_prompts() is None
        with pytest.raises(UserError, match=f"--bench {name} needs --prompts FILE"):
            bench_prompts(bench, None)
    assert bench_prompts(bench, "mine.txt") == "mine.txt"  # --prompts wins over the shipped set


def test_every_registered_bench_is_covered():
    assert set(DEFAULTS) <= set(BENCHES.names())


def test_eval_without_prompts_errors_in_one_line_only_where_nothing_is_shipped(tmp_path, capsys):
    from flowgrpo.cli import main

    for name in ("hps", "imagereward"):
        assert main(["eval", str(tmp_path / "model"), "--bench", name, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--bench {name} needs --prompts FILE" in err and "\n" not in err
    # geneval without --prompts passes the prompt check and fails on the (missing) model instead
    assert main(["eval", str(tmp_path / "model"), "--bench", "geneval", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--prompts" not in err and "model.name" in err
    assert not (tmp_path / "out").exists()


def test_eval_help_says_where_prompts_default(capsys):
    from flowgrpo.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "shipped set (geneval, ocr, pickscore)" in help_text


def test_a_recipe_names_a_shipped_prompt_file_by_its_name():
    """sd35-geneval and sd35-ocr evaluate on Flow-GRPO's test files by name: the name resolves to the
    shipped file wherever flowgrpo is installed, the whole file is evaluated once per prompt, and a
    path that exists wins over a shipped name."""
    from flowgrpo.benches.suites import bench_prompts, get_bench, shipped_file
    from flowgrpo.config import compose_config
    from flowgrpo.data import load_prompt_file

    for recipe, bench in (("sd35-geneval", "geneval"), ("sd35-ocr", "ocr")):
        ev = compose_config("flow-grpo", recipe=recipe).config.eval
        assert ev.evaluator == "bench" and ev.options["bench"] == bench and ev.seeds_per_prompt == 1
        path = bench_prompts(get_bench(bench), ev.options.get("prompts"))
        assert len(load_prompt_file(path)) == ev.num_prompts
    assert shipped_file("../pyproject.toml") is None and shipped_file("no_such.txt") is None
    assert bench_prompts(get_bench("ocr"), __file__) == __file__
