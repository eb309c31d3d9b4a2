"""Stage (a) of ``flowgrpo bench gpu``: the fused GRPO loss op on the device.

1. **build**: :func:`flowgrpo.ops.build.build_extension` with the CUDA kernels on a GPU (the CPU
   library on the CPU), timed; a failed CUDA build is recorded and the CPU library loaded instead.
2. **tests**: the op's own test file (``tests/test_ops.py``: every check against the ``grpo_loss_ref``
   reference in float64 / float32 / bf16, on the CPU and, with a GPU, on CUDA, gradcheck and
   ``torch.library.opcheck``) run by pytest in a subprocess, optionally narrowed by ``-k``;
   passed / failed / skipped counts, failed names and skip reasons from its JUnit XML.
3. **bandwidth**: :func:`flowgrpo.benchmarks.bench_ops.measure` on the device: achieved GB/s of the
   fused op and of eager PyTorch (7 N D x 4 bytes per forward + backward) against the device's peak
   (:func:`~flowgrpo.benchmarks.gpu_setup.peak_bandwidth_gbps`) and a measured copy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class OpTests:
    """pytest's outcome. passed / failed / skipped: test counts (errors count as failed); failures:
    names of failed tests; skips: "name: reason" of the first skipped tests; seconds: wall-clock."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    skips: list[str] = field(default_factory=list)
    seconds: float = 0.0
    command: str = ""
    returncode: int | None = None
    output_tail: str = ""


def build_op(device: torch.device) -> dict:
    """Build (or load from the cache) the fused op with CUDA kernels when ``device`` is CUDA; when that
    fails, the CPU library (and ``FLOWGRPO_BUILD_CUDA=0`` for the op tests' subprocess). Returns
    {"seconds", "cuda_kernels", "library", "error", "compiler_output", "backend", "nvcc"};
    ``backend`` is :func:`flowgrpo.ops.active_backend` on ``device`` ("compiled" = the fused kernel
    serves it)."""
    from flowgrpo.ops import active_backend, build

    t0 = time.perf_counter()
    error, output = None, ""
    try:
        build.build_extension(cuda=device.type == "cuda", verbose=False)
    except Exception as exc:  # nvcc missing, compile error: the CPU library is built instead (not CUDA twice)
        text = str(exc).strip()
        error, output = f"{type(exc).__name__}: {text.splitlines()[-1] if text else exc!r}", text[-3000:]
        build.STATE.notes.append(f"requested build failed: {error}")
        if device.type == "cuda":
            os.environ["FLOWGRPO_BUILD_CUDA"] = "0"  # the op tests' subprocess does not retry it either
            try:
                build.build_extension(cuda=False, verbose=False)
            except Exception as cpu_exc:
                error += f"; CPU build: {type(cpu_exc).__name__}: {str(cpu_exc).strip()[-300:]}"
    backend = active_backend(device)
    return {"seconds": time.perf_counter() - t0, "cuda_kernels": build.STATE.cuda, "library": build.STATE.path,
            "error": error or build.STATE.error, "compiler_output": output, "backend": backend,
            "nvcc": build.find_nvcc(), "torch_cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST")}


