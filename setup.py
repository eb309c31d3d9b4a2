"""Package list for setuptools, derived from the folders so that no one keeps it by hand.

pyproject.toml holds all metadata. The folders named in its ``[tool.setuptools] package-dir``
(``rewards/``, ``samplers/``, ``benchmarks/``, ``csrc/`` at the top of the repository) install as
subpackages of ``flowgrpo``; every folder below one of them that has an ``__init__.py`` is a package.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _packages() -> list[str]:
    """Each mapped root's package name and every subpackage found under its folder."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    packages = []
    for package, folder in mapping.items():
        packages.append(package)
        packages += [f"{package}.{sub}" for sub in find_packages(str(ROOT / folder))]
    return sorted(packages)


setup(packages=_packages())
