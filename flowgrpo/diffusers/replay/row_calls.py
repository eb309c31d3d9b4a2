"""Pipelines that take one prompt per call (a family with ``prompts_per_call=1``, QwenImageEditPlusPipeline).

Such a pipeline refuses a batch of prompts, so the generic adapter probes it with one prompt, encodes
each prompt with its own call and replays the transformer one row at a time:

* :func:`mark_per_prompt`: with a single probe prompt nothing shows which arguments depend on the
  prompt; the calls of further probe prompts (other texts, other references) do. A latent input's
  appended part (the reference image's tokens) that differs between them is stored per prompt; any
  other argument that differs and is not a per-row tensor cannot be replayed and is a ValueError.
* :func:`stack_rows`: the per-prompt encodings [1, k, ...] as one batch [B, k, ...]; tensors whose
  length (axis 2: text tokens) differs between prompts are zero-padded to the longest, with each
  row's length in ``<key>.rowlen`` [B];
* :func:`row`: row ``r`` of such a batch at its own length, what one call of the transformer gets.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .call_replay import CallLayout, _items, _same

ROW_LENGTH = ".rowlen"


def mark_per_prompt(layouts: list[CallLayout], calls: list, others: list[list]) -> None:
    """Update ``layouts`` (learnt from ``calls``, one prompt's transformer calls of a step) with the
    same step's ``others`` (per further probe prompt, its list of calls): see the module docstring."""
    for layout, call in zip(layouts, calls):
        items = dict(_items(call))
        for other_calls in others:
            if len(other_calls) != len(calls):
                raise ValueError(f"it made {len(other_calls)} transformer calls for another prompt, {len(calls)} "
                                 "for the first")
            other = dict(_items(other_calls[layout.index]))
            for slot in layout.slots:
                a, b = items.get(slot.key), other.get(slot.key)
                if slot.kind == "latent" and isinstance(slot.value[2], Tensor):
                    start = slot.value[1][0]
                    if not _same(_stack(a)[:, start:], _stack(b)[:, start:]):  # a per-prompt appended part
                        slot.value = (*slot.value[:2], "batched")
                elif slot.kind in ("static", "repeated") and not _same(a, b):
                    raise ValueError(f"its transformer argument {slot.key!r} changes with the prompt in a way the "
                                     "generic adapter cannot replay one row at a time")


def _stack(latent) -> Tensor:
    return latent if isinstance(latent, Tensor) else torch.stack(list(latent))


def stack_rows(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Per-prompt encodings (each tensor [1, ...]) -> one batch [B, ...] each; a tensor whose axis 2
    differs between rows is zero-padded there to the longest, its lengths [B] in ``<key>.rowlen``."""
    out: dict[str, Tensor] = {}
    for key in rows[0]:
        parts = [r[key] for r in rows]
        if all(p.shape == parts[0].shape for p in parts):
            out[key] = torch.cat(parts)
            continue
        if any(p.dim() < 3 or p.shape[:2] != parts[0].shape[:2] or p.shape[3:] != parts[0].shape[3:] for p in parts):
            raise ValueError(f"the encodings {key!r} of single prompts differ in more than their length: "
                             f"{[tuple(p.shape) for p in parts]}")
        longest = max(p.shape[2] for p in parts)
        padded = [torch.cat([p, p.new_zeros(*p.shape[:2], longest - p.shape[2], *p.shape[3:])], dim=2) for p in parts]
        out[key] = torch.cat(padded)
        out[key + ROW_LENGTH] = torch.tensor([p.shape[2] for p in parts])
    return out


def row(enc: dict[str, Tensor], r: int) -> dict[str, Tensor]:
    """Row ``r`` of a :func:`stack_rows` batch, each tensor [1, ...] at that row's own length."""
    out = {}
    for key, value in enc.items():
        if key.endswith(ROW_LENGTH):
            continue
        value = value[r:r + 1]
        if key + ROW_LENGTH in enc:
            value = value[:, :, : int(enc[key + ROW_LENGTH][r])]
        out[key] = value
    return out
