# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: the ``gpu`` marker skips cleanly on machines without a CUDA device."""

from __future__ import annotations

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
def rng() -> np.random.Generator:
    """A freshly seeded generator per test: results never depend on test order."""
    return np.random.default_rng(20261130)
