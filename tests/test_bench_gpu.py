"""`flowgrpo bench gpu`'s CPU form: every stage of the GPU command on tiny models on the CPU.

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


OLD_STAGES = "rollout_update,memory,objectives,ops"


def test_cpu_form_runs_every_stage(tmp_path, monkeypatch):
    """The stages of the SD3.5-Medium comparison, the objectives and the op (the levers and size
    stages have their own test below, so no stage runs twice)."""
    monkeypatch.chdir(REPO)  # the op tests are found as ./tests/test_ops.py
    out = tmp_path / "out"
    assert cli_main(["bench", "gpu", "--device", "cpu", "--tiny", "--stages", OLD_STAGES, "--out", str(out)]) == 0
    data = json.loads((out / "gpu.json").read_text())
    stages = data["stages"]
    assert {n: s["status"] for n, s in stages.items()} == {
        "rollout_update": "ok", "levers": "skipped", "flux": "skipped", "wan": "skipped", "memory": "ok",
        "objectives": "ok", "ops": "ok"}
    assert data["complete"] is True and data["device"]["peak_bf16_tflops"] is None
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
    # (e) the same model FLOPs on every side; no MFU without a device peak
    assert len({r["flops"]["iteration_tflops"] for r in mod["rows"]}) == 1
    assert all(r["flops"]["iteration_mfu"] is None and r["flops"]["iteration_tflops_per_s"] > 0 for r in mod["rows"])
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
    lines = [json.loads(x) for x in (out / "gpu_stages.jsonl").read_text().splitlines()]
    assert [x["stage"] for x in lines] == ["rollout_update", "levers", "flux", "wan", "memory", "objectives", "ops"]


def test_stages_pick_what_runs_and_an_unknown_stage_names_the_valid_ones(tmp_path, capsys):
    assert cli_main(["bench", "gpu", "--device", "cpu", "--tiny", "--stages", "ops,objectivs", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "objectivs" in err and "rollout_update, levers, flux, wan, memory, objectives, ops" in err
    from flowgrpo.benchmarks import bench_gpu

    res = bench_gpu.run_bench_gpu(None, out_dir=tmp_path, device="cpu", tiny=True, quiet=True, stages=("memory",))
    st = res["stages"]
    others = ["rollout_update", "levers", "flux", "wan", "objectives", "ops"]
    assert [n for n, s in st.items() if s["status"] == "skipped"] == others
    assert st["memory"]["status"] == "ok" and st["memory"]["measured_peak_gib"] is None
    assert res["summary"]["stages_skipped"] == others


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


def test_levers_and_size_stages_on_the_cpu(tmp_path):
    """levers, flux and wan on tiny models: every lever that can run on the CPU ran and was timed, flash
    is skipped with the trainer's one-line reason, ``all`` combines the levers that ran; the FLUX
    and Wan rows carry (d) and (e); results are written stage by stage."""
    out = tmp_path / "out"
    assert cli_main(["bench", "gpu", "--device", "cpu", "--tiny", "--stages", "levers,flux,wan", "--out", str(out)]) == 0
    data = json.loads((out / "gpu.json").read_text())
    st = data["stages"]
    assert {n: st[n]["status"] for n in ("levers", "flux", "wan")} == {"levers": "ok", "flux": "ok", "wan": "ok"}
    levers = {r["lever"]: r for r in st["levers"]["rows"]}
    assert list(levers) == ["plain", "attention=native", "attention=flash", "checkpointing", "all"]
    flash = levers["attention=flash"]
    assert flash["status"] == "skipped" and "flash" in flash["reason"] and "\n" not in flash["reason"]
    for name in ("plain", "attention=native", "checkpointing", "all"):
        r = levers[name]
        assert r["status"] == "ok" and r["rounds"] == 1 and r["iteration_s"] == pytest.approx(r["rollout_s"] + r["update_s"])
        assert r["vs_plain"]["iteration"] > 0 and r["vs_flow_grpo"] is None  # no rollout_update stage ran
        assert r["flops"]["forward_gflops_per_sample"] > 0 and r["flops"]["update_mfu"] is None
        assert r["peak_gib"] is None and r["peak_over_computed"] is None and "tiny" in r["computed_note"]
        # flowgrpo train's own forecast of the run as loaded: weights and state off CUDA, said so
        assert r["forecast_gib"] > 0 and "not counted off CUDA" in r["forecast_note"] and r["peak_over_forecast"] is None
    assert levers["plain"]["vs_plain"]["iteration"] == 1.0
    assert sorted(levers["all"]["overrides"]) == ["model.attention_backend=native", "model.gradient_checkpointing=true"]
    # the same work at every lever: the model FLOPs do not depend on the switches
    assert len({r["flops"]["iteration_tflops"] for r in levers.values() if r["status"] == "ok"}) == 1
    flux, wan = st["flux"], st["wan"]
    assert flux["model"]["class"] == "FluxTransformer2DModel" and wan["model"]["class"] == "WanTransformer3DModel"
    assert wan["settings"]["frames"] == 33 and wan["rows"][0]["flops"]["image_tokens"] == 9 * 2 * 2
    assert "Wan code" in wan["reference"] and [r["side"] for r in wan["rows"]] == ["flowgrpo"]
    if CHECKOUT:
        assert [r["side"] for r in flux["rows"]] == ["flow_grpo (reference)", "flowgrpo"]
        assert flux["max_latent_diff"] < 1e-5 and flux["max_logprob_diff"] < 1e-5
        assert flux["rows"][1]["vs_flow_grpo"]["iteration"] > 0
    else:
        assert [r["side"] for r in flux["rows"]] == ["flowgrpo"] and "no Flow-GRPO checkout" in flux["reference"]
    for r in (*flux["rows"], *wan["rows"]):
        assert r["rollout_s"] > 0 and r["update_s"] > 0 and r["flops"]["rollout_tflops"] > 0
    assert flux["rows"][-1]["forecast_gib"] > 0 and wan["rows"][0]["forecast_gib"] > 0
    # FLUX: no CFG; Wan: CFG doubles the rollout's forwards
    f_fl, f_wan = flux["rows"][-1]["flops"], wan["rows"][0]["flops"]
    assert f_fl["update_tflops"] / f_fl["rollout_tflops"] == pytest.approx(3.0)
    assert f_wan["update_tflops"] / f_wan["rollout_tflops"] == pytest.approx(2.5)
    lines = [json.loads(x)["stage"] for x in (out / "gpu_stages.jsonl").read_text().splitlines()]
    assert lines == list(data["stages"]) and data["complete"] is True
    rows = list(csv.DictReader((out / "gpu.csv").open()))
    assert any(r["stage"] == "levers" and r["name"].startswith("rows[attention=native].flops") for r in rows)


def test_flop_count_matches_torch_flop_counter():
    """forward_flops from the config alone equals FlopCounterMode's count of a real forward (SDPA's
    math kernel, whose matmuls it counts) on the tiny SD3, FLUX and Wan, at two sizes each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from flowgrpo.benchmarks.gpu_flops import forward_flops, image_tokens
    from flowgrpo.benchmarks.gpu_setup import SIZES, TINY_TRANSFORMER
    from flowgrpo.policies.tiny.flux import tiny_flux_components
    from flowgrpo.policies.tiny.wan import tiny_wan_components
    from flowgrpo.realsize.configs import build_transformer

    torch.manual_seed(0)
    tiny = SIZES["tiny"]
    sd3 = build_transformer("sd35-medium", device="cpu", dtype=torch.float32, **dict(
        TINY_TRANSFORMER, pooled_projection_dim=sum(tiny.clip_widths), joint_attention_dim=tiny.t5_width))
    flux = tiny_flux_components()["transformer"]
    wan = tiny_wan_components()["transformer"]

    def inputs(model, b: int, res: int, s: int) -> dict:
        c = model.config
        if model is sd3:
            return dict(hidden_states=torch.randn(b, 16, res // 8, res // 8), pooled_projections=torch.randn(b, 80),
                        encoder_hidden_states=torch.randn(b, s, c.joint_attention_dim), timestep=torch.rand(b))
        if model is flux:
            n = (res // 16) ** 2
            return dict(hidden_states=torch.randn(b, n, 64), encoder_hidden_states=torch.randn(b, s, c.joint_attention_dim),
                        pooled_projections=torch.randn(b, c.pooled_projection_dim), timestep=torch.rand(b),
                        guidance=torch.full((b,), 3.5), txt_ids=torch.zeros(s, 3), img_ids=torch.zeros(n, 3))
        return dict(hidden_states=torch.randn(b, 16, 3, res // 8, res // 8), timestep=torch.rand(b) * 1000,
                    encoder_hidden_states=torch.randn(b, s, c.text_dim))

    for model, frames in ((sd3, 1), (flux, 1), (wan, 9)):
        for b, res, s in ((2, 64, 24), (1, 128, 40)):
            with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
                model(**inputs(model, b, res, s), return_dict=False)
            cls = type(model).__name__
            counted = forward_flops(cls, dict(model.config), image_tokens(cls, dict(model.config), res, frames), s, b)
            assert counted.total == pytest.approx(counter.get_total_flops(), rel=0.01), (cls, res)
            assert counted.attention > 0 and counted.linear > 0


def test_time_budget_skips_what_no_longer_fits_and_a_cut_call_keeps_what_finished(tmp_path, monkeypatch):
    from flowgrpo.benchmarks import bench_gpu, gpu_objectives

    res = bench_gpu.run_bench_gpu(None, out_dir=tmp_path, device="cpu", tiny=True, quiet=True,
                                  stages=("memory", "objectives"), time_budget=1.0)
    for name in ("memory", "objectives"):
        assert res["stages"][name]["status"] == "skipped" and "time budget" in res["stages"][name]["error"]

    def killed(*a, **k):  # the device's time runs out during the objectives stage
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_gpu, "memory_stage", lambda *a, **k: {"measured_peak_gib": None})  # seconds, not a minute
    monkeypatch.setattr(gpu_objectives, "run_objectives_stage", killed)
    with pytest.raises(KeyboardInterrupt):
        bench_gpu.run_bench_gpu(None, out_dir=tmp_path, device="cpu", tiny=True, quiet=True,
                                stages=("memory", "objectives"))
    kept = json.loads((tmp_path / "gpu.json").read_text())
    assert kept["complete"] is False and kept["stages"]["memory"]["status"] == "ok"
    assert "objectives" not in kept["stages"]
    lines = [json.loads(x)["stage"] for x in (tmp_path / "gpu_stages.jsonl").read_text().splitlines()]
    assert lines == ["rollout_update", "levers", "flux", "wan", "memory"]
    # (d) of a point is left with the reason when stage memory's budget is spent before it
    from flowgrpo.benchmarks.gpu_points import fill_computed

    request = dict(recipe="sd35-medium", resolution=512, frames=None, micro_batch=4, rank=32, checkpointing=False)
    stages = {"levers": {"rows": [{"lever": "plain", "peak_gib": 9.0, "computed_for": request}]}}
    assert fill_computed(stages, -1.0, print) == [{"stage": "levers", "point": "plain", "peak_gib": 9.0,
                                                   "computed_gib": None, "peak_over_computed": None}]
    assert "not computed" in stages["levers"]["rows"][0]["computed_note"]


def test_dense_bf16_peaks_prefer_the_specific_name():
    from flowgrpo.benchmarks.gpu_flops import mfu, peak_bf16_tflops

    assert peak_bf16_tflops("NVIDIA H100 PCIe")[0] == 756.0 and peak_bf16_tflops("NVIDIA H100 80GB HBM3")[0] == 989.0
    assert peak_bf16_tflops("NVIDIA H200")[0] == 989.0 and peak_bf16_tflops("NVIDIA A100-SXM4-80GB")[0] == 312.0
    peak, why = peak_bf16_tflops("Some Future GPU")
    assert peak is None and "Some Future GPU" in why
    assert mfu(989e12, 2.0, 989.0) == pytest.approx(0.5) and mfu(1.0, 1.0, None) is None
