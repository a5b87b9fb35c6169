# SPDX-License-Identifier: Apache-2.0
"""The weight layouts the GEMV reads (:class:`WeightLayout`) and the host/device transforms that
build them: K padding, the split nibble order and its tiles, the re-tiled scales, and the MXFP4
scale shift that keeps the tensor-core decode exact. NumPy or CuPy arrays throughout (the CPU
tests check the kernel layouts through these functions).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from .._runtime.backend import require_cupy
from .._runtime.validate import parse_enum
from ..formats import Fp4Format
from ..formats.codes import PAIR_SLOT

if TYPE_CHECKING:
    from ..formats import DeviceFp4

# fmt: off
__all__ = [
    "CHUNK", "DEFAULT_LAYOUT", "WeightLayout", "check_expert_bytes", "chunk_count", "gemv_layout",
    "mx_scale_shift", "packed_from_layout", "pad_packed", "scale_range", "scales_from_tiles",
    "split_positions", "split_slot", "split_words", "tile_scales", "unsplit_words",
]
# fmt: on

#: Codes per lane per load (16 bytes): fixed by the kernel.
CHUNK = 32


class WeightLayout(enum.Enum):
    """The weight bytes a GEMV kernel reads; ``.value`` is its ``kOrder`` template argument.

    One name for the choice everywhere: ``MoELayer(weight_layout=...)``, ``prepare_fc1`` /
    ``prepare_fc2`` (``layout=``), the tuner and its cache key (:attr:`key`), ``GemvConfig``
    and the kernels.
    """

    #: The uploaded bytes, row-major, in the plain nibble order (element 2i in the low nibble).
    #: The GEMV decodes it with byte-permute lookups that all load the ALU pipe.
    PLAIN = 0
    #: The uploaded bytes, row-major, in the SM80 pair-interleaved nibble order: decoded with
    #: shifts and masks (left shifts written as multiplications, which ptxas may issue on the FMA
    #: pipe). H200, bf16, cta_n 64: Qwen3.6 FC1 at M = 4 / 8 takes 16.8 / 27.7 µs against 20.7 /
    #: 34.1 µs plain.
    PAIR = 1
    #: The GEMV's own copy (:func:`gemv_layout`, the default): tiles of 8 / 16 rows stored
    #: chunk-major (one contiguous stream per tile) in the split nibble order
    #: (:func:`split_words`), which decodes in 10 instructions per 8 codes for bf16 (13
    #: pair-interleaved); it costs a second copy of the weights on the GPU. H200, bf16, graph
    #: replay, µs per call, PAIR -> SPLIT: DeepSeek-V3 FC1 at M = 1 / 4 42.8 -> 38.8 / 152.9 ->
    #: 135.8, FC2 25.6 -> 24.3 / 78.1 -> 73.7; gpt-oss-20b FC1 at M = 1 16.0 -> 14.7.
    SPLIT = 2

    @property
    def key(self) -> str:
        """The layout's name in tune-cache keys and on the command line: ``"split"``, ..."""
        return self.name.lower()

    @property
    def pair_interleaved(self) -> bool:
        """The nibble order host weights are uploaded in for this layout (all but PLAIN: pair)."""
        return self is not WeightLayout.PLAIN

    @classmethod
    def parse(cls, value: str | WeightLayout, name: str = "layout") -> WeightLayout:
        """``WeightLayout`` from a member or its :attr:`key` (case-insensitive)."""
        return parse_enum(cls, value, name, spelling="key")


#: The layout of ``prepare_fc1`` / ``prepare_fc2`` and ``MoELayer`` when none is given.
DEFAULT_LAYOUT = WeightLayout.SPLIT

#: Split order: for pair p (elements 2p in the low and 2p + 1 in the high 16 bits of a word), the
#: position of the lowest magnitude bit and of the sign bit inside the half (cuda/gemv_fp4.cu).
_SPLIT_MAG = (6, 3, 0, 9)
_SPLIT_SIGN = (15, 12, 14, 13)


