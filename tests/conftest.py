# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: the ``gpu`` marker skips cleanly on machines without a CUDA device."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from cupymoe._runtime.backend import gpu_available


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CuPy sees no device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repo_script() -> Callable[[str], ModuleType]:
    """Loads a script of the repository (``"benchmarks/bench_ab.py"``, ``"scripts/sass.py"``) as
    a module, registered in ``sys.modules`` (dataclasses look their module up there)."""

    def load(relative: str) -> ModuleType:
        path = Path(__file__).resolve().parents[1] / relative
        name = path.stem
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def rng() -> np.random.Generator:
    """A freshly seeded generator per test: results never depend on test order."""
    return np.random.default_rng(20261130)
