"""Per-GPU training memory of a video recipe under context parallelism (``dist.context_parallel=N``).

With N ranks splitting a sample's tokens (:mod:`flowgrpo.trainer.context_parallel`), every rank keeps
the whole weights and LoRA training state (context parallelism runs on replicated weights) and the
activations of its own 1/N of the tokens. What splits and what does not, as diffusers' Wan plan
runs it:

* split: everything the transformer blocks save for backward that is [B, tokens, width] (norms,
  projections, feed-forward, the self-attention q / k / v / output: after Ulysses' all-to-all a rank
  holds all tokens of 1/N of the heads, the same bytes), and the blocks' hidden-state inputs that
  gradient checkpointing keeps;
* whole on every rank: the text-token tensors of cross-attention and the timestep embedding (they
  do not grow with the video), and everything outside the blocks (patch embedding, condition
  embedder, output projection: counted whole here, an upper bound, since the output norm and
  projection already run on the rank's tokens).

The blocks' bytes are measured on the meta device (:func:`~flowgrpo.realsize.activations.activation_bytes`)
at the recipe's sample and at one latent frame of it; both laws of that module are linear in the
image tokens for a fixed text length, so the two measurements give each term's token-proportional
and fixed parts, and the per-GPU value at N / degree tokens follows without a third run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .activations import ActivationCount, activation_bytes

GIB = 2**30


@dataclass(frozen=True)
class SplitActivations:
    """Activation bytes of one training forward on one rank of a context-parallel group.

    Attributes:
        degree: ranks splitting the tokens (1: no split).
        tokens: the sample's image tokens; tokens_per_rank: tokens / degree.
        checkpointing, no_checkpointing: bytes with and without gradient checkpointing (the laws of
            :mod:`flowgrpo.realsize.activations`), per rank.
    """

    degree: int
    tokens: int
    tokens_per_rank: float
    checkpointing: int
    no_checkpointing: int


def _line(full: float, small: float, n_full: int, n_small: int, n: float) -> float:
    """The value at ``n`` tokens of the line through (n_small, small) and (n_full, full)."""
    return small + (full - small) * (n - n_small) / (n_full - n_small)


def split_activations(full: ActivationCount, small: ActivationCount, degree: int) -> SplitActivations:
    """Per-rank activations at ``degree`` ranks from two counts of the same model and text length at
    different image-token counts (``full``: the sample's; ``small``: fewer tokens). The outside part
    is ``full``'s, whole; the blocks' parts are read off their lines at tokens / degree."""
    if degree < 1 or full.image_tokens % degree:
        raise ValueError(f"context-parallel degree {degree} must be >= 1 and divide the sample's "
                         f"{full.image_tokens} tokens")
    if full.image_tokens == small.image_tokens or len(full.blocks) != len(small.blocks):
        raise ValueError("split_activations needs two counts of the same model at different token counts")
    n = full.image_tokens / degree
    at = lambda a, b: _line(a, b, full.image_tokens, small.image_tokens, n)  # noqa: E731
    blocks = [at(a, b) for a, b in zip(full.blocks, small.blocks)]
    inputs = at(full.block_inputs, small.block_inputs)
    return SplitActivations(degree=degree, tokens=full.image_tokens, tokens_per_rank=n,
                            checkpointing=int(full.outside + inputs + max(blocks, default=0)),
                            no_checkpointing=int(full.outside + sum(blocks)))


def context_parallel_rows(recipe: str, degrees=(1, 2, 4), resolution: int = 480, frames: int = 81,
                          rank: int = 0) -> list[dict]:
    """Per-GPU bytes of ``recipe`` at ``resolution`` px x ``frames`` frames for each context-parallel
    degree: the replicated training state (weights of every expert, LoRA, gradients, AdamW, EMA:
    :func:`~flowgrpo.realsize.memory.training_state`'s 1-GPU layout) plus one expert's activations
    per rank, with and without gradient checkpointing. The micro-batch and CFG are the recipe's
    (:func:`~flowgrpo.realsize.table.recipe_geometry`)."""
    from .memory import training_state
    from .table import recipe_geometry

    geo, info = recipe_geometry(recipe, resolution, frames)
    rank = rank or info["rank"]
    state = training_state(recipe, gpus_list=(1,), rank=rank).per_gpu["1 GPU"]["total"]
    full = activation_bytes(recipe, geo, rank=rank)
    small = activation_bytes(recipe, replace(geo, frames=1), rank=rank)
    rows = []
    for degree in degrees:
        split = split_activations(full, small, degree)
        rows.append({"recipe": recipe, "resolution": geo.resolution, "frames": geo.frames, "batch": geo.batch,
                     "degree": degree, "tokens": split.tokens, "state": state,
                     "activations": split.checkpointing if info["checkpointing"] else split.no_checkpointing,
                     "activations_checkpointing": split.checkpointing,
                     "activations_no_checkpointing": split.no_checkpointing, "checkpointing": info["checkpointing"]})
        rows[-1]["total"] = state + rows[-1]["activations"]
    return rows


def markdown_rows(rows: list[dict]) -> str:
    """The rows of :func:`context_parallel_rows` as a markdown table (GiB)."""
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    out = ["| recipe | sample | `dist.context_parallel` | tokens per GPU | weights + LoRA state | activations "
           "(no checkpointing) | activations (checkpointing) | total GiB (recipe's setting) |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        sample = f"{r['resolution']} px x {r['frames']} f, b{r['batch']}"
        ckpt = "checkpointing" if r["checkpointing"] else "no checkpointing"
        out.append(f"| {r['recipe']} | {sample} | {r['degree']} | {r['tokens'] // r['degree']} | {gib(r['state'])} | "
                   f"{gib(r['activations_no_checkpointing'])} | {gib(r['activations_checkpointing'])} | "
                   f"{gib(r['total'])} ({ckpt}) |")
    return "\n".join(out)
