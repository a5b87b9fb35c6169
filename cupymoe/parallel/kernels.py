# SPDX-License-Identifier: Apache-2.0
"""The exchange's small device kernels (``cuda/exchange.cu``): the device side of :mod:`.plan`,
one function per step, each with its NumPy meaning in the docstring. Rows are moved as
``uint16`` words (bf16 and fp16 alike): bitwise copies.

Element-wise kernels run a grid of ``ceil(n / 256)`` blocks of 256 threads over their ``n``
elements (a 64-bit count for the row copies, whose ``rows * width`` words may pass 2**31); the
two table kernels run as one thread. The kernels index every array flat: each must be
C-contiguous, the tables ``int32`` and the rows of a 2-byte dtype (checked before each launch).

Not run on a GPU in this repository yet (see ``docs/parallel.md``); the CPU tests check the plan
they implement, ``tests/test_parallel_gpu.py`` checks them on the device.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.compile import KernelSpec
from .._runtime.launch import launch

__all__ = [
    "gather_rows",
    "home_tables",
    "kernel_specs",
    "local_rows",
    "local_tables",
    "pack_rows",
    "return_rows",
]

_STAGE = "exchange"
_BLOCK = 256
_NAMES = (
    "ep_home_tables",
    "ep_pack_rows",
    "ep_local_tables",
    "ep_local_rows",
    "ep_return_rows",
    "ep_gather_rows",
)
_SPECS = {name: KernelSpec(_STAGE, name) for name in _NAMES}


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation this module launches (one per kernel: no templates)."""
    return list(_SPECS.values())


def _blocks(n: int) -> int:
    return -(-n // _BLOCK)


def _words(a: Any) -> Any:
    """``a`` (C-contiguous, 2-byte elements) as ``uint16`` words."""
    if a.dtype.itemsize != 2 or not a.flags.c_contiguous:
        raise ValueError(f"rows: expected a C-contiguous 2-byte array, got {a.dtype} {a.shape}")
    return a.view(np.uint16)


def _tables(*arrays: Any) -> None:
    """Check that every table is a C-contiguous ``int32`` array (the kernels index it flat)."""
    for a in arrays:
        if a.dtype != np.int32 or not a.flags.c_contiguous:
            raise ValueError(f"tables: expected C-contiguous int32 arrays, got {a.dtype} {a.shape}")


def home_tables(
    offsets: Any, owner: Any, local: Any, e_max: int, base: Any, run: Any, counts_to: Any
) -> None:
    """``base[e]`` (plan.send_plan), ``counts_to[d, local[e]] = counts[e]``, ``run[d]`` = rows
    to ``d``."""
    _tables(offsets, owner, local, base, run, counts_to)
    launch(
        _SPECS["ep_home_tables"],
        1,
        1,
        (
            offsets,
            owner,
            local,
            np.int32(owner.size),
            np.int32(run.size),
            np.int32(e_max),
            base,
            run,
            counts_to,
        ),
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
    n = rows * width
    if n == 0:
        return
    _tables(sorted_rows, ids, offsets, owner, base, slot)
    launch(
        _SPECS["ep_pack_rows"],
        _blocks(n),
        _BLOCK,
        (
            _words(x),
            sorted_rows,
            ids,
            offsets,
            owner,
            base,
            np.int32(top_k),
            np.int32(width),
            np.int32(cap),
            np.int64(n),
            _words(send),
            slot,
        ),
    )


def local_tables(
    counts: Any, n_local: int, e_max: int, offsets: Any, prefix: Any, before: Any, active: Any
) -> None:
    """The owner's expert offsets and per-source prefixes (:func:`.plan.receive_plan`)."""
    world = int(counts.size) // e_max
    _tables(counts, offsets, prefix, before, active)
    launch(
        _SPECS["ep_local_tables"],
        1,
        1,
        (
            counts,
            np.int32(world),
            np.int32(n_local),
            np.int32(e_max),
            np.int32(active.size),
            offsets,
            prefix,
            before,
            active,
        ),
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
    _tables(offsets, prefix, before, sorted_rows, inverse, ids)
    launch(
        _SPECS["ep_local_rows"],
        _blocks(positions),
        _BLOCK,
        (
            offsets,
            prefix,
            before,
            np.int32(n_local),
            np.int32(cap),
            np.int32(positions),
            sorted_rows,
            inverse,
            ids,
        ),
    )


def return_rows(y: Any, inverse: Any, ret: Any) -> None:
    """``ret[p] = y[inverse[p]]``: each result where its input arrived (zeros on padding)."""
    positions, width = int(ret.shape[0]), int(ret.shape[1])
    n = positions * width
    if n == 0:
        return
    _tables(inverse)
    launch(
        _SPECS["ep_return_rows"],
        _blocks(n),
        _BLOCK,
        (_words(y), inverse, np.int32(width), np.int64(n), _words(ret)),
    )


def gather_rows(rows: Any, index: Any, out: Any) -> None:
    """``out[r] = rows[index[r]]`` (the home reads its results at their slots)."""
    n_rows, width = int(out.shape[0]), int(out.shape[1])
    n = n_rows * width
    if n == 0:
        return
    _tables(index)
    launch(
        _SPECS["ep_gather_rows"],
        _blocks(n),
        _BLOCK,
        (_words(rows), index, np.int32(width), np.int64(n), _words(out)),
    )
