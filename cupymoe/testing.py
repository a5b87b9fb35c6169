# SPDX-License-Identifier: Apache-2.0
"""Test helpers: error metrics against the float64 reference, exact integer comparison.

``assert_close`` measures two relative errors against a reference ``ref``:

* ``max_rel = max|out - ref| / max|ref|``  (the worst element, scaled by the output's range);
* ``rms_rel = ||out - ref||_2 / ||ref||_2`` (the overall error).

NaN or Inf in ``out`` where ``ref`` is finite always fails, so NaN-poisoned output buffers catch
every element a kernel forgot to write.

For tools that inspect the kernels (``scripts/sass.py``, CI's offline compile), the loader's
text and the offline NVRTC compile are re-exported here: ``kernel_source``, ``all_kernel_specs``,
``compile_offline``, ``offline_options``, ``nvrtc_module``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._runtime.backend import require_cupy, to_numpy
from ._runtime.compile import all_kernel_specs, kernel_source
from ._runtime.offline import compile_offline, nvrtc_module, offline_options

__all__ = [
    "TOLERANCES",
    "AllocationCounter",
    "all_kernel_specs",
    "assert_close",
    "assert_equal",
    "compile_offline",
    "count_allocations",
    "kernel_source",
    "nvrtc_module",
    "offline_options",
    "relative_errors",
    "tolerance_for",
]

#: (max_rel, rms_rel) by the dtype the GPU writes. bf16 has an 8-bit significand: one output
#: rounding gives <= 2^-9 relative; fp32 accumulation over K <= 8192 adds far less.
TOLERANCES: dict[str, tuple[float, float]] = {
    "bfloat16": (1.6e-2, 8e-3),
    "float16": (4e-3, 2e-3),
    "float32": (1e-4, 5e-5),
}


def tolerance_for(dtype: Any) -> tuple[float, float]:
    """``TOLERANCES`` entry for a NumPy / ml_dtypes dtype."""
    name = np.dtype(dtype).name
    if name not in TOLERANCES:
        raise KeyError(f"no tolerance for dtype {name}")
    return TOLERANCES[name]


def relative_errors(ref: Any, out: Any) -> tuple[float, float]:
    """``(max_rel, rms_rel)`` of ``out`` against ``ref`` (both converted to float64)."""
    r = to_numpy(ref).astype(np.float64)
    o = to_numpy(out).astype(np.float64)
    if r.shape != o.shape:
        raise AssertionError(f"shape mismatch: ref {r.shape}, out {o.shape}")
    if r.size == 0:
        return 0.0, 0.0
    finite = np.isfinite(r)
    if not np.array_equal(np.isnan(r), np.isnan(o)) or not np.array_equal(
        r[~finite & ~np.isnan(r)], o[~finite & ~np.isnan(r)]
    ):
        return float("inf"), float("inf")
    if not np.all(np.isfinite(o[finite])):
        return float("inf"), float("inf")
    diff = np.abs(o[finite] - r[finite])
    scale = np.max(np.abs(r[finite])) if np.any(finite) else 0.0
    norm = np.linalg.norm(r[finite])
    max_rel = float(np.max(diff) / scale) if scale > 0 else float(np.max(diff, initial=0.0))
    rms_rel = float(np.linalg.norm(diff) / norm) if norm > 0 else float(np.linalg.norm(diff))
    return max_rel, rms_rel


def assert_close(
    ref: Any, out: Any, *, max_rel: float, rms_rel: float, name: str = "output"
) -> None:
    """Fail with the worst coordinates when ``out`` is not within tolerance of ``ref``."""
    got_max, got_rms = relative_errors(ref, out)
    if got_max <= max_rel and got_rms <= rms_rel:
        return
    r = to_numpy(ref).astype(np.float64)
    o = to_numpy(out).astype(np.float64)
    bad = ~np.isclose(o, r, rtol=0, atol=max_rel * max(float(np.nanmax(np.abs(r))), 1e-300))
    bad |= np.isnan(o) != np.isnan(r)
    coords = np.argwhere(bad)[:8]
    lines = [
        f"  {tuple(int(c) for c in idx)}: ref={r[tuple(idx)]!r} out={o[tuple(idx)]!r}"
        for idx in coords
    ]
    raise AssertionError(
        f"{name}: max_rel {got_max:.3e} (limit {max_rel:.1e}), rms_rel {got_rms:.3e} "
        f"(limit {rms_rel:.1e}); {int(bad.sum())} of {bad.size} elements off, first:\n"
        + "\n".join(lines)
    )


def assert_equal(ref: Any, out: Any, *, name: str = "output") -> None:
    """Exact comparison for integer outputs (ids, offsets, permutations)."""
    r = to_numpy(ref)
    o = to_numpy(out)
    if r.shape != o.shape:
        raise AssertionError(f"{name}: shape {o.shape}, expected {r.shape}")
    if r.dtype != o.dtype:
        raise AssertionError(f"{name}: dtype {o.dtype}, expected {r.dtype}")
    if not np.array_equal(r, o):
        coords = np.argwhere(r != o)[:8]
        lines = [
            f"  {tuple(int(c) for c in idx)}: ref={r[tuple(idx)]} out={o[tuple(idx)]}"
            for idx in coords
        ]
        raise AssertionError(
            f"{name}: {int((r != o).sum())} of {r.size} elements differ, first:\n"
            + "\n".join(lines)
        )


class AllocationCounter:
    """A CuPy allocator that counts the device allocations it passes on to ``inner``.

    Every ``cupy.empty``, ``cupy.zeros``, ``astype`` and temporary of an elementwise kernel asks
    the current allocator for memory, whether or not the pool then has a free block: the count is
    of allocations requested, which a loop without allocations keeps at zero.
    """

    def __init__(self, inner: Callable[[int], Any]) -> None:
        self.inner = inner
        self.count = 0
        self.bytes = 0

    def __call__(self, size: int) -> Any:
        self.count += 1
        self.bytes += int(size)
        return self.inner(size)


@contextlib.contextmanager
def count_allocations() -> Iterator[AllocationCounter]:
    """Count the device allocations of this thread inside the ``with`` block (through
    ``cupy.cuda.using_allocator``, the memory pool still serving them)::

        with count_allocations() as counter:
            layer(x, logits, out=out)
        assert counter.count == 0
    """
    cupy = require_cupy()
    counter = AllocationCounter(cupy.cuda.get_allocator())
    with cupy.cuda.using_allocator(counter):
        yield counter
