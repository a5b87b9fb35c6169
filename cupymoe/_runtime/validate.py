# SPDX-License-Identifier: Apache-2.0
"""Argument validators shared by every layer: one function per kind of argument.

Each raises ``TypeError`` / ``ValueError`` naming the argument, what was expected and what was
received (never ``assert`` on user input).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from .backend import is_cupy_array, require_cupy

__all__ = [
    "ACTIVATION_DTYPES",
    "check_activations",
    "check_bias",
    "check_device_array",
    "check_int",
    "device_output",
    "parse_enum",
]

#: Activation dtypes of the GPU stages (bf16 and fp16).
ACTIVATION_DTYPES: tuple[np.dtype, ...] = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def parse_enum(cls: Any, value: Any, name: str, *, spelling: str = "value") -> Any:
    """Member of enum ``cls`` from a member or its (case-insensitive) spelling, the attribute
    ``spelling`` of the members; ``ValueError`` naming ``name`` and the valid spellings
    otherwise."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if getattr(member, spelling) == value.strip().lower():
                return member
    valid = ", ".join(repr(getattr(m, spelling)) for m in cls)
    raise ValueError(f"{name}: expected one of {valid} (or a {cls.__name__}), got {value!r}")


def check_int(name: str, value: Any, *, optional: bool = False) -> int | None:
    """``int(value)`` of an integer that is not a bool (``None`` passes when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    return int(value)


def check_device_array(name: str, a: Any, shape: tuple[int, ...], dtype: Any) -> None:
    """``a`` is a C-contiguous ``cupy.ndarray`` of exactly ``shape`` and ``dtype``."""
    if not is_cupy_array(a):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
    if tuple(a.shape) != shape or a.dtype != np.dtype(dtype):
        raise ValueError(
            f"{name}: expected {np.dtype(dtype).name} {shape}, got {a.dtype} {tuple(a.shape)}"
        )
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")


def device_output(out: Any, shape: tuple[int, ...], dtype: Any, name: str = "out") -> Any:
    """``out`` checked as a C-contiguous ``cupy.ndarray`` of ``shape`` and ``dtype``, or a new
    one when ``out`` is ``None``."""
    cupy = require_cupy()
    dtype = np.dtype(dtype)
    if out is None:
        return cupy.empty(shape, dtype=dtype)
    if not is_cupy_array(out):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(
            f"{name}: expected {dtype.name} {tuple(shape)}, got {out.dtype} {tuple(out.shape)}"
        )
    if not out.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    return out


def check_activations(
    a: Any, name: str, width: int, rows: int | None = None, *, aligned: bool = False
) -> np.dtype:
    """A 2-D bf16 / fp16 ``cupy.ndarray [rows, width]`` (``rows=None``: any row count);
    ``aligned``: also C-contiguous and 16-byte aligned (the GEMV loads 16 bytes at a time).
    Returns its dtype."""
    if not is_cupy_array(a):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
    if a.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"{name}: expected dtype bfloat16 or float16, got {a.dtype}")
    if a.ndim != 2 or a.shape[1] != width or (rows is not None and a.shape[0] != rows):
        expected = ("n_tokens" if rows is None else rows, width)
        raise ValueError(f"{name}: expected shape {expected}, got {a.shape}")
    if aligned and (not a.flags.c_contiguous or a.data.ptr % 16):
        raise ValueError(f"{name}: expected a C-contiguous, 16-byte aligned array")
    return np.dtype(a.dtype)


def check_bias(value: Any, name: str, shape: tuple[int, ...], *, finite: bool = True) -> Any:
    """``None``, or a bias checked as a floating-point array of ``shape`` (with only finite
    values when ``finite``). CuPy arrays are returned as they are, anything else as a NumPy
    array; the caller converts to the dtype it needs."""
    if value is None:
        return None
    b = value if is_cupy_array(value) else np.asarray(value)
    if b.dtype.kind != "f" and b.dtype != np.dtype(ml_dtypes.bfloat16):
        raise TypeError(f"{name}: expected a floating-point array, got dtype {b.dtype}")
    if tuple(b.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(b.shape)}")
    if finite:
        xp = require_cupy() if is_cupy_array(b) else np
        if not bool(xp.isfinite(b.astype(np.float32)).all()):
            raise ValueError(f"{name}: contains NaN or Inf")
    return b
