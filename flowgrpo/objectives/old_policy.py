"""A second set of the trainable weights that lags the trained ones: DiffusionNFT's "old" policy,
AWM's and DGPO's snapshot or EMA reference, CRD's old and sampling policies.

The copy holds exactly the trainable tensors (the LoRA adapter under LoRA, so it is a second
adapter's weights; every transformer weight under full fine-tuning, a weight copy). Its velocity is
computed by loading the copy into the policy, running it without gradients and loading the live
weights back: no second model is built, and the same code serves LoRA, full fine-tuning and sharded
(FSDP) weights. Call :meth:`velocity` *before* the micro-batch's forward with gradients, whose saved
tensors must not see the weights change.

Moving toward the trained weights: old <- d * old + (1 - d) * theta, with d from a
:class:`DecaySchedule` of the number of updates so far.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ..sharded_tensors import full_tensors, like_param


@dataclass(frozen=True)
class DecaySchedule:
    """d(step) = start for step < flat, else min(start + (step - flat) * rate, cap): ``start`` (0: copy
    the trained weights) for ``flat`` updates, then growing by ``rate`` per update up to ``cap``.
    (0, 0, 0) makes the old policy the weights of the previous update; CRD's old policy starts at 0.25."""

    flat: int = 0
    rate: float = 0.0
    cap: float = 0.0
    start: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.flat:
            return self.start
        return min(self.start + (step - self.flat) * self.rate, self.cap)


@contextlib.contextmanager
def trainable_weights_loaded(policy, weights: dict[str, Tensor]):
    """Inside, ``policy`` runs with ``weights`` instead of its live trainable weights, which are put back
    on leaving, whatever happens inside (the old policy, a teacher, the EMA all run this way). Take no
    gradient inside; leave before the forward with gradients."""
    live = policy.trainable_state_dict()
    policy.load_trainable_state_dict(weights)
    try:
        yield
    finally:
        policy.load_trainable_state_dict(live)


class OldPolicy:
    """A lagging copy of a policy's trainable weights (see the module docstring).

    Args:
        policy: the trained policy; the copy starts equal to its current trainable weights.
    """

    def __init__(self, policy):
        self.weights = {n: p.detach().clone() for n, p in policy.named_trainable_parameters()}
        self.updates = 0

    def active(self, policy):
        """Inside, ``policy`` runs with the old weights (no gradients should be taken)."""
        return trainable_weights_loaded(policy, self.weights)

    @torch.no_grad()
    def velocity(self, policy, x: Tensor, sigma: Tensor, cond, guidance_scale: float | None = None) -> Tensor:
        """The old policy's velocity [B, ...] at x [B, ...], sigma [B] (no gradient)."""
        with self.active(policy):
            return policy.velocity(x, sigma, cond, guidance_scale)

    @torch.no_grad()
    def move_toward(self, policy, decay: float) -> None:
        """old <- decay * old + (1 - decay) * theta; counts one update."""
        for n, p in policy.named_trainable_parameters():
            self.weights[n].lerp_(p.detach(), 1.0 - decay)
        self.updates += 1

    def state_dict(self) -> dict:
        """Whole tensors for checkpoints (a collective with sharded weights: call it on every rank)."""
        return {"weights": full_tensors({n: t.detach().clone() for n, t in self.weights.items()}),
                "updates": self.updates}

    def load_state_dict(self, state: dict, policy) -> None:
        live = dict(policy.named_trainable_parameters())
        self.weights = {n: like_param(t, live[n]).detach().clone() for n, t in state["weights"].items()}
        self.updates = int(state["updates"])
