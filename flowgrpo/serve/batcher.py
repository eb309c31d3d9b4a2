"""Batching concurrent ``/score`` requests into few reward calls, off the event loop.

A request is cut into *parts* of at most ``max_batch`` images that never split a group. One asyncio
task takes the pending parts, up to ``max_batch`` images and ``max_bytes`` of decoded images (float32
RGB, as the reward receives them), and runs the reward on them in a single worker thread (the event
loop keeps answering). While other requests are still arriving (being read or decoded:
``arriving``), it waits for them up to ``window_s`` after the first part; with none on the way it
starts at once, so a lone client pays no window. Requests that come while a batch runs queue up and
form the next one. Images wait as uint8 and become float in [0, 1] only inside the batch that scores
them, so a queued image costs a quarter of what the reward sees. Within a batch, images of one size
are scored together; each part's group ids are made distinct from the other parts', so grouping is
exactly what the request asked for. Results are split back. If a batch fails, its parts are retried
one by one so that one bad request fails only itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..references import resize_references
from ..rewards.base import wants_references
from ..rewards.wire import pack_groups
from .codec import decoded_bytes


@dataclass
class Part:
    """Up to ``max_batch`` images of one request: images [1, 3, H, W] each (uint8, or float in
    [0, 1]), prompts, group keys, each image's reference image [1, 3, h, w] (image editing; else
    None); ``nbytes``: their decoded size (:func:`~.codec.decoded_bytes`)."""

    images: list[Tensor]
    prompts: list[str]
    groups: list
    future: asyncio.Future = field(default=None, repr=False)
    references: list[Tensor] | None = None
    nbytes: int = field(init=False, default=0)

    def __post_init__(self):
        self.nbytes = sum(decoded_bytes(img) for img in [*self.images, *(self.references or [])])


@dataclass
class PartResult:
    scores: Tensor  # [n] float32
    components: dict[str, Tensor]  # name -> [n] float32


def _float_batch(images: list[Tensor]) -> Tensor:
    """Images [1, 3, H, W] of one size (uint8, or float in [0, 1]) -> float32 [n, 3, H, W] in [0, 1].

    Filled image by image: the batch's float copy is the only one (``torch.cat`` of the uint8
    images first would add a quarter more), and it lives only while the batch is scored.
    """
    out = torch.empty((len(images), *images[0].shape[1:]), dtype=torch.float32)
    for k, img in enumerate(images):
        out[k].copy_(img[0])
        if img.dtype == torch.uint8:
            out[k].div_(255.0)  # as uint8 -> float -> / 255: the same float32 values
    return out


def _score_parts(reward, parts: list[Part]) -> list[PartResult]:
    """Score several parts with as few reward calls as possible (one per image size)."""
    ids: dict[tuple[int, object], int] = {}
    flat = []  # (part index, position in part, image, prompt, global group id)
    for p, part in enumerate(parts):
        for i, (img, prompt, g) in enumerate(zip(part.images, part.prompts, part.groups)):
            flat.append((p, i, img, prompt, ids.setdefault((p, g), len(ids))))
    results = [PartResult(torch.full((len(part.images),), float("nan")), {}) for part in parts]
    by_size: dict[tuple[int, int], list[int]] = {}
    for k, item in enumerate(flat):
        by_size.setdefault(tuple(item[2].shape[-2:]), []).append(k)
    for rows in by_size.values():
        images = _float_batch([flat[k][2] for k in rows])
        extra = {}
        if wants_references(reward):  # each image's reference, at the image's size (as the trainer does)
            refs = [_float_batch([parts[flat[k][0]].references[flat[k][1]]])[0] for k in rows]
            extra["references"] = resize_references(refs, images.shape[-2], images.shape[-1])
        out = reward(images, [flat[k][3] for k in rows], groups=torch.tensor([flat[k][4] for k in rows]), **extra)
        scores = out.scores.detach().float().cpu().reshape(-1)
        comps = {name: v.detach().float().cpu().reshape(-1) for name, v in out.components.items()}
        if scores.shape[0] != len(rows) or any(v.shape[0] != len(rows) for v in comps.values()):
            raise RuntimeError(f"the reward returned {scores.shape[0]} scores for {len(rows)} images")
        for j, k in enumerate(rows):
            p, i = flat[k][0], flat[k][1]
            results[p].scores[i] = scores[j]
            for name, v in comps.items():
                dest = results[p].components.setdefault(name, torch.full((len(parts[p].images),), float("nan")))
                dest[i] = v[j]
    return results


class Batcher:
    """Collects :class:`Part` s and scores them in batches (see the module docstring)."""

    def __init__(self, reward, max_batch: int = 32, window_s: float = 0.005, max_bytes: float = float("inf")):
        self.reward = reward
        self.max_batch = max(1, int(max_batch))
        self.max_bytes = max_bytes  # a part alone may exceed it (the app keeps requests within it)
        self.window_s = float(window_s)
        self.queue: asyncio.Queue[Part] | None = None
        self._task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        self.batch_sizes: Counter[int] = Counter()  # images per reward batch -> how many batches
        self.requests = 0
        self.arriving = 0  # requests being read or decoded, not yet queued (the app counts them)

    def start(self) -> None:
        """Start the collecting task on the running event loop."""
        self.queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pool.shutdown(wait=True, cancel_futures=True)

    async def score(self, images: list[Tensor], prompts: list[str], groups: list[int] | None,
                    references: list[Tensor] | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Score one request: images [1, 3, H, W] each (uint8 or float in [0, 1]; sizes may differ),
        prompts [B], groups [B] or None (then the images of one prompt form a group), each image's
        reference image [1, 3, h, w] or None. Returns scores [B] and components [B]."""
        keys = list(groups) if groups is not None else list(prompts)
        loop = asyncio.get_running_loop()
        parts = []
        for idx in pack_groups(keys, self.max_batch):
            part = Part([images[i] for i in idx], [prompts[i] for i in idx], [keys[i] for i in idx],
                        loop.create_future(), None if references is None else [references[i] for i in idx])
            parts.append((idx, part))
            self.queue.put_nowait(part)
        self.requests += 1
        n = len(images)
        scores = torch.full((n,), float("nan"))
        comps: dict[str, Tensor] = {}
        for idx, part in parts:
            res: PartResult = await part.future
            scores[idx] = res.scores
            for name, v in res.components.items():
                comps.setdefault(name, torch.full((n,), float("nan")))[idx] = v
        return scores, comps

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        carry: Part | None = None
        while True:
            first = carry if carry is not None else await self.queue.get()
            carry = None
            batch, count, nbytes = [first], len(first.images), first.nbytes
            deadline = time.monotonic() + self.window_s
            while count < self.max_batch and nbytes < self.max_bytes:
                left = deadline - time.monotonic()
                try:
                    if self.queue.empty() and self.arriving > 0 and left > 0:
                        nxt = await asyncio.wait_for(self.queue.get(), left)
                    else:
                        nxt = self.queue.get_nowait()
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                if count + len(nxt.images) > self.max_batch or nbytes + nxt.nbytes > self.max_bytes:
                    carry = nxt
                    break
                batch.append(nxt)
                count += len(nxt.images)
                nbytes += nxt.nbytes
            batch = [p for p in batch if not p.future.done()]  # a client that went away cancels its parts
            if batch:
                await self._run(loop, batch)

    async def _run(self, loop, batch: list[Part]) -> None:
        try:
            results = await loop.run_in_executor(self._pool, _score_parts, self.reward, batch)
            self.batch_sizes[sum(len(p.images) for p in batch)] += 1
        except Exception as exc:
            if len(batch) == 1:
                if not batch[0].future.done():
                    batch[0].future.set_exception(exc)
                return
            for part in batch:  # find the culprit: each part alone
                await self._run(loop, [part])
            return
        for part, res in zip(batch, results):
            if not part.future.done():
                part.future.set_result(res)
