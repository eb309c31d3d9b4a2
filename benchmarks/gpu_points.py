"""One measured point of ``bench gpu``'s levers and size stages: time a side, its peak, and what to compare.

A *point* is one configuration of one model (a lever on SD3.5-Medium, FLUX.1-dev at 512 px, Wan 2.1
1.3B at 33 frames) run as the trainer runs it. For each point:

* :func:`measure_side`: ``warmup`` untimed then up to ``repeats`` timed iterations (rollout and
  update timed between device synchronisations, medians; the first iteration's seconds kept: a
  compiled lever's compile is in it) and the largest ``torch.cuda.max_memory_allocated`` of them;
* :func:`computed_memory`: the per-GPU figure flowgrpo's memory model computes for the point's recipe
  and geometry (:func:`flowgrpo.realsize.table.memory_row`: weights, LoRA, gradients, AdamW and one
  training forward's activations, with or without checkpointing as the point runs), and the measured
  peak over it;
* the model FLOPs of the point's rollout and update and their utilisation
  (:func:`flowgrpo.benchmarks.gpu_flops.point_flops`).

Points run one after another with nothing else of the bench on the device, so each peak is the
point's own.
"""

from __future__ import annotations

import functools
import gc
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from .bench_reference import PROMPTS, FlowgrpoSide, _rewards
from .gpu_models import GIB, Memory, _timed_iteration
from .gpu_setup import registered_components


def free_device(device: torch.device) -> None:
    """Collect garbage and return the CUDA cache, so the next point starts from what is resident."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_side(side, device: torch.device, prompts: int, group: int, *, warmup: int, repeats: int,
                 budget_s: float, log, label: str) -> dict:
    """Time ``side`` (a :class:`~flowgrpo.benchmarks.bench_reference.FlowgrpoSide` or a reference side):
    ``warmup`` + up to ``repeats`` iterations, no timed one started after ``budget_s`` seconds (one at
    least). Returns medians ``rollout_s``, ``update_s``, ``iteration_s``, ``rounds`` timed,
    ``first_iteration_s`` and the peak / transient GiB over the timed ones (None on the CPU)."""
    began = time.perf_counter()
    memory = Memory(device)
    batch = list(PROMPTS[:prompts])
    times, peaks, first = [], [], None
    for r in range(warmup + repeats):
        if r > warmup and time.perf_counter() - began > budget_s:
            log(f"{label}: budget {budget_s:.0f} s spent after {len(times)} timed iteration(s)")
            break
        roll, upd, peak, start = _timed_iteration(side, device, batch, _rewards(r + 2, prompts * group), r + 2, memory)
        first = roll + upd if first is None else first
        log(f"{label}: iteration {r} ({'timed' if r >= warmup else 'warm-up'}): rollout {roll:.3f} s, update "
            f"{upd:.3f} s" + (f", peak {peak:.2f} GiB" if peak is not None else ""))
        if r >= warmup:
            times.append((roll, upd))
            if peak is not None:
                peaks.append((peak, start))
    return {"rollout_s": statistics.median(t[0] for t in times), "update_s": statistics.median(t[1] for t in times),
            "iteration_s": statistics.median(a + b for a, b in times), "rounds": len(times), "first_iteration_s": first,
            "peak_gib": max((p for p, _ in peaks), default=None),
            "transient_gib": max((p - s for p, s in peaks), default=None)}


@contextmanager
def flowgrpo_side(components: dict, policy: str, settings, prompts: int, group: int, overrides: list[str]):
    """flowgrpo's trainer (:class:`FlowgrpoSide`) on ``components`` through the bench adapter ``policy``,
    with the shared ``settings`` and ``overrides`` (the prompts file lives as long as the block)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.txt"
        prompts_file.write_text("\n".join(PROMPTS) + "\n")
        with registered_components(components, policy) as model:
            side = FlowgrpoSide(settings, prompts, group, str(prompts_file), overrides, model=model)
        yield side


def ratios(row: dict, base: dict | None) -> dict | None:
    """``base`` seconds over ``row``'s for rollout, update and iteration (above 1: ``row`` is faster),
    and ``row``'s peak over ``base``'s; None without a base."""
    if not base or base.get("iteration_s") is None or row.get("iteration_s") is None:
        return None
    out = {f"{k}": base[f"{k}_s"] / row[f"{k}_s"] for k in ("rollout", "update", "iteration")}
    out["peak"] = row["peak_gib"] / base["peak_gib"] if row.get("peak_gib") and base.get("peak_gib") else None
    return out


@functools.lru_cache(maxsize=16)
def _memory_row(recipe: str, resolution: int, frames: int | None, micro_batch: int, rank: int,
                precompute_prompts: bool) -> dict:
    from flowgrpo.realsize.table import memory_row

    switches = {"precompute_prompts": True} if precompute_prompts else {}
    return memory_row(recipe, gpus=1, resolution=resolution, frames=frames, micro_batch=micro_batch, rank=rank,
                      **switches)


