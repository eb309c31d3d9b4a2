"""Run the flowgrpo CLI in this process, then write this process's peak memory (for ``bench memory``).

``python -m flowgrpo.benchmarks.memory_probe DIR ARGS...`` runs ``python -m flowgrpo ARGS...`` in this
process (through ``runpy``, so that this module does not import the CLI that imports the benchmarks)
and writes ``DIR/rank<RANK>.json`` = ``{"rank", "peak_rss_mb", "peak_cuda_mb", "exit_code"}``: the
peak resident set size of this process (:func:`peak_rss_mb`: ``VmHWM``, or ``ru_maxrss``) and, with CUDA,
``torch.cuda.max_memory_allocated()`` (None without CUDA). Under a distributed launcher every
process writes its own file (``RANK`` from the environment). ``--imports-only`` instead of the
arguments only imports what a training run imports (the trainer, the SD3 adapter, diffusers'
SD3 pipeline): the fixed cost in every row of the table.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB: ``VmHWM`` of ``/proc/self/status`` on Linux, else
    ``ru_maxrss``. Linux keeps ``ru_maxrss`` across ``execve``, so a process started by a large parent
    (a test runner of 1 GB) would report the parent's size at the fork; ``VmHWM`` belongs to the
    process's own address space and starts again at ``execve``."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux, bytes on macOS


def peak_memory() -> dict:
    """``{"peak_rss_mb", "peak_cuda_mb"}`` of this process so far (MiB; CUDA None where unavailable)."""
    rss = peak_rss_mb()
    cuda = None
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            cuda = torch.cuda.max_memory_allocated() / 2**20
    return {"peak_rss_mb": rss, "peak_cuda_mb": cuda}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        print("usage: python -m flowgrpo.benchmarks.memory_probe DIR flowgrpo-arguments...", file=sys.stderr)
        return 2
    out, args = Path(argv[0]), argv[1:]
    if args == ["--imports-only"]:
        import diffusers.pipelines.stable_diffusion_3  # noqa: F401
        import flowgrpo.policies.diffusers.sd3  # noqa: F401
        import flowgrpo.trainer.trainer  # noqa: F401

        code = 0
    else:  # exactly `python -m flowgrpo ARGS...`, in this process
        import runpy

        sys.argv = ["flowgrpo", *args]
        try:
            runpy.run_module("flowgrpo", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **peak_memory(), "exit_code": code}))
    return code or 0


if __name__ == "__main__":
    raise SystemExit(main())
