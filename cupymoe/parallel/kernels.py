# SPDX-License-Identifier: Apache-2.0
"""The exchange's small device kernels (CuPy ``ElementwiseKernel``; no ``RawModule``): the
device side of :mod:`.plan`, one function per step, each with its NumPy meaning in the
docstring. Rows are moved as ``uint16`` words (bf16 and fp16 alike): bitwise copies.

Not run on a GPU in this repository yet (see ``docs/parallel.md``); the CPU tests check the plan
they implement, ``tests/test_parallel_gpu.py`` checks them on the device.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .._runtime.backend import require_cupy

__all__ = ["gather_rows", "home_tables", "local_rows", "local_tables", "pack_rows", "return_rows"]


@functools.cache
def _kernel(name: str) -> Any:
    cupy = require_cupy()
    params, out, code = _SOURCES[name]
    return cupy.ElementwiseKernel(params, out, code, f"cupymoe_ep_{name}")


_SOURCES = {
    # one thread: exclusive scan of the counts over each owner's experts
    "home_tables": (
        "raw int32 offsets, raw int32 owner, raw int32 local, int32 n_experts, int32 world, "
        "int32 e_max",
        "raw int32 base, raw int32 run, raw int32 counts_to",
        """
        if (i != 0) return;
        for (int t = 0; t < world * e_max; ++t) counts_to[t] = 0;
        for (int d = 0; d < world; ++d) run[d] = 0;
        for (int e = 0; e < n_experts; ++e) {
            const int c = offsets[e + 1] - offsets[e];
            const int d = owner[e];
            base[e] = run[d];
            run[d] += c;
            counts_to[d * e_max + local[e]] = c;
        }
        """,
    ),
    # one thread per (expanded row, word): send[slot[r]] = x[sorted_rows[r] / top_k]
    "pack_rows": (
        "raw uint16 x, raw int32 sorted_rows, raw int32 ids, raw int32 offsets, raw int32 owner, "
        "raw int32 base, int32 top_k, int32 width, int32 cap",
        "raw uint16 send, raw int32 slot",
        """
        const int r = i / width, c = i % width;
        const int src = sorted_rows[r];
        const int e = ids[src];
        const int s = owner[e] * cap + base[e] + (r - offsets[e]);
        send[(long long)s * width + c] = x[(long long)(src / top_k) * width + c];
        if (c == 0) slot[r] = s;
        """,
    ),
    # one thread: the owner's offsets, per-source prefixes and active experts
    "local_tables": (
        "raw int32 counts, int32 world, int32 n_local, int32 e_max, int32 n_active",
        "raw int32 offsets, raw int32 prefix, raw int32 before, raw int32 active",
        """
        if (i != 0) return;
        int acc = 0;
        for (int j = 0; j < n_local; ++j) {
            offsets[j] = acc;
            for (int s = 0; s < world; ++s) {
                before[s * n_local + j] = acc - offsets[j];
                acc += counts[s * e_max + j];
            }
        }
        offsets[n_local] = acc;
        for (int s = 0; s < world; ++s) {
            int p = 0;
            for (int j = 0; j < n_local; ++j) {
                prefix[s * (n_local + 1) + j] = p;
                p += counts[s * e_max + j];
            }
            prefix[s * (n_local + 1) + n_local] = p;
        }
        int a = 0;
        for (int j = 0; j < n_local && a < n_active; ++j)
            if (offsets[j + 1] > offsets[j]) active[a++] = j;
        for (; a < n_active; ++a) active[a] = -1;
        """,
    ),
    # one thread per received position p = s * cap + q
    "local_rows": (
        "raw int32 offsets, raw int32 prefix, raw int32 before, int32 n_local, int32 cap",
        "raw int32 sorted_rows, raw int32 inverse, raw int32 ids",
        """
        const int s = i / cap, q = i % cap;
        const int* pre = &prefix[s * (n_local + 1)];
        if (q >= pre[n_local]) { inverse[i] = -1; ids[i] = n_local; return; }
        int lo = 0, hi = n_local;  // the j with pre[j] <= q < pre[j + 1]
        while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (pre[mid] <= q) lo = mid; else hi = mid;
        }
        const int row = offsets[lo] + before[s * n_local + lo] + (q - pre[lo]);
        sorted_rows[row] = i;
        inverse[i] = row;
        ids[i] = lo;
        """,
    ),
    # ret[p] = y[inverse[p]] (0 for padding)
    "return_rows": (
        "raw uint16 y, raw int32 inverse, int32 width",
        "raw uint16 ret",
        """
        const int p = i / width, c = i % width;
        const int row = inverse[p];
        ret[i] = row >= 0 ? y[(long long)row * width + c] : (unsigned short)0;
        """,
    ),
    # out[r] = rows[index[r]]
    "gather_rows": (
        "raw uint16 rows, raw int32 index, int32 width",
        "raw uint16 out",
        "out[i] = rows[(long long)index[i / width] * width + i % width];",
    ),
}


def _words(a: Any) -> Any:
    return a.view(np.uint16)


def home_tables(
    offsets: Any, owner: Any, local: Any, e_max: int, base: Any, run: Any, counts_to: Any
) -> None:
    """``base[e]`` (plan.send_plan), ``counts_to[d, local[e]] = counts[e]``, ``run[d]`` = rows
    to ``d``."""
    _kernel("home_tables")(
        offsets,
        owner,
        local,
        np.int32(owner.size),
        np.int32(run.size),
        np.int32(e_max),
        base,
        run,
        counts_to,
        size=1,
    )


def pack_rows(
    x: Any,
    sorted_rows: Any,
    ids: Any,
    offsets: Any,
    owner: Any,
    base: Any,
    top_k: int,
    cap: int,
    send: Any,
    slot: Any,
) -> None:
    """``send[slot[r]] = x[sorted_rows[r] // top_k]`` with ``slot`` of :func:`.plan.send_plan`."""
    rows, width = int(sorted_rows.size), int(x.shape[1])
    if rows == 0:
        return
    _kernel("pack_rows")(
        _words(x),
        sorted_rows,
        ids,
        offsets,
        owner,
        base,
        np.int32(top_k),
        np.int32(width),
        np.int32(cap),
        _words(send),
        slot,
        size=rows * width,
    )


def local_tables(
    counts: Any, n_local: int, e_max: int, offsets: Any, prefix: Any, before: Any, active: Any
) -> None:
    """The owner's expert offsets and per-source prefixes (:func:`.plan.receive_plan`)."""
    world = int(counts.size) // e_max
    _kernel("local_tables")(
        counts,
        np.int32(world),
        np.int32(n_local),
        np.int32(e_max),
        np.int32(active.size),
        offsets,
        prefix,
        before,
        active,
        size=1,
    )


def local_rows(
    offsets: Any,
    prefix: Any,
    before: Any,
    n_local: int,
    cap: int,
    positions: int,
    sorted_rows: Any,
    inverse: Any,
    ids: Any,
) -> None:
    """``sorted_rows`` of :func:`.plan.receive_plan` and its inverse (``-1`` on padding)."""
    if positions == 0:
        return
    _kernel("local_rows")(
        offsets,
        prefix,
        before,
        np.int32(n_local),
        np.int32(cap),
        sorted_rows,
        inverse,
        ids,
        size=positions,
    )


def return_rows(y: Any, inverse: Any, ret: Any) -> None:
    """``ret[p] = y[inverse[p]]``: each result where its input arrived (zeros on padding)."""
    positions, width = int(ret.shape[0]), int(ret.shape[1])
    if positions == 0:
        return
    _kernel("return_rows")(_words(y), inverse, np.int32(width), _words(ret), size=positions * width)


def gather_rows(rows: Any, index: Any, out: Any) -> None:
    """``out[r] = rows[index[r]]`` (the home reads its results at their slots)."""
    n, width = int(out.shape[0]), int(out.shape[1])
    if n == 0:
        return
    _kernel("gather_rows")(_words(rows), index, np.int32(width), _words(out), size=n * width)
