"""`flowgrpo bench gpu`: one command that measures what needs a GPU, each stage guarded.

Stages, in the order they run (the issue's figures first: a short budget cuts the tail):

* **rollout_update** (:mod:`flowgrpo.benchmarks.gpu_models`): an SD3.5-Medium-size random-weight
  SD3 in bf16 at 512 px, LoRA r = 32, CFG 4.5, T = 10 SDE steps, 1 prompt x 4 images: flowgrpo's
  trainer stages against Flow-GRPO's ``pipeline_with_logprob`` / ``sde_step_with_logprob`` from a
  checkout (``--flow-grpo PATH``) on the same weights: medians of rollout, update and iteration
  seconds (device synchronised), their ratios (reference / flowgrpo: above 1, flowgrpo is faster),
  the largest latent / log-prob differences of the same chains, and each side's model FLOPs
  utilisation (:mod:`flowgrpo.benchmarks.gpu_flops`).
* **levers** (:mod:`flowgrpo.benchmarks.gpu_levers`): the same flowgrpo run with each speed / memory
  switch alone and all together: medians, ratios to the plain run and to Flow-GRPO's row above,
  peaks; a switch the device cannot run is recorded as skipped with its one-line reason.
* **flux** and **wan** (:mod:`flowgrpo.benchmarks.gpu_sizes`): FLUX.1-dev size (12 B, 512 px, LoRA)
  against Flow-GRPO's FLUX code on the same weights; Wan 2.1 1.3B size at 33 frames (flowgrpo).
* **memory**: flowgrpo's peak of stage rollout_update against the per-GPU training state
  :func:`flowgrpo.realsize.memory.training_state` computes for ``sd35-medium``; then every point of
  the levers / size stages gets its computed figure and its measured peak over it
  (``peak_over_computed``, :func:`flowgrpo.benchmarks.gpu_points.fill_computed`).
* **objectives** (:mod:`flowgrpo.benchmarks.gpu_objectives`): each objective's preset trains a few
  iterations on the same model: whether it trained, seconds per iteration, peak memory.
* **ops** (:mod:`flowgrpo.benchmarks.gpu_ops`): the fused GRPO loss op built with its CUDA kernels,
  its test file run by pytest, and its achieved bandwidth against the device's peak.

Time plan of the GPU form on one H100 / H200 (``--time-budget``, default 470 s, keeps the whole call
under 8 minutes; planned from the model sizes, to be checked against the first device run):
rollout_update about 80 s (builds, the replay, 1 warm-up + 2 timed rounds of both sides); levers
about 125 s (each point: fresh build, 1 warm-up + 1 timed iteration; a compile's first iteration
longer); flux about 85 s (12 B built twice, 1 + 1 iterations a side); wan about 50 s; memory about
40 s (the computed figure of every levers / flux / wan point: a meta-device count per recipe and
switch set, after the timed stages so that it never delays them); objectives 40 s (presets not
started are listed); ops only with 120 s left (its CUDA build and 77 tests were measured on their
own before: it is usually skipped here, with the reason; ``--stages ops`` runs it in a second call).
A stage's budget is what the stages up to it were planned, less the time passed, never more than
leaves the later stages their minimum; a stage whose turn comes with less than its minimum left is
recorded as skipped with the reason. Builds and compilations are not cut.

``--stages`` picks stages (default all); a stage left out is recorded as skipped.

``--tiny --device cpu`` runs every line of the same path on tiny models on the CPU (the test suite's
form): CUDA-only measurements are recorded as None with the reason. A failing stage is recorded
(``status: failed``, the error and its traceback's tail) and the others still run.

Results are written as the stages finish, so a call cut short keeps what finished: after every stage
``gpu.json`` (device: name, torch / CUDA / driver versions, peaks; settings; every finished stage's
figures; ``complete`` false until the end) and ``gpu.csv`` (one row per figure: stage, name, value)
are rewritten and the stage is appended as one line to ``gpu_stages.jsonl``, all in ``--out``;
``--json`` gets the final result.
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

from . import output_dir, write_csv, write_json  # noqa: E402
from .gpu_report import flat_rows, print_tables, summary  # noqa: E402

ENV = "FLOWGRPO_REFERENCE"
#: the stages in the order they run
STAGES = ("rollout_update", "levers", "flux", "wan", "memory", "objectives", "ops")


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
    images); ``repeats``/``warmup``: timed / untimed interleaved rounds of rollout_update;
    ``op_dims``/``op_rows``/``op_repeats``/``op_impls``: the bandwidth measurement (latent elements
    D, rows N); ``test_select``: pytest ``-k`` of the op tests (None: all); ``test_timeout_s``: their
    limit, cut to the stage's budget but never under ``min_test_timeout_s``;
    ``objectives_iterations``: iterations per preset; ``levers``: the levers stage's points
    (:data:`~flowgrpo.benchmarks.gpu_levers.LEVERS` names, ``all``, ``all-speed``) and
    ``lever_repeats`` timed iterations each after ``lever_warmup`` untimed ones; ``total_budget_s``: the whole command's target;
    ``shares_s``: each stage's planned seconds (a stage's budget is what the stages up to it were
    planned, less what has passed, never more than leaves the later stages their ``min_s``);
    ``min_s``: below this a stage is skipped. Builds and compilations are not cut."""

    size: str
    dtype: torch.dtype
    num_steps: int
    prompts: int
    group: int
    repeats: int
    warmup: int
    op_dims: tuple[int, ...]
    op_rows: int
    op_repeats: int
    op_impls: tuple[str, ...]
    test_select: str | None
    test_timeout_s: float
    levers: tuple[str, ...]
    lever_repeats: int = 1
    lever_warmup: int = 1
    objectives_iterations: int = 2
    total_budget_s: float = 470.0
    min_test_timeout_s: float = 60.0
    shares_s: dict = field(default_factory=lambda: dict(
        rollout_update=80.0, levers=125.0, flux=85.0, wan=50.0, memory=40.0, objectives=40.0, ops=120.0))
    min_s: dict = field(default_factory=lambda: dict(
        rollout_update=30.0, levers=30.0, flux=40.0, wan=30.0, memory=5.0, objectives=30.0, ops=120.0))


