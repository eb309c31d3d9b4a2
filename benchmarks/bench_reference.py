"""`flowgrpo bench reference --flow-grpo PATH`: flowgrpo against Flow-GRPO's own code on the same model.

Both sides run the same tiny random SD3 (:func:`flowgrpo.policies.tiny.sd3.tiny_sd3_components`,
seed 0: identical weights), with the same LoRA (rank 32, alpha 64, flowgrpo's SD3 targets, B = 0 at
start), prompts, group size, CFG scale, SDE noise level, sigma grid (the pipeline scheduler's), T,
resolution, KL weight and clips. The Flow-GRPO side is its ``pipeline_with_logprob`` and
``sde_step_with_logprob`` imported from the checkout at PATH (never copied here) and its training
loop around them (:mod:`flowgrpo.benchmarks.reference_flow_grpo`); the flowgrpo side is the
trainer's own stages (:class:`~flowgrpo.trainer.trainer.Trainer`: prompt encoding, the forest
sampler, decoding; credit; the update loop with the GRPO objective).

Per iteration each side does

* (a) **rollout**: encode the prompts, P x G chains of T SDE steps with log-probs, decode;
* (b) **update**: advantages from the same rewards (a seeded draw per iteration, so no reward model
  is timed) and one optimizer step over all P x G x T transitions, with KL to the base model;
* (c) **iteration** = (a) + (b).

The sides take turns (the order alternates every round) for ``warmup`` untimed and ``repeats``
timed iterations; the table gives medians and ``ratio = reference median / flowgrpo median`` (above
1: flowgrpo is faster). Before timing, both sides roll out the same chains (the reference replays
flowgrpo's initial latents and SDE noise) and ``max_latent_diff`` / ``max_logprob_diff`` are the
largest absolute differences of the states and per-step log-probs: equal work is compared.

``variants`` adds flowgrpo runs with config overrides (e.g. a speed switch off), timed in the same
rounds; the ratios of the JSON are those of the first variant (the defaults).

Writes ``reference.csv``, ``reference.png`` into ``--out`` and the JSON ``{"settings", "rows",
"rollout_ratio", "update_ratio", "iteration_ratio", "max_latent_diff", "max_logprob_diff"}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import csv  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from . import output_dir, print_table, write_json  # noqa: E402
from .reference_flow_grpo import (ReferenceSettings, ReplayNoise, encode, load_reference,  # noqa: E402
                                  reference_pipeline, reference_rollout, reference_update)

PROMPTS = ("a photo of a cat sitting on a windowsill", "a red circle on a white table", "a mountain lake at dawn",
           "a blue vintage car parked on a street", "a bowl of fruit on a wooden table", "an astronaut riding a horse",
           "a lighthouse in a storm", "two dogs playing in the snow")
REFERENCE = "flow_grpo (reference)"
ENV = "FLOWGRPO_REFERENCE"  # where the tests look for a checkout
#: variant overrides of this prefix set switches of objects the trainer builds without a config key:
#: ``bench.merge_lora=false`` is the sampler's plain path (``ForestSampler.merge_lora``)
BENCH_SWITCH = "bench."


def settings_for(num_steps: int = 10, resolution: int = 64, guidance_scale: float = 4.5,
                 beta: float = 0.04) -> ReferenceSettings:
    """The shared settings: Flow-GRPO's SD3 defaults (CFG 4.5, a = 0.7, clip 1e-4, advantages clipped
    at 5, gradient norm 1) at the tiny model's own sequence length (32 T5 tokens)."""
    from flowgrpo.policies.tiny.sd3 import TINY_MAX_SEQUENCE_LENGTH

    return ReferenceSettings(num_steps=num_steps, guidance_scale=guidance_scale, noise_level=0.7, beta=beta,
                             clip_range=1e-4, adv_clip_max=5.0, max_grad_norm=1.0,
                             max_sequence_length=TINY_MAX_SEQUENCE_LENGTH, resolution=resolution)


