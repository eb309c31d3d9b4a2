"""`flowgrpo bench gpu`'s CPU form: every stage of the GPU command on a tiny SD3 on the CPU.

The Flow-GRPO side needs a checkout of github.com/yifan123/flow_grpo: set
``FLOWGRPO_REFERENCE=/path/to/flow_grpo`` (as for tests/test_bench_reference.py); without it the
reference side is left out (and recorded so). No timing is asserted.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch

from flowgrpo.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
CHECKOUT = os.environ.get("FLOWGRPO_REFERENCE")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU form; on a GPU run `flowgrpo bench gpu`")


def test_cpu_form_runs_every_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the op tests are found as ./tests/test_ops.py
    out = tmp_path / "out"
    assert cli_main(["bench", "gpu", "--device", "cpu", "--tiny", "--out", str(out)]) == 0
    data = json.loads((out / "gpu.json").read_text())
    stages = data["stages"]
    assert {n: s["status"] for n, s in stages.items()} == {"ops": "ok", "rollout_update": "ok", "memory": "ok",
                                                           "objectives": "ok"}
    assert data["device"]["device"] == "cpu" and data["device"]["torch"] == torch.__version__
    # (a) the extension, the op's own tests (opcheck included) and the bandwidth rows
    ops = stages["ops"]
    assert ops["build"]["cuda_kernels"] is False
    if ops["build"]["backend"] == "compiled":  # a C++ compiler is there
        assert ops["tests"]["failed"] == 0 and ops["tests"]["passed"] >= 4, ops["tests"]["output_tail"]
        assert any("opcheck" in s and "cuda" in s for s in ops["tests"]["skips"])  # CUDA-only: skipped with reason
        assert {r["impl"] for r in ops["bandwidth"]["rows"]} == {"fused", "eager"}
        assert all(r["gbps"] > 0 and r["pct_of_peak"] is None for r in ops["bandwidth"]["rows"])
    # (b) both sides on the same chains, ratios and medians
    mod = stages["rollout_update"]
    assert mod["settings"]["model"] == "tiny" and mod["rounds_timed"] >= 1
    assert mod["model"]["transformer_params"] > 0 and mod["model"]["resident_gib"] is None
    sides = [r["side"] for r in mod["rows"]]
    if CHECKOUT:
        assert sides == ["flow_grpo (reference)", "flowgrpo"]
        assert mod["max_latent_diff"] < 1e-5 and mod["max_logprob_diff"] < 1e-5
        assert all(mod[f"{k}_ratio"] > 0 for k in ("rollout", "update", "iteration"))
    else:
        assert sides == ["flowgrpo"] and "no Flow-GRPO checkout" in mod["reference"]
    # (c) CUDA-only figures are None with the reason; the estimate is computed
    mem = stages["memory"]
    assert mem["measured_peak_gib"] is None and "CUDA" in mem["measured"]
    assert mem["estimate_gib"]["total"] > mem["estimate_gib"]["base_weights"] > 0
    assert mem["estimate_with_activations_gib"] > mem["estimate_gib"]["total"]
    # (d) every objective's preset trained on the same model: LoRA moved, base weights bit for bit
    obj = stages["objectives"]
    from flowgrpo.benchmarks.gpu_objectives import OBJECTIVE_PRESETS

    assert [r["preset"] for r in obj["rows"]] == list(OBJECTIVE_PRESETS) and obj["not_run"] == []
    for r in obj["rows"]:
        assert r["trained"] and r["base_unchanged"] and r["base_sum_unchanged"] and r["lora_max_change"] > 0, r
        assert len(r["iterations"]) == 2 and all(it["trained"] > 0 for it in r["iterations"])
        assert r["peak_gib"] is None  # CUDA only
    assert {r["objective"] for r in obj["rows"]} == {"grpo", "flow_dppo", "diffusion_dpo", "nft", "awm", "dgpo"}
    assert data["summary"]["stages_failed"] == [] and data["summary"]["objectives_not_trained"] == []
    rows = list(csv.DictReader((out / "gpu.csv").open()))
    assert {"device", "ops", "rollout_update", "memory", "objectives", "summary"} <= {r["stage"] for r in rows}


def test_stages_pick_what_runs_and_an_unknown_stage_names_the_valid_ones(tmp_path, capsys):
    assert cli_main(["bench", "gpu", "--device", "cpu", "--tiny", "--stages", "ops,objectivs", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "objectivs" in err and "rollout_update, memory, objectives" in err
    from flowgrpo.benchmarks import bench_gpu

    res = bench_gpu.run_bench_gpu(None, out_dir=tmp_path, device="cpu", tiny=True, quiet=True, stages=("memory",))
    st = res["stages"]
    assert [n for n, s in st.items() if s["status"] == "skipped"] == ["ops", "rollout_update", "objectives"]
    assert st["memory"]["status"] == "ok" and st["memory"]["measured_peak_gib"] is None
    assert res["summary"]["stages_skipped"] == ["ops", "rollout_update", "objectives"]


def test_a_failing_stage_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    from flowgrpo.benchmarks import bench_gpu, gpu_models, gpu_ops

    def broken(*a, **k):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(gpu_ops, "run_ops_stage", lambda *a, **k: {"build": {"cuda_kernels": False}})
    monkeypatch.setattr(gpu_models, "run_models_stage", broken)
    monkeypatch.delenv("FLOWGRPO_REFERENCE", raising=False)
    res = bench_gpu.run_bench_gpu(tmp_path / "r.json", out_dir=tmp_path, device="cpu", tiny=True, quiet=True,
                                  stages=("ops", "rollout_update", "memory"))
    st = res["stages"]
    assert st["ops"]["status"] == "ok" and st["memory"]["status"] == "ok"
    assert st["rollout_update"]["status"] == "failed" and "simulated" in st["rollout_update"]["error"]
    assert "no measurement" in st["memory"]["measured"] or "CUDA" in st["memory"]["measured"]
    assert res["summary"]["stages_failed"] == ["rollout_update"]
    assert json.loads((tmp_path / "gpu.json").read_text())["stages"]["rollout_update"]["status"] == "failed"


def test_a_failed_cuda_build_falls_back_to_the_cpu_library_once(monkeypatch):
    """The CUDA build is tried once: its error (with the compiler's output) is recorded, the CPU
    library is built instead and the op tests' subprocess is told not to try CUDA again."""
    import flowgrpo.ops
    from flowgrpo.benchmarks import gpu_ops
    from flowgrpo.ops import build

    calls = []

    def fake_build(cuda=None, verbose=True, build_dir=None):
        calls.append(cuda)
        if cuda:
            raise RuntimeError("Error building extension 'flowgrpo_ops_cuda':\nnvcc fatal: simulated")
        return "cpu.so"

    monkeypatch.setattr(build, "build_extension", fake_build)
    monkeypatch.setattr(flowgrpo.ops, "active_backend", lambda device: "reference")
    monkeypatch.setenv("FLOWGRPO_BUILD_CUDA", "")
    res = gpu_ops.build_op(torch.device("cuda"))
    assert calls == [True, False]
    assert "simulated" in res["error"] and "nvcc fatal" in res["compiler_output"]
    assert os.environ["FLOWGRPO_BUILD_CUDA"] == "0"
