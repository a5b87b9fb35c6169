# SPDX-License-Identifier: Apache-2.0
"""Expert weights on the GPU and their exact dequantization to a dense array.

``dequantize(w)[s, n, k] = E2M1[nibble(e, n, k)] * scale(e, n, k // block) * global_scale[e]`` with
``e = experts[s]``. The GEMV kernels never materialise this array; the batched path above the row
window (:mod:`cupymoe.batched`) does, for the active experts only, and hands it to cuBLAS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ._backend import is_cupy_array, require_cupy
from ._compile import KernelSpec
from ._launch import launch
from .formats import ExpertShape, Fp4Experts, Fp4Format, to_pair_interleaved

__all__ = ["OUT_DTYPES", "DeviceFp4", "dequantize", "dequantize_ref", "kernel_specs"]

#: Output dtypes of :func:`dequantize` and their C++ spelling in ``cuda/dequant.cu``.
OUT_DTYPES: dict[np.dtype, str] = {
    np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16",
    np.dtype(np.float16): "__half",
    np.dtype(np.float32): "float",
}

#: ``kFormat`` template argument of each format (``common.cuh``: 0 = NVFP4, 1 = MXFP4).
_FORMAT_CODE = {Fp4Format.NVFP4: 0, Fp4Format.MXFP4: 1}

_THREADS = 256
#: Grid cap of the grid-stride loop: enough resident blocks to saturate HBM on any current GPU.
_MAX_BLOCKS = 65536


@dataclasses.dataclass(frozen=True)
class DeviceFp4(ExpertShape):
    """Block-scaled E2M1 expert weights on the GPU, in the plain checkpoint layout.

    ``w[e, n, k] = E2M1[nibble(e, n, k)] * scale(scales[e, n, k // block]) * global_scale[e]``.
    """

    format: Fp4Format
    packed: Any  # cupy uint8 [E, N, K/2]; element 2i in the LOW nibble unless pair_interleaved
    scales: Any  # cupy uint8 [E, N, K/block]; raw E4M3 (NVFP4) or E8M0 (MXFP4) bytes
    global_scale: Any  # cupy float32 [E]; all ones for MXFP4
    pair_interleaved: bool = False  # nibbles of each 32-bit word in the SM80 order of FORMATS.md

    def __post_init__(self) -> None:
        if not isinstance(self.format, Fp4Format):
            raise TypeError(f"format: expected an Fp4Format, got {self.format!r}")
        for name, dtype in (
            ("packed", np.uint8),
            ("scales", np.uint8),
            ("global_scale", np.float32),
        ):
            a = getattr(self, name)
            if not is_cupy_array(a):
                raise TypeError(f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
            if a.dtype != dtype:
                raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError(f"{name}: expected a C-contiguous array")
        if self.packed.ndim != 3:
            raise ValueError(f"packed: expected shape (E, N, K/2), got {self.packed.shape}")
        e, n, half_k = self.packed.shape
        block = self.format.block_size
        if (2 * half_k) % block:
            raise ValueError(f"packed: K = {2 * half_k} is not a multiple of the block {block}")
        if self.scales.shape != (e, n, 2 * half_k // block):
            raise ValueError(
                f"scales: expected shape {(e, n, 2 * half_k // block)}, got {self.scales.shape}"
            )
        if self.global_scale.shape != (e,):
            raise ValueError(f"global_scale: expected shape {(e,)}, got {self.global_scale.shape}")
        # Value checks read the device once, at construction (never in a hot path).
        if e and not bool(((self.global_scale > 0) & (self.global_scale < np.inf)).all()):
            raise ValueError("global_scale: expected finite values > 0")
        nan_byte = 0x7F if self.format is Fp4Format.NVFP4 else 0xFF
        masked = self.scales & np.uint8(0x7F) if self.format is Fp4Format.NVFP4 else self.scales
        if self.scales.size and bool((masked == nan_byte).any()):
            raise ValueError(f"scales: NaN scale byte 0x{nan_byte:02X} ({self.format.scale_name})")

    @classmethod
    def from_experts(cls, w: Fp4Experts, *, pair_interleaved: bool = False) -> DeviceFp4:
        """Upload host weights (re-ordering the nibbles when ``pair_interleaved``)."""
        cupy = require_cupy()
        packed = cupy.ascontiguousarray(cupy.asarray(w.packed, dtype=cupy.uint8))
        if pair_interleaved:  # re-ordered on the GPU
            packed = to_pair_interleaved(packed)
        return cls(
            format=w.format,
            packed=packed,
            scales=cupy.ascontiguousarray(cupy.asarray(w.scales, dtype=cupy.uint8)),
            global_scale=cupy.ascontiguousarray(cupy.asarray(w.global_scale, dtype=cupy.float32)),
            pair_interleaved=pair_interleaved,
        )


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
    shape = (n_out, w.n, w.k)
    if out is None:
        out = cupy.empty(shape, dtype=dtype)
    elif not is_cupy_array(out):
        raise TypeError(f"out: expected a cupy.ndarray, got {type(out).__name__}")
    elif out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out: expected {dtype.name} {shape}, got {out.dtype} {out.shape}")
    elif not out.flags.c_contiguous or out.data.ptr % 16:
        raise ValueError("out: expected a C-contiguous, 16-byte aligned array")
    if w.packed.data.ptr % 16:
        raise ValueError("w.packed: expected a 16-byte aligned array")
    if out.size == 0:
        return out
    spec = KernelSpec(
        "dequant", "dequantize_fp4", (_FORMAT_CODE[w.format], OUT_DTYPES[dtype], w.pair_interleaved)
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
        KernelSpec("dequant", "dequantize_fp4", (code, ctype, interleaved))
        for code in _FORMAT_CODE.values()
        for ctype in OUT_DTYPES.values()
        for interleaved in (False, True)
    ]
