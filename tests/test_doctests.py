# SPDX-License-Identifier: Apache-2.0
"""The examples in the package's docstrings run and give what they show (CPU)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import cupymoe

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(cupymoe.__path__, prefix="cupymoe.")
    if m.name != "cupymoe.__main__"
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_examples_exist() -> None:
    # The modules whose helpers document themselves by example (guards against a silent no-op).
    attempted = 0
    for name in ("cupymoe.formats.codes", "cupymoe.experts.layouts", "cupymoe.experts.batched"):
        attempted += doctest.testmod(importlib.import_module(name), verbose=False).attempted
    assert attempted >= 5
