# SPDX-License-Identifier: Apache-2.0
"""The package's import graph: no cycles, and each layer imports only the layers below it (CPU).

Every module is parsed (not imported) and every ``import`` statement counts, including those
inside functions, so a deferred import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import cupymoe

#: Layers from the bottom: a module may import its own layer (its folder) and those below it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_version", "_runtime"),
    ("formats",),
    ("routing",),
    ("experts",),
    ("layer",),
    ("parallel",),  # expert parallelism: above the layer, imported only by the top level
    ("io",),
    ("presets",),
    ("testing",),
    ("bench",),
    ("cli",),
    ("__main__",),  # python -m cupymoe: the command
    ("",),  # cupymoe/__init__.py: the public API
)
_RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _modules() -> dict[str, Path]:
    """Every module of the package by name, with its file (packages: their ``__init__.py``)."""
    found = {"cupymoe": Path(cupymoe.__file__)}
    for info in pkgutil.walk_packages(cupymoe.__path__, prefix="cupymoe."):
        spec = importlib.util.find_spec(info.name)
        assert spec is not None and spec.origin is not None, info.name
        found[info.name] = Path(spec.origin)
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Package modules that ``name`` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = {f"{module}.{alias.name}" for alias in node.names}
            targets.update(submodules)
            # ``from <package> import <name>`` depends on the package's ``__init__`` unless every
            # name is a submodule (``from . import cache``: the package is already importing)
            if not submodules <= set(MODULES):
                targets.add(module)
    return {t for t in targets if t in MODULES and t != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_is_in_a_layer() -> None:
    assert {_layer(name) for name in MODULES} <= set(_RANK)


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(GRAPH[name]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_layers_import_only_layers_below() -> None:
    wrong = [
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if _layer(target) != _layer(name) and _RANK[_layer(target)] >= _RANK[_layer(name)]
    ]
    assert not wrong, "imports of a layer that is not below: " + ", ".join(sorted(wrong))


def test_tune_is_the_top_of_experts() -> None:
    users = sorted(n for n, targets in GRAPH.items() if "cupymoe.experts.tune" in targets)
    assert users == ["cupymoe.cli"]


def test_only_the_top_level_imports_parallel() -> None:
    users = sorted(
        n
        for n, targets in GRAPH.items()
        if _layer(n) != "parallel" and any(_layer(t) == "parallel" for t in targets)
    )
    assert users == ["cupymoe"]


def test_config_reads_the_cache_without_tune() -> None:
    assert "cupymoe.experts.tune" not in GRAPH["cupymoe.experts.config"]
    assert "cupymoe.experts.cache" in GRAPH["cupymoe.experts.config"]


def test_cycle_detection_sees_function_level_imports(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from .formats import codes\n", encoding="utf-8")
    assert "cupymoe.formats.codes" in _imports("cupymoe.x", source)
