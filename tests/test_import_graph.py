"""The import graph of flowgrpo has no cycles, between modules or between folders.

Every ``import`` statement in the package's sources is read with ``ast`` (module level and inside
functions alike: a late import hides a cycle from the interpreter, not from a reader), resolved to a
flowgrpo module, and the graph is checked for cycles. Folders are the stages (samplers, rewards, ops,
policies, shapes, trainer, benchmarks, ...); each top-level module of ``flowgrpo/`` is its own node,
and ``flowgrpo.errors`` / ``flowgrpo.registry`` are the shared leaves every folder may import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> installed package (pyproject's package-dir)
PACKAGE_DIRS = {"flowgrpo": "flowgrpo", "samplers": "flowgrpo.samplers", "rewards": "flowgrpo.rewards",
                "benchmarks": "flowgrpo.benchmarks"}
LEAVES = ("flowgrpo.errors", "flowgrpo.registry")


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in PACKAGE_DIRS.items():
        base = ROOT / folder
        if not base.is_dir():
            continue
        for path in base.rglob("*.py"):
            if folder == "benchmarks" and path.relative_to(base).parts[0] == "experiments":
                continue  # scripts kept with their results, not modules of the package (no __init__.py)
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """flowgrpo modules imported anywhere in ``path`` (module ``name``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = name if _is_package(path) else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # "a.b.attr" -> the module "a.b"
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("flowgrpo"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if not mod.startswith("flowgrpo"):
                continue
            for alias in node.names:  # "from . import mix" imports the module flowgrpo.samplers.mix
                if f"{mod}.{alias.name}" in known:
                    add(f"{mod}.{alias.name}")
                else:
                    add(mod)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def _folder(module: str) -> str:
    if module in LEAVES:
        return module
    parts = module.split(".")
    # flowgrpo.X.Y -> flowgrpo.X (a folder); flowgrpo.X where X is a file -> itself
    return ".".join(parts[:2])


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_scanner_sees_relative_and_late_imports():
    g = _graph()
    assert "flowgrpo.samplers.steps" in g
    # samplers/forest_sampler.py: "from .steps import ..." at module level
    assert "flowgrpo.samplers.steps" in g["flowgrpo.samplers.forest_sampler"]
    # config.validation's validate imports the registries inside a function
    assert "flowgrpo.policies" in g["flowgrpo.config.validation"]


def test_the_cycle_finder_finds_a_planted_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_level_cycles():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_folder_level_cycles():
    folders: dict[str, set[str]] = {}
    for mod, deps in _graph().items():
        f = _folder(mod)
        folders.setdefault(f, set()).update(_folder(d) for d in deps if _folder(d) != f)
    cycle = _find_cycle(folders)
    assert cycle is None, "folder-level import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("leaf", LEAVES)
def test_shared_leaves_import_nothing_but_each_other(leaf):
    deps = _graph()[leaf]
    assert deps <= set(LEAVES), f"{leaf} imports {sorted(deps - set(LEAVES))}"


#: the stages every model shares: the embedded world enters them only through registries (by name),
#: like any model, reward or evaluator
GENERIC = ("flowgrpo.trainer", "flowgrpo.objectives", "flowgrpo.samplers", "flowgrpo.policies")


@pytest.mark.parametrize("package", GENERIC)
def test_generic_stages_never_import_the_shapes_world(package):
    graph = _graph()
    found = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() if mod == package or mod.startswith(package + ".")
                   for dep in deps if dep == "flowgrpo.shapes" or dep.startswith("flowgrpo.shapes."))
    assert not found, "the shapes world imported by generic code: " + "; ".join(found)
