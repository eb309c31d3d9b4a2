"""Stage ``levers`` of ``flowgrpo bench gpu``: each speed / memory switch alone and all together on SD3.5-Medium.

Every point is the rollout_update stage's flowgrpo run (SD3.5-Medium-size random weights, bf16,
512 px, LoRA r = 32, CFG 4.5, T = 10, 1 prompt x 4 images) with config overrides (:data:`LEVERS`):

* ``plain``: the defaults (diffusers' SDPA processors, eager, no checkpointing);
* ``attention=<backend>``: ``model.attention_backend`` native | flash | flash-3 | sage | xformers | flex;
* ``compile=regional``: ``model.compile_transformer=regional`` (its first iteration holds the compile);
* ``checkpointing``: ``model.gradient_checkpointing=true``;
* ``precompute_prompts``: ``model.precompute_prompts=true`` (text encoders freed after one encoding);
* ``all``: every lever that ran, with the fastest attention backend measured (checkpointing
  included: the lowest-memory configuration); ``all-speed``: the same without checkpointing.

A lever the device or the installed packages cannot run (flash on the CPU, xformers not installed)
stops the trainer's construction with a one-line error: the point is recorded ``skipped`` with that
line, not failed. Each point builds its own components (same seed: same weights) and runs alone on
the device. Rows give medians, the first iteration's seconds, the peak, the ratios to ``plain`` and
to Flow-GRPO's code (its row from the rollout_update stage, same model and settings, when a checkout
was given), (d) the computed per-GPU figure and (e) the model FLOPs utilisation
(:mod:`flowgrpo.benchmarks.gpu_points`). Points stop starting once the stage's budget is spent; the
rest are recorded ``skipped`` with that reason.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from .bench_reference import settings_for
from .gpu_points import annotate, flowgrpo_side, forecast_memory, free_device, measure_side, over_forecast, ratios
from .gpu_setup import ModelSize, build_components

#: the compile backend of the CPU form (no C++ toolchain needed, seconds instead of minutes), unless
#: $FLOWGRPO_COMPILE_BACKEND names one
CPU_COMPILE_BACKEND = "aot_eager"


@dataclass(frozen=True)
class Lever:
    """One point: ``name``, its config ``overrides`` and what it does (``what``)."""

    name: str
    overrides: tuple[str, ...]
    what: str


#: the single levers in the order they run (the most telling first: a short budget cuts the tail)
LEVERS = (
    Lever("plain", (), "defaults: diffusers' SDPA processors, eager, no checkpointing"),
    Lever("attention=native", ("model.attention_backend=native",), "PyTorch SDPA through diffusers' dispatcher"),
    Lever("attention=flash", ("model.attention_backend=flash",), "flash-attn 2"),
    Lever("compile=regional", ("model.compile_transformer=regional",), "torch.compile of each repeated block"),
    Lever("checkpointing", ("model.gradient_checkpointing=true",), "blocks recomputed in the backward pass"),
    Lever("precompute_prompts", ("model.precompute_prompts=true",), "prompts encoded once, text encoders freed"),
    Lever("attention=flash-3", ("model.attention_backend=flash-3",), "FlashAttention 3 (Hopper)"),
    Lever("attention=sage", ("model.attention_backend=sage",), "SageAttention"),
    Lever("attention=xformers", ("model.attention_backend=xformers",), "xformers memory-efficient attention"),
    Lever("attention=flex", ("model.attention_backend=flex",), "PyTorch FlexAttention (eager)"),
)
#: the combinations, run after the single levers named in a plan
COMBINED = ("all", "all-speed")


def combined_lever(name: str, rows: list[dict]) -> Lever | str:
    """``all`` / ``all-speed`` from the single levers' ``rows`` (those with status ok): the fastest
    attention backend, and every other lever that ran (``all-speed``: not checkpointing). A string
    (the reason) when no single lever besides ``plain`` ran."""
    ok = [r for r in rows if r["status"] == "ok" and r["lever"] != "plain"]
    attention = [r for r in ok if r["lever"].startswith("attention=")]
    best = min(attention, key=lambda r: r["iteration_s"]) if attention else None
    others = [r for r in ok if not r["lever"].startswith("attention=")
              and not (name == "all-speed" and r["lever"] == "checkpointing")]
    parts = ([best] if best else []) + others
    if not parts:
        return "no single lever besides plain ran"
    overrides = tuple(o for r in parts for o in r["overrides"])
    return Lever(name, overrides, " + ".join(r["lever"] for r in parts))


def run_levers_stage(device: torch.device, dtype: torch.dtype, size: ModelSize, *, levers: tuple[str, ...],
                     num_steps: int, prompts: int, group: int, warmup: int, repeats: int, budget_s: float,
                     reference_row: dict | None, peak_tflops: float | None, log) -> dict:
    """Run the points named in ``levers`` (:data:`LEVERS` names and :data:`COMBINED`), module
    docstring. ``reference_row``: Flow-GRPO's row of the rollout_update stage (None: no ratios to it).
    Returns {"settings", "rows": one per lever (status ok | skipped | failed, reason, medians, ratios,
    peak, (d), (e))}."""
    began = time.perf_counter()
    by_name = {lv.name: lv for lv in LEVERS}
    unknown = [n for n in levers if n not in by_name and n not in COMBINED]
    if unknown:
        raise ValueError(f"unknown lever(s) {', '.join(unknown)}; valid: {', '.join([*by_name, *COMBINED])}")
    s = dataclasses.replace(settings_for(num_steps, size.resolution), max_sequence_length=size.max_sequence_length)
    name = str(dtype).split(".")[-1]
    base = [f"model.dtype={name}", f"train.micro_batch={prompts * group}", "log.trackers=[]"]
    result: dict = {"settings": {"model": size.name, "dtype": name, "resolution": size.resolution,
                                 "num_steps": num_steps, "prompts": prompts, "group": group, "warmup": warmup,
                                 "repeats": repeats, "levers": list(levers)},
                    "reference": "Flow-GRPO's row of stage rollout_update" if reference_row else
                    "left out: no Flow-GRPO row (no checkout, or stage rollout_update did not run)"}
    from flowgrpo.policies.diffusers.switches import COMPILE_BACKEND_ENV

    saved = os.environ.get(COMPILE_BACKEND_ENV)
    if device.type == "cpu" and not saved:
        os.environ[COMPILE_BACKEND_ENV] = CPU_COMPILE_BACKEND
    result["settings"]["compile_backend"] = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
    try:
        result["rows"] = _run_points(device, dtype, size, s, levers, base, prompts, group, warmup, repeats, began,
                                     budget_s, reference_row, peak_tflops, log)
    finally:
        if saved is None:
            os.environ.pop(COMPILE_BACKEND_ENV, None)
    return result


def _run_points(device, dtype, size, s, levers, base, prompts, group, warmup, repeats, began, budget_s,
                reference_row, peak_tflops, log) -> list[dict]:
    """The points of :func:`run_levers_stage`, one row each."""
    by_name = {lv.name: lv for lv in LEVERS}
    rows: list[dict] = []
    plain = None
    for lever_name in levers:
        lever = by_name.get(lever_name) or combined_lever(lever_name, rows)
        row = {"lever": lever_name, "status": "ok", "reason": None,
               "overrides": list(lever.overrides) if isinstance(lever, Lever) else [],
               "what": lever.what if isinstance(lever, Lever) else None}
        rows.append(row)
        if isinstance(lever, str):
            row.update(status="skipped", reason=lever)
            continue
        spent = time.perf_counter() - began
        if rows[:-1] and spent > budget_s:
            row.update(status="skipped", reason=f"time budget: {spent:.0f} s of the stage's {budget_s:.0f} s spent")
            continue
        try:
            row.update(_run_point(device, dtype, size, s, lever, base, prompts, group, warmup, repeats,
                                  budget_s=max(1.0, (budget_s - spent) / 2), log=log))
        except Exception as exc:  # a lever the device cannot run is refused in one line by the trainer
            from flowgrpo.errors import UserError

            kind = "skipped" if isinstance(exc, UserError) else "failed"
            row.update(status=kind, reason=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            log(f"levers {lever_name}: {kind} ({row['reason']})")
        free_device(device)
        if row["status"] != "ok":
            continue
        plain = row if lever_name == "plain" else plain
        checkpointing = any(o == "model.gradient_checkpointing=true" for o in lever.overrides)
        computed = ("tiny model: the computed figures are for the published sizes (run without --tiny)"
                    if size.name != "sd35-medium" else
                    dict(recipe="sd35-medium", resolution=size.resolution, frames=None, micro_batch=prompts * group,
                         rank=32, checkpointing=checkpointing,
                         precompute_prompts="model.precompute_prompts=true" in lever.overrides))
        annotate(row, flops=dict(cls=row.pop("class"), config=row.pop("config"), resolution=size.resolution,
                                 frames=1, text_tokens=size.clip_max_length + size.max_sequence_length,
                                 samples=prompts * group, num_steps=s.num_steps, cfg=True, kl=s.beta > 0,
                                 peak_tflops=peak_tflops), computed=computed)
    for row in rows:
        if row["status"] == "ok":
            row["vs_plain"] = ratios(row, plain)
            row["vs_flow_grpo"] = ratios(row, reference_row)
    return rows


def _run_point(device, dtype, size, s, lever: Lever, base: list[str], prompts: int, group: int, warmup: int,
               repeats: int, budget_s: float, log) -> dict:
    """Build fresh components, the trainer with ``lever``'s overrides, and time it (:func:`measure_side`)."""
    from .gpu_setup import synchronize

    log(f"levers {lever.name}: building ({' '.join(lever.overrides) or 'defaults'})")
    t0 = time.perf_counter()
    components = build_components(size, device, dtype)
    transformer = components["transformer"]
    info = {"class": type(transformer).__name__, "config": dict(transformer.config)}
    del transformer
    with flowgrpo_side(components, "sd3", s, prompts, group, [*base, *lever.overrides]) as side:
        del components
        synchronize(device)
        info["build_s"] = time.perf_counter() - t0
        info.update(forecast_memory(side.trainer, device))
        info.update(measure_side(side, device, prompts, group, warmup=warmup, repeats=repeats, budget_s=budget_s,
                                 log=log, label=f"levers {lever.name}"))
    info.update(over_forecast(info))
    return info
