# SPDX-License-Identifier: Apache-2.0
"""The FP4 number formats, bit by bit, in NumPy: E2M1 codes, E4M3 / E8M0 scales, packing.

Everything here is exact and host-side; it is the single source of truth for the kernels'
decoders (``cuda/common.cuh``) and for every reference.

* **E2M1** (4 bits: sign, 2 exponent bits with bias 1, 1 mantissa bit; no Inf, no NaN): codes
  0..7 are ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and codes 8..15 their negatives (0x8 is -0).
* **E4M3FN** (NVFP4 block scale): bias 7, subnormals ``m * 2**-9``, max finite 448 (0x7E), NaN at
  0x7F / 0xFF, no infinity.
* **E8M0** (MXFP4 block scale): ``2**(b - 127)``, 0xFF is NaN; no zero, no sign. Byte 0 is
  ``2**-127``, an fp32 subnormal, kept exact.
* **Nibble order** (stated once, used everywhere): two codes per byte, **element 2i in the low
  nibble, element 2i+1 in the high nibble** (ModelOpt, gpt-oss, ``torch.float4_e2m1fn_x2``,
  ONNX FLOAT4E2M1). So in a little-endian 32-bit word of four bytes, nibble slot ``s`` (bits
  ``4s .. 4s+3``) holds element ``s``. The SM80 *pair-interleaved* order puts logical elements
  ``e0, e2, e4, e6, e1, e3, e5, e7`` in slots 0..7 instead (:func:`to_pair_interleaved`).

Rounding to E2M1 and E4M3 is round-to-nearest-even (ties go to the even code, i.e. the even
mantissa), with saturation: E2M1 at +-6, E4M3 at +-448.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy

# fmt: off
__all__ = [
    "E2M1_VALUES", "PAIR_SLOT", "decode_e2m1", "decode_e4m3", "decode_e8m0", "encode_e2m1",
    "encode_e4m3", "encode_e8m0_exponent", "from_pair_interleaved", "pack_fp4",
    "to_pair_interleaved", "unpack_fp4",
]
# fmt: on


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


#: Value of every E2M1 code 0..15 (float32, read-only). Code ``c`` has sign bit ``c & 8``.
E2M1_VALUES: np.ndarray = _frozen(
    np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 2, dtype=np.float32)
    * np.repeat(np.array([1.0, -1.0], dtype=np.float32), 8)
)
_E2M1_MAGNITUDES = _frozen(E2M1_VALUES[:8].astype(np.float64))
_E2M1_F64 = _frozen(E2M1_VALUES.astype(np.float64))


def _e4m3_table() -> np.ndarray:
    byte = np.arange(256)
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 7
    # Normal: (1 + m/8) * 2**(e - 7) = (8 + m) * 2**(e - 10); subnormal: m * 2**-9.
    magnitude = np.where(
        exponent == 0, np.ldexp(mantissa, -9), np.ldexp(8 + mantissa, exponent - 10)
    ).astype(np.float64)
    value = np.where(byte & 0x80, -magnitude, magnitude)
    value[(byte & 0x7F) == 0x7F] = np.nan
    return _frozen(value)


def _e8m0_table() -> np.ndarray:
    value = np.ldexp(1.0, np.arange(256) - 127)
    value[255] = np.nan
    return _frozen(value)


_E4M3_F64 = _e4m3_table()
_E8M0_F64 = _e8m0_table()
_E4M3_F32 = _frozen(_E4M3_F64.astype(np.float32))  # every E4M3 value is exact in fp32
_E8M0_F32 = _frozen(_E8M0_F64.astype(np.float32))  # 2**-127 becomes an exact fp32 subnormal
#: Magnitudes of the finite non-negative E4M3 codes 0x00..0x7E, ascending (code = index).
_E4M3_MAGNITUDES = _frozen(_E4M3_F64[:0x7F].copy())

#: Weight dtypes the reference quantizer accepts.
_FLOAT_DTYPES = tuple(np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64))


# ---- helpers -----------------------------------------------------------------------------------
def _host(a: Any, name: str) -> np.ndarray:
    """A NumPy view of ``a``; CuPy (anything with a ``.get()`` method) is copied to the host."""
    if not isinstance(a, (np.ndarray, Mapping)) and callable(getattr(a, "get", None)):
        a = a.get()
    try:
        return np.asarray(a)
    except Exception as exc:  # e.g. a GPU torch tensor
        raise TypeError(f"{name}: expected an array, got {type(a).__name__}") from exc


def _as_float64(x: Any, name: str) -> np.ndarray:
    a = _host(x, name)
    if a.dtype.kind not in "fiu" and a.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a real floating-point array, got dtype {a.dtype}")
    return a.astype(np.float64)


def _as_codes(a: Any, name: str, limit: int) -> np.ndarray:
    arr = _host(a, name)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array (uint8), got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= limit):
        raise ValueError(
            f"{name}: expected values in [0, {limit}), got range [{arr.min()}, {arr.max()}]"
        )
    return arr.astype(np.intp)


def _round_to_grid(magnitude: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest value of the ascending ``grid``; ties go to the even index.

    Values above ``grid[-1]`` saturate to the last index. For E2M1 and E4M3 the index is the
    code of the magnitude, and an even code is an even mantissa: this is round-to-nearest-even.
    """
    hi = np.clip(np.searchsorted(grid, magnitude, side="left"), 1, grid.size - 1)
    lo = hi - 1
    midpoint = (grid[lo] + grid[hi]) * 0.5  # exact in float64 (grid values are short)
    up = (magnitude > midpoint) | ((magnitude == midpoint) & (hi % 2 == 0))
    return np.where(up, hi, lo)