#: the GPU form (under 8 minutes on one H100 / H200) and the CPU form of the test suite
PLANS = {
    "full": GpuPlan("sd35-medium", torch.bfloat16, num_steps=10, prompts=1, group=4, repeats=2, warmup=1,
                    op_dims=(16 * 64 * 64, 16 * 128 * 128, 16 * 256 * 256), op_rows=64,
                    op_repeats=20, op_impls=("fused", "eager", "compiled"), test_select=None, test_timeout_s=240.0,
                    levers=("plain", "attention=native", "attention=flash", "compile=regional", "checkpointing",
                            "precompute_prompts", "all", "all-speed", "attention=flash-3", "attention=sage",
                            "attention=xformers", "attention=flex")),
    "tiny": GpuPlan("tiny", torch.float32, num_steps=3, prompts=1, group=2, repeats=1, warmup=1,
                    op_dims=(4096,), op_rows=8, op_repeats=3, op_impls=("fused", "eager"),
                    test_select="opcheck or (fp32_matches_float64_reference and mixed)", test_timeout_s=300.0,
                    levers=("plain", "attention=native", "attention=flash", "checkpointing", "all"), lever_warmup=0,
                    # the suite's CPU form on a loaded 2-core machine: no stage is cut (the op tests took over 60 s)
                    total_budget_s=7200.0, min_test_timeout_s=300.0,
                    shares_s=dict(rollout_update=600.0, levers=900.0, flux=600.0, wan=600.0, memory=300.0,
                                  objectives=600.0, ops=1200.0)),
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
                  quiet: bool = False, ops: bool = True, stages: tuple[str, ...] | None = None,
                  time_budget: float = 0.0) -> dict:
    """Run the stages (module docstring), writing gpu.json / gpu.csv / gpu_stages.jsonl as each
    finishes. Returns the JSON dict.

    ``device``: "cuda" / "cpu" (None: CUDA where available); ``tiny``: the CPU form's plan
    (:data:`PLANS`); ``flow_grpo``: a Flow-GRPO checkout (None: ``$FLOWGRPO_REFERENCE``, else the
    reference sides are left out); ``repeats``: timed rounds of rollout_update (0: the plan's);
    ``tests``: the folder holding ``test_ops.py``; ``stages``: the stages to run (None: all of
    :data:`STAGES`; the others are recorded as skipped; ``memory`` needs ``rollout_update``'s peak);
    ``ops=False`` leaves stage ops out as well; ``time_budget``: seconds for the whole call (0: the
    plan's ``total_budget_s``), stages that no longer fit are skipped with the reason."""
    from .gpu_setup import device_info

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
    plan = GpuPlan(**{**plan.__dict__, **({"repeats": repeats} if repeats else {}),
                      **({"total_budget_s": float(time_budget)} if time_budget else {})})
    out = output_dir(out_dir)
    (out / "gpu_stages.jsonl").write_text("")

    def log(msg: str) -> None:
        if not quiet:
            print(f"[bench gpu {time.perf_counter() - began:6.1f} s] {msg}", flush=True)

    info = device_info(dev)
    log(f"device {info.get('name')} (torch {info['torch']}, CUDA {info['torch_cuda']}, driver {info['driver']})")
    flow_grpo = flow_grpo or os.environ.get(ENV) or None
    result = {"device": info, "plan": {k: (str(v).split(".")[-1] if isinstance(v, torch.dtype) else v)
                                       for k, v in plan.__dict__.items()},
              "flow_grpo": flow_grpo, "stages": {}, "complete": False}
    runners = _stage_runners(plan, dev, info, flow_grpo, tests, out, result["stages"], log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STAGES:
            elapsed = time.perf_counter() - began
            later = sum(plan.min_s[n] for n in STAGES[STAGES.index(name) + 1:] if n in chosen)
            planned = sum(plan.shares_s[n] for n in STAGES[:STAGES.index(name) + 1] if n in chosen)
            budget = min(planned - elapsed, plan.total_budget_s - elapsed - later)
            if name not in chosen:
                stage = Stage(name, "skipped", 0.0, "left out (--stages / --no-ops)")
            elif plan.total_budget_s - elapsed < plan.min_s[name]:
                stage = Stage(name, "skipped", 0.0, f"time budget: {elapsed:.0f} s of {plan.total_budget_s:.0f} s "
                                                    f"spent, under the stage's {plan.min_s[name]:.0f} s left")
                log(f"stage {name}: skipped ({stage.error})")
            else:
                stage = _guarded(name, lambda: runners[name](max(plan.min_s[name], budget)), log)
            result["stages"][name] = stage.as_dict()
            _write_progress(out, result, began, name)
    result["complete"] = True
    _write_progress(out, result, began, None)
    write_json(json_path, result)
    if not quiet:
        print_tables(result)
    return result


def _write_progress(out: Path, result: dict, began: float, finished: str | None) -> None:
    """Rewrite gpu.json and gpu.csv with what has finished, append the finished stage to gpu_stages.jsonl."""
    import json

    result["total_s"] = time.perf_counter() - began
    result["summary"] = summary(result)
    write_json(out / "gpu.json", result)
    write_csv(out / "gpu.csv", flat_rows(result), ("stage", "name", "value"))
    if finished is not None:
        with (out / "gpu_stages.jsonl").open("a") as f:
            f.write(json.dumps({"stage": finished, **result["stages"][finished]}, default=str) + "\n")


def _stage_runners(plan: GpuPlan, dev: torch.device, info: dict, flow_grpo: str | None, tests, out: Path, done: dict,
                   log) -> dict:
    """Each stage as ``fn(budget_s) -> dict`` (``done``: the finished stages' dicts, read by later ones)."""
    from .bench_reference import _quiet_libraries
    from .gpu_setup import SIZES

    size = SIZES[plan.size]
    peak = info.get("peak_bf16_tflops")

    def models(budget: float) -> dict:
        from .gpu_models import run_models_stage
        from .reference_flow_grpo import load_reference

        _quiet_libraries()
        code = load_reference(flow_grpo) if flow_grpo else None
        res = run_models_stage(dev, plan.dtype, size, code, num_steps=plan.num_steps, prompts=plan.prompts,
                               group=plan.group, repeats=plan.repeats, warmup=plan.warmup, budget_s=budget, log=log)
        from .gpu_flops import point_flops
        from flowgrpo.realsize.configs import build_transformer
        from .gpu_setup import TINY_TRANSFORMER

        meta = build_transformer("sd35-medium", **(dict(TINY_TRANSFORMER, pooled_projection_dim=sum(size.clip_widths),
                                                        joint_attention_dim=size.t5_width) if plan.size == "tiny" else {}))
        for row in res["rows"]:
            row["flops"] = point_flops(type(meta).__name__, dict(meta.config), resolution=size.resolution, frames=1,
                                       text_tokens=size.clip_max_length + size.max_sequence_length,
                                       samples=plan.prompts * plan.group, num_steps=plan.num_steps, cfg=True, kl=True,
                                       seconds=row, peak_tflops=peak)
        return res

    def levers(budget: float) -> dict:
        from .bench_reference import REFERENCE
        from .gpu_levers import run_levers_stage

        _quiet_libraries()
        mod = done.get("rollout_update", {})
        ref = next((dict(r) for r in mod.get("rows", []) if r["side"] == REFERENCE), None)
        resident = (mod.get("memory_gib") or {}).get("flowgrpo_alone_start")
        if ref and ref.get("peak_gib") is not None and resident is not None:
            # its peak was taken with flowgrpo's model resident too (the sides alternate): that part is taken off
            ref["peak_gib"] -= resident
        return run_levers_stage(dev, plan.dtype, size, levers=plan.levers, num_steps=plan.num_steps,
                                prompts=plan.prompts, group=plan.group, warmup=plan.lever_warmup, repeats=plan.lever_repeats,
                                budget_s=budget, reference_row=ref, peak_tflops=peak, log=log)

    def sized(stage: str):
        def run(budget: float) -> dict:
            from .gpu_sizes import run_size_stage

            _quiet_libraries()
            return run_size_stage(stage, dev, plan.dtype, tiny=plan.size == "tiny", flow_grpo=flow_grpo,
                                  budget_s=budget, peak_tflops=peak, log=log)
        return run

    def objectives(budget: float) -> dict:
        from .gpu_objectives import run_objectives_stage

        _quiet_libraries()
        return run_objectives_stage(dev, plan.dtype, size, num_steps=plan.num_steps, prompts=plan.prompts,
                                    group=plan.group, iterations=plan.objectives_iterations, budget_s=budget, log=log)

    def ops(budget: float) -> dict:
        from .gpu_ops import run_ops_stage

        return run_ops_stage(dev, out, tests_dir=tests, select=plan.test_select, peak_gbps=info["peak_gbps"],
                             test_timeout=max(plan.min_test_timeout_s, min(plan.test_timeout_s, budget - 30.0)),
                             repeats=plan.op_repeats, dims=plan.op_dims, n=plan.op_rows, impls=plan.op_impls, log=log,
                             compile_within_s=max(30.0, budget - 80.0))  # compile only when the budget allows

    def memory(budget: float) -> dict:
        from .gpu_points import fill_computed

        began = time.perf_counter()
        models_stage = done.get("rollout_update") or {"status": "skipped"}
        res = memory_stage(Stage("rollout_update", models_stage["status"], data=models_stage), plan, dev)
        res["points"] = fill_computed(done, budget - (time.perf_counter() - began), log)
        return res

    return {"rollout_update": models, "levers": levers, "flux": sized("flux"), "wan": sized("wan"),
            "memory": memory, "objectives": objectives, "ops": ops}


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
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds for the whole call; stages that no longer fit are skipped (default: the plan's)")
    ap.add_argument("--stages", default=",".join(STAGES),
                    help=f"comma-separated stages to run, of {', '.join(STAGES)} (default: all)")
    a = ap.parse_args(argv)
    try:
        chosen = parse_stages(a.stages)
    except ValueError as exc:
        ap.error(f"--stages: {exc}")
    run_bench_gpu(a.json, out_dir=a.out, device=a.device, tiny=a.tiny, flow_grpo=a.flow_grpo, repeats=a.repeats,
                  tests=a.tests, ops=not a.no_ops, stages=chosen, time_budget=a.time_budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
