# SPDX-License-Identifier: Apache-2.0
"""Where arrays live: CuPy when it is installed and a GPU is present, NumPy otherwise.

CuPy is an optional dependency. Every module imports it through :func:`cupy_or_none` so that
the package (formats, references, the CLI) works on a machine with neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import numpy as np


@functools.lru_cache(maxsize=1)
def cupy_or_none() -> ModuleType | None:
    """Return the ``cupy`` module, or ``None`` when it is not installed or cannot load."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    return cupy


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """``True`` when CuPy is importable and sees at least one CUDA device."""
    cupy = cupy_or_none()
    if cupy is None:
        return False
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no driver, or a driver older than the runtime
        return False


def is_cupy_array(a: Any) -> bool:
    """``True`` for a ``cupy.ndarray`` (without importing CuPy when it is absent)."""
    cupy = cupy_or_none()
    return cupy is not None and isinstance(a, cupy.ndarray)


def require_cupy() -> ModuleType:
    """Return ``cupy`` or raise ``RuntimeError`` explaining how to install it."""
    cupy = cupy_or_none()
    if cupy is None:
        raise RuntimeError(
            "this operation needs CuPy and a CUDA GPU; install with "
            "`pip install 'cupymoe[cuda12]'` (or [cuda13])"
        )
    return cupy


def to_numpy(a: Any) -> np.ndarray:
    """Copy a CuPy array to the host; pass NumPy arrays (and array-likes) through."""
    if is_cupy_array(a):
        return a.get()
    return np.asarray(a)
