"""`flowgrpo bench schedulers`: `flowgrpo sample` against the stock pipeline with the exported LoRA, when
the pipeline's own solver is not flow-matching Euler.

Wan's pipeline folders ship ``UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=...)``, a
multistep predictor-corrector on the flow ODE. flowgrpo's rollouts need one-step transitions (every
SDE step and its log-prob is one Euler-Maruyama step), so the ``wan`` and generic adapters replace it
by flow-matching Euler at the same ``flow_shift``, and ``flowgrpo sample`` integrates the same ODE with
Euler. Both solve the ODE of the same trained velocity field; they differ by their discretisation
error, which shrinks with the step count. This benchmark measures that difference where it matters
to a user: a LoRA run with a Wan recipe is exported, loaded into the stock ``WanPipeline`` (UniPC, as
shipped), and its videos are compared with ``flowgrpo sample``'s at the recipe's step count (and at
half and twice it), all from the same initial noise; the stock pipeline with its scheduler replaced
by flow-matching Euler at ``flow_shift`` is the control (it is ``flowgrpo sample``'s computation), and
a 400-step Euler solution stands for the exact ODE solution.

Models: the tiny random Wan 2.1 (``wan`` adapter) and Wan 2.2 A14B (generic adapter, two experts)
pipelines of the test suite, trained one LoRA iteration with their recipe's settings (its step count
included) at 32 px x 5 frames; pixel values in [0, 1]. A tiny random network's velocity field is not
a real model's, so the absolute gap is not a real model's either: the table shows how the two
solvers relate (which is closer to the ODE's solution, how the gap falls with steps).

Output: ``schedulers.csv``, ``schedulers.png`` (gap against steps), the table printed, JSON.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from . import output_dir, print_table, write_csv, write_json

PROMPTS = ["a red kite over a beach", "a cat walking in the snow"]
#: the step count standing for the exact solution of the ODE
REFERENCE_STEPS = 400
#: (family, recipe): the tiny pipeline and the recipe whose settings its run takes
FAMILIES = (("wan21", "wan21-t2v-1.3b"), ("wan22-a14b", "wan22-a14b"))
COLUMNS = ["family", "steps", "sample_vs_unipc_max", "sample_vs_unipc_mean", "sample_vs_stock_euler_max",
           "sample_vs_exact_mean", "unipc_vs_exact_mean"]


def _pipeline_folder(family: str, directory: Path) -> Path:
    if family == "wan21":
        from flowgrpo.policies.tiny.wan import save_tiny_wan

        return save_tiny_wan(directory)
    from flowgrpo.policies.tiny.families import save_tiny_pipeline

    return save_tiny_pipeline(family, directory)


def _trained_run(family: str, recipe: str, root: Path) -> tuple[Path, Path, int]:
    """(pipeline folder, LoRA run folder, the recipe's step count): one LoRA iteration with the recipe's
    settings at a tiny size, exported into ``root/lora``."""
    from flowgrpo.config import compose_config

    base = _pipeline_folder(family, root / "base")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    steps = compose_config("flow-grpo", None, [], recipe).config.sampler.num_steps
    argv = ["train", "--recipe", recipe, f"model.name={base}", "model.resolution=32", "model.num_frames=5",
            "model.max_sequence_length=16", "model.dtype=float32", "model.lora_rank=4", "model.lora_alpha=8",
            f"data.prompts={prompts}", "data.prompts_per_iteration=2", "data.trees_per_prompt=2",
            "reward.weights={jpeg_compressibility: 1.0}", "reward.frame_stride=1", "train.iterations=1",
            "train.lr=3e-2", "train.micro_batch=4", "log.progress=false", "log.trackers=[]", "log.grid_every=0",
            f"log.out_dir={root}", "log.run_name=run"]
    # the CLI in a child process, as a user runs it (benchmarks sit below the CLI in the import graph)
    for args in (argv, ["export", str(root / "run"), "--to", str(root / "lora")]):
        proc = subprocess.run([sys.executable, "-m", "flowgrpo", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the {family} LoRA run or its export failed: {proc.stderr.strip()[-2000:]}")
    return base, root / "run", steps


def _stock(base: Path, lora: Path, euler: bool):
    """The stock pipeline of ``base`` with the exported LoRA (each expert's), UniPC as shipped or Euler."""
    from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

    pipe = DiffusionPipeline.from_pretrained(str(base), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora))
    if (lora / "transformer_2").is_dir():
        pipe.load_lora_weights(str(lora / "transformer_2"), load_into_transformer_2=True)
    if euler:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return pipe


def _videos(pipe, noise, steps: int, guidance: float) -> torch.Tensor:
    with torch.no_grad():
        return pipe(prompt=list(PROMPTS), height=32, width=32, num_frames=5, num_inference_steps=steps,
                    latents=noise.clone(), guidance_scale=guidance, output_type="pt",
                    max_sequence_length=16)[0].float().clamp(0, 1)


def _gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a - b).abs()
    return float(d.max()), float(d.mean())


