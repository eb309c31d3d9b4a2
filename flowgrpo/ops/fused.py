"""Python side of the fused GRPO loss op: autograd, fake (meta) kernels, dispatch and fallback.

The compiled library (csrc/, built by :mod:`flowgrpo.ops.build`) defines two operators:

* ``flowgrpo::grpo_loss_fwd(prev_sample, mean, mean_old, std, logp_old, advantages, weights,
  mean_ref?, kl_sigma?, clip_range, beta, guard) -> (loss, logp, ratio, kl, coef)``
* ``flowgrpo::grpo_loss_bwd(grad_loss, prev_sample, mean, mean_old?, mean_ref?, coef) -> grad_mean``

``coef`` [N, 3] holds, per row, the coefficients of dL/dmu for grad_loss = 1; it is all the
forward pass saves besides the inputs. Autograd (``torch.library.register_autograd``) gives a
gradient to ``mean`` only; when any other input requires a gradient, :func:`grpo_loss` runs the
reference instead, so no gradient is ever silently dropped.
"""

from __future__ import annotations

import threading
import warnings

import torch
from torch import Tensor

from . import build
from .output import GRPOLossOutput
from .reference import grpo_loss_ref

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_registered = False
_reg_lock = threading.Lock()
_warned = False


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def register_python_side() -> None:
    """Fake kernels and autograd for the operators; called once after the library is loaded."""
    global _registered
    with _reg_lock:
        if _registered:
            return

        @torch.library.register_fake("flowgrpo::grpo_loss_fwd")
        def _fwd_fake(prev_sample, mean, mean_old, std, logp_old, advantages, weights, mean_ref,
                      kl_sigma, clip_range, beta, guard):
            n = prev_sample.shape[0]
            acc = _acc_dtype(prev_sample.dtype)
            new = prev_sample.new_empty
            return (new((), dtype=acc), new((n,), dtype=acc), new((n,), dtype=acc),
                    new((n,), dtype=acc), new((n, 3), dtype=acc))

        @torch.library.register_fake("flowgrpo::grpo_loss_bwd")
        def _bwd_fake(grad_loss, prev_sample, mean, mean_old, mean_ref, coef):
            return torch.empty_like(mean, memory_format=torch.contiguous_format)

        torch.library.register_autograd(
            "flowgrpo::grpo_loss_fwd", _backward, setup_context=_setup_context
        )
        _registered = True


def _setup_context(ctx, inputs, output):
    (prev_sample, mean, mean_old, _std, _lpo, _adv, _w, mean_ref, _ks, _clip, _beta, guard) = inputs
    coef = output[4]
    ctx.guard = bool(guard)
    ctx.use_kl = mean_ref is not None and _beta != 0.0
    ctx.save_for_backward(
        prev_sample, mean, mean_old if ctx.guard else None, mean_ref if ctx.use_kl else None, coef
    )


def _backward(ctx, grad_loss, _g_logp, _g_ratio, _g_kl, _g_coef):
    prev_sample, mean, mean_old, mean_ref, coef = ctx.saved_tensors
    grad_mean = None
    if ctx.needs_input_grad[1]:
        grad_mean = torch.ops.flowgrpo.grpo_loss_bwd(
            grad_loss, prev_sample, mean, mean_old, mean_ref, coef
        )
    return (None, grad_mean) + (None,) * 10


def _warn_fallback(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            f"flowgrpo: the fused GRPO loss op is unavailable ({reason}); "
            "using the PyTorch reference (same results, slower)",
            RuntimeWarning,
            stacklevel=3,
        )


def active_backend(device: torch.device | str = "cpu") -> str:
    """"compiled" when the fused kernel serves tensors on ``device``, else "reference".

    Builds and loads the extension on first call (cached on disk afterwards).
    """
    if build.disabled_by_env():
        return "reference"
    if not build.ensure_loaded():
        return "reference"
    register_python_side()
    return "compiled" if build.has_kernel(device) else "reference"


def fused_available(device: torch.device | str) -> bool:
    return active_backend(device) == "compiled"


