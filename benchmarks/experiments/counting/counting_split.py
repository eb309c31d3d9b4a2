"""Counting on trained against held-out prompts, and how a counting sample fails (issue 47, item 6).

For every counting prompt of the shapes world (both pools of ``split_specs("counting")``) draw
``--seeds`` samples, each from a noise of its own, with the evaluation's sampler (20-step Euler ODE),
and read each image with the verifier. Per pool it reports accuracy and the failure modes of the
wrong samples:

* ``too_few`` / ``too_many``: the right glyph (shape and colour) drawn fewer / more times than asked,
  nothing else in the image;
* ``wrong_glyph``: a glyph of another shape or colour drawn (whatever the count of the right one);
* ``unknown``: a cell the verifier cannot read (a smear).

Also per count (2, 3, 4): the accuracy on each pool, which says whether one number fails everywhere
(a count the model cannot draw) or only on unseen colour-shape pairs (a count it cannot transfer).

    python benchmarks/experiments/counting/counting_split.py --weights RUN_OR_WEIGHTS --seeds 32 --out F.json
    python benchmarks/experiments/counting/counting_split.py --plot F.png A.json B.json ...   # per-prompt bars
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from flowgrpo.commands.probe import load_shapes_policy
from flowgrpo.images import to_uint8
from flowgrpo.shapes.evaluate import generate_ode
from flowgrpo.shapes.prompts import split_specs
from flowgrpo.shapes.verify import UNKNOWN, detect, group_hits, score


def failure(spec, dets) -> str:
    """The one failure mode of a sample (see the module docstring); "correct" when it passes."""
    if score(spec, dets)["correct"] == 1.0:
        return "correct"
    if any(d.shape == UNKNOWN for d in dets):
        return "unknown"
    obj = spec.objects[0]
    hits = group_hits(obj, dets)
    if len(hits) != len(dets):
        return "wrong_glyph"
    return "too_few" if len(hits) < obj.count else "too_many"


def measure(policy, shift: float, seeds: int, base_seed: int = 70000) -> dict:
    """Per pool (train / heldout): accuracy, failure-mode shares, accuracy per count, per prompt."""
    out = {}
    for pool, specs in zip(("train", "heldout"), split_specs("counting")):
        prompts = [s.prompt for s in specs for _ in range(seeds)]
        # every sample its own noise; the held-out pool's seeds start 10,000 later, so no noise is shared
        start = base_seed + (0 if pool == "train" else 10_000)
        imgs = to_uint8(generate_ode(policy, prompts, list(range(start, start + len(prompts))), shift=shift))
        modes, per_prompt, per_count = Counter(), {}, {}
        for i, spec in enumerate(specs):
            got = [failure(spec, detect(imgs[i * seeds + j])) for j in range(seeds)]
            modes.update(got)
            acc = sum(g == "correct" for g in got) / seeds
            per_prompt[spec.prompt] = acc
            per_count.setdefault(spec.objects[0].count, []).append(acc)
        n = len(specs) * seeds
        out[pool] = {"prompts": len(specs), "samples": n, "accuracy": modes["correct"] / n,
                     "modes": {k: v / n for k, v in sorted(modes.items())},
                     "per_count": {str(k): float(np.mean(v)) for k, v in sorted(per_count.items())},
                     "per_prompt": per_prompt}
    return out


def plot(results: list[dict], labels: list[str], out: Path) -> None:
    """Accuracy of every held-out counting prompt, one bar per result, with each result's training-pool
    accuracy as a dashed line of its colour: the gap between the two is the generalisation gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = list(results[0]["heldout"]["per_prompt"])
    width = 0.8 / len(results)
    fig, ax = plt.subplots(figsize=(10, 4.4))
    for k, (res, label) in enumerate(zip(results, labels)):
        bars = ax.bar([i + k * width for i in range(len(prompts))], [res["heldout"]["per_prompt"][p] for p in prompts],
                      width, label=label)
        ax.axhline(res["train"]["accuracy"], color=bars.patches[0].get_facecolor(), ls="--", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(prompts))])
    ax.set_xticklabels([p.replace(" ", "\n", 1) for p in prompts], fontsize=7)
    ax.set_ylabel("correct (held-out prompt)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=min(len(results), 7), loc="upper center", bbox_to_anchor=(0.5, -0.16))
    ax.set_title("Held-out counting prompts (bars) against the trained ones (dashed), per model")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=None, help="a run folder, checkpoint or weights folder (default: shipped)")
    ap.add_argument("--seeds", type=int, default=32, help="samples per prompt")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    ap.add_argument("--plot", nargs="+", default=None, metavar=("PNG", "JSON"),
                    help="instead of measuring: draw PNG from the JSON results given after it (labels: file stems)")
    a = ap.parse_args(argv)
    if a.plot:
        if len(a.plot) < 2:
            ap.error("--plot needs the PNG to write and at least one JSON result")
        files = [Path(f) for f in a.plot[1:]]
        plot([json.loads(f.read_text()) for f in files], [f.stem for f in files], Path(a.plot[0]))
        return
    torch.set_num_threads(1)
    policy, shift, desc = load_shapes_policy(a.weights)
    with torch.no_grad():
        res = {"weights": desc, "seeds": a.seeds, **measure(policy, shift, a.seeds)}
    for pool in ("train", "heldout"):
        r = res[pool]
        modes = ", ".join(f"{k} {v:.3f}" for k, v in r["modes"].items())
        counts = ", ".join(f"{k}: {v:.2f}" for k, v in r["per_count"].items())
        print(f"{pool:8s} {r['prompts']:2d} prompts x {a.seeds}: accuracy {r['accuracy']:.3f}  [{modes}]  per count {counts}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