def run_op_tests(test_file: Path, select: str | None, timeout: float, junit: Path) -> OpTests:
    """pytest on ``test_file`` (``-k select`` where given) in a subprocess of this interpreter,
    with this process's environment (the same extension cache: the library built above is reused),
    run in ``junit``'s folder: ``python -m`` puts its working directory first on sys.path, and a
    repository root there would shadow the installed flowgrpo (whose subpackages map other folders)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", str(test_file),
           f"--junitxml={junit}", "-rs"] + (["-k", select] if select else [])
    # third-party pytest plugins of the machine are not loaded (the op's tests need none), and the
    # repository's addopts (xdist workers, the slow filter) are not applied: one process, every op test
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=junit.parent)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = None, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}"
    result = OpTests(seconds=time.perf_counter() - t0, command=" ".join(cmd), returncode=rc,
                     output_tail=out[-2000:] if isinstance(out, str) else "")
    if junit.is_file():
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = case.get("name", "?")
            if case.find("failure") is not None or case.find("error") is not None:
                result.failed += 1
                result.failures.append(name)
            elif (skip := case.find("skipped")) is not None:
                result.skipped += 1
                if len(result.skips) < 20:
                    result.skips.append(f"{name}: {skip.get('message', '')}")
            else:
                result.passed += 1
    return result


def measure_bandwidth(device: torch.device, peak_gbps: float | None, repeats: int, dims, n: int,
                      impls: tuple[str, ...]) -> dict:
    """:func:`bench_ops.measure` on ``device`` with each row's share of the peak and of the copy."""
    from .bench_ops import measure

    res = measure(device, repeats=repeats, dims=dims, n=n, impls=impls)
    for row in res["rows"]:
        row["pct_of_copy"] = 100 * row["gbps"] / res["copy_gbps"]
        row["pct_of_peak"] = 100 * row["gbps"] / peak_gbps if peak_gbps else None
    res.update(N=n, peak_gbps=peak_gbps, copy_pct_of_peak=100 * res["copy_gbps"] / peak_gbps if peak_gbps else None)
    return res


def run_ops_stage(device: torch.device, out: Path, *, tests_dir: str | Path, select: str | None, test_timeout: float,
                  peak_gbps: float | None, repeats: int, dims, n: int, impls: tuple[str, ...], log,
                  compile_within_s: float = float("inf")) -> dict:
    """Build, tests and bandwidth (module docstring); each part guarded, so one failing part is
    recorded ("error") and the others still run; "compiled" is left out of the bandwidth when build
    and tests took longer than ``compile_within_s``. Returns the stage's JSON dict, with ``status``
    "failed" and the ``error`` when an op test failed or pytest did not run them."""
    began = time.perf_counter()
    result: dict = {}
    log("ops: building the extension" + (" with CUDA kernels" if device.type == "cuda" else ""))
    try:
        result["build"] = build_op(device)
    except Exception as exc:
        result["build"] = {"error": f"{type(exc).__name__}: {exc}"}
    log("ops: build " + ", ".join(f"{k} {v}" for k, v in result["build"].items() if k != "compiler_output"))
    test_file = Path(tests_dir).resolve() / "test_ops.py"
    if test_file.is_file():
        log(f"ops: pytest {test_file}" + (f" -k {select!r}" if select else ""))
        result["tests"] = asdict(run_op_tests(test_file, select, test_timeout, out / "gpu_ops_junit.xml"))
        t = result["tests"]
        log(f"ops: {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped in {t['seconds']:.0f} s")
    else:
        result["tests"] = {"skipped": f"{test_file} not found (run from the repository root or pass --tests DIR)"}
    if "compiled" in impls and time.perf_counter() - began > compile_within_s:  # inductor's compile costs time
        impls = tuple(i for i in impls if i != "compiled")
        result["compiled_skipped"] = f"build and tests took over {compile_within_s:.0f} s: no time for torch.compile"
    log(f"ops: bandwidth of {', '.join(impls)}")
    try:
        result["bandwidth"] = measure_bandwidth(device, peak_gbps, repeats, dims, n, impls)
    except Exception as exc:
        if "compiled" in impls:  # inductor unavailable here: the fused op against eager still counts
            log(f"ops: bandwidth with torch.compile failed ({type(exc).__name__}: {exc}); again without it")
            result["bandwidth"] = measure_bandwidth(device, peak_gbps, repeats, dims, n,
                                                    tuple(i for i in impls if i != "compiled"))
            result["bandwidth"]["compiled_error"] = f"{type(exc).__name__}: {exc}"
        else:
            raise
    tests = result["tests"]
    if "passed" in tests and (tests["failed"] or tests["returncode"] not in (0, 5) or not tests["passed"]):
        result["status"] = "failed"
        result["error"] = (f"op tests: {tests['failed']} failed, {tests['passed']} passed (pytest exit "
                           f"{tests['returncode']}): {', '.join(tests['failures'][:5]) or tests['output_tail'][-300:]}")
    return result
