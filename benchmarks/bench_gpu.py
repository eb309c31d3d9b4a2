"""`flowgrpo bench gpu`: one command that measures what needs a GPU, each stage guarded.

* **(a) ops** (:mod:`flowgrpo.benchmarks.gpu_ops`): the fused GRPO loss op built with its CUDA
  kernels, its test file run by pytest (checks against ``grpo_loss_ref``, gradcheck,
  ``torch.library.opcheck``, on the CPU and on CUDA), and its achieved bandwidth (bench ops'
  measurement: 7 N D x 4 bytes per forward + backward / time) against the device's peak.
* **(b) rollout_update** (:mod:`flowgrpo.benchmarks.gpu_models`): an SD3.5-Medium-size random-weight
  SD3 in bf16 at 512 px, LoRA r = 32, CFG 4.5, T = 10 SDE steps, 1 prompt x 4 images: flowgrpo's
  trainer stages against Flow-GRPO's ``pipeline_with_logprob`` / ``sde_step_with_logprob`` from a
  checkout (``--flow-grpo PATH``) on the same weights: medians of rollout, update and iteration
  seconds (device synchronised), their ratios (reference / flowgrpo: above 1, flowgrpo is faster) and
  the largest latent / log-prob differences of the same chains.
* **(c) memory**: flowgrpo's peak ``torch.cuda.max_memory_allocated`` of one iteration with nothing
  else on the device, against the per-GPU training state :func:`flowgrpo.realsize.memory.training_state`
  computes for ``sd35-medium`` (weights, LoRA, gradients, AdamW; the rest of the peak is activations
  and the text encoders / VAE).
* **(d) objectives** (:mod:`flowgrpo.benchmarks.gpu_objectives`): each objective's preset (flow-grpo,
  flow-dppo, diffusion-dpo, diffusion-nft, awm, dgpo) trains a few full iterations on the same model
  and rollout: whether it trained (finite loss, LoRA moved, base weights unchanged), seconds per
  iteration and peak memory.

``--stages`` picks stages (default all); a stage left out is recorded as skipped.

``--tiny --device cpu`` runs every line of the same path on a tiny SD3 on the CPU (the test suite's
form): CUDA-only measurements are recorded as None with the reason. A failing stage is recorded
(``status: failed``, the error and its traceback's tail) and the others still run.

Writes ``gpu.json`` (device: name, torch / CUDA / driver versions; settings; every stage's figures)
and ``gpu.csv`` (one row per figure: stage, name, value) into ``--out``, and ``--json`` if given.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from . import number_or_dash as _f  # noqa: E402
from . import output_dir, print_table, write_csv, write_json  # noqa: E402

ENV = "FLOWGRPO_REFERENCE"
#: the stages in the order they run
STAGES = ("ops", "rollout_update", "memory", "objectives")


def parse_stages(stages: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Stage names from ``"ops,objectives"`` or a sequence; a ValueError naming the unknown ones and
    the valid ones otherwise."""
    names = tuple(x.strip() for x in (stages.split(",") if isinstance(stages, str) else stages) if x.strip())
    unknown = sorted(set(names) - set(STAGES))
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; valid: {', '.join(STAGES)}")
    return names


@dataclass(frozen=True)
class GpuPlan:
    """What one run measures. ``size``: a :data:`~flowgrpo.benchmarks.gpu_setup.SIZES` key; ``dtype``:
    the model dtype; ``num_steps``, ``prompts``, ``group``: T and the rollout batch (prompts x group
    images); ``repeats``/``warmup``: timed / untimed interleaved rounds; ``models_budget_s``: timed
    rounds stop starting after it; ``op_dims``/``op_rows``/``op_repeats``/``op_impls``: the bandwidth
    measurement (latent elements D, rows N); ``test_select``: pytest ``-k`` of the op tests (None: all);
    ``test_timeout_s``: their limit, cut to keep the later stages' time but never under
    ``min_test_timeout_s``; ``objectives_iterations``/``objectives_budget_s``: stage (d)'s
    iterations per preset and the time after which it starts no further preset;
    ``total_budget_s``: the whole command's target (the op tests' limit
    and the timed rounds are cut to keep to it; builds and compilations are not)."""

    size: str
    dtype: torch.dtype
    num_steps: int
    prompts: int
    group: int
    repeats: int
    warmup: int
    models_budget_s: float
    op_dims: tuple[int, ...]
    op_rows: int
    op_repeats: int
    op_impls: tuple[str, ...]
    test_select: str | None
    test_timeout_s: float
    objectives_iterations: int = 2
    objectives_budget_s: float = 240.0
    total_budget_s: float = 450.0
    min_test_timeout_s: float = 60.0


