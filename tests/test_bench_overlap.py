"""`bench overlap` smoke test: a served delayed reward, every setting timed, CSV/PNG/JSON written."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from flowgrpo.benchmarks.bench_overlap import COLUMNS, run_bench_overlap  # noqa: E402

SMALL = ("data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=2")


def test_bench_overlap_times_every_setting_and_writes_its_files(tmp_path):
    res = run_bench_overlap(tmp_path / "overlap.json", tmp_path, delay=0.05, iterations=1, waves=(2,),
                            concurrency=2, overrides=SMALL)
    names = [r["setting"] for r in res["rows"]]
    assert names == ["serial", "waves 2", "serial+concurrent", "waves 2+concurrent"]
    serial = res["rows"][0]
    # 2 groups, one request each, 50 ms per reward call: the serial collect includes both calls
    assert serial["collect_s"] >= serial["sample_s"] + 2 * 0.05
    for r in res["rows"]:
        assert 0 < r["sample_s"] <= r["collect_s"] and r["bound_s"] > 0
    assert json.loads((tmp_path / "overlap.json").read_text()) == json.loads(json.dumps(res))
    rows = list(csv.DictReader(open(tmp_path / "overlap.csv")))
    assert tuple(rows[0]) == COLUMNS and len(rows) == 4
    assert (tmp_path / "overlap.png").stat().st_size > 0
