"""Stage (b) of ``flowgrpo bench gpu``: rollout + update of a random-weight SD3, flowgrpo against
Flow-GRPO's own code, on one device; and the peak memory that stage (c) compares.

The sides are :mod:`flowgrpo.benchmarks.bench_reference`'s: flowgrpo's trainer stages
(:class:`~flowgrpo.benchmarks.bench_reference.FlowgrpoSide`: prompt encoding, the forest sampler,
decoding; credit and the GRPO update) on ``model.name=bench-gpu-sd3`` (the components of
:func:`~flowgrpo.benchmarks.gpu_setup.build_components`), and Flow-GRPO's ``pipeline_with_logprob``
/ ``sde_step_with_logprob`` from a checkout with its update loop
(:class:`~flowgrpo.benchmarks.bench_reference.ReferenceSide`) over a deep copy of the same components.
Both: LoRA r = 32 (alpha 64) on flowgrpo's SD3 targets, CFG, SDE noise level 0.7, KL 0.04, the same
sigma grid and T; flowgrpo's update runs ``P x G`` transitions per forward (Flow-GRPO's per-timestep
batch). Before timing, the reference replays flowgrpo's first chains (initial latents and step
noise): the largest latent and log-prob differences say that equal work is compared.

Order (so that flowgrpo's peak memory is measured with nothing else on the device): components;
the Flow-GRPO copy parked on the CPU; flowgrpo's chains; one flowgrpo iteration alone (its peak);
the copy back, the reference's replay; then ``warmup`` + ``repeats`` interleaved rounds (the order
alternates), each side's rollout and update timed between device synchronisations, each side's
peak per iteration recorded.
"""

from __future__ import annotations

import copy
import gc
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from .bench_reference import PROMPTS, REFERENCE, FlowgrpoSide, ReferenceSide, _rewards, _rows, compare_chains, settings_for
from .gpu_setup import ModelSize, build_components, parameter_count, registered_components, synchronize

FLOWGRPO = "flowgrpo"
GIB = 2**30


def _move_modules(components: dict, device) -> None:
    for value in components.values():
        if isinstance(value, torch.nn.Module):
            value.to(device)


