"""The report of ``flowgrpo bench gpu``: headline figures, the CSV's rows and the printed tables.

:func:`summary` picks the headline numbers out of a (possibly partial) result, :func:`flat_rows`
flattens every figure into (stage, dotted name, value) rows for ``gpu.csv``, :func:`print_tables`
prints one table per stage that produced figures.
"""

from __future__ import annotations

from . import number_or_dash as _f
from . import print_table


def summary(result: dict) -> dict:
    """The headline figures (None where a stage did not produce them, or has not run yet)."""
    st = result["stages"]
    ops, mod, mem = st.get("ops", {}), st.get("rollout_update", {}), st.get("memory", {})
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
            "estimate_state_gib": (mem.get("estimate_gib") or {}).get("total"), **point_headlines(st)}


def point_headlines(st: dict) -> dict:
    """The levers and size stages' headlines: the ``all`` lever's and the FLUX row's ratios to
    Flow-GRPO, the best iteration MFU and the peak / computed ratios of every point."""
    levers = {r["lever"]: r for r in st.get("levers", {}).get("rows", []) if r.get("status") == "ok"}
    flux = {r["side"]: r for r in st.get("flux", {}).get("rows", [])}
    wan = {r["side"]: r for r in st.get("wan", {}).get("rows", [])}
    out = {}
    for name in ("all", "all-speed"):
        vs = (levers.get(name) or {}).get("vs_flow_grpo") or {}
        out[f"levers_{name}_iteration_ratio"] = vs.get("iteration")
        out[f"levers_{name}_peak_ratio"] = vs.get("peak")
    out["flux_iteration_ratio"] = ((flux.get("flowgrpo") or {}).get("vs_flow_grpo") or {}).get("iteration")
    points = [*(("levers " + n, r) for n, r in levers.items()), *(("flux " + n, r) for n, r in flux.items()),
              *(("wan " + n, r) for n, r in wan.items())]
    mfus = [(r["flops"].get("iteration_mfu"), n) for n, r in points if r.get("flops", {}).get("iteration_mfu")]
    out["best_iteration_mfu"] = max(mfus)[0] if mfus else None
    out["best_iteration_mfu_point"] = max(mfus)[1] if mfus else None
    out["peak_over_computed"] = {n: r.get("peak_over_computed") for n, r in points}
    out["peak_over_forecast"] = {n: r.get("peak_over_forecast") for n, r in points if "forecast_gib" in r}
    return out


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
                       else v["preset"] if "preset" in v else v["lever"] if "lever" in v else str(i))
                walk(stage, f"{prefix}[{key}]", v)
        elif prefix != "traceback" and not prefix.endswith("output_tail"):
            rows.append({"stage": stage, "name": prefix, "value": value})

    walk("device", "", result["device"])
    for name, st in result["stages"].items():
        walk(name, "", st)
    walk("summary", "", result.get("summary", {}))
    return rows


def print_tables(result: dict) -> None:
    dev, st = result["device"], result["stages"]
    title = f"bench gpu on {dev.get('name')} (torch {dev['torch']}, CUDA {dev['torch_cuda']}, driver {dev['driver']})"
    print_table(("stage", "status", "seconds", "error"),
                [[n, s["status"], f"{s['seconds']:.1f}", (s["error"] or "")[:90]] for n, s in st.items()],
                title=title, caption=f"total {result['total_s']:.1f} s")
    bw = st.get("ops", {}).get("bandwidth")
    if bw:
        tests = st["ops"].get("tests", {})
        print_table(("impl", "D", "ms", "GB/s", "% peak", "% copy"),
                    [[r["impl"], str(r["D"]), f"{1e3 * r['seconds']:.3f}", f"{r['gbps']:.1f}",
                      _f(r["pct_of_peak"], "{:.0f}%"), f"{r['pct_of_copy']:.0f}%"] for r in bw["rows"]],
                    title=f"(a) GRPO loss fwd+bwd, N={bw['N']}: peak {_f(bw['peak_gbps'], '{:.0f}')} GB/s, "
                          f"copy {bw['copy_gbps']:.1f} GB/s",
                    caption=f"op tests: {tests.get('passed')} passed, {tests.get('failed')} failed, "
                            f"{tests.get('skipped')} skipped; CUDA kernels: {st['ops'].get('build', {}).get('cuda_kernels')}")
    mod = st.get("rollout_update", {})
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
    mem = st.get("memory", {})
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
    print_points_table("levers", st.get("levers", {}), "lever")
    for name in ("flux", "wan"):
        print_points_table(name, st.get(name, {}), "side")
    from .gpu_objectives import print_objectives_table

    print_objectives_table(st.get("objectives", {}))


def _ratio(r: dict, key: str, part: str) -> str:
    return _f((r.get(key) or {}).get(part), "{:.2f}")


def print_points_table(stage: str, data: dict, key: str) -> None:
    """One row per point of a levers / size stage: medians, ratios, peak, computed, MFU."""
    rows = data.get("rows") or []
    if not rows:
        return
    cells = []
    for r in rows:
        if r.get("status", "ok") != "ok":
            cells.append([r[key], r["status"], *["-"] * 9, (r.get("reason") or "")[:60]])
            continue
        fl = r.get("flops", {})
        cells.append([r[key], "ok", f"{r['rollout_s']:.3f}", f"{r['update_s']:.3f}", f"{r['iteration_s']:.3f}",
                      _ratio(r, "vs_plain", "iteration"), _ratio(r, "vs_flow_grpo", "iteration"),
                      _f(r.get("peak_gib"), "{:.2f}"), _f(r.get("peak_over_computed"), "{:.2f}"),
                      _f(fl.get("rollout_mfu"), "{:.0%}"), _f(fl.get("update_mfu"), "{:.0%}"), ""])
    settings = data.get("settings", {})
    print_table((key, "status", "rollout s", "update s", "iteration s", "x plain", "x Flow-GRPO", "peak GiB",
                 "peak/computed", "MFU roll", "MFU upd", "note"), cells,
                title=f"{stage}: {settings.get('recipe') or settings.get('model')}, {settings.get('resolution')} px",
                caption=f"reference: {data.get('reference')}; ratio = other / this (> 1: faster); MFU = model FLOPs "
                        "/ s / dense bf16 peak")