#: the GPU form (about 8 minutes on one H100 at most) and the CPU form of the test suite
PLANS = {
    "full": GpuPlan("sd35-medium", torch.bfloat16, num_steps=10, prompts=1, group=4, repeats=3, warmup=1,
                    models_budget_s=200.0, op_dims=(16 * 64 * 64, 16 * 128 * 128, 16 * 256 * 256), op_rows=64,
                    op_repeats=20, op_impls=("fused", "eager", "compiled"), test_select=None, test_timeout_s=240.0,
                    total_budget_s=690.0),
    "tiny": GpuPlan("tiny", torch.float32, num_steps=3, prompts=1, group=2, repeats=1, warmup=1, models_budget_s=60.0,
                    op_dims=(4096,), op_rows=8, op_repeats=3, op_impls=("fused", "eager"),
                    test_select="opcheck or (fp32_matches_float64_reference and mixed)", test_timeout_s=300.0,
                    # the suite's CPU form: on a loaded 2-core machine the op tests took over 60 s
                    objectives_budget_s=120.0, min_test_timeout_s=300.0),
}


@dataclass
class Stage:
    """One stage's outcome: status "ok" | "failed" | "skipped", its seconds, the error (or skip
    reason) and its figures (``data``)."""

    name: str
    status: str = "ok"
    seconds: float = 0.0
    error: str | None = None
    data: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"status": self.status, "seconds": self.seconds, "error": self.error, **self.data}


def _guarded(name: str, fn, log) -> Stage:
    """Run ``fn()`` (returning the stage's dict) as stage ``name``; an exception marks it failed."""
    stage = Stage(name)
    t0 = time.perf_counter()
    log(f"stage {name}: start")
    try:
        stage.data = fn()
        stage.status = stage.data.pop("status", "ok")  # a stage may fail without raising (its checks failed)
        stage.error = stage.data.pop("error", None)
    except Exception as exc:
        stage.status, stage.error = "failed", f"{type(exc).__name__}: {exc}"
        stage.data = {"traceback": traceback.format_exc()[-3000:]}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    stage.seconds = time.perf_counter() - t0
    log(f"stage {name}: {stage.status} in {stage.seconds:.1f} s" + (f" ({stage.error})" if stage.error else ""))
    return stage


def memory_stage(models: Stage, plan: GpuPlan, device: torch.device) -> dict:
    """(c): flowgrpo's measured peak against the training state computed for ``sd35-medium`` (bf16,
    LoRA r = 32, no EMA, 1 GPU) and the activations of one training forward of the full plan's
    micro-batch (``P x G`` transitions at 512 px, 77 + 128 text tokens; no checkpointing)."""
    from flowgrpo.realsize.activations import Geometry, activation_bytes
    from flowgrpo.realsize.memory import GIB, training_state

    from .gpu_setup import SIZES

    state = training_state("sd35-medium", gpus_list=(1,), rank=32, dtype=torch.bfloat16, ema=False)
    per_gpu = state.per_gpu["1 GPU"]
    full, medium = PLANS["full"], SIZES["sd35-medium"]
    geo = Geometry(resolution=medium.resolution, text_tokens=medium.clip_max_length + medium.max_sequence_length,
                   batch=full.prompts * full.group)
    activations = activation_bytes("sd35-medium", geo, rank=32, dtype=torch.bfloat16).no_checkpointing
    out = {"estimate_recipe": "sd35-medium", "estimate_gib": {k: v / GIB for k, v in per_gpu.items()},
           "estimate_activations_gib": activations / GIB, "estimate_geometry": geo.__dict__,
           "estimate_with_activations_gib": (per_gpu["total"] + activations) / GIB,
           "estimate_transformer_params": state.transformer_params, "estimate_lora_params": state.lora_params}
    measured = models.data.get("memory_gib", {}).get("flowgrpo_alone_peak") if models.status == "ok" else None
    out["measured_peak_gib"] = measured
    if measured is None:
        out["measured"] = ("no CUDA device: torch.cuda.max_memory_allocated is CUDA only" if device.type != "cuda"
                           else f"no measurement: stage rollout_update {models.status}")
        return out
    total = per_gpu["total"] / GIB
    out.update(peak_over_estimate=measured / total, activations_and_rest_gib=measured - total,
               peak_over_estimate_with_activations=measured / out["estimate_with_activations_gib"],
               resident_after_build_gib=models.data["model"]["resident_gib"])
    if plan.size != "sd35-medium":
        out["note"] = f"the measured model is {plan.size}, the estimate sd35-medium's: not comparable"
    return out