def _floor_log2(a: np.ndarray) -> np.ndarray:
    """``floor(log2(a))`` exactly, for ``a > 0`` (0 where ``a == 0``)."""
    _, exponent = np.frexp(a)  # a = f * 2**exponent with f in [0.5, 1)
    return np.where(a > 0, exponent.astype(np.int64) - 1, 0)


# ---- E2M1 --------------------------------------------------------------------------------------
def encode_e2m1(x: Any) -> np.ndarray:
    """Round to the nearest E2M1 value: ``code = RNE_sat6(x)``, uint8 codes of ``x``'s shape.

    Decision points 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5; a tie goes to the even code (as values:
    0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Magnitudes
    above 6 and infinity saturate to 6. The sign is kept: -0.0 and small negatives that round
    to zero give 0x8. NaN has no E2M1 code: ``ValueError``.

    Examples
    --------
    >>> encode_e2m1([0.25, 0.75, 2.5, 5.0, 7.0, -0.1]).tolist()
    [0, 2, 4, 6, 7, 8]
    """
    a = _as_float64(x, "x")
    if np.isnan(a).any():
        raise ValueError("x: NaN cannot be encoded as E2M1 (the format has no NaN)")
    code = _round_to_grid(np.abs(a), _E2M1_MAGNITUDES)
    return (code | (np.signbit(a) << 3)).astype(np.uint8)


def decode_e2m1(codes: Any) -> np.ndarray:
    """``E2M1_VALUES[codes]``: float32 values of E2M1 codes 0..15 (exact)."""
    return E2M1_VALUES[_as_codes(codes, "codes", 16)]


# ---- E4M3FN ------------------------------------------------------------------------------------
def encode_e4m3(x: Any) -> np.ndarray:
    """Round to the nearest E4M3FN value: ``byte = RNE_sat448(x)``, uint8 of ``x``'s shape.

    Round-to-nearest-even over normals and subnormals (``m * 2**-9``). Finite values beyond 448
    saturate to +-448 (0x7E / 0xFE), where an ``ml_dtypes`` cast gives NaN. NaN and +-infinity
    (the format has no infinity) encode as 0x7F.

    Examples
    --------
    >>> encode_e4m3([1.0, 448.0, 1e6, 2.0**-10, -0.5]).tolist()
    [56, 126, 126, 0, 176]
    """
    a = _as_float64(x, "x")
    code = _round_to_grid(np.abs(a), _E4M3_MAGNITUDES).astype(np.uint8)
    code |= np.signbit(a).astype(np.uint8) << 7
    code[~np.isfinite(a)] = 0x7F
    return code


def decode_e4m3(data: Any) -> np.ndarray:
    """float32 value of each E4M3FN byte (exact); 0x7F and 0xFF give NaN.

    Examples
    --------
    >>> decode_e4m3([0x38, 0x7E, 0x01, 0xB8]).tolist()
    [1.0, 448.0, 0.001953125, -1.0]
    """
    return _E4M3_F32[_as_codes(data, "data", 256)]