def measure(family: str, recipe: str, root: Path) -> list[dict]:
    """The rows of one family (see the module docstring)."""
    from flowgrpo.output.drawing import draw
    from flowgrpo.trainer.checkpoint import load_trained_policy

    base, run_dir, steps = _trained_run(family, recipe, root)
    run = load_trained_policy(run_dir)
    policy, guidance = run.policy.eval(), run.cfg.model.guidance_scale
    seeds = [11, 12]
    noise = torch.stack([torch.randn(policy.latent_shape, generator=torch.Generator().manual_seed(s)) for s in seeds])
    unipc, euler = _stock(base, root / "lora", euler=False), _stock(base, root / "lora", euler=True)
    exact = _videos(euler, noise, REFERENCE_STEPS, guidance)
    rows = []
    for n in (max(2, steps // 2), steps, 2 * steps):
        ours = draw(policy, PROMPTS, seeds, n, run.cfg.sampler.shift)
        theirs, control = _videos(unipc, noise, n, guidance), _videos(euler, noise, n, guidance)
        rows.append({"family": family, "steps": n, "recipe_steps": steps,
                     "sample_vs_unipc_max": _gap(ours, theirs)[0], "sample_vs_unipc_mean": _gap(ours, theirs)[1],
                     "sample_vs_stock_euler_max": _gap(ours, control)[0],
                     "sample_vs_exact_mean": _gap(ours, exact)[1], "unipc_vs_exact_mean": _gap(theirs, exact)[1]})
    return rows


def run_bench_schedulers(json_path=None, out_dir=None) -> dict:
    """Run the benchmark (see the module docstring); returns the JSON it writes."""
    out = output_dir(out_dir)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, recipe in FAMILIES:
            rows += measure(family, recipe, Path(tmp) / family)
    print_table(COLUMNS, [[r["family"], str(r["steps"]), *(f"{r[c]:.2e}" for c in COLUMNS[2:])] for r in rows],
                title="flowgrpo sample (Euler) against the stock WanPipeline (UniPC) with the exported LoRA",
                caption=f"pixel differences in [0, 1]; exact = stock Euler at {REFERENCE_STEPS} steps; "
                        "recipe steps: " + ", ".join(f"{f} {r['recipe_steps']}" for f, r in
                                                     {r["family"]: r for r in rows}.items()))
    write_csv(out / "schedulers.csv", rows, ["recipe_steps", *COLUMNS])
    _plot(rows, out / "schedulers.png")
    data = {"reference_steps": REFERENCE_STEPS, "rows": rows}
    write_json(json_path, data)
    return data


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == family]
        steps = [r["steps"] for r in mine]
        ax.plot(steps, [r["sample_vs_unipc_mean"] for r in mine], "o-", label=f"{family}: sample vs stock UniPC")
        ax.plot(steps, [r["sample_vs_exact_mean"] for r in mine], "s--", label=f"{family}: sample vs exact")
        ax.plot(steps, [r["unipc_vs_exact_mean"] for r in mine], "^:", label=f"{family}: UniPC vs exact")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("steps")
    ax.set_ylabel("mean |pixel difference|")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    run_bench_schedulers()
