# SPDX-License-Identifier: Apache-2.0
"""Typed kernel launches.

CuPy validates nothing about kernel arguments ("No validation is performed ... including types
and number of arguments"): a bare Python ``int`` becomes a 64-bit value and silently shifts every
later argument. :func:`launch` accepts only device arrays, ``None`` (a null pointer) and NumPy
scalars of an exact type, so each call site states the C++ type of every scalar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._backend import require_cupy
from ._compile import KernelSpec, get_kernel

_SCALAR_TYPES = (np.int32, np.uint32, np.int64, np.uint64, np.float32, np.float64, np.bool_)


def _check_args(spec: KernelSpec, args: Sequence[Any]) -> None:
    cupy = require_cupy()
    for i, a in enumerate(args):
        if a is None or isinstance(a, (cupy.ndarray, *_SCALAR_TYPES)):
            continue
        raise TypeError(
            f"{spec.name}: argument {i} must be a cupy.ndarray or an exact NumPy scalar "
            f"(np.int32(...), np.float32(...)), got {type(a).__name__}"
        )


def launch(
    spec: KernelSpec,
    grid: tuple[int, ...] | int,
    block: tuple[int, ...] | int,
    args: Sequence[Any],
    *,
    shared_mem: int = 0,
    stream: Any = None,
) -> None:
    """Launch ``spec`` on ``stream`` (the current stream when ``None``).

    ``args`` follow the ``__global__`` signature in the ``.cu`` file, in order.
    """
    _check_args(spec, args)
    kernel = get_kernel(spec)
    grid = grid if isinstance(grid, tuple) else (grid,)
    block = block if isinstance(block, tuple) else (block,)
    cupy_args = tuple(0 if a is None else a for a in args)  # CuPy passes 0 as a null pointer
    if stream is None:
        kernel(grid, block, cupy_args, shared_mem=shared_mem)
    else:
        with stream:
            kernel(grid, block, cupy_args, shared_mem=shared_mem)
