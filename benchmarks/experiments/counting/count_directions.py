"""Where the count stops being a direction of its own: the conditioning of counting prompts, layer by layer.

For each pair of counts (2 -> 3, 2 -> 4, 3 -> 4) and each colour-shape group that the counting prompts
hold at both counts, take the difference of the subject group's vector at the two counts. If the
count is represented apart from colour and shape, these differences point the same way whatever the
group is ("three" minus "two" is one vector), and their mean pairwise cosine is near 1. Read at:

* ``text_group`` / ``pooled``: the frozen scene encoder's token that holds the count (the group token,
  or the subject's count token in a model with count tokens) and pooled vector;
* ``ctx_proj``: the transformer's context projection of the group token;
* ``temb``: the timestep + pooled embedding that modulates every block (adaLN);
* ``blockK_ctx``: that token's context-stream state after MMDiT block K (the last block keeps no
  context output), with one fixed noise image for every prompt, at ``sigma`` 0.9 and 0.5.

A value that falls inside the transformer says its per-token layers mix the count with the colour
and the shape there, which is where a policy trained on some colour-shape pairs would learn a count
that does not carry over to others.

    python benchmarks/experiments/counting/count_directions.py base RUN_DIR ... --out F.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import Tensor

from flowgrpo.commands.probe import load_shapes_policy
from flowgrpo.shapes.prompts import split_specs

PAIRS = ((2, 3), (2, 4), (3, 4))


def direction_consistency(vectors: Tensor, specs) -> float:
    """Mean over :data:`PAIRS` of the mean pairwise cosine between count-difference vectors.

    ``vectors`` [N, D], one row per spec of ``specs`` (single-group counting specs)."""
    row = {(s.objects[0].count, s.objects[0].color, s.objects[0].shape): i for i, s in enumerate(specs)}
    means = []
    for c1, c2 in PAIRS:
        diffs = [vectors[row[(c2, col, sh)]] - vectors[i] for (c, col, sh), i in row.items()
                 if c == c1 and (c2, col, sh) in row]
        if len(diffs) < 2:
            continue
        d = torch.stack(diffs).double()
        d = d / d.norm(dim=1, keepdim=True)
        n = len(diffs)
        means.append(float(((d @ d.T).sum() - n) / (n * n - n)))
    return sum(means) / len(means)


def measure(weights: str | None, sigmas=(0.9, 0.5), seed: int = 0) -> dict[str, float]:
    """``direction_consistency`` at every read-out point named in the module docstring."""
    policy, _, desc = load_shapes_policy(weights)
    model, tf = policy.model, policy.model.transformer
    specs = [*split_specs("counting")[0], *split_specs("counting")[1]]
    caught: dict[str, Tensor] = {}
    hooks = [tf.context_embedder.register_forward_hook(lambda m, a, o: caught.__setitem__("ctx_proj", o)),
             tf.time_text_embed.register_forward_hook(lambda m, a, o: caught.__setitem__("temb", o))]
    for k, block in enumerate(tf.transformer_blocks):
        # diffusers' joint block returns (context, image); the last one keeps no context (None)
        hooks.append(block.register_forward_hook(
            lambda m, a, o, k=k: caught.__setitem__(f"block{k}_ctx", o[0]) if o[0] is not None else None))
    slot = 3 if model.cfg.count_tokens else 0  # the subject's count token, else its group token
    out = {"weights": desc, "count_slot": slot}
    try:
        with torch.no_grad():
            hidden, pooled = model.encode([s.prompt for s in specs])
            out["text_group"] = direction_consistency(hidden[:, slot], specs)
            out["pooled"] = direction_consistency(pooled, specs)
            noise = torch.randn(1, *policy.latent_shape, generator=torch.Generator().manual_seed(seed))
            for sigma in sigmas:
                caught.clear()
                model.predict(noise.expand(len(specs), *noise.shape[1:]), torch.full((len(specs),), sigma),
                              hidden, pooled)
                for name, value in caught.items():
                    vec = value if name == "temb" else value[:, slot]
                    out[f"sigma{sigma}:{name}"] = direction_consistency(vec, specs)
    finally:
        for h in hooks:
            h.remove()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("weights", nargs="+", help="'base' (the shipped weights), run folders or weights folders")
    ap.add_argument("--out", default=None, help="write every model's figures as JSON here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(None if w == "base" else w) for w in a.weights]
    for r in rows:
        print(r["weights"])
        print("  " + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k not in ("weights", "count_slot")))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
