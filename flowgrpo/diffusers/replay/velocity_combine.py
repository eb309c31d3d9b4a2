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

import math
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


def combine_tolerance(parts: Tensor, g: float, velocity_dtype: torch.dtype, rtol: float = 1e-4) -> Tensor:
    """Elementwise [b, ...] bound on how far a scheme computed here in float32 from ``parts`` [m, b, ...]
    can be from the velocity a pipeline combined in ``velocity_dtype``: ``rtol`` of the largest part,
    or, in a narrower type, four roundings of each term the pipeline added (the parts, ``g`` times
    their difference, and the result), the bfloat16 pipelines' case (Wan 2.2 guides in bf16)."""
    floor = rtol * float(parts.abs().max().clamp_min(1e-12))
    if not velocity_dtype.is_floating_point or torch.finfo(velocity_dtype).eps <= torch.finfo(torch.float32).eps:
        return torch.full_like(parts[0], floor)
    eps = float(torch.finfo(velocity_dtype).eps)
    terms = parts.abs().sum(0)
    if parts.shape[0] > 1:
        terms = terms + (abs(g) + 1.0) * (parts[0] - parts[1]).abs() + (abs(g) + 1.0) * parts.abs().amax(0)
    return (4.0 * eps * terms).clamp_min(floor)


def infer_combine(parts: Tensor, g: float, velocity: Tensor, rtol: float = 1e-4) -> Combine | None:
    """The scheme of :func:`candidates` that gives ``velocity`` [b, ...] from ``parts`` [m, b, ...] with the
    smallest error relative to :func:`combine_tolerance` (``velocity``'s dtype sets the rounding the
    pipeline's own arithmetic had); None when none is within it."""
    target = velocity.float()
    parts = parts.float()
    tol = combine_tolerance(parts, g, velocity.dtype, rtol).reshape(target.shape)
    best, best_ratio = None, math.inf
    for rule in candidates(parts.shape[0]):  # on a tie the earlier (simpler) scheme stays
        got = rule(parts, g).reshape(target.shape)
        ratio = float(((got - target).abs() / tol).max()) if bool(torch.isfinite(got).all()) else math.inf
        if ratio <= 1.0 and ratio < best_ratio:
            best, best_ratio = rule, ratio
    return best
