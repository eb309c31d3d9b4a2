"""A non-editable install works: the wheel holds every package, the benchmarks, presets, csrc
sources and shipped weights (fast); and, in a fresh venv, the installed ``flowgrpo`` command runs
from another directory and writes only where it is told (slow).

Both build the wheel from a copy of the sources, so the build leaves nothing in the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import cli_env

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it installs as (pyproject.toml [tool.setuptools] package-dir)
SOURCE_PACKAGES = {"flowgrpo": "flowgrpo", "rewards": "flowgrpo.rewards", "samplers": "flowgrpo.samplers",
                   "benchmarks": "flowgrpo.benchmarks"}
BENCHES = ("bench_ops.py", "bench_samplers.py", "bench_e2e.py", "bench_profile.py")


def _build_wheel(dest: Path) -> Path:
    src = dest / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in (*SOURCE_PACKAGES, "csrc"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(dest / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (dest / "dist").glob("flowgrpo-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    try:
        import setuptools  # noqa: F401  (the build runs without isolation, with this environment's setuptools)
    except ImportError:
        pytest.skip("setuptools is not installed in this environment")
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def _expected_files() -> set[str]:
    """Every module of every package folder, the presets, csrc sources, shipped weights and benchmark prompt
    sets, by the path they must have in the wheel."""
    want = set()
    for folder, package in SOURCE_PACKAGES.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            pkg_dir = init.parent
            if "__pycache__" in pkg_dir.parts:
                continue
            target = "/".join([*package.split("."), *pkg_dir.relative_to(base).parts])
            want |= {f"{target}/{m.name}" for m in pkg_dir.glob("*.py")}
    presets = ROOT / "flowgrpo/presets"  # the papers' methods and, in worlds/<recipe>/, the world presets
    want |= {f"flowgrpo/presets/{p.relative_to(presets).as_posix()}" for p in presets.rglob("*.yaml")}
    want |= {f"flowgrpo/csrc/{p.name}" for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h", ".cuh")}
    want |= {f"flowgrpo/shapes/weights/{p.name}" for p in (ROOT / "flowgrpo/shapes/weights").iterdir()}
    want |= {f"flowgrpo/benches/data/{p.name}" for p in (ROOT / "flowgrpo/benches/data").iterdir()}
    return want


def test_wheel_holds_packages_benchmarks_and_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_expected_files() - names)
    assert not missing, (f"missing from the wheel (every folder with an __init__.py below a package-dir root is a "
                         f"package (setup.py)): {missing}")
    for b in BENCHES:
        assert f"flowgrpo/benchmarks/{b}" in names
    assert {"flowgrpo/csrc/grpo_loss.cpp", "flowgrpo/presets/flow-grpo.yaml",
            "flowgrpo/presets/worlds/shapes/shapes-nft.yaml", "flowgrpo/shapes/weights/model.safetensors"} <= names
    # the reference results, the tests and the repository layout stay out of the installation
    assert not [n for n in names if "results/" in n or n.startswith(("benchmarks/", "tests/", "samplers/"))]


def _fresh_venv(tmp: Path, wheel: Path) -> Path:
    """A new venv with the wheel installed (no editable finder); its dependencies are this
    environment's, reached through a path entry, so nothing is downloaded."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    proc = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # then (so that pip does not find this environment's flowgrpo already installed) a plain path line:
    # the folder goes on sys.path after the venv's own site-packages, and its .pth files (an editable
    # flowgrpo finder among them) are not run
    Path(site, "host_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
def test_installed_commands_run_elsewhere_and_write_only_where_asked(wheel, tmp_path):
    venv = _fresh_venv(tmp_path, wheel)
    exe = venv / "bin" / "flowgrpo"
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import flowgrpo, pathlib; "
                                "print(pathlib.Path(flowgrpo.__file__).parent)"],
                               capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip())
    assert site.is_relative_to(venv) and not site.is_relative_to(ROOT)
    installed = _files_under(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}

    def run(*args, timeout=600):
        proc = subprocess.run([str(exe), *args], cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"flowgrpo {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    assert "shapes" in run("presets").split()
    assert f"extension sources: {site / 'csrc'}" in run("doctor")
    assert "│ loss.grpo.clip_range " in run("config", "explain", "loss")
    out = run("bench", "ops", "--json", "ops.json", "--out", "res", "--repeats", "1")
    assert "fused" in out
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "flowgrpo.benchmarks.bench_samplers",
                           "--presets", "mix-grpo", "--iterations", "1", "--warmup", "0", "--num-steps", "5",
                           "--group-size", "2", "--prompts", "1", "--resolution", "32", "--out", "res2"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _files_under(work) == {"ops.json", "res/ops.csv", "res/ops.png", "res2/samplers.csv", "res2/samplers.png"}
    assert _files_under(site) == installed  # nothing written into site-packages
    assert not os.path.exists(site / "benchmarks" / "results")
