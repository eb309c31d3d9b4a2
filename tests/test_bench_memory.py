"""`flowgrpo bench memory`: per-process peak memory of short training runs, from fresh processes."""

from __future__ import annotations

import json

from flowgrpo.benchmarks.bench_memory import run_bench_memory
from flowgrpo.benchmarks.memory_probe import peak_memory


def test_probe_reads_this_process():
    peak = peak_memory()
    assert peak["peak_rss_mb"] > 50  # Python and torch are loaded in this process
    assert peak["peak_cuda_mb"] is None or peak["peak_cuda_mb"] >= 0


def test_runs_report_every_process(tmp_path):
    res = run_bench_memory(tmp_path / "m.json", iterations=1, out_dir=tmp_path, quiet=True,
                           only=["imports-only", "sd3-tiny-lora", "sd3-tiny-lora-fsdp2"])
    rows = {r["run"]: r for r in res["rows"]}
    assert list(rows) == ["imports-only", "sd3-tiny-lora", "sd3-tiny-lora-fsdp2"]
    assert rows["sd3-tiny-lora-fsdp2"]["processes"] == 2
    # a training run holds the imports plus a model, its rollouts and an optimizer
    assert rows["sd3-tiny-lora"]["peak_rss_mb"] > rows["imports-only"]["peak_rss_mb"]
    assert json.loads((tmp_path / "m.json").read_text())["rows"] == res["rows"]
    assert (tmp_path / "memory.csv").read_text().count("\n") == 4
    assert (tmp_path / "memory.png").stat().st_size > 0
