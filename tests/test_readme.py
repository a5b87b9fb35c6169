# SPDX-License-Identifier: Apache-2.0
"""The README's Python examples run as written: every ```python block, in order, in one
namespace (later blocks continue earlier ones), in a scratch directory. A block whose first line
is ``# needs a CUDA GPU`` runs only on a GPU; every other block must run on the NumPy backend."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from cupymoe._runtime.backend import gpu_available

ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = "# needs a CUDA GPU"


def _python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.M | re.S)


def test_readme_has_cpu_and_gpu_examples() -> None:
    blocks = _python_blocks()
    assert any(not b.startswith(GPU_ONLY) for b in blocks)
    for block in blocks:  # a block that touches CuPy or CUDA graphs says it needs a GPU
        if re.search(r"\bcupy\.|\.graph\(|record_graph", block):
            assert block.startswith(GPU_ONLY), block


def test_readme_python_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the example writes a checkpoint file
    namespace: dict[str, object] = {"__name__": "readme"}
    ran = 0
    for block in _python_blocks():
        if block.startswith(GPU_ONLY) and not gpu_available():
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "no CUDA GPU: runs the reference"
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
        ran += 1
    assert ran >= 1
    assert namespace["out"].shape == (4, 1024)  # type: ignore[attr-defined]
