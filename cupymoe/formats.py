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

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

# fmt: off
__all__ = [
    "E2M1_VALUES", "Fp4Experts", "Fp4Format", "MxScaleRule", "decode_e2m1", "decode_e4m3",
    "decode_e8m0", "encode_e2m1", "encode_e4m3", "encode_e8m0_exponent", "from_pair_interleaved",
    "pack_fp4", "to_pair_interleaved", "unpack_fp4",
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
_PAIR_SLOT = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # logical i is read from slot _PAIR_SLOT[i]


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
    from ._backend import is_cupy_array, require_cupy

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
    return _permute_words(packed, _PAIR_SLOT)


# ---- formats and scale rules -------------------------------------------------------------------
def parse_enum(cls: Any, value: Any, name: str) -> Any:
    """Member of enum ``cls`` from a member or its (case-insensitive) value; ``ValueError``
    naming ``name`` and the valid values otherwise."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if member.value == value.strip().lower():
                return member
    valid = ", ".join(repr(m.value) for m in cls)
    raise ValueError(f"{name}: expected one of {valid} (or a {cls.__name__}), got {value!r}")


class Fp4Format(enum.Enum):
    """Block-scaled E2M1 weight formats."""

    #: NVIDIA NVFP4: blocks of 16 along K, one E4M3 (e4m3fn) scale per block, and one FP32 global
    #: scale per expert (gate and up each keep their own).
    NVFP4 = "nvfp4"
    #: OCP MXFP4 (Microscaling v1.0): blocks of 32 along K, one E8M0 power-of-two scale per
    #: block; the global scale is 1.0.
    MXFP4 = "mxfp4"

    @property
    def block_size(self) -> int:
        """E2M1 elements per block scale along K (16 or 32)."""
        return 16 if self is Fp4Format.NVFP4 else 32

    @property
    def scale_name(self) -> str:
        """``ml_dtypes`` name of the block-scale type."""
        return "float8_e4m3fn" if self is Fp4Format.NVFP4 else "float8_e8m0fnu"

    @property
    def scale_dtype(self) -> np.dtype:
        """The ``ml_dtypes`` dtype of the block scales (stored here as raw uint8 bytes)."""
        return np.dtype(getattr(ml_dtypes, self.scale_name))

    def decode_scales(self, data: Any) -> np.ndarray:
        """float32 values of raw scale bytes in this format (exact)."""
        return decode_e4m3(data) if self is Fp4Format.NVFP4 else decode_e8m0(data)

    @classmethod
    def parse(cls, value: str | Fp4Format, name: str = "format") -> Fp4Format:
        """``Fp4Format`` from a member or its name (``"nvfp4"``, ``"mxfp4"``; case-insensitive).

        Raises ``ValueError`` listing the valid names otherwise.
        """
        return parse_enum(cls, value, name)


class MxScaleRule(enum.Enum):
    """How the MXFP4 quantizer picks a block's E8M0 scale from its ``amax``."""

    #: OCP Microscaling v1.0 (the default): ``2**(floor(log2(amax)) - 2)``. The largest
    #: elements of a block can exceed 6 after scaling (up to < 8) and then saturate to 6.
    OCP = "ocp"
    #: ``2**ceil(log2(amax / 6))``: the smallest power of two that never clips.
    ROUND_UP = "round_up"

    @classmethod
    def parse(cls, value: str | MxScaleRule, name: str = "mx_scale_rule") -> MxScaleRule:
        """``MxScaleRule`` from a member or its name (``"ocp"``, ``"round_up"``)."""
        return parse_enum(cls, value, name)


# ---- quantizers ----------------------------------------------------------------------------------
def _quantize_nvfp4(blocks: np.ndarray, expert: int) -> tuple[np.ndarray, np.ndarray, float]:
    """ModelOpt's NVFP4 rule for one expert, in float32 like ModelOpt. ``blocks``: [N, K/16, 16]."""
    w = blocks.astype(np.float32)
    magnitude = np.abs(w)
    amax = magnitude.max(initial=np.float32(0))
    global_scale = amax / np.float32(6.0 * 448.0) if amax > 0 else np.float32(1.0)
    block_scale = magnitude.max(axis=2, initial=np.float32(0)) / (np.float32(6.0) * global_scale)
    block_scale[block_scale == 0] = 1.0
    block_scale = np.maximum(block_scale, np.float32(2.0**-9))
    scale_bytes = encode_e4m3(block_scale)
    effective = decode_e4m3(scale_bytes) * global_scale  # one fp32 rounding
    if not global_scale > 0 or not np.all(effective > 0):  # underflow (or NaN from 0 / 0)
        raise ValueError(
            f"weights: expert {expert} has amax {amax:.3e}, too small for an FP32 NVFP4 global "
            f"scale (block scale x global scale underflows to 0)"
        )
    codes = encode_e2m1(w / effective[..., None])  # one fp32 rounding, then RNE to E2M1
    return codes, scale_bytes, float(global_scale)


def _quantize_mxfp4(blocks: np.ndarray, rule: MxScaleRule) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX rule (or the round-up rule), exact in float64. ``blocks``: [N, K/32, 32]."""
    w = blocks.astype(np.float64)
    amax = np.abs(w).max(axis=2, initial=0.0)
    exponent = _floor_log2(amax) - 2  # OCP: amax / 2**exponent lies in [4, 8)
    if rule is MxScaleRule.ROUND_UP:
        # Smallest s with 6 * 2**s >= amax: s = floor(log2 amax) - 2, plus one when
        # amax > 1.5 * 2**floor(log2 amax). Compared exactly, no log2 rounding.
        exponent += amax > np.ldexp(1.5, exponent + 2)
    # An all-zero block has no exponent of its own: scale 2**0 (byte 127), codes +-0.
    exponent = np.clip(np.where(amax > 0, exponent, 0), -127, 127)
    codes = encode_e2m1(np.ldexp(w, -exponent[..., None]))  # power-of-two scaling: exact
    return codes, encode_e8m0_exponent(exponent)


# ---- Fp4Experts ----------------------------------------------------------------------------------
def _check_array(value: Any, name: str, dtype: Any, ndim: int) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TypeError(
            f"{name}: expected a NumPy array (Fp4Experts.from_packed converts CuPy and other "
            f"arrays), got {type(value).__name__}"
        )
    if value.dtype != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {value.dtype}")
    if value.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {value.shape}")
    view = np.ascontiguousarray(value).view()  # a view: the caller's flags stay untouched
    view.flags.writeable = False
    return view


class ExpertShape:
    """Shape properties shared by host (:class:`Fp4Experts`) and device
    (:class:`~cupymoe.dequant.DeviceFp4`) expert weights: ``packed [E, N, K/2]``, ``scales``,
    ``global_scale`` and ``format`` are attributes of the subclass."""

    packed: Any
    scales: Any
    global_scale: Any
    format: Fp4Format

    @property
    def n_experts(self) -> int:
        """Number of experts E."""
        return int(self.packed.shape[0])

    @property
    def n(self) -> int:
        """Output rows per expert N."""
        return int(self.packed.shape[1])

    @property
    def k(self) -> int:
        """Input columns per expert K (E2M1 elements per row)."""
        return 2 * int(self.packed.shape[2])

    @property
    def block_size(self) -> int:
        """Elements per block scale (16 for NVFP4, 32 for MXFP4)."""
        return self.format.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of packed codes, block scales and global scales together."""
        return int(self.packed.nbytes + self.scales.nbytes + self.global_scale.nbytes)


@dataclass(frozen=True, eq=False, repr=False)
class Fp4Experts(ExpertShape):
    """Block-scaled E2M1 weights of ``n_experts`` experts, each ``[n, k]`` (host NumPy arrays).

    ``w[e, n, k] = E2M1[nib(e, n, k)] * scale(scales[e, n, k // block]) * global_scale[e]``

    where ``nib(e, n, k)`` is the low nibble of ``packed[e, n, k // 2]`` for even ``k`` and the
    high nibble for odd ``k``, ``scale`` decodes E4M3 (NVFP4, block 16) or E8M0 (MXFP4, block
    32) bytes, and ``E2M1`` is :data:`E2M1_VALUES`.

    Attributes
    ----------
    format : Fp4Format
        The block format (a string such as ``"nvfp4"`` is accepted and parsed).
    packed : numpy.ndarray
        uint8 ``(n_experts, n, k // 2)``; element 2i in the LOW nibble, 2i+1 in the high nibble.
    scales : numpy.ndarray
        uint8 ``(n_experts, n, k // block)``: raw E4M3 (NVFP4) or E8M0 (MXFP4) bytes, no NaN code.
    global_scale : numpy.ndarray
        float32 ``(n_experts,)``, finite and > 0 (all ones for MXFP4 from the quantizer).

    Notes
    -----
    The arrays are stored C-contiguous and read-only. Construction takes a read-only *view* of
    contiguous inputs (no copy), so keep the source arrays unchanged; non-contiguous inputs are
    copied. Build from CuPy arrays or ``ml_dtypes`` float8 scales with :meth:`from_packed`.
    """

    format: Fp4Format
    packed: np.ndarray
    scales: np.ndarray
    global_scale: np.ndarray

    def __post_init__(self) -> None:
        fmt = Fp4Format.parse(self.format)
        packed = _check_array(self.packed, "packed", np.uint8, 3)
        scales = _check_array(self.scales, "scales", np.uint8, 3)
        global_scale = _check_array(self.global_scale, "global_scale", np.float32, 1)
        n_experts, n, half_k = packed.shape
        block = fmt.block_size
        if (2 * half_k) % block:
            raise ValueError(
                f"packed: K = 2 * packed.shape[2] = {2 * half_k} must be a multiple of the "
                f"{fmt.value} block size {block}"
            )
        expected = (n_experts, n, 2 * half_k // block)
        if scales.shape != expected:
            raise ValueError(f"scales: expected shape {expected}, got {scales.shape}")
        if global_scale.shape != (n_experts,):
            raise ValueError(
                f"global_scale: expected shape ({n_experts},), got {global_scale.shape}"
            )
        if not np.all(np.isfinite(global_scale) & (global_scale > 0)):
            bad = global_scale[~(np.isfinite(global_scale) & (global_scale > 0))]
            raise ValueError(f"global_scale: expected finite values > 0, got {bad[:4].tolist()}")
        nan_byte = (scales & 0x7F) == 0x7F if fmt is Fp4Format.NVFP4 else scales == 0xFF
        if np.any(nan_byte):
            where = tuple(int(i) for i in np.argwhere(nan_byte)[0])
            raise ValueError(
                f"scales: {int(nan_byte.sum())} NaN {fmt.scale_name} byte(s), first "
                f"{int(scales[where]):#04x} at {where}"
            )
        object.__setattr__(self, "format", fmt)
        object.__setattr__(self, "packed", packed)
        object.__setattr__(self, "scales", scales)
        object.__setattr__(self, "global_scale", global_scale)

    def __repr__(self) -> str:
        return (
            f"Fp4Experts(format={self.format.value}, n_experts={self.n_experts}, n={self.n}, "
            f"k={self.k})"
        )

    @classmethod
    def quantize(
        cls,
        weights: Any,
        format: str | Fp4Format = "nvfp4",
        *,
        mx_scale_rule: str | MxScaleRule = "ocp",
    ) -> Fp4Experts:
        """Reference quantizer: float weights ``[E, N, K]`` -> ``Fp4Experts``.

        Parameters
        ----------
        weights : numpy.ndarray
            float16, bfloat16 (``ml_dtypes``), float32 or float64 ``(n_experts, n, k)``, finite;
            ``k`` a multiple of the block size.
        format : {"nvfp4", "mxfp4"} or Fp4Format
            Target format.
        mx_scale_rule : {"ocp", "round_up"} or MxScaleRule
            MXFP4 only: how block scales are chosen (see :class:`MxScaleRule`).

        Returns
        -------
        Fp4Experts

        Notes
        -----
        NVFP4 follows NVIDIA ModelOpt, in float32 (float64 weights are rounded to float32
        first): per expert ``global_scale = amax(|W_e|) / (6 * 448)`` (1.0 when ``amax == 0``);
        per block ``s = block_amax / (6 * global_scale)``, zeros replaced by 1.0, clamped to
        ``>= 2**-9``, rounded to E4M3 (RNE, saturating at 448); codes
        ``RNE_E2M1(W / (float(s) * global_scale))``. An all-zero block gets scale 1.0 (0x38).

        MXFP4 follows the OCP rule ``2**(floor(log2(block_amax)) - 2)`` by default (largest
        elements may saturate to 6) or ``2**ceil(log2(block_amax / 6))`` (never clips),
        exponents clamped to [-127, 127]; exact in float64. **An all-zero block gets scale byte
        127 (2**0) and codes +-0.** The global scale is 1.0.

        Examples
        --------
        >>> w = np.array([[[0.5, -1.0] * 8]], dtype=np.float32)
        >>> q = Fp4Experts.quantize(w, "nvfp4")
        >>> bool(np.array_equal(q.dequantize(), w))
        True
        """
        fmt = Fp4Format.parse(format)
        rule = MxScaleRule.parse(mx_scale_rule)
        w = _host(weights, "weights")
        if w.dtype not in _FLOAT_DTYPES:
            names = ", ".join(d.name for d in _FLOAT_DTYPES)
            raise TypeError(f"weights: expected dtype {names}, got {w.dtype}")
        if w.ndim != 3:
            raise ValueError(f"weights: expected shape (n_experts, n, k), got {w.shape}")
        n_experts, n, k = w.shape
        block = fmt.block_size
        if k % block:
            raise ValueError(
                f"weights: k = {k} must be a multiple of the {fmt.value} block size {block}"
            )
        if not np.all(np.isfinite(w)):
            raise ValueError(f"weights: {int(np.sum(~np.isfinite(w)))} non-finite value(s)")
        packed = np.empty((n_experts, n, k // 2), dtype=np.uint8)
        scales = np.empty((n_experts, n, k // block), dtype=np.uint8)
        global_scale = np.ones(n_experts, dtype=np.float32)
        for e in range(n_experts):  # one expert at a time bounds the temporaries
            blocks = w[e].reshape(n, k // block, block)
            if fmt is Fp4Format.NVFP4:
                codes, scales[e], global_scale[e] = _quantize_nvfp4(blocks, e)
            else:
                codes, scales[e] = _quantize_mxfp4(blocks, rule)
            packed[e] = pack_fp4(codes.reshape(n, k))
        return cls(fmt, packed, scales, global_scale)

    @classmethod
    def from_packed(
        cls,
        packed: Any,
        scales: Any,
        global_scale: Any = None,
        format: str | Fp4Format = "nvfp4",
    ) -> Fp4Experts:
        """Wrap checkpoint-layout arrays (NumPy, CuPy or array-likes; copied to the host).

        Parameters
        ----------
        packed : array_like
            uint8 ``(n_experts, n, k // 2)``, element 2i in the low nibble.
        scales : array_like
            ``(n_experts, n, k // block)``: raw uint8 bytes, or ``ml_dtypes.float8_e4m3fn``
            (NVFP4) / ``ml_dtypes.float8_e8m0fnu`` (MXFP4) values, taken as their bytes.
        global_scale : array_like or float, optional
            Floating ``(n_experts,)``, cast to float32; ``None`` means all ones. A scalar (Python
            float or 0-d array) is accepted only when ``n_experts == 1``, so that a per-tensor
            scale is never silently broadcast over experts. ModelOpt's ``weight_scale_2`` is this
            value; compressed-tensors' ``weight_global_scale`` is its reciprocal.
        format : {"nvfp4", "mxfp4"} or Fp4Format

        Returns
        -------
        Fp4Experts
        """
        fmt = Fp4Format.parse(format)
        packed_np = _host(packed, "packed")
        scales_np = _host(scales, "scales")
        if scales_np.dtype == fmt.scale_dtype:
            scales_np = scales_np.view(np.uint8)
        elif scales_np.dtype != np.uint8:
            raise TypeError(
                f"scales: expected uint8 or {fmt.scale_name} for {fmt.value}, got {scales_np.dtype}"
            )
        n_experts = packed_np.shape[0] if packed_np.ndim == 3 else -1
        if global_scale is None:
            gs = np.ones(max(n_experts, 0), dtype=np.float32)
        else:
            gs = _host(global_scale, "global_scale")
            if gs.dtype.kind not in "fi" and gs.dtype not in _FLOAT_DTYPES:
                raise TypeError(f"global_scale: expected a floating dtype, got {gs.dtype}")
            if gs.ndim == 0:
                if n_experts != 1:
                    raise ValueError(
                        f"global_scale: a scalar is accepted only for one expert; expected "
                        f"shape ({n_experts},) for {n_experts} experts, got a scalar"
                    )
                gs = gs.reshape(1)
            gs = gs.astype(np.float32)
        return cls(fmt, packed_np, scales_np, gs)

    def dequantize(self, dtype: Any = np.float32) -> np.ndarray:
        """The weights ``(n_experts, n, k)`` in ``dtype``: float64 (exact), float32, float16 or
        ``ml_dtypes.bfloat16`` (one rounding).

        ``E2M1 * scale`` has at most 6 significant bits and ``* global_scale`` at most 30, so the
        float64 product is exact; the cast to ``dtype`` is the single rounding (for float32 it
        equals fp32 ``(E2M1 * scale) * global_scale``). MXFP4 values above the float32 range
        (``6 * 2**127``) become inf in float32.
        """
        dt = np.dtype(dtype)
        if dt not in _FLOAT_DTYPES:
            names = ", ".join(d.name for d in _FLOAT_DTYPES)
            raise TypeError(f"dtype: expected one of {names}, got {dt}")
        table = _E4M3_F64 if self.format is Fp4Format.NVFP4 else _E8M0_F64
        n, k, block = self.n, self.k, self.block_size
        out = np.empty((self.n_experts, n, k), dtype=dt)
        for e in range(self.n_experts):  # one expert at a time bounds the float64 temporaries
            values = _E2M1_F64[unpack_fp4(self.packed[e])].reshape(n, k // block, block)
            scaled = values * (table[self.scales[e]] * float(self.global_scale[e]))[..., None]
            with np.errstate(over="ignore"):
                out[e] = scaled.reshape(n, k)
        return out

    def select_rows(self, index: slice | Any) -> Fp4Experts:
        """Rows ``index`` (a slice or 1-D integer array) along N of every expert, same global
        scales: ``slice(0, None, 2)`` is the gate of an interleaved gpt-oss FC1, ``slice(0, I)``
        the first half of a concatenated ``[gate; up]`` FC1."""
        if not isinstance(index, slice):
            idx = _host(index, "index")
            if idx.ndim != 1 or idx.dtype.kind not in "iu":
                raise TypeError(
                    f"index: expected a slice or a 1-D integer array, got dtype {idx.dtype} "
                    f"with shape {idx.shape}"
                )
            if idx.size and (idx.min() < 0 or idx.max() >= self.n):
                raise ValueError(
                    f"index: expected rows in [0, {self.n}), got range [{idx.min()}, {idx.max()}]"
                )
            index = idx
        return Fp4Experts(
            self.format, self.packed[:, index, :], self.scales[:, index, :], self.global_scale
        )