# ---- E8M0 --------------------------------------------------------------------------------------
def encode_e8m0_exponent(exponent: Any) -> np.ndarray:
    """E8M0 byte of ``2**exponent``: ``clip(exponent + 127, 0, 254)`` (never 0xFF, the NaN).

    Takes integer exponents, not values: MX scales come from an exponent rule
    (:class:`MxScaleRule`), whereas ``ml_dtypes.float8_e8m0fnu`` rounds a value to the nearest
    power of two, which is neither rule.
    """
    e = _host(exponent, "exponent")
    if e.dtype.kind not in "iu":
        raise TypeError(f"exponent: expected an integer array, got dtype {e.dtype}")
    return (np.clip(e.astype(np.int64), -127, 127) + 127).astype(np.uint8)


def decode_e8m0(data: Any) -> np.ndarray:
    """float32 ``2**(b - 127)`` of each E8M0 byte (exact: byte 0 is the subnormal 2**-127).

    0xFF gives NaN."""
    return _E8M0_F32[_as_codes(data, "data", 256)]


# ---- packing -----------------------------------------------------------------------------------
_PAIR_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # slot s holds logical element _PAIR_ORDER[s]
PAIR_SLOT = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # logical i is read from slot PAIR_SLOT[i]


def pack_fp4(codes: Any) -> np.ndarray:
    """Pack E2M1 codes two per byte: ``packed[..., i] = codes[..., 2i] | codes[..., 2i+1] << 4``.

    ``codes`` (..., K), values 0..15, K even -> uint8 (..., K // 2), element 2i in the low nibble.

    Examples
    --------
    >>> pack_fp4([1, 2, 15, 0]).tolist()
    [33, 15]
    """
    c = _as_codes(codes, "codes", 16).astype(np.uint8)
    if c.ndim == 0 or c.shape[-1] % 2:
        raise ValueError(f"codes: expected an even last dimension, got shape {c.shape}")
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: Any) -> np.ndarray:
    """Inverse of :func:`pack_fp4`: uint8 (..., K // 2) -> uint8 codes (..., K)."""
    p = _host(packed, "packed")
    if p.dtype != np.uint8 or p.ndim == 0:
        raise TypeError(f"packed: expected a uint8 array, got {p.dtype} with shape {p.shape}")
    out = np.empty((*p.shape[:-1], 2 * p.shape[-1]), dtype=np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def _permute_words(packed: Any, order: np.ndarray) -> Any:
    """Slot ``s`` of each 32-bit little-endian word gets the nibble of slot ``order[s]``.

    Bit operations on the words: NumPy in, NumPy out; CuPy in, CuPy out (on the GPU).
    """
    xp = require_cupy() if is_cupy_array(packed) else np
    packed = xp.ascontiguousarray(xp.asarray(packed, dtype=xp.uint8))
    if packed.shape[-1] % 4:
        raise ValueError(
            f"packed: the pair-interleaved order needs K a multiple of 8 (last dimension a "
            f"multiple of 4 bytes), got K = {2 * packed.shape[-1]}"
        )
    words = packed.view("<u4")
    out = xp.zeros_like(words)
    for slot, source in enumerate(order):
        out |= ((words >> np.uint32(4 * int(source))) & np.uint32(0xF)) << np.uint32(4 * slot)
    return out.view(xp.uint8)


def to_pair_interleaved(packed: Any) -> np.ndarray:
    """Plain packed bytes -> SM80 pair-interleaved bytes (same shape, K a multiple of 8).

    In every 32-bit little-endian word (4 consecutive bytes, 8 codes) nibble slots 0..7 hold
    logical elements ``e0, e2, e4, e6, e1, e3, e5, e7``.

    Examples
    --------
    >>> [hex(b) for b in to_pair_interleaved(pack_fp4([1, 2, 3, 4, 5, 6, 7, 8]))]
    ['0x31', '0x75', '0x42', '0x86']
    """
    return _permute_words(packed, _PAIR_ORDER)


def from_pair_interleaved(packed: Any) -> np.ndarray:
    """Inverse of :func:`to_pair_interleaved`: logical element i is read from slot
    ``{0, 4, 1, 5, 2, 6, 3, 7}[i]`` of its word."""
    return _permute_words(packed, PAIR_SLOT)
