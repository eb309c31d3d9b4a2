"""How a pipeline combines the outputs of one step's transformer calls into the velocity it steps with.

The outputs of a step are ``parts``: [m, b, ...] float32, one per batch chunk of every call in call
order (SD3's single call of batch 2B gives two parts, Qwen-Image's two calls of batch B two parts,
FLUX's one call one part). A :class:`Combine` is one guidance scheme over them, with g the
pipeline's guidance value:

=============  ==================================================================================
kind           velocity
=============  ==================================================================================
``single``     ``sign * p0`` (no guidance, or guidance distilled into the transformer's input)
``cfg``        ``sign * (u + (g + offset) * (c - u))``; offset 1 is Z-Image's ``c + g (c - u)``
``cfg_renorm`` ``w * |c| / |w|`` with ``w = u + g (c - u)``, norms over the last axis (Qwen-Image's
               true CFG)
=============  ==================================================================================

``c`` and ``u`` are the parts at :attr:`Combine.cond` and :attr:`Combine.uncond`. :func:`infer_combine`
picks the scheme that reproduces a recorded velocity; ``sign`` -1 is Z-Image's negated output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Combine:
    """One guidance scheme (see the module docstring)."""

    kind: str
    cond: int = 0
    uncond: int = 1
    offset: float = 0.0
    sign: float = 1.0

    def __call__(self, parts: Tensor, g: float) -> Tensor:
        """The velocity [b, ...] from ``parts`` [m, b, ...] at guidance ``g``."""
        if self.kind == "single":
            return self.sign * parts[0]
        c, u = parts[self.cond], parts[self.uncond]
        mixed = u + (g + self.offset) * (c - u)
        if self.kind == "cfg":
            return self.sign * mixed
        return self.sign * mixed * (torch.norm(c, dim=-1, keepdim=True) / torch.norm(mixed, dim=-1, keepdim=True))


def candidates(m: int) -> list[Combine]:
    """Every scheme over ``m`` parts, in the order they are tried."""
    if m == 1:
        return [Combine("single", sign=s) for s in (1.0, -1.0)]
    if m != 2:
        return []
    out = []
    for kind in ("cfg", "cfg_renorm"):
        for cond, uncond in ((0, 1), (1, 0)):
            for offset in ((0.0, 1.0) if kind == "cfg" else (0.0,)):
                out += [Combine(kind, cond, uncond, offset, s) for s in (1.0, -1.0)]
    return out


def infer_combine(parts: Tensor, g: float, velocity: Tensor, rtol: float = 1e-4) -> Combine | None:
    """The first of :func:`candidates` that gives ``velocity`` [b, ...] from ``parts`` [m, b, ...] to
    ``rtol`` of its largest magnitude; None when none does."""
    target = velocity.float()
    scale = float(target.abs().max()) or 1.0
    for rule in candidates(parts.shape[0]):
        got = rule(parts, g).reshape(target.shape)
        if bool(torch.isfinite(got).all()) and float((got - target).abs().max()) <= rtol * scale:
            return rule
    return None
