# SPDX-License-Identifier: Apache-2.0
"""Finalize: ``out[t] = sum_j topk_weights[t, j] * y[inverse[t * k + j]] (+ bias)``.

``y [n_tokens * top_k, hidden]`` is in expanded (expert-major) order. The sum runs over the
slots ``j = 0 .. k-1`` in order with float32 accumulation (fused multiply-add), so the result is
bitwise reproducible; one rounding to the output dtype at the end.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from .._runtime.compile import CTYPE, KernelSpec
from .._runtime.launch import launch
from ..routing import Routing, check_device_routing

__all__ = ["finalize", "finalize_ref", "kernel_specs"]

MAX_TOP_K = 64


def _vec(dtype: np.dtype) -> int:
    return 16 // dtype.itemsize  # one 16-byte load of y per slot


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation :func:`finalize` can launch (bias type = float or y's type)."""
    specs = []
    for ty, cy in CTYPE.items():
        for co in CTYPE.values():
            for cb in dict.fromkeys(("float", cy)):
                for vec in (_vec(ty), 1):
                    specs.append(KernelSpec("finalize", "finalize_rows", (cy, co, cb, vec)))
    return specs


def _check(y: Any, routing: Any, bias: Any) -> tuple[int, int]:
    if not isinstance(routing, Routing):
        raise TypeError(f"routing: expected a Routing, got {type(routing).__name__}")
    m, k = routing.n_tokens, routing.top_k
    if y.ndim != 2 or y.shape[0] != m * k:
        raise ValueError(f"y: expected shape ({m * k}, hidden), got {tuple(y.shape)}")
    hidden = int(y.shape[1])
    if bias is not None and tuple(bias.shape) != (hidden,):
        raise ValueError(f"bias: expected shape ({hidden},), got {tuple(bias.shape)}")
    return m, hidden


def finalize_ref(y: np.ndarray, routing: Routing, *, bias: np.ndarray | None = None) -> np.ndarray:
    """NumPy reference in float64: ``[n_tokens, hidden]`` float64.

    Examples
    --------
    >>> from cupymoe.routing import Router, route_ref
    >>> r = route_ref(np.array([[0.0, 0.0]], np.float32), Router(2, 2))
    >>> finalize_ref(np.array([[2.0], [4.0]]), r).tolist()
    [[3.0]]
    """
    y = np.asarray(y)
    m, hidden = _check(y, routing, bias)
    k = routing.top_k
    rows = y.astype(np.float64)[np.asarray(routing.inverse).reshape(m, k)]  # [M, k, H]
    w = np.asarray(routing.topk_weights, np.float64)[:, :, None]
    out = (w * rows).sum(axis=1) if m else np.zeros((0, hidden))
    if bias is not None:
        out = out + np.asarray(bias).astype(np.float64)
    return out


def finalize(
    y: Any,
    routing: Routing,
    *,
    bias: Any = None,
    out: Any = None,
    out_dtype: Any = None,
    pdl: bool = False,
) -> Any:
    """Weighted sum of each token's ``top_k`` expert rows on the GPU.

    Parameters
    ----------
    y : cupy.ndarray [n_tokens * top_k, hidden]
        bfloat16, float16 or float32, C-contiguous, expanded order.
    routing : Routing
        CuPy arrays (``topk_weights`` and ``inverse`` are read); ``top_k <= 64``.
    bias : cupy.ndarray [hidden], optional
        float32 or y's dtype, added once per token.
    out : cupy.ndarray [n_tokens, hidden], optional
        C-contiguous; its dtype is the output dtype. Nothing is allocated when given.
    out_dtype : dtype, optional
        Output dtype when ``out`` is not given (default: y's dtype).
    pdl : bool
        Make the launch a programmatic dependent launch (:mod:`cupymoe._runtime.launch`) that
        reads the routing weights while the previous kernel finishes and waits for it before it
        reads ``y``. Only when the previous kernel on the stream ran after ``routing`` was complete:
        the FC2 of this call, as in ``MoELayer``.

    Returns
    -------
    cupy.ndarray [n_tokens, hidden]
    """
    cupy = require_cupy()
    for name, a in (("y", y), ("bias", bias), ("out", out)):
        if a is not None and not is_cupy_array(a):
            raise TypeError(
                f"{name}: expected cupy.ndarray (use finalize_ref for NumPy), "
                f"got {type(a).__name__}"
            )
    m, hidden = _check(y, routing, bias)
    check_device_routing(routing)
    if np.dtype(y.dtype) not in CTYPE:
        raise TypeError(f"y: expected dtype bfloat16, float16 or float32, got {y.dtype}")
    if routing.top_k > MAX_TOP_K:
        raise ValueError(f"routing: top_k must be <= {MAX_TOP_K}, got {routing.top_k}")
    if not y.flags.c_contiguous:
        raise ValueError("y: expected a C-contiguous array")
    if bias is not None and (
        bias.dtype not in (np.dtype(np.float32), y.dtype) or not bias.flags.c_contiguous
    ):
        raise TypeError(f"bias: expected a contiguous float32 or {y.dtype} array, got {bias.dtype}")
    if out is None:
        dtype = np.dtype(y.dtype if out_dtype is None else out_dtype)
        if dtype not in CTYPE:
            raise TypeError(f"out_dtype: expected bfloat16, float16 or float32, got {dtype}")
        out = cupy.empty((m, hidden), dtype)
    elif (
        tuple(out.shape) != (m, hidden)
        or np.dtype(out.dtype) not in CTYPE
        or not out.flags.c_contiguous
    ):
        raise ValueError(
            f"out: expected a C-contiguous ({m}, {hidden}) bfloat16/float16/float32 "
            f"array, got {out.dtype} {tuple(out.shape)}"
        )
    if m == 0 or hidden == 0:
        return out
    vec = _vec(y.dtype)
    ptrs = [(y, y.dtype), (out, out.dtype)] + ([(bias, bias.dtype)] if bias is not None else [])
    if hidden % vec or any(a.data.ptr % (vec * t.itemsize) for a, t in ptrs):
        vec = 1
    cb = CTYPE[np.dtype(bias.dtype)] if bias is not None else "float"
    spec = KernelSpec(
        "finalize",
        "finalize_rows",
        (CTYPE[np.dtype(y.dtype)], CTYPE[np.dtype(out.dtype)], cb, vec),
    )
    threads = 64 if m <= 16 else 128
    launch(
        spec,
        (m, -(-hidden // (vec * threads))),
        threads,
        (
            y,
            routing.topk_weights,
            routing.inverse,
            bias,
            np.int32(routing.top_k),
            np.int32(hidden),
            out,
        ),
        pdl=pdl,
    )
    return out