def run_bench_gpu(json_path=None, *, out_dir=None, device: str | None = None, tiny: bool = False,
                  flow_grpo: str | None = None, repeats: int = 0, tests: str | Path = "tests",
                  quiet: bool = False, ops: bool = True, stages: tuple[str, ...] | None = None) -> dict:
    """Run stages (a)-(d) (module docstring) and write gpu.json / gpu.csv. Returns the JSON dict.

    ``device``: "cuda" / "cpu" (None: CUDA where available); ``tiny``: the CPU form's plan
    (:data:`PLANS`); ``flow_grpo``: a Flow-GRPO checkout (None: ``$FLOWGRPO_REFERENCE``, else the
    reference side is left out); ``repeats``: timed rounds of (b) (0: the plan's); ``tests``: the
    folder holding ``test_ops.py``; ``stages``: the stages to run (None: all of :data:`STAGES`; the
    others are recorded as skipped; ``memory`` needs ``rollout_update``'s peak); ``ops=False`` leaves
    stage (a) out as well, for a second call on a lent device whose time is short."""
    from .gpu_setup import SIZES, device_info

    chosen = set(STAGES if stages is None else parse_stages(stages))
    if not ops:
        chosen.discard("ops")

    began = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    if dev.type == "cpu" and torch.cuda.is_available():
        raise RuntimeError("--device cpu on a machine with a GPU: hide it (CUDA_VISIBLE_DEVICES=) so the trainer runs on the CPU")
    plan = PLANS["tiny" if tiny else "full"]
    if repeats:
        plan = GpuPlan(**{**plan.__dict__, "repeats": repeats})
    out = output_dir(out_dir)

    def log(msg: str) -> None:
        if not quiet:
            print(f"[bench gpu {time.perf_counter() - began:6.1f} s] {msg}", flush=True)

    info = device_info(dev)
    log(f"device {info.get('name')} (torch {info['torch']}, CUDA {info['torch_cuda']}, driver {info['driver']})")
    flow_grpo = flow_grpo or os.environ.get(ENV) or None
    stages: dict[str, Stage] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from .gpu_ops import run_ops_stage
        from .gpu_models import run_models_stage

        def left() -> float:  # seconds left of the whole command's budget
            return plan.total_budget_s - (time.perf_counter() - began)

        def skipped(name: str) -> Stage:
            return Stage(name, "skipped", 0.0, "left out (--stages / --no-ops)")

        # seconds kept for the stages after the op tests: (b) + (c) about 4 minutes, (d) its budget
        later = (240.0 if "rollout_update" in chosen else 0.0) + (
            plan.objectives_budget_s + 60.0 if "objectives" in chosen else 0.0)
        stages["ops"] = skipped("ops") if "ops" not in chosen else _guarded("ops", lambda: run_ops_stage(
            dev, out, tests_dir=tests, select=plan.test_select, peak_gbps=info["peak_gbps"],
            test_timeout=max(plan.min_test_timeout_s, min(plan.test_timeout_s, left() - later)),
            repeats=plan.op_repeats, dims=plan.op_dims, n=plan.op_rows, impls=plan.op_impls, log=log,
            compile_within_s=max(30.0, left() - later - 80.0)), log)  # compile only when the later stages keep their time

        def models():
            from .bench_reference import _quiet_libraries
            from .reference_flow_grpo import load_reference

            _quiet_libraries()
            code = load_reference(flow_grpo) if flow_grpo else None
            keep = plan.objectives_budget_s + 60.0 if "objectives" in chosen else 30.0
            return run_models_stage(dev, plan.dtype, SIZES[plan.size], code, num_steps=plan.num_steps,
                                    prompts=plan.prompts, group=plan.group, repeats=plan.repeats,
                                    warmup=plan.warmup, budget_s=max(30.0, min(plan.models_budget_s, left() - keep)),
                                    log=log)

        def objectives():
            from .bench_reference import _quiet_libraries
            from .gpu_objectives import run_objectives_stage

            _quiet_libraries()
            return run_objectives_stage(dev, plan.dtype, SIZES[plan.size], num_steps=plan.num_steps,
                                        prompts=plan.prompts, group=plan.group,
                                        iterations=plan.objectives_iterations,
                                        budget_s=max(30.0, min(plan.objectives_budget_s, left())), log=log)

        stages["rollout_update"] = _guarded("rollout_update", models, log) if "rollout_update" in chosen else skipped("rollout_update")
        stages["memory"] = (_guarded("memory", lambda: memory_stage(stages["rollout_update"], plan, dev), log)
                            if "memory" in chosen else skipped("memory"))
        stages["objectives"] = _guarded("objectives", objectives, log) if "objectives" in chosen else skipped("objectives")
    result = {"device": info, "plan": {k: (str(v).split(".")[-1] if isinstance(v, torch.dtype) else v)
                                       for k, v in plan.__dict__.items()},
              "flow_grpo": flow_grpo, "stages": {name: st.as_dict() for name, st in stages.items()},
              "total_s": time.perf_counter() - began}
    result["summary"] = summary(result)
    write_json(out / "gpu.json", result)
    write_json(json_path, result)
    write_csv(out / "gpu.csv", flat_rows(result), ("stage", "name", "value"))
    if not quiet:
        print_tables(result)
    return result


