# SPDX-License-Identifier: Apache-2.0
"""Expand: gather token rows into expert order, ``x_sorted[r] = x[sorted_rows[r] // top_k]``.

The copy is bitwise (any dtype). A GEMV can skip this stage and read ``x`` through
``routing.sorted_rows`` directly: row ``r`` of the expanded activations is token
``sorted_rows[r] // top_k``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from .._runtime.compile import KernelSpec
from .._runtime.launch import launch
from ..routing import Routing, check_device_routing

__all__ = ["expand", "expand_ref", "kernel_specs"]

#: Copy word types, widest first: (bytes, C++ type).
_WORDS = (
    (16, "uint4"),
    (8, "uint2"),
    (4, "unsigned int"),
    (2, "unsigned short"),
    (1, "unsigned char"),
)


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation :func:`expand` can launch."""
    return [KernelSpec("expand", "expand_rows", (ctype,)) for _, ctype in _WORDS]


def _check(x: Any, routing: Any) -> tuple[int, int]:
    if not isinstance(routing, Routing):
        raise TypeError(f"routing: expected a Routing, got {type(routing).__name__}")
    if x.ndim != 2 or x.shape[0] != routing.n_tokens:
        raise ValueError(f"x: expected shape ({routing.n_tokens}, hidden), got {tuple(x.shape)}")
    return routing.n_tokens * routing.top_k, int(x.shape[1])


def expand_ref(x: np.ndarray, routing: Routing) -> np.ndarray:
    """NumPy reference: ``x[sorted_rows // top_k]``, shape ``[n_tokens * top_k, hidden]``.

    Examples
    --------
    >>> from cupymoe.routing import Router, route_ref
    >>> r = route_ref(np.array([[0.0, 1.0], [1.0, 0.0]], np.float32), Router(2, 1))
    >>> expand_ref(np.array([[10], [20]]), r).ravel().tolist()
    [20, 10]
    """
    x = np.asarray(x)
    _check(x, routing)
    return x[np.asarray(routing.sorted_rows) // routing.top_k]


def expand(x: Any, routing: Routing, *, out: Any = None) -> Any:
    """Gather rows of ``x [n_tokens, hidden]`` (CuPy, any dtype) into expert order.

    Parameters
    ----------
    x : cupy.ndarray [n_tokens, hidden]
        Rows may be strided; the hidden axis must be contiguous.
    routing : Routing
        CuPy routing arrays (``sorted_rows`` is read).
    out : cupy.ndarray [n_tokens * top_k, hidden], optional
        Same dtype as ``x``, C-contiguous. Nothing is allocated when given (capturable).

    Returns
    -------
    cupy.ndarray [n_tokens * top_k, hidden]
    """
    cupy = require_cupy()
    if not is_cupy_array(x):
        raise TypeError(
            f"x: expected cupy.ndarray (use expand_ref for NumPy), got {type(x).__name__}"
        )
    n_rows, hidden = _check(x, routing)
    check_device_routing(routing)
    item = x.dtype.itemsize
    if x.shape[0] > 0 and hidden > 1 and x.strides[1] != item:  # empty: strides mean nothing
        raise ValueError("x: the hidden axis must be contiguous")
    if x.shape[0] > 1 and x.strides[0] % item:
        raise ValueError(f"x: row stride must be a multiple of {item} bytes")
    if out is None:
        out = cupy.empty((n_rows, hidden), x.dtype)
    elif (
        not is_cupy_array(out)
        or tuple(out.shape) != (n_rows, hidden)
        or out.dtype != x.dtype
        or not out.flags.c_contiguous
    ):
        raise ValueError(
            f"out: expected a C-contiguous cupy.ndarray {x.dtype} "
            f"{(n_rows, hidden)}, got {getattr(out, 'dtype', None)} "
            f"{getattr(out, 'shape', type(out).__name__)}"
        )
    if n_rows == 0 or hidden == 0:
        return out
    row_bytes = hidden * item
    ld_bytes = x.strides[0] if x.shape[0] > 1 else row_bytes
    size, ctype = next(
        (s, c)
        for s, c in _WORDS
        if row_bytes % s == 0
        and ld_bytes % s == 0
        and x.data.ptr % s == 0
        and out.data.ptr % s == 0
    )
    words = row_bytes // size
    threads = min(256, -(-words // 32) * 32)
    launch(
        KernelSpec("expand", "expand_rows", (ctype,)),
        (n_rows, -(-words // threads)),
        threads,
        (
            x,
            np.int64(ld_bytes // size),
            routing.sorted_rows,
            np.int32(routing.top_k),
            np.int32(n_rows),
            np.int32(words),
            out,
        ),
    )
    return out
