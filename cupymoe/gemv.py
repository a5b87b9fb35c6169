# SPDX-License-Identifier: Apache-2.0
"""FP4 expert GEMV for decode: FC1 with the gated activation fused, and FC2.

``fc2(h)[r] = h[r] @ W[e]^T + b[e]`` and
``fc1(x)[r] = act(x[t] @ Wg[e]^T + bg[e], x[t] @ Wu[e]^T + bu[e])`` for every expanded row ``r``
of expert ``e`` (``expert_offsets[e] <= r < expert_offsets[e + 1]``) with
``t = sorted_rows[r] // top_k``.

The kernels (``cuda/gemv_fp4.cu``) run on tensor cores (``mma.sync`` m16n8k16, weights decoded
and block-scaled exactly in 16 bits, fp32 accumulation) and are expert-major: one block per
(column tile, active expert) applies each decoded weight tile to all rows of its expert, so an
expert's weights are read once per call. FC1 reads ``x`` in token order through ``sorted_rows``
(no expand launch). Above the row window (:data:`~cupymoe.config.ROW_WINDOW` expanded rows)
the calls go to :mod:`cupymoe.batched` (dequantize + cuBLAS, not capturable).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any

import ml_dtypes
import numpy as np

from ._backend import device_output, is_cupy_array, require_cupy, to_numpy
from ._compile import KernelSpec
from ._launch import launch, pdl_enabled
from .config import CHUNK, ROW_WINDOW, TILINGS, WEIGHT_LAYOUTS, GemvConfig
from .dequant import DeviceFp4
from .formats import _PAIR_SLOT, Fp4Experts, Fp4Format, parse_enum
from .routing import check_device_routing

# fmt: off
__all__ = [
    "DEFAULT_GEMV_ORDER", "DEFAULT_PAIR_INTERLEAVED", "GEMV_ORDERS", "ROW_WINDOW", "Activation",
    "ActivationSpec", "PreparedFc1", "PreparedFc2", "activation_ref", "fc1", "fc1_ref", "fc2",
    "gemv_layout", "gemv_ref", "kernel_specs", "split_slot", "split_words",
    "mx_scale_shift", "prepare_fc1", "prepare_fc2", "tile_scales",
]
# fmt: on

#: Nibble order host weights are uploaded in: the pair-interleaved order decodes with shifts and
#: masks (left shifts written as multiplications, which ptxas may issue on the FMA pipe), the
#: plain order with byte-permute lookups that all load the ALU pipe, which limits the GEMV.
#: Measured on the H200 (bf16, cta_n 64): Qwen3.6 FC1 at M = 4 / 8 takes 16.8 / 27.7 µs
#: pair-interleaved vs 20.7 / 34.1 µs plain.
DEFAULT_PAIR_INTERLEAVED = True

#: Weight layouts the GEMV kernels read (``prepare_fc1`` / ``prepare_fc2``, ``gemv_order``):
#: ``"split"`` -- the GEMV's own copy (:func:`gemv_layout`): tiles of 8 / 16 rows stored
#: chunk-major (one contiguous stream per tile) and the split nibble order (:func:`split_words`),
#: which decodes in 10 instructions per 8 codes for bf16 (13 pair-interleaved); it costs a second
#: copy of the weights on the GPU. ``"native"`` -- the :class:`DeviceFp4` bytes themselves (plain
#: or pair-interleaved, row-major; no copy when K is a multiple of 32).
#: Measured on the H200 (bf16, graph replay, µs per call, native pair -> split, one run of the
#: final kernels): DeepSeek-V3 FC1 at M = 1 / 4 42.8 -> 38.8 / 152.9 -> 135.8, FC2 25.6 -> 24.3 /
#: 78.1 -> 73.7; gpt-oss-20b FC1 at M = 1 16.0 -> 14.7.
GEMV_ORDERS = ("split", "native")
DEFAULT_GEMV_ORDER = "split"

#: Template argument kOrder of the GEMV kernels (their names: config.WEIGHT_LAYOUTS).
_ORDER_PLAIN, _ORDER_PAIR, _ORDER_SPLIT = 0, 1, 2

#: Split order: for pair p (elements 2p in the low and 2p + 1 in the high 16 bits of a word), the
#: position of the lowest magnitude bit and of the sign bit inside the half (cuda/gemv_fp4.cu).
_SPLIT_MAG = (6, 3, 0, 9)
_SPLIT_SIGN = (15, 12, 14, 13)

_CTYPES = {np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16", np.dtype(np.float16): "__half"}
_FORMAT_CODE = {Fp4Format.NVFP4: 0, Fp4Format.MXFP4: 1}


class Activation(enum.Enum):
    """Gated activation of FC1: ``h = act(gate, up)``, computed in fp32 in the GEMV epilogue."""

    #: ``silu(gate) * up`` (Qwen, DeepSeek, Mixtral).
    SWIGLU = "swiglu"
    #: ``gelu(gate) * up`` with the exact (erf) GELU.
    GEGLU = "geglu"
    #: gpt-oss: ``g * sigmoid(alpha * g) * (u + 1)``, ``g = min(gate, limit)``,
    #: ``u = clip(up, -limit, limit)``.
    SWIGLU_OAI = "swiglu_oai"

    @classmethod
    def parse(cls, value: str | Activation, name: str = "activation") -> Activation:
        """``Activation`` from a member or its value (case-insensitive)."""
        return parse_enum(cls, value, name)


_ACT_CODE = {Activation.SWIGLU: 1, Activation.GEGLU: 2, Activation.SWIGLU_OAI: 3}


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """An activation and its parameters (``alpha`` and ``limit`` are used by swiglu_oai only)."""

    kind: Activation
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Activation.parse(self.kind, "kind"))
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
                raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
            object.__setattr__(self, name, float(value))
        if not math.isfinite(self.alpha):
            raise ValueError(f"alpha: expected a finite float, got {self.alpha}")
        if not self.limit > 0:  # +inf is allowed: no clamping
            raise ValueError(f"limit: expected > 0 (inf for no clamping), got {self.limit}")


def _sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))  # never overflows
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


_erf = np.frompyfunc(math.erf, 1, 1)


def activation_ref(gate: Any, up: Any, act: ActivationSpec) -> np.ndarray:
    """``act(gate, up)`` in float64 (the formulas of :class:`Activation`).

    >>> activation_ref(np.array([0.0, 100.0]), np.array([3.0, 2.0]), ActivationSpec("swiglu"))
    array([  0., 200.])
    """
    if not isinstance(act, ActivationSpec):
        raise TypeError(f"act: expected an ActivationSpec, got {type(act).__name__}")
    g = np.asarray(to_numpy(gate), dtype=np.float64)
    u = np.asarray(to_numpy(up), dtype=np.float64)
    if g.shape != u.shape:
        raise ValueError(f"up: expected the shape of gate {g.shape}, got {u.shape}")
    if act.kind is Activation.SWIGLU:
        return g * _sigmoid(g) * u
    if act.kind is Activation.GEGLU:
        return 0.5 * g * (1.0 + np.asarray(_erf(g / math.sqrt(2.0)), dtype=np.float64)) * u
    g = np.minimum(g, act.limit)
    u = np.clip(u, -act.limit, act.limit)
    return g * _sigmoid(act.alpha * g) * (u + 1.0)


# ---- references ------------------------------------------------------------------------------
def _host_offsets(expert_offsets: Any, n_experts: int, rows: int) -> np.ndarray:
    off = np.asarray(to_numpy(expert_offsets))
    if off.shape != (n_experts + 1,) or off.dtype.kind not in "iu":
        raise ValueError(
            f"expert_offsets: expected integers of shape {(n_experts + 1,)}, got "
            f"{off.dtype} {off.shape}"
        )
    off = off.astype(np.int64)
    if off[0] != 0 or off[-1] != rows or np.any(np.diff(off) < 0):
        raise ValueError(
            f"expert_offsets: expected non-decreasing offsets from 0 to {rows} rows, "
            f"got {off.tolist()[:4]}... ending at {int(off[-1])}"
        )
    return off


def _expert_f64(w: Fp4Experts, e: int) -> np.ndarray:
    """Exact float64 ``[N, K]`` of expert ``e`` (one expert at a time: bounded memory)."""
    from .formats import decode_e2m1, unpack_fp4

    values = decode_e2m1(unpack_fp4(w.packed[e])).astype(np.float64)
    scales = w.format.decode_scales(w.scales[e]).astype(np.float64)
    values = values.reshape(w.n, -1, w.block_size) * scales[..., None]
    return values.reshape(w.n, w.k) * float(w.global_scale[e])


def _check_bias_ref(bias: Any, name: str, w: Fp4Experts) -> np.ndarray | None:
    if bias is None:
        return None
    b = np.asarray(to_numpy(bias), dtype=np.float64)
    if b.shape != (w.n_experts, w.n):
        raise ValueError(f"{name}: expected shape {(w.n_experts, w.n)}, got {b.shape}")
    return b


def gemv_ref(
    x_sorted: Any, weights: Fp4Experts, expert_offsets: Any, *, bias: Any = None
) -> np.ndarray:
    """``out[r] = x_sorted[r] @ W[e]^T (+ bias[e])`` for the rows ``r`` of each expert ``e``.

    Parameters
    ----------
    x_sorted : array [R, K]
        Activations in expanded order (any float dtype; widened to float64).
    weights : Fp4Experts
        ``[E, N, K]``.
    expert_offsets : int array [E + 1]
        Rows ``offsets[e]:offsets[e+1]`` belong to expert ``e``.
    bias : array [E, N], optional

    Returns
    -------
    numpy.ndarray
        float64 ``[R, N]``; exact weights, float64 math.
    """
    if not isinstance(weights, Fp4Experts):
        raise TypeError(f"weights: expected Fp4Experts, got {type(weights).__name__}")
    x = np.asarray(to_numpy(x_sorted)).astype(np.float64)
    if x.ndim != 2 or x.shape[1] != weights.k:
        raise ValueError(f"x_sorted: expected shape (rows, {weights.k}), got {x.shape}")
    off = _host_offsets(expert_offsets, weights.n_experts, x.shape[0])
    b = _check_bias_ref(bias, "bias", weights)
    out = np.zeros((x.shape[0], weights.n), dtype=np.float64)
    for e in np.flatnonzero(np.diff(off)):
        lo, hi = int(off[e]), int(off[e + 1])
        out[lo:hi] = x[lo:hi] @ _expert_f64(weights, int(e)).T
        if b is not None:
            out[lo:hi] += b[e]
    return out


def fc1_ref(
    x_sorted: Any,
    gate: Fp4Experts,
    up: Fp4Experts,
    expert_offsets: Any,
    *,
    act: ActivationSpec,
    gate_bias: Any = None,
    up_bias: Any = None,
) -> np.ndarray:
    """``act(gemv_ref(x, gate) + gate_bias, gemv_ref(x, up) + up_bias)``: float64 ``[R, I]``."""
    if not isinstance(up, Fp4Experts) or not isinstance(gate, Fp4Experts):
        raise TypeError("gate, up: expected Fp4Experts")
    if (up.n_experts, up.n, up.k) != (gate.n_experts, gate.n, gate.k):
        raise ValueError(
            f"up: expected the shape of gate {(gate.n_experts, gate.n, gate.k)}, "
            f"got {(up.n_experts, up.n, up.k)}"
        )
    _check_bias_ref(gate_bias, "gate_bias", gate)  # name the caller's argument
    _check_bias_ref(up_bias, "up_bias", up)
    g = gemv_ref(x_sorted, gate, expert_offsets, bias=gate_bias)
    u = gemv_ref(x_sorted, up, expert_offsets, bias=up_bias)
    return activation_ref(g, u, act)


# ---- prepared device layouts -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PreparedFc1:
    """FC1 weights on the GPU: plain :class:`DeviceFp4` (for the batched path) + kernel layouts.

    ``kernel_gate`` / ``kernel_up`` are the weights the kernel reads, in ``kernel_order`` (the
    kOrder template argument: 0 plain, 1 pair-interleaved, 2 split): with ``gemv_order="native"``
    ``[E, I, chunks * 16]`` uint8, the packed arrays themselves when ``H % 32 == 0``, else copies
    zero-padded along K to a multiple of 32 codes; with ``"split"`` the :func:`gemv_layout` copies
    (tiles of 8 rows).
    ``kernel_scales`` (uint8 ``[E, ceil(I / 8), chunks, 8 * 2 * 32 / block]``, see
    :func:`tile_scales`) puts the scale bytes one lane needs per chunk (gate and up of one column)
    side by side: one 4- or 2-byte load. ``scale_range`` is the (min, max) MXFP4 scale exponent
    byte of gate and up (NaN bytes left out), ``None`` for NVFP4: it picks the kernel's power-of-two
    scale shift (:func:`mx_scale_shift`).
    """

    gate: DeviceFp4
    up: DeviceFp4
    kernel_gate: Any
    kernel_up: Any
    kernel_scales: Any
    kernel_order: int
    gate_bias: Any = None  # cupy float32 [E, I] or None (set together with up_bias)
    up_bias: Any = None
    scale_range: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class PreparedFc2:
    """FC2 weights on the GPU: the plain :class:`DeviceFp4` + kernel layouts.

    ``kernel_scales`` is uint8 ``[E, ceil(H / 16), chunks, 8 * 2 * 32 / block]`` (rows ``g`` and
    ``g + 8`` of each 16-row tile side by side); ``kernel_packed`` and ``kernel_order`` as in
    :class:`PreparedFc1` (split: tiles of 16 rows); see :func:`tile_scales`.
    """

    down: DeviceFp4
    kernel_packed: Any
    kernel_scales: Any
    kernel_order: int
    bias: Any = None  # cupy float32 [E, H] or None
    scale_range: tuple[int, int] | None = None


def _device(w: Fp4Experts | DeviceFp4, name: str, pair_interleaved: bool | None) -> DeviceFp4:
    if isinstance(w, DeviceFp4):
        if pair_interleaved is not None and w.pair_interleaved != pair_interleaved:
            raise ValueError(
                f"{name}: expected pair_interleaved={pair_interleaved}, got {w.pair_interleaved}"
            )
    elif not isinstance(w, Fp4Experts):
        raise TypeError(f"{name}: expected Fp4Experts or DeviceFp4, got {type(w).__name__}")
    else:
        order = DEFAULT_PAIR_INTERLEAVED if pair_interleaved is None else pair_interleaved
        w = DeviceFp4.from_experts(w, pair_interleaved=order)
    if w.packed.data.ptr % 16:  # the kernels load 16 bytes at a time
        raise ValueError(f"{name}.packed: expected a 16-byte aligned array")
    check_expert_bytes(w.n, w.k, name)
    return w


def check_expert_bytes(n: int, k: int, name: str) -> None:
    """The GEMV addresses one expert's padded ``[n, K/2]`` bytes with 32-bit offsets."""
    size = -(-n // 16) * 16 * _chunks(k) * CHUNK // 2  # N padded to whole tiles (split layout)
    if size >= 2**32:
        raise ValueError(
            f"{name}: one expert's weights take {size} bytes ({n} x {k} codes); "
            "the GEMV supports less than 4 GiB per expert"
        )


def _chunks(k: int) -> int:
    return -(-k // CHUNK)


def _xp(a: Any) -> Any:
    return np if isinstance(a, np.ndarray) else require_cupy()


def pad_packed(packed: Any, k: int) -> Any:
    """``packed [E, N, K/2]`` zero-padded along K to whole 32-code chunks (itself when aligned).

    Works on NumPy or CuPy arrays (the CPU tests check the kernel layouts through it).
    """
    pad = _chunks(k) * CHUNK // 2 - packed.shape[2]
    if pad == 0:
        return packed
    xp = _xp(packed)
    return xp.ascontiguousarray(xp.pad(packed, ((0, 0), (0, 0), (0, pad))))


def split_words(words: Any, pair_interleaved: bool) -> Any:
    """uint32 words of 8 codes (plain or pair-interleaved nibble order) -> the split order.

    In the split order the magnitude bits of element ``2p`` (``2p + 1``) sit at bits
    ``_SPLIT_MAG[p] ..+2`` and its sign at bit ``_SPLIT_SIGN[p]`` of the low (high) 16 bits: the
    places the GEMV's bf16 decode reaches with the fewest instructions. NumPy or CuPy.
    """
    xp = _xp(words)
    if words.dtype != np.uint32:
        raise TypeError(f"words: expected uint32, got {words.dtype}")
    out = xp.zeros_like(words)
    for i in range(8):
        slot = int(_PAIR_SLOT[i]) if pair_interleaved else i
        code = (words >> np.uint32(4 * slot)) & np.uint32(0xF)
        pair, half = divmod(i, 2)
        out |= (code & np.uint32(7)) << np.uint32(16 * half + _SPLIT_MAG[pair])
        out |= (code >> np.uint32(3)) << np.uint32(16 * half + _SPLIT_SIGN[pair])
    return out


def split_slot(row: Any, chunk: Any) -> Any:
    """Where row ``row`` of a tile sits among the 16-byte slots of chunk ``chunk`` in the split
    layout: rows rotate by ``2 * (chunk % 4)`` inside each group of 8 (NumPy broadcasting).

    A GEMV warp's lanes (g, t) load row g of chunk 4j + t. Without the rotation the eight lanes
    of a quarter warp (g in {2p, 2p + 1}, t in 0..3) read 16-byte pieces that are 256 or 128
    bytes apart and come back through the same two L1 bank groups; with it, through eight.

    >>> split_slot(np.arange(8), 1).tolist()
    [2, 3, 4, 5, 6, 7, 0, 1]
    """
    return (row // 8) * 8 + (row % 8 + 2 * (chunk % 4)) % 8


def gemv_layout(packed: Any, k: int, pair_interleaved: bool, rows_per_tile: int) -> Any:
    """``packed [E, N, K/2]`` -> the GEMV's split layout ``[E, tiles, chunks, rows_per_tile, 16]``.

    Rows are grouped in tiles of ``rows_per_tile`` (FC1: 8, gate and up each; FC2: 16; the last
    tile padded with zero rows), K in 32-code chunks (zero-padded), and a tile is stored
    chunk-major: the rows of one chunk are ``16 * rows_per_tile`` contiguous bytes, row ``r`` of
    chunk ``c`` at slot :func:`split_slot` ``(r, c)``, and a tile's whole K range is one stream.
    Every word is in the :func:`split_words` order. NumPy or CuPy; converts a bounded number of
    experts at a time.
    """
    xp = _xp(packed)
    padded = pad_packed(packed, k)
    n_experts, n, row = padded.shape
    chunks = row // 16
    tiles = -(-n // rows_per_tile)
    out = xp.empty((n_experts, tiles, chunks, rows_per_tile, 16), np.uint8)
    step = max(1, (64 << 20) // max(1, tiles * rows_per_tile * row))
    for lo in range(0, n_experts, step):
        hi = min(n_experts, lo + step)
        part = xp.zeros((hi - lo, tiles * rows_per_tile, row), np.uint8)
        part[:, :n] = padded[lo:hi]
        words = split_words(part.view(np.uint32), pair_interleaved)
        tiled = words.view(np.uint8).reshape(hi - lo, tiles, rows_per_tile, chunks, 16)
        tiled = tiled.transpose(0, 1, 3, 2, 4)  # [E, tiles, chunks, rows, 16]
        for q in range(4):  # the chunks c with c % 4 == q share one rotation
            slots = split_slot(np.arange(rows_per_tile), q).tolist()
            out[lo:hi, :, q::4][:, :, :, slots] = tiled[:, :, q::4]
    return out


def tile_scales(scales: list[Any], k: int, block: int) -> Any:
    """Scale bytes ``[E, N, K/block]`` re-tiled for the tensor-core GEMV (NumPy or CuPy).

    ``scales`` is ``[gate, up]`` (FC1: a tile is 8 columns, its two halves are gate and up) or
    ``[down]`` (FC2: a tile is 16 rows, its halves are rows 0-7 and 8-15). Result
    ``[E, tiles, chunks, 8 * 2 * 32 / block]``: for tile ``t``, chunk ``c`` and lane row ``g``, the
    bytes ``(g * 2 + half) * 32 / block + s`` are block ``s`` of the chunk in the half's row ``g``
    (zero past N and past K), so a lane loads its 2 rows x 1-2 blocks in one go.
    """
    if len(scales) not in (1, 2):
        raise ValueError(f"scales: expected [gate, up] or [down], got {len(scales)} arrays")
    xp = _xp(scales[0])
    n_experts, n = scales[0].shape[:2]
    per_chunk = CHUNK // block
    chunks = _chunks(k)
    rows = 16 // len(scales)  # rows of each matrix in one tile
    tiles = -(-n // rows)
    parts = []
    for s in scales:
        z = xp.zeros((n_experts, tiles * rows, chunks * per_chunk), dtype=xp.uint8)
        z[:, :n, : s.shape[2]] = s
        parts.append(z.reshape(n_experts, tiles, rows // 8, 8, chunks, per_chunk))
    halves = xp.concatenate(parts, axis=2)  # [E, tiles, 2, 8, chunks, blocks]
    tiled = xp.ascontiguousarray(halves.transpose(0, 1, 4, 3, 2, 5))
    return tiled.reshape(n_experts, tiles, chunks, -1)


#: MXFP4: the interval the exponent byte plus the kernel's scale shift must stay in, per
#: (activation dtype, pair-interleaved), so that every decoded ``code * 2^(s - 127 + shift)`` and
#: its table entry are exact 16-bit numbers (normal for bf16); derived in ``cuda/gemv_fp4.cu``.
_MX_INTERVALS = {
    (np.dtype(ml_dtypes.bfloat16), False): (2, 252),
    (np.dtype(ml_dtypes.bfloat16), True): (12, 138),
    (np.dtype(np.float16), False): (104, 140),
    (np.dtype(np.float16), True): (118, 142),
}


def mx_scale_shift(scale_range: tuple[int, int] | None, dtype: Any, pair: bool) -> int | None:
    """The kernel's power-of-two scale shift for MXFP4 scale bytes in ``scale_range``.

    ``0`` for NVFP4 (``scale_range`` None) and for every MXFP4 range that fits as it is; else the
    shift closest to 0 that moves the range into the dtype's interval; ``None`` when the range is
    wider than the interval (fp16 activations with scales spanning more than about 2^24-2^36):
    the tensor-core GEMV cannot fold those scales exactly and the call takes the batched path.

    >>> mx_scale_shift((120, 130), np.float16, False), mx_scale_shift((90, 100), np.float16, False)
    (0, 14)
    """
    if scale_range is None:
        return 0
    lo, hi = scale_range
    first, last = _MX_INTERVALS[(np.dtype(dtype), bool(pair))]
    if hi - lo > last - first:
        return None
    return min(max(0, first - lo), last - hi)


def _scale_range_host(scales: list[Any], fmt: Fp4Format) -> tuple[int, int] | None:
    """(min, max) MXFP4 scale byte over ``scales`` (NumPy or CuPy) without the NaN byte 0xFF;
    ``None`` for NVFP4. All-NaN (or empty) scales give ``(127, 127)``."""
    if fmt is not Fp4Format.MXFP4:
        return None
    lo, hi = 255, 0
    for s in scales:
        xp = _xp(s)
        b = s.reshape(-1)
        finite = b[b != 255]  # 0xFF is NaN: it stays NaN whatever the shift
        if finite.size:
            lo, hi = min(lo, int(xp.min(finite))), max(hi, int(xp.max(finite)))
    return (lo, hi) if lo <= hi else (127, 127)


def _scale_range(*mats: DeviceFp4) -> tuple[int, int] | None:
    return _scale_range_host([m.scales for m in mats], mats[0].format)


def _device_bias(bias: Any, name: str, n_experts: int, n: int) -> Any:
    cupy = require_cupy()
    b = np.asarray(to_numpy(bias))
    if b.shape != (n_experts, n):
        raise ValueError(f"{name}: expected shape {(n_experts, n)}, got {b.shape}")
    if b.dtype.kind != "f" and b.dtype != np.dtype(ml_dtypes.bfloat16):
        raise TypeError(f"{name}: expected a float array, got dtype {b.dtype}")
    b = b.astype(np.float32)
    if not np.all(np.isfinite(b)):
        raise ValueError(f"{name}: contains NaN or Inf")
    return cupy.ascontiguousarray(cupy.asarray(b))


def _gemv_order(gemv_order: str | None) -> str:
    order = DEFAULT_GEMV_ORDER if gemv_order is None else gemv_order
    if order not in GEMV_ORDERS:
        raise ValueError(f"gemv_order: expected one of {list(GEMV_ORDERS)}, got {gemv_order!r}")
    return order


def _kernel_weights(w: DeviceFp4, order: str, rows_per_tile: int) -> tuple[Any, int]:
    """The bytes the GEMV reads and their kOrder: the split copy or the native (padded) array."""
    if order == "split":
        return gemv_layout(w.packed, w.k, w.pair_interleaved, rows_per_tile), _ORDER_SPLIT
    return pad_packed(w.packed, w.k), _ORDER_PAIR if w.pair_interleaved else _ORDER_PLAIN


def prepare_fc1(
    gate: Fp4Experts | DeviceFp4,
    up: Fp4Experts | DeviceFp4,
    *,
    gate_bias: Any = None,
    up_bias: Any = None,
    pair_interleaved: bool | None = None,
    gemv_order: str | None = None,
) -> PreparedFc1:
    """Upload FC1 (gate ``[E, I, H]`` and up ``[E, I, H]``) and build the kernel layouts once.

    A bias given for only one of gate / up gets a zero bias for the other. ``pair_interleaved``:
    the nibble order on the GPU; ``None`` keeps a :class:`DeviceFp4`'s own order and uploads
    host weights in :data:`DEFAULT_PAIR_INTERLEAVED` order; ``True`` / ``False`` require it.
    ``gemv_order``: the layout the GEMV reads, one of :data:`GEMV_ORDERS` (``None``:
    :data:`DEFAULT_GEMV_ORDER`); ``"split"`` keeps a second copy of the weights.
    """
    order = _gemv_order(gemv_order)
    g = _device(gate, "gate", pair_interleaved)
    u = _device(up, "up", pair_interleaved)
    if (u.format, u.n_experts, u.n, u.k) != (g.format, g.n_experts, g.n, g.k):
        raise ValueError(
            f"up: expected the format and shape of gate {(g.format.value, g.n_experts, g.n, g.k)}, "
            f"got {(u.format.value, u.n_experts, u.n, u.k)}"
        )
    biases = [gate_bias, up_bias]
    if any(b is not None for b in biases):
        biases = [np.zeros((g.n_experts, g.n), np.float32) if b is None else b for b in biases]
        biases = [
            _device_bias(b, name, g.n_experts, g.n)
            for b, name in zip(biases, ("gate_bias", "up_bias"), strict=True)
        ]
    scales = tile_scales([g.scales, u.scales], g.k, g.block_size)
    kernel_gate, kernel_order = _kernel_weights(g, order, 8)
    kernel_up, _ = _kernel_weights(u, order, 8)
    return PreparedFc1(
        g,
        u,
        kernel_gate,
        kernel_up,
        scales,
        kernel_order,
        gate_bias=biases[0],
        up_bias=biases[1],
        scale_range=_scale_range(g, u),
    )


def prepare_fc2(
    down: Fp4Experts | DeviceFp4,
    *,
    bias: Any = None,
    pair_interleaved: bool | None = None,
    gemv_order: str | None = None,
) -> PreparedFc2:
    """Upload FC2 (down ``[E, H, I]``) and build the kernel layouts once (``pair_interleaved`` and
    ``gemv_order`` as in :func:`prepare_fc1`)."""
    order = _gemv_order(gemv_order)
    d = _device(down, "down", pair_interleaved)
    b = None if bias is None else _device_bias(bias, "bias", d.n_experts, d.n)
    scales = tile_scales([d.scales], d.k, d.block_size)
    packed, kernel_order = _kernel_weights(d, order, 16)
    return PreparedFc2(d, packed, scales, kernel_order, b, scale_range=_scale_range(d))


# ---- GPU ops -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _device_name(device_id: int) -> str:
    from .tune import device_name

    return device_name()


def _check_activations(a: Any, name: str, rows: int, width: int) -> np.dtype:
    if not is_cupy_array(a):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
    if a.dtype not in _CTYPES:
        raise TypeError(f"{name}: expected dtype bfloat16 or float16, got {a.dtype}")
    if a.shape != (rows, width):
        raise ValueError(f"{name}: expected shape {(rows, width)}, got {a.shape}")
    if not a.flags.c_contiguous or a.data.ptr % 16:
        raise ValueError(f"{name}: expected a C-contiguous, 16-byte aligned array")
    return np.dtype(a.dtype)


def _config(
    config: GemvConfig | None,
    w: DeviceFp4,
    rows: int,
    dtype: np.dtype,
    *,
    gated: bool,
    kernel_order: int,
) -> GemvConfig:
    if config is None:
        name = _device_name(require_cupy().cuda.Device().id)
        return GemvConfig.for_problem(
            n=w.n,
            k=w.k,
            rows=rows,
            fmt=w.format,
            device_name=name,
            dtype=dtype,
            gated=gated,
            n_experts=w.n_experts,
            layout=WEIGHT_LAYOUTS[kernel_order],
        )
    if not isinstance(config, GemvConfig):
        raise TypeError(f"config: expected a GemvConfig, got {type(config).__name__}")
    return config


def _blocks(n: int, cols_per_tile: int, cfg: GemvConfig) -> int:
    """Column blocks of a launch: tiles of ``cols_per_tile`` columns, ``cfg.cta_n / 16`` each."""
    tiles = -(-n // cols_per_tile)
    return -(-tiles // (cfg.cta_n // 16))


def fc1(
    x: Any,
    weights: PreparedFc1,
    routing: Any,
    *,
    act: ActivationSpec,
    out: Any = None,
    config: GemvConfig | None = None,
    row_window: int = ROW_WINDOW,
    pdl: bool = False,
) -> Any:
    """FC1 GEMV with the gated activation: ``h[r] = act(x[t] Wg[e]^T + bg, x[t] Wu[e]^T + bu)``.

    Parameters
    ----------
    x : cupy.ndarray
        ``[n_tokens, hidden]`` bf16 or fp16, token order (read through ``routing.sorted_rows``).
    weights : PreparedFc1
    routing : Routing
        CuPy routing arrays (int32).
    act : ActivationSpec
    out : cupy.ndarray, optional
        ``[n_tokens * top_k, intermediate]`` of ``x.dtype``.
    config : GemvConfig, optional
        Tiling; default :meth:`GemvConfig.for_problem`.
    row_window : int
        Above this many expanded rows, :func:`cupymoe.batched.fc1_batched` runs instead.
    pdl : bool
        Make the GEMV launch a programmatic dependent launch (:mod:`cupymoe._launch`): its blocks
        build their scale tables while the previous kernel finishes and wait for it before they
        read the routing maps. Safe after any kernel.

    Returns
    -------
    cupy.ndarray
        ``h [n_tokens * top_k, intermediate]`` in expanded order, dtype of ``x``.

    Notes
    -----
    Weights times block scales are exact 16-bit numbers (times a power of two); products and sums
    in fp32 on tensor cores; global scales (gate and up separately), biases and the activation in
    fp32; one rounding to ``x.dtype``. Capturable in a CUDA graph at or below the row window (no
    host read, no allocation with ``out``). Bitwise deterministic for a given config. MXFP4 with
    fp16 activations whose scales span more than :func:`mx_scale_shift` can fold exactly takes the
    batched path.
    """
    if not isinstance(weights, PreparedFc1):
        raise TypeError(f"weights: expected PreparedFc1, got {type(weights).__name__}")
    if not isinstance(act, ActivationSpec):
        raise TypeError(f"act: expected an ActivationSpec, got {type(act).__name__}")
    g = weights.gate
    if not is_cupy_array(x) or x.ndim != 2:
        raise TypeError(f"x: expected a 2-D cupy.ndarray [n_tokens, {g.k}], got {type(x).__name__}")
    dtype = _check_activations(x, "x", x.shape[0], g.k)
    n_tokens, top_k = check_device_routing(routing, n_tokens=int(x.shape[0]), n_experts=g.n_experts)
    rows = n_tokens * top_k
    shift = mx_scale_shift(weights.scale_range, x.dtype, weights.kernel_order != _ORDER_PLAIN)
    if rows > row_window or shift is None:
        from .batched import fc1_batched

        return fc1_batched(
            x,
            g,
            weights.up,
            routing,
            act=act,
            gate_bias=weights.gate_bias,
            up_bias=weights.up_bias,
            out=out,
        )
    out = device_output(out, (rows, g.n), dtype)
    if rows == 0 or g.n == 0:
        return out
    cfg = _config(config, g, rows, dtype, gated=True, kernel_order=weights.kernel_order)
    has_bias = weights.gate_bias is not None
    spec = KernelSpec(
        "gemv_fp4",
        "gemv_fc1",
        (
            _FORMAT_CODE[g.format],
            _CTYPES[dtype],
            weights.kernel_order,
            cfg.cta_n,
            cfg.threads,
            _ACT_CODE[act.kind],
            has_bias,
        ),
    )
    active = routing.active_experts
    grid = (_blocks(g.n, 8, cfg), int(active.shape[0]))
    launch(
        spec,
        grid,
        cfg.threads,
        (
            x,
            routing.sorted_rows,
            weights.kernel_gate,
            weights.kernel_up,
            weights.kernel_scales,
            g.global_scale,
            weights.up.global_scale,
            weights.gate_bias,
            weights.up_bias,
            routing.expert_offsets,
            active,
            out,
            np.int32(g.n_experts),
            np.int32(g.n),
            np.int32(g.k),
            np.int32(_chunks(g.k)),
            np.int32(top_k),
            np.int32(shift),
            np.float32(act.alpha),
            np.float32(act.limit),
        ),
        pdl=pdl,
    )
    return out


def fc2(
    h: Any,
    weights: PreparedFc2,
    routing: Any,
    *,
    out: Any = None,
    config: GemvConfig | None = None,
    row_window: int = ROW_WINDOW,
    pdl: bool = False,
) -> Any:
    """FC2 GEMV: ``y[r] = h[r] W[e]^T + b[e]`` for every expanded row ``r`` of expert ``e``.

    Parameters
    ----------
    h : cupy.ndarray
        ``[n_tokens * top_k, intermediate]`` bf16 or fp16, expanded order.
    weights : PreparedFc2
    routing : Routing
    out : cupy.ndarray, optional
        ``[n_tokens * top_k, hidden]`` of ``h.dtype``.
    config : GemvConfig, optional
    row_window : int
        Above this many expanded rows, :func:`cupymoe.batched.fc2_batched` runs instead.
    pdl : bool
        Make the GEMV launch a programmatic dependent launch (:mod:`cupymoe._launch`) that reads
        the routing maps and builds its scale tables while the previous kernel finishes and waits
        for it only before it reads ``h``. Only when the previous kernel on the stream ran after
        ``routing`` was complete: this call's :func:`fc1`, as in ``MoELayer``.

    Returns
    -------
    cupy.ndarray
        ``y [n_tokens * top_k, hidden]`` in expanded order, dtype of ``h``.

    Notes
    -----
    Numerics and capturability as :func:`fc1`.
    """
    if not isinstance(weights, PreparedFc2):
        raise TypeError(f"weights: expected PreparedFc2, got {type(weights).__name__}")
    w = weights.down
    n_tokens, top_k = check_device_routing(routing, n_experts=w.n_experts)
    rows = n_tokens * top_k
    dtype = _check_activations(h, "h", rows, w.k)
    shift = mx_scale_shift(weights.scale_range, dtype, weights.kernel_order != _ORDER_PLAIN)
    if rows > row_window or shift is None:
        from .batched import fc2_batched

        return fc2_batched(h, w, routing, bias=weights.bias, out=out)
    out = device_output(out, (rows, w.n), dtype)
    if rows == 0 or w.n == 0:
        return out
    cfg = _config(config, w, rows, dtype, gated=False, kernel_order=weights.kernel_order)
    spec = KernelSpec(
        "gemv_fp4",
        "gemv_fc2",
        (
            _FORMAT_CODE[w.format],
            _CTYPES[dtype],
            weights.kernel_order,
            cfg.cta_n,
            cfg.threads,
            weights.bias is not None,
        ),
    )
    active = routing.active_experts
    dependent = pdl and pdl_enabled()  # the pre-wait prefetch only in a programmatic launch
    launch(
        spec,
        (_blocks(w.n, 16, cfg), int(active.shape[0])),
        cfg.threads,
        (
            h,
            weights.kernel_packed,
            weights.kernel_scales,
            w.global_scale,
            weights.bias,
            routing.expert_offsets,
            active,
            out,
            np.int32(w.n_experts),
            np.int32(w.n),
            np.int32(w.k),
            np.int32(_chunks(w.k)),
            np.int32(shift),
            np.int32(dependent),
        ),
        pdl=dependent,
    )
    return out


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation :func:`fc1` / :func:`fc2` can select.

    2 formats x 2 dtypes x 3 weight orders (plain, pair-interleaved, split) x len(TILINGS) tilings
    x 2 (bias) x (FC2 + 3 FC1 activations).
    """
    specs = []
    for fmt in _FORMAT_CODE.values():
        for ctype in _CTYPES.values():
            for order in (_ORDER_PLAIN, _ORDER_PAIR, _ORDER_SPLIT):
                for cta_n, threads in TILINGS:
                    for bias in (False, True):
                        head = (fmt, ctype, order, cta_n, threads)
                        specs.append(KernelSpec("gemv_fp4", "gemv_fc2", (*head, bias)))
                        specs += [
                            KernelSpec("gemv_fp4", "gemv_fc1", (*head, code, bias))
                            for code in _ACT_CODE.values()
                        ]
    return specs