def summary(result: dict) -> dict:
    """The headline figures (None where a stage did not produce them)."""
    st = result["stages"]
    ops, mod, mem = st["ops"], st["rollout_update"], st["memory"]
    bw = ops.get("bandwidth", {})
    fused = [r for r in bw.get("rows", []) if r["impl"] == "fused"]
    tests = ops.get("tests", {})
    rows = {r["side"]: r for r in mod.get("rows", [])}
    obj = st.get("objectives", {})
    return {"stages_failed": [n for n, s in st.items() if s["status"] == "failed"],
            "stages_skipped": [n for n, s in st.items() if s["status"] == "skipped"],
            "objectives_trained": [r["preset"] for r in obj.get("rows", []) if r.get("trained")],
            "objectives_not_trained": [r["preset"] for r in obj.get("rows", []) if not r.get("trained")],
            "op_tests_passed": tests.get("passed"), "op_tests_failed": tests.get("failed"),
            "op_cuda_kernels": ops.get("build", {}).get("cuda_kernels"),
            "fused_gbps_largest_d": fused[-1]["gbps"] if fused else None,
            "fused_pct_of_peak_largest_d": fused[-1].get("pct_of_peak") if fused else None,
            "rollout_ratio": mod.get("rollout_ratio"), "update_ratio": mod.get("update_ratio"),
            "iteration_ratio": mod.get("iteration_ratio"),
            "flowgrpo_iteration_s": rows.get("flowgrpo", {}).get("iteration_s"),
            "max_latent_diff": mod.get("max_latent_diff"), "max_logprob_diff": mod.get("max_logprob_diff"),
            "flowgrpo_peak_gib": mem.get("measured_peak_gib"),
            "estimate_state_gib": (mem.get("estimate_gib") or {}).get("total")}


