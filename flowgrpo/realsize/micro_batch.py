"""``sampler.max_micro_batch: auto``: the rollout micro-batch chosen from computed memory.

A rollout runs the transformer without gradients on the nodes of one depth, chunked into micro-batches
of ``sampler.max_micro_batch`` samples (both CFG halves in one call). Larger calls keep a GPU busier,
but each sample adds its activations to the rollout phase's peak. With ``auto`` the trainer asks, once
at set-up, for the largest micro-batch whose rollout phase (:func:`~flowgrpo.realsize.budget.per_gpu_budget`:
persistent weights, resident text encoders, the stored trajectory and one forward's working memory)
fits the device with :data:`~flowgrpo.realsize.budget.HEADROOM` to spare:

- :func:`fit_rollout_micro_batch` is the arithmetic, on :class:`~flowgrpo.realsize.budget.MemoryInputs`
  whose rollout peak was counted for some micro-batch (assumed linear in the samples);
- :func:`choose_rollout_micro_batch` counts the run's own modules (:mod:`flowgrpo.realsize.forecast`),
  fits, then recounts the forward at the chosen size (a forward's fixed part is amortised over the
  counted batch, so the linear guess can be a little high) and steps down until the recount fits.

Off CUDA (no device memory at stake) and for policies the forecast does not count (the shapes
world), ``auto`` is every sample of a process's depth in one call. The rollout's other phases are
untouched: the update's micro-batch is ``train.micro_batch``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .budget import AUTO, GIB, HEADROOM, Layout, MemoryInputs, per_gpu_budget

__all__ = ["AUTO", "MicroBatchFit", "choose_rollout_micro_batch", "fit_rollout_micro_batch", "process_samples"]


@dataclass(frozen=True)
class MicroBatchFit:
    """The rollout micro-batch ``auto`` resolved to, and why.

    Attributes:
        micro_batch: samples per rollout forward (before CFG doubling), >= 1.
        cap: the process's samples per iteration (no depth has more to batch).
        per_sample_bytes: a rollout forward's working bytes per sample (0 where not counted).
        room_bytes: device bytes left for that working memory in the rollout phase (None off CUDA).
        limited_by: ``samples`` (all of them fit), ``memory`` (the device's bytes bound it), or
            ``no device`` (off CUDA, or a policy whose memory is not counted).
    """

    micro_batch: int
    cap: int
    per_sample_bytes: int
    room_bytes: int | None
    limited_by: str

    def line(self) -> str:
        """One line for the start of a run: the value and its reason."""
        head = f"sampler.max_micro_batch=auto -> {self.micro_batch}"
        if self.limited_by == "samples":
            return f"{head} (every sample of a depth in one call: {self.cap}; it fits the device's memory)"
        if self.limited_by == "memory":
            warn = "" if self.room_bytes and self.room_bytes >= self.per_sample_bytes else \
                " (not even one sample's forward fits beside the run's weights: see the memory line)"
            return (f"{head} of {self.cap} samples: {self.per_sample_bytes / GIB:.2f} GiB per sample in "
                    f"{max(self.room_bytes or 0, 0) / GIB:.1f} GiB left for the rollout forward{warn}")
        return f"{head} (every sample of a depth in one call; no device memory counted)"


def process_samples(samples: int, gpus: int) -> int:
    """Samples one process rolls out per iteration: the iteration's ``samples`` over ``gpus``, rounded up."""
    return -(-samples // max(gpus, 1))


def fit_rollout_micro_batch(inputs: MemoryInputs, layout: Layout, device_bytes: int,
                            headroom: float = HEADROOM) -> MicroBatchFit:
    """The largest micro-batch whose rollout phase fits ``device_bytes`` with ``headroom`` to spare.

    Args:
        inputs: the run's memory inputs; ``inputs.rollout_peak`` is the working bytes of one forward of
            ``inputs.rollout_micro_batch`` samples, taken as linear in the samples.
        layout: the run's layout (the persistent bytes and the process's share of the samples).
        device_bytes: the device's memory, bytes (the budget counts every module the run holds).
        headroom: share of ``device_bytes`` kept free (CUDA context, allocator fragmentation).

    Returns:
        A :class:`MicroBatchFit`; ``micro_batch`` is in ``[1, cap]`` (1 when not even one fits)."""
    cap = process_samples(inputs.samples, layout.gpus)
    per_sample = -(-inputs.rollout_peak // max(inputs.rollout_micro_batch, 1))
    base = per_gpu_budget(dataclasses.replace(inputs, rollout_peak=0), layout)["phases"]["rollout"]
    room = int(device_bytes * (1 - headroom)) - base
    if per_sample == 0:
        return MicroBatchFit(cap, cap, 0, room, "no device")
    n = max(room, 0) // per_sample
    if n >= cap:
        return MicroBatchFit(cap, cap, per_sample, room, "samples")
    return MicroBatchFit(max(1, int(n)), cap, per_sample, room, "memory")


def choose_rollout_micro_batch(trainer, device_bytes: int | None = None, recounts: int = 4) -> MicroBatchFit:
    """``sampler.max_micro_batch=auto`` for ``trainer``'s run.

    Args:
        trainer: a :class:`~flowgrpo.trainer.trainer.Trainer` whose policy, objective and engine are set.
        device_bytes: the device's memory; default: CUDA's total (``torch.cuda.mem_get_info``), None off
            CUDA, where every sample of a depth goes in one call.
        recounts: at most this many recounts of the forward at a smaller size before settling.

    Returns:
        A :class:`MicroBatchFit` (ranks agree on it: it depends on the configuration, the loaded modules'
        shapes and the device's size, not on what is free at the moment)."""
    from ..policies.diffusers.policy import DiffusersPolicy
    from .forecast import free_device_memory, rollout_peak_at, run_inputs, run_layout

    cfg = trainer.cfg
    layout = run_layout(trainer)
    cap = process_samples(cfg.data.prompts_per_iteration * cfg.data.trees_per_prompt, layout.gpus)
    if device_bytes is None:
        free = free_device_memory(trainer.accelerator.device)
        device_bytes = None if free is None else free[1]
    if device_bytes is None or not isinstance(trainer.policy, DiffusersPolicy):
        return MicroBatchFit(cap, cap, 0, None, "no device")
    inputs, _ = run_inputs(trainer, working=True, micro=cap)
    fit = fit_rollout_micro_batch(inputs, layout, device_bytes)
    for _ in range(recounts):
        if fit.limited_by != "memory" or fit.micro_batch <= 1:
            break
        peak = rollout_peak_at(trainer.policy, cfg, fit.micro_batch)
        if peak <= fit.room_bytes:
            break
        smaller = max(1, min(fit.micro_batch - 1, fit.micro_batch * fit.room_bytes // max(peak, 1)))
        fit = dataclasses.replace(fit, micro_batch=int(smaller), per_sample_bytes=-(-peak // fit.micro_batch))
    return fit
