"""`flowgrpo bench memory`: per-process peak memory of short training runs, from fresh processes."""

from __future__ import annotations

import json

import pytest

from flowgrpo.benchmarks.bench_memory import run_bench_memory
from flowgrpo.benchmarks.memory_probe import peak_memory


def test_probe_reads_this_process():
    peak = peak_memory()
    assert peak["peak_rss_mb"] > 50  # Python and torch are loaded in this process
    assert peak["peak_cuda_mb"] is None or peak["peak_cuda_mb"] >= 0


def test_runs_report_every_process(tmp_path):
    res = run_bench_memory(tmp_path / "m.json", iterations=1, out_dir=tmp_path, quiet=True,
                           only=["imports-only", "sd3-tiny-lora"])
    rows = {r["run"]: r for r in res["rows"]}
    assert list(rows) == ["imports-only", "sd3-tiny-lora"]
    assert rows["sd3-tiny-lora"]["processes"] == 1
    # a training run holds the imports plus a model, its rollouts and an optimizer
    assert rows["sd3-tiny-lora"]["peak_rss_mb"] > rows["imports-only"]["peak_rss_mb"]
    assert json.loads((tmp_path / "m.json").read_text())["rows"] == res["rows"]
    assert (tmp_path / "memory.csv").read_text().count("\n") == 3
    assert (tmp_path / "memory.png").stat().st_size > 0


@pytest.mark.slow  # two launched processes with FSDP2 take about 2.5 minutes on 2 cores (CI budget)
def test_a_two_process_run_reports_both_ranks(tmp_path):
    res = run_bench_memory(tmp_path / "m.json", iterations=1, out_dir=tmp_path, quiet=True,
                           only=["sd3-tiny-lora-fsdp2"])
    assert [r["run"] for r in res["rows"]] == ["sd3-tiny-lora-fsdp2"]
    assert res["rows"][0]["processes"] == 2
    assert res["rows"][0]["peak_rss_mb"] > 50