class FlowgrpoSide:
    """flowgrpo's trainer stages on ``model.name=model`` (default the tiny SD3) with the shared settings
    plus ``overrides``."""

    def __init__(self, s: ReferenceSettings, prompts_per_iteration: int, group: int, prompts_file: str,
                 overrides: list[str] = (), model: str = "sd3-tiny"):
        from flowgrpo.config import load_config
        from flowgrpo.trainer.trainer import Trainer

        ov = [f"model.name={model}", "model.train_mode=lora", "model.lora_rank=32", "model.lora_alpha=64",
              f"model.resolution={s.resolution}", f"model.guidance_scale={s.guidance_scale}",
              f"model.max_sequence_length={s.max_sequence_length}",
              f"sampler.num_steps={s.num_steps}", f"sampler.noise_level={s.noise_level}", f"loss.grpo.kl_beta={s.beta}",
              f"loss.grpo.clip_range={s.clip_range}", f"advantage.clip={s.adv_clip_max}",
              f"train.max_grad_norm={s.max_grad_norm}", "train.lr=3e-4", "train.ema=false", "train.threads=1",
              f"data.prompts={prompts_file}", f"data.prompts_per_iteration={prompts_per_iteration}",
              f"data.trees_per_prompt={group}", "reward.weights={jpeg_compressibility: 1.0}", "log.progress=false",
              "loss.cfg_uncond_grad=false",  # the reference's update detaches noise_pred_uncond: the same gradient
              # the reference's script neither checkpoints nor offloads: pinned, so that a model outside
              # the shapes recipe (whose fallback recipe turns both on) is timed on equal terms
              "model.gradient_checkpointing=false", "model.offload_text_encoders=false",
              *overrides]
        own = [o for o in ov if o.startswith(BENCH_SWITCH)]
        self.cfg = load_config("flow-grpo", None, [o for o in ov if not o.startswith(BENCH_SWITCH)])
        self.trainer = Trainer(self.cfg)
        self.group = group
        for o in own:  # switches of objects the trainer builds without a config key
            key, _, value = o[len(BENCH_SWITCH):].partition("=")
            if key != "merge_lora":
                raise ValueError(f"unknown bench switch {o!r}; valid: {BENCH_SWITCH}merge_lora=true|false")
            self.trainer.sampler.merge_lora = value.lower() in ("1", "true", "yes")

    def rollout(self, prompts: list[str], iteration: int):
        """The collect stage without the reward: encode, roll out, decode. Returns (cond, plan, rollout, images)."""
        from flowgrpo.seeds import ROLLOUT, derive_seed

        tr = self.trainer
        plan = tr.strategy.plan(iteration)
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.train.seed, iteration, ROLLOUT))
        tr.policy.eval()
        cond = tr.policy.encode_prompts(prompts)
        rollout = tr.sampler.rollout(plan, prompts, self.group, gen, cond=cond)
        return cond, plan, rollout, tr.decode_leaves(rollout)

    def update(self, out, rewards: torch.Tensor, iteration: int) -> dict[str, float]:
        """Credit (group z-score of ``rewards`` [P * G]) and the trainer's update over every transition."""
        from flowgrpo.objectives import Collected

        cond, plan, rollout, images = out
        tr = self.trainer
        col = Collected(iteration=iteration, plan=plan, cond=cond, rollout=rollout, images=images,
                        view=tr.dp.forest_view(rollout), rewards={"jpeg_compressibility": rewards}, components={})
        return tr.update(col, tr.credit(col))


class ReferenceSide:
    """Flow-GRPO's functions on a stock SD3 pipeline over the same components (default: the tiny SD3's)."""

    def __init__(self, code, s: ReferenceSettings, group: int, lora_targets: list[str], components: dict | None = None):
        from flowgrpo.policies.tiny.sd3 import tiny_sd3_components

        self.code, self.s, self.group = code, s, group
        self.pipe = reference_pipeline(components or tiny_sd3_components(seed=0), 32, 64.0, lora_targets)
        params = [p for p in self.pipe.transformer.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
        self.neg = encode(self.pipe, [""], s.max_sequence_length)  # once, as its training script does

    def rollout(self, prompts: list[str], iteration: int, latents=None):
        self.pipe.transformer.eval()
        return reference_rollout(self.code, self.pipe, prompts, self.group, self.neg, self.s, latents=latents)

    def update(self, out, rewards: torch.Tensor, iteration: int) -> dict[str, float]:
        """Per-prompt z-score of ``rewards`` (population std + 1e-4, as its stat tracker), then its update."""
        r = rewards.to(out["log_probs"].device).view(-1, self.group)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-4)).reshape(-1)
        return reference_update(self.code, self.pipe, self.optimizer, out, adv, self.neg, self.s)


