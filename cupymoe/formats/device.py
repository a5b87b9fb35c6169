# SPDX-License-Identifier: Apache-2.0
"""Expert weights on the GPU (``DeviceFp4``): the host format uploaded as it is, or with its nibbles
in the pair-interleaved order."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from .codes import to_pair_interleaved
from .experts import ExpertShape, Fp4Experts, Fp4Format

__all__ = ["DeviceFp4", "random_fp4_gpu"]


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


def _random_uint8(rs: Any, shape: tuple[int, ...], low: int, high: int) -> Any:
    """Uniform integers in ``[low, high]`` as a cupy uint8 array, made in bounded chunks."""
    cupy = require_cupy()
    out = cupy.empty(shape, dtype=cupy.uint8)
    flat = out.reshape(-1)
    step = 1 << 27
    for i in range(0, flat.size, step):
        count = min(step, flat.size - i)
        u = rs.random_sample(count, dtype=cupy.float32) * np.float32(high - low + 1) + low
        flat[i : i + count] = cupy.minimum(u, high).astype(cupy.uint8)
    return out


def random_fp4_gpu(n_experts: int, n: int, k: int, fmt: Any, *, seed: int = 0) -> Fp4Experts:
    """Random valid FP4 weights ``[n_experts, n, k]`` drawn on the GPU (for tuning and benchmarks).

    Codes are uniform bytes; block scales are E4M3 bytes 0x30..0x40 (0.5..2) or E8M0 bytes
    120..124 (2^-7..2^-3); NVFP4 global scales are 1/64. The arrays are copied once to the host
    (``Fp4Experts`` holds NumPy arrays); nothing is quantized on the host.
    """
    cupy = require_cupy()
    fmt = Fp4Format.parse(fmt, "fmt")
    rs = cupy.random.RandomState(seed)
    packed = _random_uint8(rs, (n_experts, n, k // 2), 0, 255)
    low, high = (0x30, 0x40) if fmt is Fp4Format.NVFP4 else (120, 124)
    scales = _random_uint8(rs, (n_experts, n, k // fmt.block_size), low, high)
    global_scale = np.full(n_experts, 1.0 / 64 if fmt is Fp4Format.NVFP4 else 1.0, np.float32)
    return Fp4Experts.from_packed(packed.get(), scales.get(), global_scale, format=fmt)
