"""Just-in-time build of the fused GRPO loss op in csrc/ (cached), and ahead-of-time `build-ext`.

The sources ship as package data of ``flowgrpo.csrc``; nothing is compiled at ``pip install``.
On first use, :func:`ensure_loaded` compiles them with ``torch.utils.cpp_extension.load`` into a
cache directory (``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/flowgrpo/extensions``, one sub-folder per
Python / torch / build variant) and loads the library, which registers ``torch.ops.flowgrpo.*``.
Later processes find the cached library and only load it (ninja sees nothing to do).

Environment:
    FLOWGRPO_NO_EXT=1        never build or load the extension; the PyTorch reference runs.
    FLOWGRPO_BUILD_CUDA=0|1  build the CUDA kernels (default: when torch has CUDA, nvcc exists and
                             a GPU is visible).
    FLOWGRPO_CPU_ISA=base|avx2  instruction set of the CPU kernel (default: avx2 where torch
                             reports AVX2/AVX512; the cache directory is keyed by it).
    FLOWGRPO_HUGEPAGES=0     (runtime) allocate the CPU gradient without the transparent-huge-page
                             hint (on by default for gradients of 4 MiB and more, on Linux).
    MAX_JOBS, CXX, CUDA_HOME, TORCH_CUDA_ARCH_LIST, TORCH_EXTENSIONS_DIR: as for torch extensions.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger("flowgrpo.ops")


def _quiet_cpp_extension_import() -> None:
    """Import torch.utils.cpp_extension without its CUDA_HOME guess warning on CPU-only machines.

    The warning ("No CUDA runtime is found, using CUDA_HOME=...") is noise when no CUDA kernel is
    wanted; `flowgrpo doctor` reports the CUDA situation instead.
    """
    if "torch.utils.cpp_extension" in sys.modules:
        return
    ext_log = logging.getLogger("torch.utils.cpp_extension")
    level = ext_log.level
    ext_log.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension  # noqa: F401
    finally:
        ext_log.setLevel(level)


_quiet_cpp_extension_import()

CPP_SOURCES = ("grpo_loss.cpp",)
CUDA_SOURCES = ("grpo_loss_cuda.cu",)
HEADERS = ("grpo_loss.h", "grpo_loss_ops.h")
OP_NAMESPACE = "flowgrpo"


@dataclass
class LoadState:
    """What this process has loaded (the library can be loaded only once per process)."""

    attempted: bool = False
    loaded: bool = False
    cuda: bool = False  # whether the loaded library has CUDA kernels
    path: str | None = None
    error: str | None = None  # why the extension is unavailable, when it is
    notes: list[str] = field(default_factory=list)


STATE = LoadState()
_LOCK = threading.RLock()


def disabled_by_env() -> bool:
    return os.environ.get("FLOWGRPO_NO_EXT", "").strip().lower() in ("1", "true", "yes", "on")


def source_dir() -> Path:
    """Folder holding the csrc/ sources (installed as package data of ``flowgrpo.csrc``)."""
    try:
        import importlib.resources as resources

        # flowgrpo.csrc is a namespace package (no __init__.py): files() gives a MultiplexedPath,
        # whose joinpath() gives the real file.
        f = resources.files("flowgrpo.csrc").joinpath(CPP_SOURCES[0])
        if f.is_file():
            return Path(str(f)).parent
    except (ModuleNotFoundError, TypeError, ValueError, NotImplementedError):
        pass
    # Editable installs made before csrc/ was mapped to flowgrpo.csrc: the repository's own copy.
    p = Path(__file__).resolve().parents[2] / "csrc"
    if (p / CPP_SOURCES[0]).is_file():
        return p
    raise FileNotFoundError("flowgrpo.csrc sources (grpo_loss.cpp) not found in the installation")


def cache_root() -> Path:
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "flowgrpo" / "extensions"


def _tag() -> str:
    """ABI tag of this interpreter + torch build: cached libraries are never shared across them."""
    tv = re.sub(r"[^0-9A-Za-z]+", "_", torch.__version__)
    return f"py{sys.version_info.major}{sys.version_info.minor}_torch{tv}_{platform.machine()}"


def extension_name(cuda: bool) -> str:
    return "flowgrpo_ops_cuda" if cuda else "flowgrpo_ops_cpu"


def cpu_isa() -> str:
    """Instruction set the CPU code is compiled for: "avx2" (AVX2 + FMA + F16C, used when torch
    reports AVX2 or AVX512 for this CPU) or "base" (the compiler's default target). The build
    directory is keyed by it, so a cache shared by different machines never hands one a library
    its CPU cannot run. FLOWGRPO_CPU_ISA=base|avx2 overrides."""
    env = os.environ.get("FLOWGRPO_CPU_ISA", "").strip().lower()
    if env in ("base", "avx2"):
        return env
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform == "win32":
        return "base"
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover
        return "base"
    return "avx2" if cap in ("AVX2", "AVX512") else "base"


def build_directory(cuda: bool) -> Path:
    return cache_root() / _tag() / f"{extension_name(cuda)}_{cpu_isa()}"


def find_cxx() -> str | None:
    """The C++ compiler torch's extension builder would use, if present."""
    cxx = os.environ.get("CXX") or ("cl" if sys.platform == "win32" else "c++")
    return shutil.which(cxx)


def find_nvcc() -> str | None:
    """nvcc of CUDA_HOME (as torch resolves it), else nvcc on PATH; None without CUDA toolkit."""
    if not torch.version.cuda:
        return None
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # pragma: no cover - broken torch install
        CUDA_HOME = None
    if CUDA_HOME:
        p = Path(CUDA_HOME) / "bin" / ("nvcc.exe" if sys.platform == "win32" else "nvcc")
        if p.is_file():
            return str(p)
    return shutil.which("nvcc")


def have_ninja() -> bool:
    try:
        from torch.utils.cpp_extension import is_ninja_available

        return bool(is_ninja_available())
    except Exception:  # pragma: no cover
        return shutil.which("ninja") is not None


def want_cuda(cuda: bool | None = None) -> bool:
    """Whether a build should include the CUDA kernels.

    ``cuda=True`` asks for them (and fails later when torch has no CUDA or nvcc is missing);
    ``None`` decides: FLOWGRPO_BUILD_CUDA if set, else only when torch has CUDA, nvcc exists and
    a GPU is visible (a CPU-only machine never pays for an nvcc build it cannot use).
    """
    if cuda is not None:
        return bool(cuda)
    if not torch.version.cuda or find_nvcc() is None:
        return False
    env = os.environ.get("FLOWGRPO_BUILD_CUDA", "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    return torch.cuda.is_available()


def _cflags() -> list[str]:
    if sys.platform == "win32":
        return ["/O2", "/openmp"]
    flags = ["-O3"]
    if sys.platform.startswith("linux"):
        flags.append("-fopenmp")  # at::parallel_for is inline: without OpenMP it runs serially
    if cpu_isa() == "avx2":
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return flags


def _ldflags() -> list[str]:
    return ["-fopenmp"] if sys.platform.startswith("linux") else []


def _cuda_cflags() -> list[str]:
    return ["-O3", "-lineinfo"]


def build_extension(
    cuda: bool | None = None, verbose: bool = True, build_dir: str | os.PathLike | None = None
) -> str:
    """Compile (if needed) and load the fused op library into this process; return its path.

    Args:
        cuda: include the CUDA kernels (None: decide with :func:`want_cuda`).
        verbose: show the compiler output.
        build_dir: override the cache directory.

    Raises RuntimeError with the reason when it cannot be built or loaded. Only one variant can
    be loaded per process (the operator namespace is registered once); asking for a different
    one afterwards raises.
    """
    with _LOCK:
        use_cuda = want_cuda(cuda)
        if STATE.loaded:
            if use_cuda and not STATE.cuda:
                raise RuntimeError(
                    "the CPU-only fused op is already loaded in this process; build the CUDA "
                    "variant in a fresh process (`flowgrpo build-ext --cuda`)"
                )
            return STATE.path or ""
        if find_cxx() is None:
            raise RuntimeError("no C++ compiler found (set CXX or install g++/clang++)")
        if not have_ninja():
            raise RuntimeError("ninja is not installed (pip install ninja)")
        if use_cuda:
            if not torch.version.cuda:
                raise RuntimeError("this torch build has no CUDA support")
            if find_nvcc() is None:
                raise RuntimeError("nvcc not found (set CUDA_HOME to a CUDA toolkit)")
        from torch.utils import cpp_extension

        src = source_dir()
        sources = [str(src / s) for s in CPP_SOURCES]
        if use_cuda:
            sources += [str(src / s) for s in CUDA_SOURCES]
        bdir = Path(build_dir) if build_dir is not None else build_directory(use_cuda)
        bdir.mkdir(parents=True, exist_ok=True)
        name = extension_name(use_cuda)
        log.info("building/loading %s in %s", name, bdir)
        path = cpp_extension.load(
            name=name,
            sources=sources,
            extra_cflags=_cflags(),
            extra_cuda_cflags=_cuda_cflags() if use_cuda else None,
            extra_ldflags=_ldflags(),
            extra_include_paths=[str(src)],
            build_directory=str(bdir),
            verbose=verbose,
            with_cuda=use_cuda,
            is_python_module=False,
        )
        STATE.attempted = True
        STATE.loaded = True
        STATE.cuda = use_cuda
        STATE.path = str(path) if path else str(bdir / f"{name}.so")
        STATE.error = None
        return STATE.path


def ensure_loaded() -> bool:
    """Load the fused op once per process, building it on first use; False (and the reason in
    ``STATE.error``) when it is unavailable. A failed CUDA build falls back to the CPU build."""
    if STATE.loaded:
        return True
    if STATE.attempted:
        return False
    with _LOCK:
        if STATE.loaded or STATE.attempted:
            return STATE.loaded
        if disabled_by_env():
            STATE.attempted = True
            STATE.error = "disabled by FLOWGRPO_NO_EXT=1"
            return False
        verbose = os.environ.get("FLOWGRPO_EXT_VERBOSE", "") == "1"
        tries = [True, False] if want_cuda(None) else [False]
        errors = []
        for use_cuda in tries:
            try:
                build_extension(cuda=use_cuda, verbose=verbose)
                if errors:
                    STATE.notes.extend(errors)
                return True
            except Exception as exc:  # compiler missing, compile error, load error
                msg = str(exc).strip().splitlines()
                errors.append(f"{'CUDA' if use_cuda else 'CPU'} build failed: {msg[-1] if msg else exc!r}")
        STATE.attempted = True
        STATE.error = "; ".join(errors)
        return False


def has_kernel(device: torch.device | str) -> bool:
    """Whether the loaded library serves tensors on ``device`` (after :func:`ensure_loaded`)."""
    if not STATE.loaded:
        return False
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return STATE.cuda
    return False


def cuda_compile_check(out_dir: str | os.PathLike, arch: str | None = None, timeout: float = 1800) -> Path:
    """Compile-only check of the CUDA source: ``nvcc -c grpo_loss_cuda.cu`` with torch's include
    paths and flags, for one architecture (``arch`` like "90", default from TORCH_CUDA_ARCH_LIST
    or 90). Returns the object file; raises RuntimeError with nvcc's output on failure."""
    from torch.utils import cpp_extension

    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found")
    if arch is None:
        env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
        arch = env[0].replace(".", "").replace("+PTX", "") if env else "90"
    src = source_dir()
    out = Path(out_dir) / "grpo_loss_cuda.o"
    abi = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))
    cmd = [
        nvcc, "-c", str(src / CUDA_SOURCES[0]), "-o", str(out),
        f"-I{src}", *[f"-I{p}" for p in cpp_extension.include_paths(device_type="cuda")],
        *cpp_extension.COMMON_NVCC_FLAGS,
        "-DTORCH_API_INCLUDE_EXTENSION_H", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        "-std=c++20", "--compiler-options", "-fPIC", "-O3",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return out


__all__ = [
    "STATE",
    "build_directory",
    "build_extension",
    "cache_root",
    "cpu_isa",
    "cuda_compile_check",
    "disabled_by_env",
    "ensure_loaded",
    "extension_name",
    "find_cxx",
    "find_nvcc",
    "has_kernel",
    "source_dir",
    "want_cuda",
]