class Memory:
    """Peak ``torch.cuda.max_memory_allocated`` of a block (CUDA only; None on the CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def start(self) -> float | None:
        if not self.cuda:
            return None
        synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device) / GIB

    def peak(self) -> float | None:
        if not self.cuda:
            return None
        synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) / GIB

    def allocated(self) -> float | None:
        return torch.cuda.memory_allocated(self.device) / GIB if self.cuda else None


def _timed_iteration(side, device, prompts, rewards, iteration, memory: Memory) -> tuple[float, float, float | None, float | None]:
    """(rollout s, update s, peak GiB, GiB allocated at the start) of one iteration of ``side``."""
    gc.collect()
    start = memory.start()
    synchronize(device)
    t0 = time.perf_counter()
    out = side.rollout(prompts, iteration)
    synchronize(device)
    t1 = time.perf_counter()
    side.update(out, rewards, iteration)
    synchronize(device)
    t2 = time.perf_counter()
    del out
    return t1 - t0, t2 - t1, memory.peak(), start


def run_models_stage(device: torch.device, dtype: torch.dtype, size: ModelSize, code, *, num_steps: int, prompts: int,
                     group: int, repeats: int, warmup: int, budget_s: float, log) -> dict:
    """Build, check, time (module docstring). ``code``: :func:`load_reference`'s result or None (the
    reference side is then left out, with the reason in the result). Timed rounds stop starting
    once ``budget_s`` seconds have passed since the stage began (at least one is timed).

    Returns {"settings", "model", "rows" (bench reference's rows: medians in s and ratios),
    "rollout_ratio", "update_ratio", "iteration_ratio", "max_latent_diff", "max_logprob_diff",
    "memory_gib": {...}, "rounds_timed"}."""
    from flowgrpo.policies.diffusers.sd3 import SD3_LORA_TARGETS

    began = time.perf_counter()
    s = replace(settings_for(num_steps, size.resolution), max_sequence_length=size.max_sequence_length)
    memory = Memory(device)
    result: dict = {"settings": {**s.__dict__, "prompts": prompts, "group": group, "dtype": str(dtype).split(".")[-1],
                                 "lora_rank": 32, "lora_alpha": 64.0, "lora_targets": list(SD3_LORA_TARGETS),
                                 "warmup": warmup, "repeats": repeats, "model": size.name}}
    log(f"models: building {size.name} ({str(dtype).split('.')[-1]}) on {device}")
    t0 = time.perf_counter()
    components = build_components(size, device, dtype)
    synchronize(device)
    result["model"] = {"build_s": time.perf_counter() - t0,
                       "transformer_params": parameter_count(components["transformer"]),
                       "text_encoder_params": sum(parameter_count(components[k]) for k in
                                                  ("text_encoder", "text_encoder_2", "text_encoder_3")),
                       "vae_params": parameter_count(components["vae"]), "resident_gib": memory.allocated()}
    log(f"models: built in {result['model']['build_s']:.1f} s: transformer "
        f"{result['model']['transformer_params'] / 1e9:.3f} B parameters")
    ref_components = None
    if code is not None:
        ref_components = copy.deepcopy(components)
        _move_modules(ref_components, "cpu")  # parked: flowgrpo's peak is measured alone
    batch = list(PROMPTS[:prompts])
    times: dict[str, list[tuple[float, float]]] = {REFERENCE: []} if code is not None else {}
    times[FLOWGRPO] = []
    peaks: dict[str, list[tuple[float, float]]] = {name: [] for name in times}
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.txt"
        prompts_file.write_text("\n".join(PROMPTS) + "\n")
        overrides = [f"model.dtype={str(dtype).split('.')[-1]}", f"train.micro_batch={prompts * group}",
                     "log.trackers=[]"]
        with registered_components(components) as model:  # the trainer builds its policy here
            flow = FlowgrpoSide(s, prompts, group, str(prompts_file), overrides, model=model)
        del components
        from flowgrpo.ops import active_backend

        result["loss_backend"] = active_backend(device)
        log("models: flowgrpo's chains for the equality check")
        _, _, chains, _ = flow.rollout(batch, 0)
        log("models: one flowgrpo iteration alone (its peak memory)")
        roll, upd, peak, start = _timed_iteration(flow, device, batch, _rewards(0, prompts * group), 1, memory)
        result["memory_gib"] = {"flowgrpo_alone_peak": peak, "flowgrpo_alone_start": start,
                                "flowgrpo_alone_iteration_s": roll + upd}
        sides = {FLOWGRPO: flow}
        if code is not None:
            _move_modules(ref_components, device)
            sides = {REFERENCE: ReferenceSide(code, s, group, SD3_LORA_TARGETS, components=ref_components), **sides}
            del ref_components
            log("models: Flow-GRPO replays flowgrpo's chains")
            result["max_latent_diff"], result["max_logprob_diff"] = compare_chains(sides[REFERENCE], batch, chains)
            log(f"models: max |latent diff| {result['max_latent_diff']:.2e}, "
                f"max |log-prob diff| {result['max_logprob_diff']:.2e}")
        else:
            result["reference"] = "left out: no Flow-GRPO checkout (--flow-grpo PATH)"
        del chains
        names = list(sides)
        r = 0
        while r < warmup + repeats:
            timed = r >= warmup
            if timed and r > warmup and time.perf_counter() - began > budget_s:
                log(f"models: time budget {budget_s:.0f} s spent after {r - warmup} timed round(s)")
                break
            rewards = _rewards(r + 2, prompts * group)
            k = r % len(names)
            for name in names[k:] + names[:k]:  # rotate the order: load affects every side alike
                roll, upd, peak, start = _timed_iteration(sides[name], device, batch, rewards, r + 2, memory)
                log(f"models: round {r} ({'timed' if timed else 'warm-up'}) {name}: rollout {roll:.3f} s, "
                    f"update {upd:.3f} s" + (f", peak {peak:.2f} GiB" if peak is not None else ""))
                if timed:
                    times[name].append((roll, upd))
                    if peak is not None:
                        peaks[name].append((peak, start))
            r += 1
    result["rounds_timed"] = len(times[FLOWGRPO])
    result["rows"] = _rows(times)
    for row in result["rows"]:
        if peaks[row["side"]]:
            row["peak_gib"] = max(p for p, _ in peaks[row["side"]])
            row["transient_gib"] = max(p - st for p, st in peaks[row["side"]])
    if code is not None:
        main = next(row for row in result["rows"] if row["side"] == FLOWGRPO)
        result.update({f"{k}_ratio": main[f"{k}_ratio"] for k in ("rollout", "update", "iteration")})
    return result