def check_equal(flow: FlowgrpoSide, ref: ReferenceSide, prompts: list[str]) -> tuple[float, float]:
    """Both sides roll out the same chains (the reference replays flowgrpo's initial latents and step
    noise); returns (max |latent difference| over every state, max |log-prob difference| over every step)."""
    _, _, rollout, _ = flow.rollout(prompts, 0)
    return compare_chains(ref, prompts, rollout)


def compare_chains(ref: ReferenceSide, prompts: list[str], rollout, pack=None) -> tuple[float, float]:
    """The reference replays a flowgrpo ``rollout`` of ``prompts`` (its initial latents and step noise);
    returns (max |latent difference| over every state, max |log-prob difference| over every step).
    ``pack``: flowgrpo's state layout -> the reference's (FLUX's 2x2 token packing; None: the same)."""
    pack = pack or (lambda x: x)
    levels = rollout.levels
    noise = [pack((lv.x - lv.mean) / lv.std.view(-1, *([1] * (lv.x.ndim - 1)))) for lv in levels[1:]]
    with ReplayNoise(ref.code, noise):
        out = ref.rollout(prompts, 0, latents=pack(levels[0].x.clone()))
    lat = max(float((out["latents"][:, d].float() - pack(levels[d].x)).abs().max()) for d in range(len(levels) - 1))
    lat = max(lat, float((out["next_latents"][:, -1].float() - pack(levels[-1].x)).abs().max()))
    logp = max(float((out["log_probs"][:, d] - levels[d + 1].log_prob).abs().max()) for d in range(len(levels) - 1))
    return lat, logp


