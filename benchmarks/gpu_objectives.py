"""Stage (d) of ``flowgrpo bench gpu``: every objective's preset trains at the benchmark's model size.

Stages (b) and (c) time the GRPO update; the other objectives (Flow-DPPO's trust region, Diffusion-DPO's
online pairs, DiffusionNFT, AWM and DGPO on the forward process) have their own update paths, each with
its own tensors to keep on the device. This stage runs each preset's trainer for a few full iterations
(collect with a real reward, credit, update, EMA) on the same random-weight SD3 as stage (b), with the
same rollout (``P x G`` images, T steps, LoRA r = 32, no gradient checkpointing; guidance as the
trainer's default for this model, 1: no CFG, unlike stage (b)'s 4.5), and records per preset:

* whether it trained: every iteration's loss finite, the gradient norm positive, the LoRA weights moved
  and the base transformer's weights unchanged (bit for bit on the first and last blocks, and in the
  float64 sum of every base tensor);
* what it costs: seconds per iteration (device synchronised; the first iteration includes the
  warm-up) and the peak ``torch.cuda.max_memory_allocated`` over the iterations (CUDA only);
* how many rows or transitions its update trained.

The reward is ``jpeg_compressibility`` (no reward model to load; random images give every group spread).
Each preset gets freshly built components (same seed): presets never share trained weights.
"""

from __future__ import annotations

import gc
import math
import tempfile
import time
from pathlib import Path

import torch

from . import number_or_dash, print_table
from .bench_reference import PROMPTS
from .gpu_setup import ModelSize, build_components, registered_components, synchronize

GIB = 2**30

#: the objective presets the stage trains (GRPO's is stage (b)'s update, repeated here on equal terms)
OBJECTIVE_PRESETS = ("flow-grpo", "flow-dppo", "diffusion-dpo", "diffusion-nft", "awm", "dgpo")


def _base_fingerprint(policy) -> tuple[dict[str, torch.Tensor], float]:
    """(copies of the base transformer tensors of the first and last blocks, float64 sum of every base
    transformer tensor): enough to say the frozen weights did not move without copying 2 B parameters."""
    trainable = {id(p) for p in policy.trainable_parameters()}
    base = [(n, p) for n, p in policy.named_parameters() if id(p) not in trainable and n.startswith("transformer")]
    blocks = sorted({n.split(".transformer_blocks.")[1].split(".")[0] for n, _ in base if ".transformer_blocks." in n},
                    key=int)
    keep = {f".transformer_blocks.{blocks[0]}.", f".transformer_blocks.{blocks[-1]}."} if blocks else set()
    copies = {n: p.detach().clone() for n, p in base if any(k in n for k in keep)}
    total = sum(float(p.detach().double().sum()) for _, p in base)
    return copies, total


