"""Replaying a recorded transformer call on new latents and sigmas, with gradients.

A :class:`CallLayout` is learnt from one recorded call (:mod:`flowgrpo.diffusers.replay.step_record`) of a
pipeline that denoised ``B`` prompts, the call's batch being ``k * B`` (k = 2 when the pipeline
concatenates its conditional and unconditional passes, else 1). Each top-level argument is one of:

* ``latent``: the latent input, ``k`` copies of the scheduler's sample [B, ...] concatenated on the
  batch axis (a tensor in the transformer's dtype, or a list of per-sample tensors, e.g. Z-Image's),
  possibly followed on the channel axis by channels that are the same for every sample
  (HunyuanVideo 1.5's text-to-video input is [sample, zero condition latents, zero mask]), kept as
  one recorded row, or by a part that changes with the prompt (an edit pipeline's reference-image
  tokens: FLUX.1-Kontext and Qwen-Image-Edit concatenate them after the sample's tokens), stored in
  the :class:`~flowgrpo.policies.base.Conditioning` as [B, k, ...] like a ``batched`` argument; the
  call's output is then cut back to the sample's length on that axis, as those pipelines do;
* ``timestep``: ``a * sigma + b`` per row (``a``, ``b`` fitted from two steps by the policy), of
  shape [k*B] or, for a per-token timestep such as Wan 2.2 TI2V-5B's [k*B, tokens], the row value
  repeated over the recorded per-row shape;
* ``batched``: a tensor [k*B, ...] (prompt embeddings, masks, FLUX's guidance, ...), stored in the
  :class:`~flowgrpo.policies.base.Conditioning` as [B, k, ...]; a pipeline that passes None for it
  in some batches (Qwen-Image drops its text mask when no prompt of the batch is padded) is stored as
  a ``.absent`` marker [B] and replayed as None;
* ``ragged``: a list of k*B tensors of different lengths (Z-Image's prompt features), stored padded
  as [B, k, T_max, ...] with their lengths [B, k];
* ``repeated``: a list of k*B equal non-tensor items (Qwen-Image's ``img_shapes``), rebuilt per batch;
* ``static``: anything else (RoPE ids, flags, ``None``), replayed as recorded; it must not depend on
  the prompts (checked at every encoding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .step_record import TransformerCall


@dataclass
class ArgSlot:
    """How one top-level argument (``key``: a keyword name or a positional index) is rebuilt."""

    key: str | int
    kind: str  # latent | timestep | batched | ragged | repeated | static
    value: Any = None  # static value, repeated item, or the latent's per-sample shape
    dtype: torch.dtype | None = None


def _items(call: TransformerCall) -> list[tuple[str | int, Any]]:
    return [*enumerate(call.args), *call.kwargs.items()]


def _same(a, b) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _appended(stacked: Tensor, samples: Tensor) -> Tensor | str | None:
    """What the latent input ``stacked`` [n, ...] holds beyond ``samples`` [n, ...]: None when it is
    the samples (any shape of the same size); the part appended after them on axis 1, as one row
    [1, c, ...], when it is the same for every row; ``"batched"`` when that part differs between rows
    (a reference image's tokens). ValueError when the input does not start with the samples."""
    n = stacked.shape[0]
    flat = samples.reshape(n, -1).to(stacked.dtype).float()
    if stacked[0].numel() == samples[0].numel():
        if torch.equal(stacked.reshape(n, -1).float(), flat):
            return None
    elif stacked.dim() == samples.dim() and stacked.shape[2:] == samples.shape[2:] \
            and stacked.shape[1] > samples.shape[1]:
        c = samples.shape[1]
        tail = stacked[:, c:]
        if torch.equal(stacked[:, :c].reshape(n, -1).float(), flat):
            return tail[:1].clone() if torch.equal(tail, tail[:1].expand_as(tail)) else "batched"
    raise ValueError("its latent input is not the scheduler's sample repeated on the batch axis (with at most "
                     "a part appended after it on axis 1)")


@dataclass
class CallLayout:
    """The slots of one transformer call and its batch multiple ``k`` (see the module docstring)."""

    index: int
    k: int
    slots: list[ArgSlot] = field(default_factory=list)

    @classmethod
    def learn(cls, index: int, call: TransformerCall, sample: Tensor, latent_key, timestep_key) -> "CallLayout":
        """The layout of ``call`` (the ``index``-th of its step) from the step's ``sample`` [B, ...];
        ValueError naming what does not fit."""
        b = sample.shape[0]
        items = dict(_items(call))
        latent = items[latent_key]
        n = latent.shape[0] if isinstance(latent, Tensor) else len(latent)
        if n % b:
            raise ValueError(f"its latent input has batch {n}, not a multiple of the {b} samples")
        k = n // b
        stacked = latent if isinstance(latent, Tensor) else torch.stack(list(latent))
        extra = _appended(stacked, sample.repeat(k, *[1] * (sample.dim() - 1)))
        layout = cls(index, k)
        for key, value in _items(call):
            if key == latent_key:
                item_shape = tuple(stacked.shape[1:])
                if extra is not None:  # the sample's own part, then the appended one
                    item_shape = (sample.shape[1], *item_shape[1:])
                layout.slots.append(ArgSlot(key, "latent", (isinstance(latent, Tensor), item_shape, extra),
                                            stacked.dtype))
            elif key == timestep_key:
                rows = value.reshape(value.shape[0], -1) if value.dim() > 1 else value.reshape(-1, 1)
                if not torch.equal(rows, rows[:, :1].expand_as(rows)):
                    raise ValueError(f"its timestep argument {key!r} varies within a sample")
                layout.slots.append(ArgSlot(key, "timestep", tuple(value.shape[1:]), value.dtype))
            elif isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
                layout.slots.append(ArgSlot(key, "batched"))
            elif isinstance(value, (list, tuple)) and len(value) == n and n > 0 and all(isinstance(v, Tensor) for v in value):
                layout.slots.append(ArgSlot(key, "ragged"))
            elif isinstance(value, (list, tuple)) and len(value) == n and n > 0 and all(_same(v, value[0]) for v in value):
                layout.slots.append(ArgSlot(key, "repeated", (type(value), value[0])))
            else:
                layout.slots.append(ArgSlot(key, "static", value))
        return layout

    # ------------------------------------------------------------------ encoding
    def conditioning(self, call: TransformerCall, b: int) -> dict[str, Tensor]:
        """The prompt-dependent arguments of ``call`` (a pipeline run over ``b`` prompts) as batch-first
        tensors [b, k, ...]; ValueError when a static argument differs from the recorded one."""
        out: dict[str, Tensor] = {}
        items = dict(_items(call))
        for slot in self.slots:
            value, name = items.get(slot.key), f"c{self.index}.{slot.key}"
            if slot.kind == "latent" and isinstance(slot.value[2], str):  # the appended per-prompt part
                stacked = value if isinstance(value, Tensor) else torch.stack(list(value))
                tail = stacked[:, slot.value[1][0]:]
                out[name + ".appended"] = tail.reshape(self.k, b, *tail.shape[1:]).transpose(0, 1).contiguous()
            elif slot.kind == "batched" and value is None:
                out[name + ".absent"] = torch.ones(b, dtype=torch.bool)
            elif slot.kind == "batched":
                out[name] = value.reshape(self.k, b, *value.shape[1:]).transpose(0, 1).contiguous()
            elif slot.kind == "ragged":
                lengths = torch.tensor([v.shape[0] for v in value])
                padded = torch.nn.utils.rnn.pad_sequence(list(value), batch_first=True)
                out[name] = padded.reshape(self.k, b, *padded.shape[1:]).transpose(0, 1).contiguous()
                out[name + ".len"] = lengths.reshape(self.k, b).transpose(0, 1).contiguous()
            elif slot.kind == "static" and not _same(value, slot.value):
                raise ValueError(f"transformer argument {slot.key!r} changes with the prompts; the generic "
                                 "adapter replays it as recorded")
        return out

    # ------------------------------------------------------------------ replay
    def call(self, transformer, x: Tensor, timestep: Tensor, enc: dict[str, Tensor]):
        """Call ``transformer`` on latents x [b, ...] and per-row timestep values [b] (as the pipeline passes them) with
        the conditioning rows ``enc``; returns its output as [k, b, *x.shape[1:]] (float32)."""
        b = x.shape[0]
        args, kwargs = [], {}
        for slot in self.slots:
            name = f"c{self.index}.{slot.key}"
            if slot.kind == "latent":
                as_tensor, item_shape, extra = slot.value
                rows = x.to(slot.dtype).reshape(b, *item_shape)
                if isinstance(extra, Tensor):
                    rows = torch.cat([rows, extra.to(rows.device).expand(b, *extra.shape[1:])], dim=1)
                rows = rows.repeat(self.k, *[1] * (rows.dim() - 1))
                if isinstance(extra, str):  # per-prompt rows [b, k, ...] -> [k*b, ...], after the sample's part
                    tail = enc[name + ".appended"]
                    rows = torch.cat([rows, tail.transpose(0, 1).reshape(self.k * b, *tail.shape[2:]).to(rows)], dim=1)
                value = rows if as_tensor else list(rows.unbind(0))
            elif slot.kind == "timestep":
                row = slot.value
                value = timestep.to(slot.dtype).reshape(b, *[1] * len(row)).expand(b, *row)
                value = value.repeat(self.k, *[1] * len(row))
            elif slot.kind == "batched" and name + ".absent" in enc:
                value = None
            elif slot.kind == "batched":
                rows = enc[name]
                value = rows.transpose(0, 1).reshape(self.k * b, *rows.shape[2:])
            elif slot.kind == "ragged":
                rows, lengths = enc[name].transpose(0, 1), enc[name + ".len"].transpose(0, 1)
                value = [rows[i, j, : int(lengths[i, j])] for i in range(self.k) for j in range(b)]
            elif slot.kind == "repeated":
                kind, item = slot.value
                value = kind([item] * (self.k * b))
            else:
                value = slot.value
            if isinstance(slot.key, int):
                args.append(value)
            else:
                kwargs[slot.key] = value
        out = transformer(*args, **kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out.sample
        return sample_part(out, x.shape[1:]).reshape(self.k, b, *x.shape[1:])


def sample_part(out, sample_shape: tuple[int, ...]) -> Tensor:
    """A transformer output [n, ...] (a tensor, or a list of per-sample tensors) as float32, cut to the
    sample's length on axis 1 where it is longer (an edit pipeline's output covers the reference
    tokens appended to the input too; the pipeline keeps the first ``sample_shape[0]``)."""
    if not isinstance(out, Tensor):
        out = torch.stack([o.float() for o in out])
    out = out.float()
    if out[0].numel() != math.prod(sample_shape) and out.dim() > 1 and out.shape[1] > sample_shape[0]:
        out = out[:, : sample_shape[0]]
    return out