def _quiet_libraries() -> None:
    """The tiny CLIP's 16-token limit truncates long prompts on both sides alike; its warnings are muted."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()


def _rewards(iteration: int, n: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(1000 + iteration))


def run_bench_reference(flow_grpo_path: str | Path, json_path=None, *, num_steps: int = 10, prompts: int = 4,
                        group: int = 4, resolution: int = 64, guidance_scale: float = 4.5, beta: float = 0.04,
                        repeats: int = 5, warmup: int = 1, variants: dict[str, list[str]] | None = None,
                        out_dir=None, quiet: bool = False) -> dict:
    """Time both sides (module docstring); print a table, write CSV, PNG and JSON. Returns the JSON dict."""
    from flowgrpo.policies.diffusers.sd3 import SD3_LORA_TARGETS

    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    torch.set_num_threads(1)
    _quiet_libraries()
    code = load_reference(flow_grpo_path)
    s = settings_for(num_steps, resolution, guidance_scale, beta)
    variants = dict(variants or {"flowgrpo": []})
    times: dict[str, list[tuple[float, float]]] = {REFERENCE: [], **{v: [] for v in variants}}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prompts_file = Path(tmp) / "prompts.txt"
        prompts_file.write_text("\n".join(PROMPTS) + "\n")
        sides = {name: FlowgrpoSide(s, prompts, group, str(prompts_file), ov) for name, ov in variants.items()}
        sides[REFERENCE] = ReferenceSide(code, s, group, SD3_LORA_TARGETS)
        first = next(iter(variants))
        lat_diff, logp_diff = check_equal(sides[first], sides[REFERENCE], list(PROMPTS[:prompts]))
        names = list(sides)
        for r in range(warmup + repeats):
            batch = [PROMPTS[(r * prompts + i) % len(PROMPTS)] for i in range(prompts)]
            rewards = _rewards(r, prompts * group)
            k = r % len(names)
            for name in names[k:] + names[:k]:  # rotate the order: load affects every side alike
                gc.collect()
                t0 = time.perf_counter()
                out = sides[name].rollout(batch, r + 1)
                t1 = time.perf_counter()
                sides[name].update(out, rewards, r + 1)
                t2 = time.perf_counter()
                if r >= warmup:
                    times[name].append((t1 - t0, t2 - t1))
    rows = _rows(times)
    ref_row = rows[0]
    main = next(row for row in rows if row["side"] == first)
    result = {"settings": {**asdict(s), "prompts": prompts, "group": group, "repeats": repeats, "warmup": warmup,
                           "threads": torch.get_num_threads(), "reference_path": str(code.path),
                           "variants": variants},
              "rows": rows,
              "rollout_ratio": ref_row["rollout_s"] / main["rollout_s"],
              "update_ratio": ref_row["update_s"] / main["update_s"],
              "iteration_ratio": ref_row["iteration_s"] / main["iteration_s"],
              "max_latent_diff": lat_diff, "max_logprob_diff": logp_diff}
    out = output_dir(out_dir)
    _write_csv(out / "reference.csv", rows)
    _plot(out / "reference.png", rows, result)
    write_json(json_path, result)
    if not quiet:
        _print_table(rows, result)
    return result


def _rows(times: dict[str, list[tuple[float, float]]]) -> list[dict]:
    rows = []
    for name, ts in times.items():
        roll, upd = [t[0] for t in ts], [t[1] for t in ts]
        it = [a + b for a, b in ts]
        rows.append({"side": name, "rollout_s": statistics.median(roll), "update_s": statistics.median(upd),
                     "iteration_s": statistics.median(it), "iteration_min_s": min(it), "iteration_max_s": max(it)})
    ref = rows[0]
    for row in rows:
        for k in ("rollout", "update", "iteration"):
            row[f"{k}_ratio"] = ref[f"{k}_s"] / row[f"{k}_s"]
    return rows


COLUMNS = ("side", "rollout_s", "update_s", "iteration_s", "rollout_ratio", "update_ratio", "iteration_ratio",
           "iteration_min_s", "iteration_max_s")


def _write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(COLUMNS)
        for r in rows:
            wr.writerow([f"{r[k]:.4f}" if isinstance(r[k], float) else r[k] for k in COLUMNS])


def caption(result: dict) -> str:
    st = result["settings"]
    return (f"tiny SD3, {st['resolution']} px, T = {st['num_steps']}, {st['prompts']} prompts x {st['group']}, "
            f"CFG {st['guidance_scale']}, beta {st['beta']}; median of {st['repeats']} interleaved iterations "
            f"after {st['warmup']} warm-up, {st['threads']} thread(s); ratio = reference / side (> 1: faster); "
            f"max |latent diff| {result['max_latent_diff']:.1e}, max |log-prob diff| {result['max_logprob_diff']:.1e}")


def _plot(path: Path, rows: list[dict], result: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # pragma: no cover - matplotlib missing
        return
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(rows) + 2), 4.5))
    x = range(len(rows))
    roll = [r["rollout_s"] for r in rows]
    ax.bar(x, roll, label="(a) rollout")
    ax.bar(x, [r["update_s"] for r in rows], bottom=roll, label="(b) update")
    for i, r in enumerate(rows):
        ax.text(i, r["rollout_s"] + r["update_s"], f"{r['iteration_ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["side"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds per iteration (median)")
    ax.set_title(caption(result), fontsize=7, wrap=True)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_table(rows: list[dict], result: dict) -> None:
    cols = ("side", "rollout s", "update s", "iteration s", "x rollout", "x update", "x iteration")
    cells = [[r["side"], f"{r['rollout_s']:.3f}", f"{r['update_s']:.3f}", f"{r['iteration_s']:.3f}",
              f"{r['rollout_ratio']:.2f}", f"{r['update_ratio']:.2f}", f"{r['iteration_ratio']:.2f}"] for r in rows]
    print_table(cols, cells, title="flowgrpo vs Flow-GRPO's own code (bench reference)", caption=caption(result))


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"NAME:key=value key=value"`` -> (NAME, [overrides])."""
    name, _, rest = text.partition(":")
    if not name or not _:
        raise ValueError(f"--variant wants NAME:key=value ..., got {text!r}")
    return name, rest.split()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flowgrpo.benchmarks.bench_reference", description=__doc__.splitlines()[0])
    ap.add_argument("--flow-grpo", required=True, metavar="PATH", help="a checkout of github.com/yifan123/flow_grpo")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:key=value ...",
                    help="a flowgrpo run with these overrides (repeatable; default: one run with the defaults)")
    args = ap.parse_args(argv)
    variants = dict(parse_variant(v) for v in args.variant) or None
    run_bench_reference(args.flow_grpo, args.json, num_steps=args.num_steps, prompts=args.prompts, group=args.group,
                        resolution=args.resolution, repeats=args.repeats, warmup=args.warmup, variants=variants,
                        out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
