"""Pipelines with more than one denoiser: which expert runs at which noise level.

Wan 2.2 A14B denoises with two transformers of one architecture: ``transformer`` while the
scheduler's timestep is at or above ``boundary_ratio * num_train_timesteps`` (high noise), then
``transformer_2``. :class:`ExpertSwitch` is that rule, read from the pipeline's config (the family
entry names the key, :attr:`~flowgrpo.policies.diffusers.generic.families.PipelineFamily.boundary_config`) and checked
against the experts the pipeline was seen to call. The generic adapter routes every row of a batch
to its expert, so the trained steps decide which experts get gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ExpertSwitch:
    """The experts of a pipeline (pipeline attribute names, in the order they take over) and the
    scheduler timestep ``boundary`` below which the second one runs (None: one expert)."""

    names: tuple[str, ...] = ("transformer",)
    boundary: float | None = None
    num_train_timesteps: int = 1000

    @classmethod
    def of(cls, pipeline, names: tuple[str, ...], boundary_config: str | None) -> "ExpertSwitch":
        """The switch of ``pipeline``: the experts of ``names`` it holds; with two, the boundary
        ``config[boundary_config] * scheduler.config.num_train_timesteps`` (a boundary of None: the
        pipeline runs the first expert only, as ``WanPipeline`` does). ValueError for more than two."""
        present = tuple(n for n in names if isinstance(getattr(pipeline, n, None), nn.Module))
        if not present or present[0] != names[0]:
            raise ValueError(f"it has no {names[0]!r} module")
        if len(present) > 2:
            raise ValueError(f"it has {len(present)} experts ({', '.join(present)}); the switch knows two")
        steps = int(pipeline.scheduler.config.get("num_train_timesteps", 1000))
        ratio = pipeline.config.get(boundary_config) if boundary_config and len(present) == 2 else None
        if ratio is None:
            return cls(present[:1], None, steps)
        return cls(present, float(ratio) * steps, steps)

    def route(self, sigma: Tensor) -> Tensor:
        """Expert index [b] (long) of each row at sigma [b]: the pipeline's ``t >= boundary`` test on the
        scheduler timestep ``t = sigma * num_train_timesteps`` (float32, as the scheduler computes it)."""
        if self.boundary is None:
            return torch.zeros(sigma.shape[0], dtype=torch.long, device=sigma.device)
        t = sigma.float() * self.num_train_timesteps
        return (t < self.boundary).long()

    def check(self, steps) -> None:
        """ValueError unless each recorded step (``sigma``, ``calls[i].module``) called the expert
        :meth:`route` gives."""
        for step in steps:
            want = self.names[int(self.route(torch.tensor([step.sigma], dtype=torch.float32))[0])]
            seen = {call.module for call in step.calls}
            if seen != {want}:
                raise ValueError(f"at sigma {step.sigma:.4g} it called {sorted(seen)}, not {want!r} as its "
                                 f"boundary ({self.boundary}) says")


def route_rows(switch: ExpertSwitch, sigma: Tensor, run) -> Tensor:
    """``run(expert_index, rows)`` [m, n_rows, ...] for the rows of each expert, reassembled in row order
    into [m, b, ...] (differentiable); ``rows`` is a long index [n_rows] into the batch of ``sigma`` [b]."""
    which = switch.route(sigma)
    experts = which.unique().tolist()
    if len(experts) == 1:
        return run(experts[0], torch.arange(sigma.shape[0], device=sigma.device))
    rows = [torch.nonzero(which == e).flatten() for e in experts]
    outs = [run(e, r) for e, r in zip(experts, rows)]
    return torch.cat(outs, dim=1)[:, torch.argsort(torch.cat(rows))]
