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

``train.old_policy_device=cpu`` keeps the copies in host memory (:func:`old_policy_home`): under full
fine-tuning each copy is a whole weight copy, and so is the stash of the live weights while a copy
runs, which then goes to host memory too. Costs: every old-policy forward copies the trainable
weights to the device and the live ones back, and every decay step copies them to the host once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError
from ..sharded_tensors import full_tensors, like_param


def host_copy_home(key: str, value: str, engine_name: str | None = None) -> str | None:
    """Where whole copies of the trainable weights placed by config key ``key`` (``auto`` | ``cpu``:
    ``train.ema_device``, ``train.old_policy_device``) live: None (beside the weights) or ``"cpu"``.
    FSDP shards the weights, so whole host copies are refused there in one line (given ``engine_name``)."""
    home = "cpu" if value == "cpu" else None
    if home and engine_name == "fsdp":
        raise ConfigError(f"{key}=cpu keeps whole weights, and FSDP shards them: use {key}=auto "
                          "(fsdp_offload_params: true puts the shards on the CPU)")
    return home


def old_policy_home(train_cfg, engine_name: str | None = None) -> str | None:
    """:func:`host_copy_home` of ``train.old_policy_device``: where the objective's lagging copies live."""
    return host_copy_home("train.old_policy_device", getattr(train_cfg, "old_policy_device", "auto"), engine_name)


def trainable_copy(policy, home: str | None = None) -> dict[str, Tensor]:
    """A copy of ``policy``'s trainable weights on ``home`` (None: their own device), by name."""
    return {n: p.detach().to(home, copy=True) for n, p in policy.named_trainable_parameters()}


@torch.no_grad()
def lerp_toward(copy: dict[str, Tensor], policy, weight: float, home: str | None = None) -> None:
    """copy <- copy + weight * (theta - copy), in place (theta brought to ``home`` first)."""
    for n, p in policy.named_trainable_parameters():
        copy[n].lerp_(p.detach().to(home), weight)


def copy_loaded(saved: dict[str, Tensor], policy, home: str | None = None) -> dict[str, Tensor]:
    """A checkpoint's whole tensors laid out like ``policy``'s live trainable weights (sharded where they
    are), on ``home``."""
    live = dict(policy.named_trainable_parameters())
    return {n: like_param(t, live[n]).detach().to(home, copy=True) for n, t in saved.items()}


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
def trainable_weights_loaded(policy, weights: dict[str, Tensor], stash: str | None = None):
    """Inside, ``policy`` runs with ``weights`` instead of its live trainable weights, which are put back
    on leaving, whatever happens inside (the old policy, a teacher, the EMA all run this way). Take no
    gradient inside; leave before the forward with gradients. ``stash``: where the live weights wait
    (None: beside them; ``"cpu"``: host memory, no second copy on the device)."""
    live = trainable_copy(policy, stash)
    policy.load_trainable_state_dict(weights)
    try:
        yield
    finally:
        policy.load_trainable_state_dict(live)


class OldPolicy:
    """A lagging copy of a policy's trainable weights (see the module docstring).

    Args:
        policy: the trained policy; the copy starts equal to its current trainable weights.
        home: where the copy lives (:func:`old_policy_home`; None: beside the trainable weights).
    """

    def __init__(self, policy, home: str | None = None):
        self.home = home
        self.weights = trainable_copy(policy, home)
        self.updates = 0

    def active(self, policy):
        """Inside, ``policy`` runs with the old weights (no gradients should be taken)."""
        return trainable_weights_loaded(policy, self.weights, stash=self.home)

    @torch.no_grad()
    def velocity(self, policy, x: Tensor, sigma: Tensor, cond, guidance_scale: float | None = None) -> Tensor:
        """The old policy's velocity [B, ...] at x [B, ...], sigma [B] (no gradient)."""
        with self.active(policy):
            return policy.velocity(x, sigma, cond, guidance_scale)

    @torch.no_grad()
    def move_toward(self, policy, decay: float) -> None:
        """old <- decay * old + (1 - decay) * theta; counts one update."""
        lerp_toward(self.weights, policy, 1.0 - decay, self.home)
        self.updates += 1

    def state_dict(self) -> dict:
        """Whole tensors for checkpoints (a collective with sharded weights: call it on every rank)."""
        return {"weights": full_tensors({n: t.detach().clone() for n, t in self.weights.items()}),
                "updates": self.updates}

    def load_state_dict(self, state: dict, policy) -> None:
        self.weights = copy_loaded(state["weights"], policy, self.home)
        self.updates = int(state["updates"])
