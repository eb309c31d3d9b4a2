"""Rewards overlapped with sampling: a rank's trees rolled out in waves, each scored while the next samples.

The collect stage's time is sampling plus scoring. A reward that waits on a server (a remote reward,
a VLM judge) or runs a model of its own leaves the sampler idle meanwhile. With ``reward.waves`` = W
the rank's trees are split into W waves of whole groups (pairwise rewards compare within a group,
so a group is never split); while wave k + 1 samples, a worker thread decodes and scores wave k.
The collect time falls from sum(sampling, scoring) towards max(sampling, scoring) plus one wave's
scoring.

Every wave's noise is the monolithic rollout's: a tree draws its noise from its own stream, seeded
from one state of the iteration's generator (:class:`~flowgrpo.samplers.noise.TreeNoise`), and each
wave starts from a copy of that state. The waves are merged into one rollout
(:func:`~flowgrpo.samplers.forest.concat_rollouts`); images and rewards are placed at the merged
leaves' positions. ``reward.overlap=false`` scores the same waves in turn on the main thread: the
numbers are the overlapped ones bit for bit (the model sees the same batches either way); against
W = 1 they differ only by float batching of the model calls (none at ``sampler.max_micro_batch=1``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..samplers.forest import Rollout, concat_rollouts

#: scores a wave: (rollout) -> (images [L_wave, ...], rewards name -> [L_wave], components name -> [L_wave])
WaveScorer = Callable[[Rollout], tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]]


def wave_ranges(trees: range, trees_per_prompt: int, waves: int) -> list[range]:
    """``trees`` (a contiguous range of global tree ids) split into at most ``waves`` contiguous ranges
    of about equal size whose cuts fall on group boundaries (multiples of ``trees_per_prompt``).
    Fewer ranges where the range holds fewer whole groups."""
    if waves < 1:
        raise ValueError(f"waves must be >= 1, got {waves}")
    cuts = [t for t in range(trees.start + 1, trees.stop) if t % trees_per_prompt == 0]
    # more waves than groups cut at every group boundary: capped, so reward.waves=100000000 does not
    # loop 1e8 times (it hung the trainer) for the same cuts
    waves = min(waves, len(cuts) + 1)
    chosen = []
    for k in range(1, waves):
        if not cuts:
            break
        target = trees.start + k * len(trees) / waves
        best = min(cuts, key=lambda c: (abs(c - target), c))
        if best not in chosen:
            chosen.append(best)
    bounds = [trees.start, *sorted(chosen), trees.stop]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass
class WaveCollect:
    """The merged product of the waves (this rank's trees).

    Attributes:
        rollout: the merged rollout; images [L, ...] and rewards / components name -> [L] in its leaf order.
        sample_seconds: wall-clock spent sampling (main thread).
        seconds: wall-clock of the whole collect (sampling, and the scoring not hidden behind it).
    """

    rollout: Rollout
    images: Tensor
    rewards: dict[str, Tensor]
    components: dict[str, Tensor]
    sample_seconds: float
    seconds: float


def collect_in_waves(ranges: list[range], sample: Callable[[range], Rollout], score: WaveScorer,
                     overlap: bool = True) -> WaveCollect:
    """Sample each tree range of ``ranges`` in turn with ``sample`` and score it with ``score``: on a
    worker thread while the next range samples (``overlap``), else right after it."""
    t0 = time.perf_counter()
    sampled, results, sample_s = [], [], 0.0
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowgrpo-score") if overlap else None
    try:
        pending: list[Future] = []
        for trees in ranges:
            ts = time.perf_counter()
            ro = sample(trees)
            sample_s += time.perf_counter() - ts
            sampled.append(ro)
            if pool is not None:
                pending.append(pool.submit(score, ro))
            else:
                results.append(score(ro))
        results.extend(f.result() for f in pending)  # re-raises a scoring error here, in the main thread
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    if len(sampled) == 1:
        (images, rewards, comps), = results
        return WaveCollect(sampled[0], images, rewards, comps, sample_s, time.perf_counter() - t0)
    merged, positions = concat_rollouts(sampled)
    images = _place([r[0] for r in results], positions, merged.num_leaves)
    rewards = {k: _place([r[1][k] for r in results], positions, merged.num_leaves) for k in results[0][1]}
    comps = {k: _place([r[2][k] for r in results], positions, merged.num_leaves) for k in results[0][2]}
    return WaveCollect(merged, images, rewards, comps, sample_s, time.perf_counter() - t0)


def _place(chunks: list[Tensor], positions: list[Tensor], n: int) -> Tensor:
    """Per-wave rows [L_k, ...] -> [n, ...] with wave k's rows at ``positions[k]``."""
    out = torch.empty((n, *chunks[0].shape[1:]), dtype=chunks[0].dtype, device=chunks[0].device)
    for rows, pos in zip(chunks, positions):
        out[pos.to(out.device)] = rows
    return out
