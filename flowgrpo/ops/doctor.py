"""`flowgrpo doctor`: which GRPO loss backend runs here, and why."""

from __future__ import annotations

import platform
import sys

import torch

from . import build


def doctor_report(build_if_needed: bool = True) -> list[str]:
    """Lines describing torch, CUDA, the compilers and the loss backend per device.

    With ``build_if_needed`` (default) the fused op is built/loaded as on first use, so the
    answer is the one training will get; otherwise only what is already loaded is reported.
    """
    lines = [
        f"python {sys.version.split()[0]} ({platform.machine()}), torch {torch.__version__}",
        f"torch CUDA build: {torch.version.cuda or 'no'}; CUDA available: {torch.cuda.is_available()}"
        + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""),
        f"CPU capability: {torch.backends.cpu.get_cpu_capability()}, threads: {torch.get_num_threads()}, "
        f"fused CPU kernel ISA: {build.cpu_isa()}",
        f"C++ compiler: {build.find_cxx() or 'not found'}; ninja: {'yes' if build.have_ninja() else 'no'}",
        f"nvcc: {build.find_nvcc() or 'not found'}; CUDA kernels wanted: {build.want_cuda(None)}",
        f"extension sources: {_safe(build.source_dir)}",
        f"extension cache: {build.cache_root()}",
    ]
    if build.disabled_by_env():
        lines.append("fused op: disabled by FLOWGRPO_NO_EXT=1")
    elif build_if_needed or build.STATE.loaded:
        ok = build.ensure_loaded()
        if ok:
            lines.append(f"fused op: loaded from {build.STATE.path}")
        else:
            lines.append(f"fused op: unavailable ({build.STATE.error})")
        lines.extend(f"note: {n}" for n in build.STATE.notes)
    else:
        lines.append("fused op: not loaded yet (built on first use)")
    from .fused import active_backend

    for dev in ("cpu", "cuda"):
        if dev == "cuda" and not torch.cuda.is_available():
            backend = active_backend(dev) + " (no CUDA device)" if build.STATE.loaded else "n/a (no CUDA device)"
        else:
            backend = active_backend(dev) if (build_if_needed or build.STATE.loaded) else "not determined"
        lines.append(f"GRPO loss backend on {dev}: {backend}")
    return lines


def _safe(fn):
    try:
        return fn()
    except Exception as exc:  # pragma: no cover
        return f"not found ({exc})"


if __name__ == "__main__":  # pragma: no cover
    print("\n".join(doctor_report()))
