# SPDX-License-Identifier: Apache-2.0
"""The example notebooks run end to end (on a machine without a GPU: the reference backend).

Each notebook runs in a fresh Jupyter kernel of this very interpreter, with the Agg backend
and the checkout on ``sys.path``, and must finish without an error. Notebooks are committed
without outputs; that is checked too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = ("quickstart.ipynb", "formats.ipynb", "performance.ipynb")
KERNEL = "cupymoe-tests"
CELL_TIMEOUT_S = 300  # generous: a GPU machine compiles the kernels on first use


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernel spec that runs this interpreter, whatever ``python3`` means on this machine."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + (os.pathsep + path if path else ""))
    return KERNEL


def _execute(name: str, kernel: str, parameters: str | None = None) -> Any:
    """Run ``examples/name`` in ``examples/``; ``parameters`` replaces the cell tagged so."""
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    if parameters is not None:
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name}: expected one cell tagged 'parameters'"
        tagged[0].source = parameters
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any exception
    return nb


def _stdout(nb: Any) -> str:
    return "".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "stream" and out.name == "stdout"
    )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs(name: str) -> None:
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{name}: no code cells"
    dirty = [i for i, c in enumerate(code) if c.outputs or c.execution_count is not None]
    assert not dirty, f"{name}: code cells {dirty} carry outputs; clear them before committing"


# quickstart: the whole API on a small layer (seconds); formats: the quantizers on 4 x 0.5M
# weights, about 10 s on a 2-core CPU.
@pytest.mark.parametrize("name", ["quickstart.ipynb", "formats.ipynb"])
def test_notebook_runs(name: str, kernel: str) -> None:
    nb = _execute(name, kernel)
    assert _stdout(nb), f"{name}: printed nothing"


def test_performance_without_results(kernel: str, tmp_path: Path) -> None:
    missing = tmp_path / "absent.json"
    nb = _execute("performance.ipynb", kernel, f"BENCH_JSON = {str(missing)!r}")
    assert "cupymoe bench --json" in _stdout(nb)


def _synthetic_results() -> dict[str, Any]:
    """Made-up records in the ``cupymoe bench --json`` schema, to exercise the plots only."""
    results = []
    for preset, fmt, stages in (
        ("preset-a", "nvfp4", True),
        ("preset-b", "mxfp4", False),  # a series without per-stage times
    ):
        for tokens in (1, 2, 4, 8):
            floor_us, us = 1.0 * tokens, 2.0 * tokens + 1.0
            record = {
                "mode": "eager" if tokens == 8 else "graph",
                "preset": preset,
                "format": fmt,
                "dtype": "bf16",
                "tokens": tokens,
                "us_per_layer": us,
                "floor_us": floor_us,
                "pct_of_floor": 100.0 * floor_us / us,
                "distinct_bytes": 1000 * tokens,
                "effective_tbps": 1.0,
            }
            if stages:
                record["stages_us"] = {"route": 0.5, "fc1": us / 2, "fc2": us / 4}
            results.append(record)
    return {"gpu": "synthetic", "hbm_read_tbps": 4.5, "results": results}


def test_performance_plots_a_results_file(kernel: str, tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_synthetic_results()))
    text = _stdout(_execute("performance.ipynb", kernel, f"BENCH_JSON = {str(path)!r}"))
    assert f"8 results from {path}" in text
    assert "preset-a nvfp4 bf16" in text and "preset-b mxfp4 bf16" in text
    # Each point is marked by how it was timed; the plot claims no single mode for all.
    assert text.count("eager calls: 2 points; CUDA-graph replay: 6 points") == 2  # time, TB/s
    source = (EXAMPLES / "performance.ipynb").read_text()
    assert "time per layer (CUDA-graph replay)" not in source


def test_performance_as_committed(kernel: str) -> None:
    """Plots benchmarks/h200.json when it is committed, else explains how to produce it."""
    text = _stdout(_execute("performance.ipynb", kernel))
    committed = (ROOT / "benchmarks" / "h200.json").is_file()
    assert ("results from" in text) if committed else ("cupymoe bench --json" in text)
