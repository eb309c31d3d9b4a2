"""Compile-only check of the CUDA kernel (csrc/grpo_loss_cuda.cu) with nvcc.

Runs wherever torch has CUDA and a CUDA toolkit (CUDA_HOME or PATH) has nvcc, GPU or not; it
compiles one architecture (TORCH_CUDA_ARCH_LIST's first entry, else sm_90) into a temp dir and
loads nothing into the process. About a minute on 2 CPU cores.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.ops import build


def _skip_reason() -> str | None:
    if not torch.version.cuda:
        return "torch is a CPU-only build"
    if build.find_nvcc() is None:
        return "nvcc not found (set CUDA_HOME)"
    return None


@pytest.mark.slow  # about 70 s of nvcc/ninja on 2 cores; `pytest -m slow` runs it (the CPU op is tested by default)
@pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")
def test_cuda_source_compiles(tmp_path):
    obj = build.cuda_compile_check(tmp_path)
    assert obj.is_file() and obj.stat().st_size > 0
