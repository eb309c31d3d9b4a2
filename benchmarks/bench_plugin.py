"""The diffusers plug-in path against flowgrpo's own SD3 path: seconds per rollout + update.

Both paths train the same policy (the tiny random SD3 with a LoRA adapter) with the same update
code; they differ in who samples:

* **sd3 path**: :class:`~flowgrpo.trainer.trainer.Trainer`'s own rollout
  (:class:`~flowgrpo.samplers.forest_sampler.ForestSampler` calling the policy's velocity);
* **plug-in path**: the stock ``StableDiffusion3Pipeline`` built over the *same* modules, with
  :class:`~flowgrpo.diffusers.scheduler.FlowGRPOScheduler` and the recorder
  (:func:`flowgrpo.diffusers.rollout`), then the trainer's decode, rewards, advantages and update.

Each path runs ``warmup`` untimed and then ``iterations`` timed iterations, interleaved (A, B, A,
B, ...) so that machine load hits both alike; the table gives the median seconds per iteration and
the ratio plug-in / sd3 (the issue's bound: at most 1.05).

    flowgrpo bench plugin [--out DIR] [--json PATH]
    python -m flowgrpo.benchmarks.bench_plugin --iterations 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import output_dir, write_json

BOUND = 1.05


def _trainer(model_dir: Path, prompt_file: Path, prompts: int, group: int, steps: int, resolution: int):
    from flowgrpo.config import load_config
    from flowgrpo.trainer.trainer import Trainer

    cfg = load_config("flow-grpo", None, [
        "model.name=sd3", f"model.path={model_dir}", f"model.resolution={resolution}", "model.lora_rank=4",
        "model.max_sequence_length=16", "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompt_file}",
        f"data.prompts_per_iteration={prompts}", f"data.trees_per_prompt={group}", f"sampler.num_steps={steps}",
        "loss.grpo.kl_beta=0", "eval.evaluator=none", "train.threads=1", "train.ema=false", "log.progress=false"],
        recipe="shapes")
    return Trainer(cfg)


def _plugin_iteration(trainer, pipe, it: int) -> int:
    """One iteration whose rollout is the stock pipeline's; decode, rewards, advantages, update as the trainer's."""
    from flowgrpo.diffusers import rollout
    from flowgrpo.objectives import Collected

    cfg = trainer.cfg
    prompts = trainer.prompts.batch(it, cfg.data.prompts_per_iteration)
    gen = torch.Generator().manual_seed(1000 + it)
    trainer.policy.eval()
    out = rollout(pipe, prompts, trees_per_prompt=cfg.data.trees_per_prompt, num_inference_steps=cfg.sampler.num_steps,
                  generator=gen, height=cfg.model.resolution, width=cfg.model.resolution, guidance_scale=1.0,
                  max_sequence_length=cfg.model.max_sequence_length,
                  scheduler_options={"noise_level": cfg.sampler.noise_level, "sde_kind": cfg.sampler.sde_kind})
    ro = out.rollout
    cond = trainer.policy.encode_prompts(ro.prompts)
    images = trainer.decode_leaves(ro)
    rewards, comps = trainer.score(images, ro.leaf_prompts, ro.leaf_groups)
    # the trainer's own credit and update stages on the plug-in's rollout
    col = Collected(iteration=it, plan=ro.plan, cond=cond, rollout=ro, images=images, view=trainer.dp.forest_view(ro),
                    rewards=rewards, components=comps)
    credit = trainer.credit(col)
    credit.steps = ro.plan.trained_steps()
    if not credit.advantages.leaf_mask.any():
        return 0
    return int(trainer.update(col, credit).get("transitions", 0))


def run_bench_plugin(json_path: str | None = None, out: str | None = None, prompts: int = 4, group: int = 4,
                     steps: int = 10, resolution: int = 64, iterations: int = 5, warmup: int = 1) -> dict:
    """Time both paths (see the module docstring); print a table, write CSV/PNG to ``out``, JSON to ``json_path``."""
    from diffusers import StableDiffusion3Pipeline

    from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "sd3"
        tiny_sd3_pipeline(seed=0).save_pretrained(model_dir)
        prompt_file = Path(tmp) / "prompts.txt"
        prompt_file.write_text("\n".join(["a red circle", "a blue square", "a cat on a mat", "a mountain lake",
                                          "two green triangles", "a photo of a dog", "a yellow star", "a city at night"]))
        trainer = _trainer(model_dir, prompt_file, prompts, group, steps, resolution)
        pol = trainer.policy
        pipe = StableDiffusion3Pipeline(transformer=pol.transformer, vae=pol.vae, text_encoder=pol.text_encoder,
                                        tokenizer=pol.tokenizer, text_encoder_2=pol.text_encoder_2,
                                        tokenizer_2=pol.tokenizer_2, text_encoder_3=pol.text_encoder_3,
                                        tokenizer_3=pol.tokenizer_3, scheduler=pol.scheduler)
        pipe.set_progress_bar_config(disable=True)
        times: dict[str, list[float]] = {"sd3": [], "plugin": []}
        trained: dict[str, list[int]] = {"sd3": [], "plugin": []}  # transitions in each update
        for it in range(warmup + iterations):
            for name in ("sd3", "plugin"):
                t0 = time.perf_counter()
                if name == "sd3":
                    n = int(trainer.iteration_step().metrics.get("transitions", 0))
                else:
                    n = _plugin_iteration(trainer, pipe, it)
                if it >= warmup:
                    times[name].append(time.perf_counter() - t0)
                    trained[name].append(n)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["plugin"] / med["sd3"]
    result = {"seconds": times, "median_seconds": med, "transitions": trained, "ratio_plugin_over_sd3": ratio, "bound": BOUND,
              "within_bound": ratio <= BOUND, "prompts": prompts, "group": group, "steps": steps,
              "resolution": resolution, "iterations": iterations, "threads": 1, "torch": torch.__version__}
    _report(result, output_dir(out), json_path)
    return result


def _report(result: dict, out: Path, json_path: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.table import Table

    rows = [(k, result["median_seconds"][k], result["seconds"][k]) for k in ("sd3", "plugin")]
    (out / "plugin.csv").write_text("path,median_s,runs_s\n" + "".join(
        f"{k},{m:.4f},{' '.join(f'{x:.4f}' for x in v)}\n" for k, m, v in rows))
    fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.boxplot([v for _, _, v in rows], tick_labels=[k for k, _, _ in rows])
    ax.set_ylabel("seconds per iteration (rollout + update)")
    ax.set_title(f"plug-in / sd3 = {result['ratio_plugin_over_sd3']:.3f}")
    fig.tight_layout()
    fig.savefig(out / "plugin.png", dpi=120)
    plt.close(fig)
    if json_path:
        write_json(json_path, result)
    table = Table(title=f"tiny SD3, {result['prompts']} prompts x {result['group']}, T = {result['steps']}, "
                        f"{result['resolution']} px, 1 thread")
    for col in ("path", "median s / iteration", "runs", "transitions trained"):
        table.add_column(col)
    for k, m, v in rows:
        table.add_row(k, f"{m:.3f}", " ".join(f"{x:.2f}" for x in v), " ".join(map(str, result["transitions"][k])))
    table.add_row("plug-in / sd3", f"{result['ratio_plugin_over_sd3']:.3f}", f"bound <= {BOUND}", "")
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="folder for plugin.csv / plugin.png (default: the current directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    run_bench_plugin(args.json, args.out, steps=args.steps, iterations=args.iterations, warmup=args.warmup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