def check_expert_bytes(n: int, k: int, name: str) -> None:
    """The GEMV addresses one expert's padded ``[n, K/2]`` bytes with 32-bit offsets."""
    size = -(-n // 16) * 16 * chunk_count(k) * CHUNK // 2  # N padded to whole tiles (split layout)
    if size >= 2**32:
        raise ValueError(
            f"{name}: one expert's weights take {size} bytes ({n} x {k} codes); "
            "the GEMV supports less than 4 GiB per expert"
        )


def chunk_count(k: int) -> int:
    """32-code chunks of a K-long row (the last one zero-padded)."""
    return -(-k // CHUNK)


def _xp(a: Any) -> Any:
    return np if isinstance(a, np.ndarray) else require_cupy()


def pad_packed(packed: Any, k: int) -> Any:
    """``packed [E, N, K/2]`` zero-padded along K to whole 32-code chunks (itself when aligned).

    Works on NumPy or CuPy arrays (the CPU tests check the kernel layouts through it).
    """
    pad = chunk_count(k) * CHUNK // 2 - packed.shape[2]
    if pad == 0:
        return packed
    xp = _xp(packed)
    return xp.ascontiguousarray(xp.pad(packed, ((0, 0), (0, 0), (0, pad))))


def _split_bits(pair_interleaved: bool) -> list[tuple[int, int, int]]:
    """For each element i of a word: (its nibble slot in the plain or pair-interleaved order, the
    bit of its lowest magnitude bit and of its sign bit in the split order)."""
    bits = []
    for i in range(8):
        pair, half = divmod(i, 2)
        slot = int(PAIR_SLOT[i]) if pair_interleaved else i
        bits.append((slot, 16 * half + _SPLIT_MAG[pair], 16 * half + _SPLIT_SIGN[pair]))
    return bits


def _check_words(words: Any) -> Any:
    if words.dtype != np.uint32:
        raise TypeError(f"words: expected uint32, got {words.dtype}")
    return _xp(words).zeros_like(words)


def split_words(words: Any, pair_interleaved: bool) -> Any:
    """uint32 words of 8 codes (plain or pair-interleaved nibble order) -> the split order.

    In the split order the magnitude bits of element ``2p`` (``2p + 1``) sit at bits
    ``_SPLIT_MAG[p] ..+2`` and its sign at bit ``_SPLIT_SIGN[p]`` of the low (high) 16 bits: the
    places the GEMV's bf16 decode reaches with the fewest instructions. NumPy or CuPy.
    """
    out = _check_words(words)
    for slot, mag, sign in _split_bits(pair_interleaved):
        code = (words >> np.uint32(4 * slot)) & np.uint32(0xF)
        out |= (code & np.uint32(7)) << np.uint32(mag)
        out |= (code >> np.uint32(3)) << np.uint32(sign)
    return out


def unsplit_words(words: Any, pair_interleaved: bool) -> Any:
    """The inverse of :func:`split_words`: split-order words -> plain or pair-interleaved words."""
    out = _check_words(words)
    for slot, mag, sign in _split_bits(pair_interleaved):
        code = ((words >> np.uint32(mag)) & np.uint32(7)) | (
            ((words >> np.uint32(sign)) & np.uint32(1)) << np.uint32(3)
        )
        out |= code << np.uint32(4 * slot)
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
    chunks = chunk_count(k)
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


def packed_from_layout(tiled: Any, n: int, k: int, *, pair_interleaved: bool = False) -> Any:
    """The inverse of :func:`gemv_layout`: ``[E, tiles, chunks, rows_per_tile, 16]`` -> the packed
    ``[E, n, k / 2]`` bytes (plain or pair-interleaved nibble order). NumPy or CuPy; converts a
    bounded number of experts at a time. The fallback that needs row-major bytes rebuilds them
    from the one resident copy with this."""
    xp = _xp(tiled)
    n_experts, tiles, chunks, rows, _ = tiled.shape
    out = xp.empty((n_experts, n, k // 2), np.uint8)
    step = max(1, (64 << 20) // max(1, tiles * rows * chunks * 16))
    for lo in range(0, n_experts, step):
        hi = min(n_experts, lo + step)
        part = xp.empty((hi - lo, tiles, chunks, rows, 16), np.uint8)
        for q in range(4):  # undo the slot rotation of the chunks c with c % 4 == q
            slots = split_slot(np.arange(rows), q).tolist()
            part[:, :, q::4] = tiled[lo:hi, :, q::4][:, :, :, slots]
        rowmajor = xp.ascontiguousarray(part.transpose(0, 1, 3, 2, 4))
        rowmajor = rowmajor.reshape(hi - lo, tiles * rows, chunks * 16)
        words = unsplit_words(rowmajor.view(np.uint32), pair_interleaved)
        out[lo:hi] = words.view(np.uint8)[:, :n, : k // 2]
    return out


def scales_from_tiles(tiled: Any, n: int, k: int, block: int, matrices: int) -> list[Any]:
    """The inverse of :func:`tile_scales`: the ``matrices`` (2: gate and up, 1: down) scale
    arrays ``[E, n, k / block]`` from the tiled bytes."""
    xp = _xp(tiled)
    n_experts, tiles, chunks, _ = tiled.shape
    per_chunk = CHUNK // block
    t = tiled.reshape(n_experts, tiles, chunks, 8, 2, per_chunk).transpose(0, 1, 4, 3, 2, 5)
    rows = 16 // matrices
    if matrices == 2:
        parts = [t[:, :, m] for m in range(2)]  # [E, tiles, 8, chunks, blocks] each
    else:
        parts = [t]  # [E, tiles, 2, 8, chunks, blocks]: rows 0-7 and 8-15 of each tile
    return [
        xp.ascontiguousarray(
            p.reshape(n_experts, tiles * rows, chunks * per_chunk)[:, :n, : k // block]
        )
        for p in parts
    ]


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


def scale_range(*mats: DeviceFp4) -> tuple[int, int] | None:
    return _scale_range_host([m.scales for m in mats], mats[0].format)


def split_positions(n: int) -> np.ndarray:
    """Where each of ``n`` columns of h goes when the wgmma FC1 writes it for the wgmma FC2
    (``permuted_h``; ``split_position`` in cuda/gemm_sm90.cu): in every whole stage of 128
    columns, column ``32t + 8q + 4h + 2kc + e`` moves to ``64 (q // 2) + 8j + 2t + e`` with
    ``j = 4 (q % 2) + 2h + kc`` (the FC2 producer's B order: half, 16-byte chunk, word); the
    columns of a last partial stage stay in place. ``h_permuted[:, split_positions(n)] = h``."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n: expected an int >= 0, got {n!r}")
    c = np.arange(int(n), dtype=np.int64)
    lo = c % 128
    t, q, h, kc, e = lo // 32, (lo // 8) % 4, (lo // 4) % 2, (lo // 2) % 2, lo % 2
    moved = c - lo + 64 * (q // 2) + 8 * (4 * (q % 2) + 2 * h + kc) + 2 * t + e
    return np.where(c < int(n) // 128 * 128, moved, c)
