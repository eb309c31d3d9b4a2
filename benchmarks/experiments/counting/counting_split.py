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
        # every sample its own noise; the held-out pool's seeds continue where the training pool's stop
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default=None, help="a run folder, checkpoint or weights folder (default: shipped)")
    ap.add_argument("--seeds", type=int, default=32, help="samples per prompt")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    a = ap.parse_args(argv)
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
