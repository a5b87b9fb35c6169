# SPDX-License-Identifier: Apache-2.0
"""TMA tensor maps (``CUtensorMap``) for kernel parameters.

A tensor map is a 128-byte opaque descriptor of a strided region of global memory that the
Hopper copy engine (TMA) reads boxes of with one instruction (``cp.async.bulk.tensor``). It is
encoded on the host by ``cuTensorMapEncodeTiled`` (CUDA driver 12.0+, compute capability 9.0+;
CuPy does not wrap it, so it is called through ``ctypes`` on ``libcuda``) and passed to the
kernel by value as a ``const __grid_constant__`` parameter, which :func:`.launch.launch` packs
like any other argument (a captured CUDA graph keeps its copy).

:func:`tiled` encodes and caches a map per (address, geometry): the map holds only the address
and the geometry, so a cached map is valid for any buffer at that address with that geometry.
:func:`check_geometry` is the driver's documented rules for the maps built here, run before the
driver sees them (and on machines without one).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ELEMENT_BYTES",
    "L2_PROMOTION_256B",
    "SWIZZLE_128B",
    "UINT8",
    "UINT16",
    "UINT64",
    "TensorMap",
    "check_geometry",
    "tiled",
]

#: CUtensorMapDataType values used here and their element sizes.
UINT8, UINT16, UINT64 = 0, 1, 4
ELEMENT_BYTES = {UINT8: 1, UINT16: 2, UINT64: 8}
#: CUtensorMapL2promotion: L2 sectors fetched per request (CU_TENSOR_MAP_L2_PROMOTION_L2_256B).
L2_PROMOTION_256B = 3
_INTERLEAVE_NONE = _SWIZZLE_NONE = _OOB_FILL_ZERO = 0
#: CUtensorMapSwizzle: 16-byte piece j of each 128-byte row r of a box at j ^ (r % 8) in shared
#: memory (the box's shared address 1024-byte aligned; its inner row at most 128 bytes).
SWIZZLE_128B = 3
_MAP_BYTES = 128
_MAP_ALIGN = 64


class TensorMap:
    """One encoded ``CUtensorMap``: 128 bytes at a 64-byte aligned host address
    (:attr:`address`, what a launch's ``kernelParams`` entry points at)."""

    __slots__ = ("_buffer", "address", "geometry")

    def __init__(self, geometry: tuple[Any, ...]) -> None:
        self._buffer = ctypes.create_string_buffer(_MAP_BYTES + _MAP_ALIGN)
        base = ctypes.addressof(self._buffer)
        self.address = base + (-base % _MAP_ALIGN)
        self.geometry = geometry

    @property
    def raw(self) -> bytes:
        """The encoded descriptor."""
        return ctypes.string_at(self.address, _MAP_BYTES)

    def __repr__(self) -> str:
        return f"TensorMap{self.geometry}"


def check_geometry(
    address: int,
    dtype: int,
    dims: Sequence[int],
    strides: Sequence[int],
    box: Sequence[int],
    swizzle: int = _SWIZZLE_NONE,
) -> None:
    """Raise ``ValueError`` where a tiled, non-interleaved map breaks the rules of
    ``cuTensorMapEncodeTiled``: rank 1..5, a 16-byte aligned address, dimensions in 1..2^32,
    byte strides of the outer dimensions multiples of 16 below 2^40, box sizes in 1..256 (a box
    may reach past its dimension: those elements are zero-filled on loads and not written by
    stores), and an inner box row of a multiple of 16 bytes, at most 128 with
    :data:`SWIZZLE_128B`."""
    rank = len(dims)
    if not 1 <= rank <= 5 or len(strides) != rank - 1 or len(box) != rank:
        raise ValueError(
            f"tensor map: rank {rank} with {len(strides)} strides, {len(box)} box dims"
        )
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"tensor map: data type {dtype} is not one of {sorted(ELEMENT_BYTES)}")
    if address % 16:
        raise ValueError(f"tensor map: global address {address:#x} is not 16-byte aligned")
    for i, d in enumerate(dims):
        if not 1 <= d <= 2**32:
            raise ValueError(f"tensor map: dimension {i} = {d} outside 1..2^32")
    for i, s in enumerate(strides):
        if s % 16 or not 0 < s < 2**40:
            raise ValueError(
                f"tensor map: stride {i + 1} = {s} bytes, not a multiple of 16 below 2^40"
            )
    for i, b in enumerate(box):
        if not 1 <= b <= 256:
            raise ValueError(f"tensor map: box dimension {i} = {b} outside 1..256")
    if box[0] * ELEMENT_BYTES[dtype] % 16:
        raise ValueError(
            f"tensor map: inner box of {box[0] * ELEMENT_BYTES[dtype]} bytes, not a multiple of 16"
        )
    if swizzle not in (_SWIZZLE_NONE, SWIZZLE_128B):
        raise ValueError(f"tensor map: swizzle {swizzle} is not 0 (none) or {SWIZZLE_128B} (128B)")
    if swizzle == SWIZZLE_128B and box[0] * ELEMENT_BYTES[dtype] > 128:
        raise ValueError(
            f"tensor map: inner box of {box[0] * ELEMENT_BYTES[dtype]} bytes with the 128-byte "
            "swizzle, more than 128"
        )


@functools.lru_cache(maxsize=1)
def _encode_fn() -> Any:
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_void_p,
        u64p,
        u64p,
        u32p,
        u32p,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
    ]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=4096)
def tiled(
    address: int,
    dtype: int,
    dims: tuple[int, ...],
    strides: tuple[int, ...],
    box: tuple[int, ...],
    l2_promotion: int = L2_PROMOTION_256B,
    swizzle: int = _SWIZZLE_NONE,
) -> TensorMap:
    """The tiled map of the region at device ``address``: ``dims`` elements of ``dtype``
    innermost first, the byte ``strides`` of dimensions 1.. (dimension 0 is contiguous),
    copied in boxes of ``box`` elements between global memory and dense shared memory
    (innermost fastest; ``swizzle``: :data:`SWIZZLE_128B` permutes each row's 16-byte pieces);
    elements outside ``dims`` are zero-filled on loads and skipped by stores. Cached per argument
    tuple."""
    check_geometry(address, dtype, dims, strides, box, swizzle)
    rank = len(dims)
    m = TensorMap((hex(address), dtype, dims, strides, box, swizzle))
    status = _encode_fn()(
        ctypes.c_void_p(m.address),
        dtype,
        rank,
        ctypes.c_void_p(address),
        (ctypes.c_uint64 * rank)(*dims),
        (ctypes.c_uint64 * max(rank - 1, 1))(*strides),
        (ctypes.c_uint32 * rank)(*box),
        (ctypes.c_uint32 * rank)(*([1] * rank)),
        _INTERLEAVE_NONE,
        swizzle,
        l2_promotion,
        _OOB_FILL_ZERO,
    )
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled{m.geometry} failed (CUresult {status})")
    return m
