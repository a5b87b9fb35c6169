# SPDX-License-Identifier: Apache-2.0
"""Block-scaled FP4 expert weights on the host: the formats, ``Fp4Experts`` and the quantizers.

``w[e, n, k] = E2M1[nib(e, n, k)] * scale(scales[e, n, k // block]) * global_scale[e]``; the codes
and scale bytes are defined in :mod:`.codes`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .._runtime.validate import parse_enum
from .codes import (
    _E2M1_F64,
    _E4M3_F64,
    _E8M0_F64,
    _FLOAT_DTYPES,
    _floor_log2,
    _host,
    decode_e4m3,
    decode_e8m0,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0_exponent,
    pack_fp4,
    unpack_fp4,
)

__all__ = ["ExpertShape", "Fp4Experts", "Fp4Format", "MxScaleRule"]


class Fp4Format(enum.Enum):
    """Block-scaled E2M1 weight formats."""

    #: NVIDIA NVFP4: blocks of 16 along K, one E4M3 (e4m3fn) scale per block, and one FP32 global
    #: scale per expert (gate and up each keep their own).
    NVFP4 = "nvfp4"
    #: OCP MXFP4 (Microscaling v1.0): blocks of 32 along K, one E8M0 power-of-two scale per
    #: block; the global scale is 1.0.
    MXFP4 = "mxfp4"

    @property
    def code(self) -> int:
        """The kernels' ``kFormat`` template argument (``common.cuh``: 0 NVFP4, 1 MXFP4)."""
        return 0 if self is Fp4Format.NVFP4 else 1

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