def _train_preset(preset: str, device: torch.device, dtype: torch.dtype, size: ModelSize, *, num_steps: int,
                  prompts: int, group: int, iterations: int, prompts_file: Path, out_dir: Path, log) -> dict:
    """Build, train ``iterations`` iterations of ``preset``, check and measure (module docstring)."""
    from flowgrpo.config import load_config
    from flowgrpo.trainer.trainer import Trainer

    cuda = device.type == "cuda"
    components = build_components(size, device, dtype)
    overrides = [f"model.dtype={str(dtype).split('.')[-1]}", "model.train_mode=lora", "model.lora_rank=32",
                 "model.lora_alpha=64", f"model.resolution={size.resolution}",
                 f"model.max_sequence_length={size.max_sequence_length}", f"sampler.num_steps={num_steps}",
                 f"data.prompts={prompts_file}", f"data.prompts_per_iteration={prompts}",
                 f"data.trees_per_prompt={group}", f"train.micro_batch={prompts * group}", "train.threads=1",
                 "reward.weights={jpeg_compressibility: 1.0}", "eval.evaluator=none", "log.progress=false",
                 "log.trackers=[]", f"log.out_dir={out_dir / preset}",
                 # as stage (b): neither checkpointing nor offloading, so the presets compare on equal terms
                 "model.gradient_checkpointing=false", "model.offload_text_encoders=false"]
    with registered_components(components) as model:
        cfg = load_config(preset, None, [f"model.name={model}", *overrides])
        trainer = Trainer(cfg)
    del components
    policy = trainer.policy
    lora_before = {k: v.detach().clone() for k, v in policy.trainable_state_dict().items()}
    base_copies, base_sum = _base_fingerprint(policy)
    rows: list[dict] = []
    if cuda:
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(iterations):
        synchronize(device)
        t0 = time.perf_counter()
        m = trainer.iteration_step().metrics
        synchronize(device)
        rows.append({"iteration": i, "seconds": time.perf_counter() - t0, "loss": float(m["loss"]),
                     "grad_norm": float(m.get("grad_norm", float("nan"))),
                     "trained": int(m.get("transitions", 0) or m.get("rows", 0) or 0)})
        log(f"objectives: {preset} iteration {i}: {rows[-1]['seconds']:.2f} s, loss {rows[-1]['loss']:.4g}, "
            f"grad norm {rows[-1]['grad_norm']:.3g}, {rows[-1]['trained']} rows/transitions")
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    lora_after = policy.trainable_state_dict()
    lora_moved = max(float((lora_after[k].float() - lora_before[k].float()).abs().max()) for k in lora_before)
    params = dict(policy.named_parameters())
    base_same = all(torch.equal(params[n].detach(), t) for n, t in base_copies.items())
    _, base_sum_after = _base_fingerprint(policy)
    finite = all(math.isfinite(r["loss"]) for r in rows)
    grads = all(r["grad_norm"] > 0 for r in rows)
    trained = finite and grads and lora_moved > 0 and base_same and base_sum_after == base_sum
    result = {"preset": preset, "objective": cfg.loss.objective, "trained": trained, "loss_finite": finite,
              "grad_norm_positive": grads, "lora_max_change": lora_moved, "base_unchanged": base_same,
              "base_sum_unchanged": base_sum_after == base_sum, "iterations": rows,
              "first_iteration_s": rows[0]["seconds"],
              "iteration_s": rows[-1]["seconds"] if len(rows) > 1 else None, "peak_gib": peak,
              "strategy": cfg.sampler.strategy, "sde_kind": cfg.sampler.sde_kind,
              "guidance_scale": cfg.model.guidance_scale}
    del trainer, policy, params, base_copies, lora_before, lora_after
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def run_objectives_stage(device: torch.device, dtype: torch.dtype, size: ModelSize, *, num_steps: int, prompts: int,
                         group: int, iterations: int, budget_s: float, log,
                         presets: tuple[str, ...] = OBJECTIVE_PRESETS) -> dict:
    """Train each of ``presets`` (module docstring). A preset that raises is recorded with its error and
    the next one runs; presets not started once ``budget_s`` seconds have passed are listed as such.

    Returns {"settings", "rows" (one dict per preset), "not_run", and "status"/"error" when a preset
    failed or did not train}."""
    began = time.perf_counter()
    settings = {"model": size.name, "dtype": str(dtype).split(".")[-1], "resolution": size.resolution,
                "num_steps": num_steps, "prompts": prompts, "group": group, "iterations": iterations,
                "lora_rank": 32, "reward": "jpeg_compressibility", "gradient_checkpointing": False}
    rows, not_run = [], []
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.txt"
        prompts_file.write_text("\n".join(PROMPTS) + "\n")
        for preset in presets:
            if rows and time.perf_counter() - began > budget_s:
                not_run.append(preset)
                continue
            log(f"objectives: {preset}: building {size.name} on {device}")
            try:
                rows.append(_train_preset(preset, device, dtype, size, num_steps=num_steps, prompts=prompts,
                                          group=group, iterations=iterations, prompts_file=prompts_file,
                                          out_dir=Path(tmp), log=log))
            except Exception as exc:  # recorded; the next preset still runs
                import traceback

                rows.append({"preset": preset, "trained": False, "error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-2000:]})
                log(f"objectives: {preset} failed: {type(exc).__name__}: {exc}")
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    result: dict = {"settings": settings, "rows": rows, "not_run": not_run}
    bad = [r["preset"] for r in rows if not r["trained"]]
    if bad:
        result["status"] = "failed"
        result["error"] = f"did not train: {', '.join(bad)}"
    return result


def print_objectives_table(obj: dict) -> None:
    """Stage (d)'s table: one row per preset."""

    if not obj.get("rows"):
        return
    st = obj["settings"]
    print_table(("preset", "trained", "1st iteration s", "iteration s", "peak GiB", "rows / transitions", "loss", "error"),
                [[r["preset"], "yes" if r.get("trained") else "NO", number_or_dash(r.get("first_iteration_s"), "{:.2f}"),
                  number_or_dash(r.get("iteration_s"), "{:.2f}"), number_or_dash(r.get("peak_gib"), "{:.2f}"),
                  str(r["iterations"][-1]["trained"]) if r.get("iterations") else "-",
                  number_or_dash(r["iterations"][-1]["loss"], "{:.4g}") if r.get("iterations") else "-",
                  (r.get("error") or "")[:60]] for r in obj["rows"]],
                title=f"(d) objectives: {st['model']} {st['dtype']}, {st['resolution']} px, T={st['num_steps']}, "
                      f"{st['prompts']}x{st['group']} images, LoRA r={st['lora_rank']}, {st['iterations']} iterations each",
                caption="trained: every loss finite, grad norm > 0, LoRA moved, base weights unchanged"
                        + (f"; not run (budget): {', '.join(obj['not_run'])}" if obj.get("not_run") else ""))