def flat_rows(result: dict) -> list[dict]:
    """Every number and string of the stages as (stage, dotted name, value) rows for the CSV."""
    rows = []

    def walk(stage: str, prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(stage, f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for i, v in enumerate(value):
                key = (v["side"] if "side" in v else f"{v['impl']}@{v['D']}" if "impl" in v
                       else v["preset"] if "preset" in v else str(i))
                walk(stage, f"{prefix}[{key}]", v)
        elif prefix != "traceback" and not prefix.endswith("output_tail"):
            rows.append({"stage": stage, "name": prefix, "value": value})

    walk("device", "", result["device"])
    for name, st in result["stages"].items():
        walk(name, "", st)
    walk("summary", "", result["summary"])
    return rows


def print_tables(result: dict) -> None:
    dev, st = result["device"], result["stages"]
    title = f"bench gpu on {dev.get('name')} (torch {dev['torch']}, CUDA {dev['torch_cuda']}, driver {dev['driver']})"
    print_table(("stage", "status", "seconds", "error"),
                [[n, s["status"], f"{s['seconds']:.1f}", (s["error"] or "")[:90]] for n, s in st.items()],
                title=title, caption=f"total {result['total_s']:.1f} s")
    bw = st["ops"].get("bandwidth")
    if bw:
        tests = st["ops"].get("tests", {})
        print_table(("impl", "D", "ms", "GB/s", "% peak", "% copy"),
                    [[r["impl"], str(r["D"]), f"{1e3 * r['seconds']:.3f}", f"{r['gbps']:.1f}",
                      _f(r["pct_of_peak"], "{:.0f}%"), f"{r['pct_of_copy']:.0f}%"] for r in bw["rows"]],
                    title=f"(a) GRPO loss fwd+bwd, N={bw['N']}: peak {_f(bw['peak_gbps'], '{:.0f}')} GB/s, "
                          f"copy {bw['copy_gbps']:.1f} GB/s",
                    caption=f"op tests: {tests.get('passed')} passed, {tests.get('failed')} failed, "
                            f"{tests.get('skipped')} skipped; CUDA kernels: {st['ops'].get('build', {}).get('cuda_kernels')}")
    mod = st["rollout_update"]
    if mod.get("rows"):
        print_table(("side", "rollout s", "update s", "iteration s", "x rollout", "x update", "x iteration", "peak GiB"),
                    [[r["side"], f"{r['rollout_s']:.3f}", f"{r['update_s']:.3f}", f"{r['iteration_s']:.3f}",
                      f"{r['rollout_ratio']:.2f}", f"{r['update_ratio']:.2f}", f"{r['iteration_ratio']:.2f}",
                      _f(r.get("peak_gib"), "{:.2f}")] for r in mod["rows"]],
                    title=f"(b) {mod['settings']['model']} {mod['settings']['dtype']}, {mod['settings']['resolution']} px, "
                          f"T={mod['settings']['num_steps']}, {mod['settings']['prompts']}x{mod['settings']['group']} images",
                    caption=f"median of {mod['rounds_timed']} interleaved rounds; ratio = reference / side; "
                            f"max |latent diff| {_f(mod.get('max_latent_diff'), '{:.1e}')}, "
                            f"max |log-prob diff| {_f(mod.get('max_logprob_diff'), '{:.1e}')}")
    mem = st["memory"]
    if mem.get("estimate_gib"):
        print_table(("figure", "GiB"),
                    [["flowgrpo peak, alone (measured)", _f(mem.get("measured_peak_gib"), "{:.2f}")],
                     *[[f"estimate: {k}", f"{v:.2f}"] for k, v in mem["estimate_gib"].items()],
                     ["estimate: activations (one forward, no checkpointing)", f"{mem['estimate_activations_gib']:.2f}"],
                     ["estimate: total with activations", f"{mem['estimate_with_activations_gib']:.2f}"]],
                    title="(c) peak memory against the computed per-GPU training state (sd35-medium, 1 GPU)",
                    caption=mem.get("measured") if isinstance(mem.get("measured"), str) else
                    f"peak / state estimate {_f(mem.get('peak_over_estimate'), '{:.2f}')}, peak / estimate with "
                    f"activations {_f(mem.get('peak_over_estimate_with_activations'), '{:.2f}')}")
    from .gpu_objectives import print_objectives_table

    print_objectives_table(st.get("objectives", {}))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowgrpo.benchmarks.bench_gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder of gpu.json / gpu.csv (default: the current directory)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default=None, choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="the tiny SD3 and small op sizes (the CPU test's form)")
    ap.add_argument("--flow-grpo", default=None, metavar="PATH")
    ap.add_argument("--repeats", type=int, default=0)
    ap.add_argument("--tests", default="tests", help="folder holding test_ops.py (default: ./tests)")
    ap.add_argument("--no-ops", action="store_true", help="leave stage (a), the op build and tests, out")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma-separated stages to run, of {', '.join(STAGES)} (default: all)")
    a = ap.parse_args(argv)
    try:
        chosen = parse_stages(a.stages)
    except ValueError as exc:
        ap.error(f"--stages: {exc}")
    run_bench_gpu(a.json, out_dir=a.out, device=a.device, tiny=a.tiny, flow_grpo=a.flow_grpo, repeats=a.repeats,
                  tests=a.tests, ops=not a.no_ops, stages=chosen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