def computed_memory(recipe: str, *, resolution: int, frames: int | None, micro_batch: int, rank: int,
                    checkpointing: bool, precompute_prompts: bool = False) -> dict:
    """The per-GPU GiB flowgrpo's memory model (:func:`flowgrpo.realsize.table.memory_row`) computes for
    one GPU training ``recipe`` as the bench runs it: LoRA ``rank``, ``micro_batch`` samples in the
    training forward (the bench keeps the unconditional half out of it: ``loss.cfg_uncond_grad=false``),
    no EMA, activations with or without ``checkpointing``.

    ``computed_gib``: the transformer's training state and one training forward's activations, the
    figure the bench's measurement compares with (its text encoders and VAE are small);
    ``computed_whole_run_gib``: the model's whole-run budget of the 1-GPU layout at its peak phase,
    every module the recipe loads at its real size (``precompute_prompts`` as the point runs), for
    reference. Returns those, the parts and the geometry."""
    from flowgrpo.realsize.table import recipe_geometry

    cfg_doubles = recipe_geometry(recipe)[1]["cfg"]  # memory_row doubles the micro-batch then
    row = _memory_row(recipe, resolution, frames, max(1, micro_batch // 2) if cfg_doubles else micro_batch, rank,
                      precompute_prompts)
    per = row["per_gpu"]["1 GPU"]
    state = per["total"] - per["activations"] - per.get("ema", 0)
    act = row["activations"]["checkpointing" if checkpointing else "no_checkpointing"]
    whole = (row.get("budget") or {}).get("1 GPU") or {}
    return {"computed_gib": (state + act) / GIB, "computed_state_gib": state / GIB,
            "computed_activations_gib": act / GIB, "computed_geometry": row["geometry"],
            "computed_whole_run_gib": whole["total"] / GIB if "total" in whole else None,
            "computed_whole_run_peak_phase": whole.get("peak_phase"),
            "computed_by": "flowgrpo.realsize.table.memory_row"}


def forecast_memory(trainer, device: torch.device) -> dict:
    """(d) as ``flowgrpo train`` forecasts it for the run as loaded (:mod:`flowgrpo.realsize.forecast`:
    the modules the policy holds, at their real sizes and dtypes, the run's switches and layout; on
    CUDA the activations and the rollout / decode peaks counted on meta copies, off CUDA left out):
    ``forecast_gib``, its peak phase and note."""
    from flowgrpo.realsize.budget import per_gpu_budget
    from flowgrpo.realsize.forecast import run_inputs, run_layout

    inputs, note = run_inputs(trainer, working=device.type == "cuda")
    budget = per_gpu_budget(inputs, run_layout(trainer))
    return {"forecast_gib": budget["total"] / GIB, "forecast_peak_phase": budget["peak_phase"],
            "forecast_note": note or None}


def over_forecast(row: dict) -> dict:
    """``peak_over_forecast``: the measured peak over :func:`forecast_memory`'s figure (None without a peak)."""
    peak, forecast = row.get("peak_gib"), row.get("forecast_gib")
    return {"peak_over_forecast": peak / forecast if peak is not None and forecast else None}


def compare_memory(row: dict, computed: dict | str) -> dict:
    """(d): ``row``'s measured peak against ``computed`` (:func:`computed_memory`'s dict, or the
    reason there is none): ``peak_over_computed`` (None with ``computed_note`` where either is missing)."""
    if isinstance(computed, str):
        return {"computed_gib": None, "peak_over_computed": None, "computed_note": computed}
    out = dict(computed)
    peak = row.get("peak_gib")
    out["peak_over_computed"] = peak / computed["computed_gib"] if peak is not None else None
    if peak is None:
        out["computed_note"] = "no measured peak (torch.cuda.max_memory_allocated is CUDA only)"
    return out


def annotate(row: dict, *, flops: dict | None, computed: dict | str) -> dict:
    """``row`` (:func:`measure_side`'s) with (e) its FLOP figures (``flops``: the point's
    :func:`~flowgrpo.benchmarks.gpu_flops.point_flops` arguments, or None) and (d): ``computed`` is
    either the reason there is no computed figure, or :func:`computed_memory`'s keyword arguments,
    kept as ``computed_for`` for stage memory to fill in (:func:`fill_computed`; the meta-device
    counting takes seconds to a minute per recipe, so it runs after the timed stages)."""
    from .gpu_flops import point_flops

    if flops is not None:
        row["flops"] = point_flops(seconds=row, **flops)
    if isinstance(computed, str):
        row.update(compare_memory(row, computed))
    else:
        row.update(computed_for=dict(computed), computed_gib=None, peak_over_computed=None,
                   computed_note="to be computed by stage memory")
    return row


def fill_computed(stages: dict, budget_s: float, log) -> list[dict]:
    """(d) for every point of ``stages`` (the finished stages' dicts) that asked for it
    (``computed_for``): the computed figure and the measured peak over it, written into the point's
    row; points left once ``budget_s`` seconds have passed keep a note saying so. Returns one
    summary row per point: stage, point, peak, computed, ratio."""
    began = time.perf_counter()
    out = []
    for name in ("levers", "flux", "wan"):
        for row in stages.get(name, {}).get("rows", []):
            request = row.get("computed_for")
            if not request:
                continue
            point = row.get("lever") or row.get("side")
            if time.perf_counter() - began > budget_s:
                row["computed_note"] = f"not computed: stage memory's {budget_s:.0f} s spent"
            else:
                log(f"memory: computing {request['recipe']} for {name} {point}")
                row.update(compare_memory(row, computed_memory(**request)))
            out.append({"stage": name, "point": point, "peak_gib": row.get("peak_gib"),
                        "computed_gib": row.get("computed_gib"), "peak_over_computed": row.get("peak_over_computed")})
    return out