def grpo_loss(prev_sample: Tensor, mean: Tensor, mean_old: Tensor, std: Tensor, logp_old: Tensor, advantages: Tensor,
              weights: Tensor, *, clip_range: float, guard: bool = False, mean_ref: Tensor | None = None,
              kl_sigma: Tensor | None = None, beta: float = 0.0, backend: str = "auto") -> GRPOLossOutput:
    """Fused GRPO loss: same signature, semantics and results as :func:`grpo_loss_ref`.

    ``backend``: "auto" (fused kernel where one is built for the device, else the reference with
    one warning), "reference" (force the PyTorch reference) or "fused" (raise if unavailable).
    Gradients flow to ``mean`` only; if another input requires grad the reference runs.
    Under ``torch.compile`` the op is traced (it has fake kernels) when the library is already
    loaded in the process; call :func:`active_backend` once before compiling to make sure.
    """
    if backend not in ("auto", "fused", "reference"):
        raise ValueError(f"backend must be 'auto', 'fused' or 'reference', got {backend!r}")
    kwargs = dict(clip_range=clip_range, guard=guard, mean_ref=mean_ref, kl_sigma=kl_sigma, beta=beta)
    args = (prev_sample, mean, mean_old, std, logp_old, advantages, weights)
    if backend == "reference":
        return grpo_loss_ref(*args, **kwargs)

    use_kl = mean_ref is not None and beta != 0.0
    if use_kl and kl_sigma is None:
        raise ValueError("mean_ref given without kl_sigma")
    reason = _unsupported(prev_sample, mean, mean_old, std, logp_old, advantages, weights,
                          mean_ref if use_kl else None, kl_sigma if use_kl else None, guard)
    if torch.compiler.is_compiling():
        # No building while tracing: the library is used if this process has already loaded it
        # (any eager call or active_backend() does); otherwise the reference is traced.
        available = _registered and build.STATE.loaded and build.has_kernel(prev_sample.device)
    else:
        available = fused_available(prev_sample.device)
    if reason is None and not available:
        if build.STATE.loaded:
            reason = f"no kernel for device {prev_sample.device.type} in the loaded library"
        else:
            reason = build.STATE.error or "extension not built"
        if backend == "auto" and not build.disabled_by_env():
            _warn_fallback(reason)
    if reason is not None:
        if backend == "fused":
            raise RuntimeError(f"fused GRPO loss op unavailable: {reason}")
        return grpo_loss_ref(*args, **kwargs)

    # One dtype for the latent operands: theirs when they agree, else (as the reference does)
    # the accumulation dtype of `mean`. The cast of `mean` is differentiable.
    dt = mean.dtype
    for t in (prev_sample, mean_old if guard else None, mean_ref if use_kl else None):
        if t is not None and t.dtype != mean.dtype:
            dt = _acc_dtype(mean.dtype)
    x, mu = prev_sample.to(dt), mean.to(dt)
    mo = mean_old.to(dt) if guard else mean_old
    mr = mean_ref.to(dt) if use_kl else None
    acc = _acc_dtype(dt)
    n = x.shape[0]
    rows = [t.reshape(n).to(acc) for t in (std, logp_old, advantages, weights)]
    ks = kl_sigma.reshape(n).to(acc) if use_kl else None
    loss, logp, ratio, kl, _coef = torch.ops.flowgrpo.grpo_loss_fwd(
        x, mu, mo, *rows, mr, ks, float(clip_range), float(beta), bool(guard)
    )
    ratio = ratio.detach()
    return GRPOLossOutput(loss=loss, logp=logp.detach(), ratio=ratio, kl=kl.detach(),
                          clipped_high=ratio > 1.0 + clip_range, clipped_low=ratio < 1.0 - clip_range)


def _unsupported(prev_sample, mean, mean_old, std, logp_old, advantages, weights, mean_ref,
                 kl_sigma, guard) -> str | None:
    """Why the fused op cannot serve these inputs (the reference then runs), or None."""
    latents = [prev_sample, mean] + ([mean_old] if guard else []) + ([mean_ref] if mean_ref is not None else [])
    if prev_sample.dim() == 0 or prev_sample.shape[0] == 0 or prev_sample.numel() == 0:
        return "empty input"
    for t in latents:
        if t.dtype not in _SUPPORTED:
            return f"dtype {t.dtype}"
        if t.shape != prev_sample.shape or t.device != prev_sample.device:
            return "shape/device mismatch"
    if torch.is_grad_enabled():
        others = [prev_sample, mean_old, std, logp_old, advantages, weights, mean_ref, kl_sigma]
        if any(isinstance(t, Tensor) and t.requires_grad for t in others):
            return "an input other than `mean` requires grad"
    return None


__all__ = ["active_backend", "fused_available", "grpo_loss", "register_python_side"]
