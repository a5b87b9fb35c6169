# SPDX-License-Identifier: Apache-2.0
"""Exact dequantization of GPU expert weights to a dense array.

``dequantize(w)[s, n, k] = E2M1[nibble(e, n, k)] * scale(e, n, k // block) * global_scale[e]`` with
``e = experts[s]``. The GEMV kernels never materialise this array; the batched path above the row
window (:mod:`.batched`) does, for the active experts only, and hands it to cuBLAS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from .._runtime.compile import CTYPE, KernelSpec
from .._runtime.launch import launch
from .._runtime.validate import device_output
from ..formats import DeviceFp4, Fp4Experts, Fp4Format

__all__ = ["OUT_DTYPES", "dequantize", "dequantize_ref", "kernel_specs"]

#: Output dtypes of :func:`dequantize`.
OUT_DTYPES: tuple[np.dtype, ...] = (
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
    np.dtype(np.float32),
)

_THREADS = 256
#: Grid cap of the grid-stride loop: enough resident blocks to saturate HBM on any current GPU.
_MAX_BLOCKS = 65536


def _out_dtype(out_dtype: Any) -> np.dtype:
    dtype = np.dtype(out_dtype)
    if dtype not in OUT_DTYPES:
        raise TypeError(
            f"out_dtype: expected one of {[d.name for d in OUT_DTYPES]}, got {dtype.name}"
        )
    return dtype


def _host_experts(experts: Any, n_experts: int) -> np.ndarray:
    """Expert ids as host int64, checked to be a 1-D integer array in ``[0, n_experts)``."""
    ids = experts.get() if is_cupy_array(experts) else np.asarray(experts)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise TypeError(f"experts: expected a 1-D integer array, got {ids.dtype} {ids.shape}")
    ids = ids.astype(np.int64)
    bad = (ids < 0) | (ids >= n_experts)
    if bad.any():
        raise ValueError(
            f"experts: expected ids in [0, {n_experts}), got {int(ids[bad][0])} "
            f"(at position {int(np.argmax(bad))})"
        )
    return ids


def dequantize(
    w: DeviceFp4,
    *,
    experts: Any = None,
    out_dtype: Any = np.float32,
    out: Any = None,
    check_experts: bool = True,
) -> Any:
    """``out[s] = W[experts[s]]`` dequantized exactly: ``e2m1 * scale * global_scale``.

    Parameters
    ----------
    w : DeviceFp4
        Weights ``[E, N, K]`` on the GPU.
    experts : array of int, optional
        Expert ids to decode, in output order (NumPy, sequence or CuPy). ``None``: all ``E``.
    out_dtype : dtype
        ``float32``, ``float16`` or ``ml_dtypes.bfloat16``.
    out : cupy.ndarray, optional
        C-contiguous ``[len(experts) or E, N, K]`` of ``out_dtype``, 16-byte aligned.
    check_experts : bool
        Read ``experts`` back to the host to check the ids (a synchronisation when it is a CuPy
        array). With ``False`` and a CuPy ``experts`` the call is capturable in a CUDA graph; an
        id out of range then gives a NaN matrix, never an out-of-range read.

    Returns
    -------
    cupy.ndarray
        ``[len(experts) or E, N, K]`` of ``out_dtype``.

    Notes
    -----
    fp32 math: ``(e2m1 * scale)`` is exact, ``* global_scale`` is one fp32 rounding, so float32
    output equals ``Fp4Experts.dequantize(np.float32)`` bit for bit; 16-bit outputs are that value
    rounded to nearest even. A product below the fp32 normal range (2^-126) is flushed to zero
    (CuPy compiles with ``-ftz``); real checkpoints are far above it.
    """
    cupy = require_cupy()
    if not isinstance(w, DeviceFp4):
        raise TypeError(f"w: expected a DeviceFp4, got {type(w).__name__}")
    dtype = _out_dtype(out_dtype)
    if experts is None:
        ids, n_out = None, w.n_experts
    elif check_experts or not is_cupy_array(experts):
        ids = cupy.asarray(_host_experts(experts, w.n_experts), dtype=cupy.int32)
        n_out = int(ids.shape[0])
    else:  # unchecked device ids: no host read, capturable
        if experts.ndim != 1 or experts.dtype != np.int32:
            raise TypeError(f"experts: expected 1-D int32, got {experts.dtype} {experts.shape}")
        ids = cupy.ascontiguousarray(experts)
        n_out = int(ids.shape[0])
    out = device_output(out, (n_out, w.n, w.k), dtype)
    if out.data.ptr % 16:
        raise ValueError("out: expected a C-contiguous, 16-byte aligned array")
    if w.packed.data.ptr % 16:
        raise ValueError("w.packed: expected a 16-byte aligned array")
    if out.size == 0:
        return out
    spec = KernelSpec(
        "dequant", "dequantize_fp4", (w.format.code, CTYPE[dtype], w.pair_interleaved)
    )
    words = 4 if w.k % 32 == 0 else 2  # codes per thread step: 32, or 16 when K % 32 != 0
    chunks = n_out * w.n * (w.k // (8 * words))
    blocks = max(1, min(_MAX_BLOCKS, -(-chunks // _THREADS)))
    launch(
        spec,
        blocks,
        _THREADS,
        (
            w.packed,
            w.scales,
            w.global_scale,
            ids,
            out,
            np.int32(n_out),
            np.int32(w.n_experts),
            np.int32(w.n),
            np.int32(w.k),
        ),
    )
    return out


def dequantize_ref(
    w: Fp4Experts, *, experts: Sequence[int] | np.ndarray | None = None, out_dtype: Any = np.float32
) -> np.ndarray:
    """NumPy reference of :func:`dequantize`: ``Fp4Experts.dequantize`` then a RNE cast.

    ``out_dtype`` may also be ``float64`` (the exact values, for references).
    """
    dtype = np.dtype(out_dtype)
    if dtype != np.float64:
        dtype = _out_dtype(dtype)
    ids = None if experts is None else _host_experts(experts, w.n_experts)
    dense = w.dequantize(np.float64 if dtype == np.float64 else np.float32)
    if ids is not None:
        dense = dense[ids]
    return np.ascontiguousarray(dense.astype(dtype))


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation :func:`dequantize` can select: 2 formats x 3 dtypes x 2 orders."""
    return [
        KernelSpec("dequant", "dequantize_fp4", (fmt.code, CTYPE[dtype], interleaved))
        for fmt in Fp4Format
        for dtype in OUT_DTYPES
        for interleaved in (False, True)
    ]
