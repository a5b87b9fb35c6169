# SPDX-License-Identifier: Apache-2.0
"""Grouped FP4 expert GEMM on tensor cores for batches above the GEMV's hand-over
(:func:`.handover.choose`).

Same functions as :mod:`.gemv` (:func:`gemm_fc1` = FC1 with the gated activation fused,
:func:`gemm_fc2` = FC2), same numerics contract (exact ``e2m1 x scale`` 16-bit products, fp32
accumulation, the FP32 global scales, biases and the activation in fp32, one rounding), read from
the same resident weights: the split layout (:func:`.layouts.gemv_layout`). The kernels are
persistent: the tile schedule comes from the expert maps on the device, so every call is
capturable in a CUDA graph (no host read, no allocation with ``out``).

Two kernels: on sm_90 (H100, H200) ``cuda/gemm_sm90.cu``, warp-specialised ``wgmma`` with the
decoded weights in registers (:class:`WgmmaConfig`, compiled for ``sm_90a``); elsewhere
``cuda/gemm_fp4.cu``, ``mma.sync`` (:class:`GemmConfig`). A block tile is 256 (wgmma) or
``16 * m_tiles`` weight rows x ``bn`` expanded rows of one expert; the tiling is chosen on the
host from the average rows per active expert (``for_rows``), which the host knows without
reading the routing. ``CUPYMOE_WGMMA=0`` keeps the mma.sync kernel on sm_90.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from .._runtime.compile import CTYPE, KernelSpec, resident_blocks
from .._runtime.device import compute_capability, max_shared_per_block, sm_count
from .._runtime.launch import launch
from .._runtime.tensormap import SWIZZLE_128B, UINT16, UINT64, TensorMap, tiled
from .._runtime.validate import ACTIVATION_DTYPES, check_activations, device_output
from ..formats import Fp4Format
from ..routing import Routing
from .activation import Activation, ActivationSpec
from .gemv import PreparedFc1, PreparedFc2, fc1_arrays, fc2_arrays
from .layouts import WeightLayout, chunk_count

__all__ = [
    "ENV_WGMMA",
    "GEMM_TILINGS",
    "TILING_FOR_ROWS_PER_EXPERT",
    "WGMMA_TILINGS",
    "WGMMA_MIN_ROWS_PER_EXPERT",
    "WGMMA_NARROW_MAX_ROWS_PER_EXPERT",
    "WGMMA_SLACK_ROWS_PER_EXPERT",
    "GemmConfig",
    "WgmmaConfig",
    "default_config",
    "wgmma_tiling",
    "wgmma_enabled",
    "gemm_fc1",
    "gemm_fc1_single",
    "gemm_fc2",
    "kernel_specs",
    "map_geometry",
    "x_box_rows",
    "x_map_geometry",
    "permute_split",
    "row_tiles",
    "block_items",
    "schedule_ref",
    "tile_rows",
]


#: Bytes of one pipeline stage per m-tile (weights) and per expanded row (activations); scale
#: bytes per m-tile: 128 (NVFP4) or 64 (MXFP4). Mirrors Gemm<> in cuda/gemm_fp4.cu.
_MTILE_BYTES = 1024
_XROW_BYTES = 256
_SCALE_TILE_BYTES = {Fp4Format.NVFP4.code: 128, Fp4Format.MXFP4.code: 64}
#: The wgmma epilogue's two staging buffers of ``rows`` rows of 256 16-bit columns + 16 bytes
#: each (Gemm90::kEpiRows / kEpiBytes in cuda/gemm_sm90.cu): 32 rows at bn 64, 16 at bn 128;
#: bn 144 stages 48-row chunks in a stage slot and needs no buffers of its own.
_EPI_ROWS = {64: 32, 128: 16}


def _epi_bytes(bn: int) -> int:
    return 2 * _EPI_ROWS[bn] * (256 * 2 + 16) if bn in _EPI_ROWS else 0


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """One tiling: ``warps_m x warps_n`` warps, each ``mt`` m-tiles (16 weight rows) by ``nt``
    n-tiles (8 expanded rows), ``stages`` cp.async stages of 128 codes of K."""

    warps_m: int
    warps_n: int
    mt: int
    nt: int
    stages: int

    def __post_init__(self) -> None:
        for name in ("warps_m", "warps_n", "mt", "nt", "stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected int, got {type(value).__name__}")
        key = self.key
        if key not in GEMM_TILINGS:
            raise ValueError(
                f"GemmConfig: {key} is not compiled; expected one of {list(GEMM_TILINGS)}"
            )

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        """The template arguments (warps_m, warps_n, mt, nt, stages)."""
        return (self.warps_m, self.warps_n, self.mt, self.nt, self.stages)

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def m_tiles(self) -> int:
        """m-tiles (16 weight rows: FC2 16 columns, FC1 8 columns x gate and up) per block."""
        return self.warps_m * self.mt

    @property
    def bn(self) -> int:
        """Expanded rows of one expert per block tile."""
        return self.warps_n * self.nt * 8

    def stage_bytes(self, fmt_code: int) -> int:
        return self.m_tiles * (_MTILE_BYTES + _SCALE_TILE_BYTES[fmt_code]) + self.bn * _XROW_BYTES

    def shared_bytes(self, fmt_code: int, slots: int) -> int:
        """Dynamic shared memory of a launch: the stages and the row-tile table of ``slots``."""
        return self.stages * self.stage_bytes(fmt_code) + _table_bytes(slots)

    #: Static shared memory of the kernel, rounded up: the scale table (1 KB) and the scan's
    #: warp totals (an int and a packed 64-bit class count per warp).
    static_bytes = 1024 + 128

    @staticmethod
    def for_rows(
        rows: int, n_experts: int, *, fmt_code: int = 0, max_shared: int | None = None
    ) -> GemmConfig:
        """The tiling for ``rows`` expanded rows over ``n_experts`` experts, from the average
        rows per active expert (at most ``min(rows, E)`` experts are active):
        :data:`TILING_FOR_ROWS_PER_EXPERT`. With ``max_shared`` (the device's opt-in shared
        memory per block: 227 KB on sm_90, 163 KB on sm_80, 99 KB on sm_89 and sm_120) the
        widest tiling that fits when the table's choice does not."""
        per_expert = rows / max(1, min(rows, n_experts))
        choice = GEMM_TILINGS[-1]
        for limit, tiling in TILING_FOR_ROWS_PER_EXPERT:
            if per_expert <= limit:
                choice = tiling
                break
        config = GemmConfig(*choice)
        if max_shared is None:
            return config
        slots = min(rows, n_experts)
        fitting = [
            GemmConfig(*t)
            for t in GEMM_TILINGS
            if GemmConfig(*t).shared_bytes(fmt_code, slots) + GemmConfig.static_bytes <= max_shared
        ]
        if not fitting:
            raise ValueError(
                f"max_shared: no grouped-GEMM tiling fits {max_shared} bytes of shared memory"
            )
        if config in fitting:
            return config
        return max(fitting, key=lambda c: c.bn)


#: (warps_m, warps_n, mt, nt, stages) compiled for every format, dtype, op and bias.
GEMM_TILINGS: tuple[tuple[int, int, int, int, int], ...] = (
    (4, 1, 2, 2, 4),  # bn 16: 128 threads, 4 blocks per SM
    (4, 1, 2, 4, 4),  # bn 32: 128 threads, 3 blocks per SM
    (4, 2, 2, 8, 4),  # bn 128: 256 threads, 1 block per SM (208 registers, 169 KB shared)
)

#: Analytic table: (largest average rows per active expert, tiling); above the last entry the
#: bn 128 tiling. Measured on the H200 (FC1 + FC2 graph replays over HBM-resident weights, µs;
#: bn 16 / 32 / 64 / 128): Qwen3.6 M = 256 (8 rows per expert) 230 / 285 / 631 / 866; M = 1,024
#: (32) 544 / 432 / 660 / 905; M = 4,096 (128) 1,850 / 1,305 / 1,590 / 1,351; gpt-oss M = 64
#: (8) 235 / 283 / 566 / 804; M = 4,096 (512) 6,438 / 4,346 / 4,778 / 3,672; DeepSeek-V3 M = 512
#: (16) 4,024 / 3,721 / 7,450 / 10,161. bn 64 never won and is not compiled.
TILING_FOR_ROWS_PER_EXPERT: tuple[tuple[float, tuple[int, int, int, int, int]], ...] = (
    (8, GEMM_TILINGS[0]),
    (256, GEMM_TILINGS[1]),
)


#: ``CUPYMOE_WGMMA=0``: the mma.sync kernel on sm_90 too (the wgmma kernel needs exactly sm_90).
ENV_WGMMA = "CUPYMOE_WGMMA"

#: (bn, stages, consumer warp groups) of the sm_90a wgmma kernel: a producer warp group and 2 or
#: 4 consumer groups (384 or 640 threads), 256 weight rows x bn expanded rows per block tile, one
#: block per SM. A tile with fewer rows runs its wgmma at N = 32 or 64 (the kernel picks per
#: item).
#: Whole layers on the H200 (session 19, µs per layer, bn 64 x 5 | 128 x 4, the wgmma kernel
#: forced from 4 rows per expert): Qwen3.6 M = 256 / 512 / 1,024 / 2,048 (8 / 16 / 32 / 64 rows
#: per expert) 232.5 | 253.2, 227.0 | 253.0, 269.9 | 292.3, 404.6 | 394.2; gpt-oss M = 64 / 128 /
#: 256 / 512 (the same rows) 197.7 | 219.0, 203.8 | 228.2, 244.6 | 264.2, 366.7 | 358.3. bn 64 x 6
#: was within 2 % of x 5; bn 32 x 8 does not fit the block's shared memory (both on two groups,
#: bn 64 decoding two fragments per wgmma group, ``Gemm90::kBatch``).
#: Four consumer groups for bn 64 (one m-tile and one fragment per wgmma group per consumer
#: warp): four warps per scheduler instead of two hide more of the decode's latency where the
#: tensor cores wait on it (session 21, the same GPU run, layer µs, two groups | four: Qwen3.6 M
#: = 512 / 1,024 222.3 | 215.8, 260.6 | 254.8; gpt-oss M = 128 / 256 200.4 | 192.4, 234.3 |
#: 229.2). bn 128's 64 accumulators per thread leave no registers for four.
#: bn 144 is bn 128 whose last row tile of an expert takes up to 16 more rows
#: (:func:`tile_rows`), in a wgmma of N = 144, instead of leaving them to an item of their own,
#: whose decode costs about half a full item's (``WGMMA_SLACK_ROWS_PER_EXPERT``).
WGMMA_TILINGS: tuple[tuple[int, int, int], ...] = ((64, 5, 4), (128, 4, 2), (144, 4, 2))

#: Average rows per active expert up to which the wgmma kernel takes its bn 64 tiling (above it
#: bn 128): the measurements of :data:`WGMMA_TILINGS`.
WGMMA_NARROW_MAX_ROWS_PER_EXPERT = 32

#: Average rows per active expert (low, high] where the wgmma kernel takes bn 144 instead of bn
#: 128. Measured on the H100 (session 27, whole layers, graph replays, µs per layer, bn 128 |
#: 144, outputs bitwise equal): at 128 rows per expert Qwen3.6 M = 4,096 599.6 | 564.6 and
#: gpt-oss M = 1,024 513.2 | 476.9 (with random routing about half the experts hold 129-160
#: rows: bn 128 runs them as a full item and a narrow one); at 64 rows Qwen3.6 M = 2,048 376.9 |
#: 374.7 and gpt-oss M = 512 325.5 | 331.3, at 512 rows gpt-oss M = 4,096 1,546.7 | 1,601.8,
#: where few remainders fit the 16 rows and bn 144 ran 0-4 % slower (the cost of its register
#: split and stage layout, not isolated). The bounds: below 112 rows per expert few experts pass
#: 128 rows, above 160 few remainders are within 16 rows.
WGMMA_SLACK_ROWS_PER_EXPERT = (112.0, 160.0)

#: Average rows per active expert above which sm_90 runs the wgmma kernel instead of the
#: mma.sync table (:data:`.handover.HAND_OVERS` per shape). Measured on the H200 in session 19
#: (``cupymoe tune --kernel gemm`` for gpt-oss, µs per call, best mma.sync | wgmma bn 128; the
#: bn 64 tiling 6-12 % below bn 128 at these rows, above): at 8 rows per expert FC1 126.7 |
#: 159.9 (bn 64 in the layer 127.4), FC2 73.7 | 77.2 (bn 64 59.3); at 16 FC1 161.3 | 166.7 (bn 64
#: 129.6), FC2 83.2 | 80.0 (bn 64 60.6); Qwen3.6 at 16 rows mma.sync FC1 157.7, FC2 98.7 (session
#: 17) against bn 64's 132.0 and 74.7. Up to 4 rows per expert the GEMV serves these shapes
#: (since session 23: :data:`.handover.HAND_OVERS`).
WGMMA_MIN_ROWS_PER_EXPERT = 8


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
    """One tiling of the sm_90a wgmma kernel: ``bn`` expanded rows per block tile (the wgmma N),
    ``stages`` pipeline stages of 128 codes of K, ``groups`` consumer warp groups."""

    bn: int
    stages: int
    groups: int = 2

    def __post_init__(self) -> None:
        for name in ("bn", "stages", "groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected int, got {type(value).__name__}")
        if self.key not in WGMMA_TILINGS:
            raise ValueError(
                f"WgmmaConfig: {self.key} is not compiled; expected one of {list(WGMMA_TILINGS)}"
            )

    @property
    def key(self) -> tuple[int, int, int]:
        """The template arguments (bn, stages, groups)."""
        return (self.bn, self.stages, self.groups)

    @property
    def threads(self) -> int:
        """Threads per block: a producer warp group and the consumer warp groups."""
        return 128 * (1 + self.groups)

    #: m-tiles (16 weight rows) per block tile: 16 / groups per consumer warp group.
    m_tiles = 16
    #: Static shared memory of the kernel, the largest tiling's (bn 64 on 640 threads; the
    #: offline compile test checks every specialisation against it): the scale table (1 KB),
    #: the mbarriers (80 bytes) and the scan's totals of 20 warps (240 bytes).
    static_bytes = 1024 + 320

    def stage_bytes(self, fmt_code: int) -> int:
        """Activations, weights, and the scales padded to whole kilobytes (Gemm90 in
        cuda/gemm_sm90.cu)."""
        scales = _ceil_div(self.m_tiles * _SCALE_TILE_BYTES[fmt_code], 1024) * 1024
        return self.bn * _XROW_BYTES + self.m_tiles * _MTILE_BYTES + scales

    def shared_bytes(self, fmt_code: int, slots: int) -> int:
        """Dynamic shared memory of a launch: 1 KB of slack to align the stages to 1024 bytes
        (the swizzle atoms), the stages, the epilogue's staging buffers (bn 144 stages its
        epilogue in a stage slot instead), a 16-byte item record per stage, and the row-tile
        table of ``slots``."""
        stages = self.stages * (self.stage_bytes(fmt_code) + 16)
        return 1024 + stages + _epi_bytes(self.bn) + _table_bytes(slots)


def wgmma_enabled() -> bool:
    """Whether the current device runs the wgmma kernel: compute capability exactly 9.0 (the
    ``sm_90a`` cubin runs nowhere else) and ``CUPYMOE_WGMMA`` is not ``0``."""
    if os.environ.get(ENV_WGMMA, "1").strip() == "0":
        return False
    return compute_capability() == 90


def _table_bytes(slots: int) -> int:
    """Shared memory of the kernels' row-tile table (gemm_items.cuh): ``slots + 3`` ints and a
    16-bit slot per joined or partial tile, rounded up to 16 bytes."""
    return -(-(4 * (slots + 3) + 2 * slots) // 16) * 16


def tile_rows(bn: int) -> tuple[int, int]:
    """(rows of a row tile, slack) of block tiles of ``bn`` rows (gemm_items.cuh TileClasses):
    an expert's last remainder of up to ``slack`` rows joins the tile before it (bn 144: tiles of
    128 rows, the last of up to 144)."""
    slack = bn - 128 if bn > 128 else 0
    return bn - slack, slack


def tile_classes(bn: int) -> int:
    """Width classes of the row tiles (gemm_items.cuh TileClasses): widths ``tile - 32 c``."""
    tile = tile_rows(bn)[0]
    return min(tile // 32, 4) if tile >= 64 else 1


def row_tiles(expert_offsets: Any, active: Any, bn: int) -> list[tuple[int, int, int]]:
    """NumPy transcription of the kernels' schedule scan: every row tile of a launch in item
    order, as ``(slot, first row within the expert, rows)``. Tiles of :func:`tile_rows` rows, a
    last remainder of up to its slack joined to the tile before it. Widest first: the joined
    tiles in slot order, class 0 (the other full tiles and a last tile wider than ``tile - 32``)
    in slot order, then the experts' last, partial tiles by width class (widths ``tile - 32 c``),
    each class in slot order."""
    off = np.asarray(expert_offsets, dtype=np.int64)
    act = np.asarray(active, dtype=np.int64)
    valid = (act >= 0) & (act < len(off) - 1)
    safe = np.where(valid, act, 0)
    rows = np.where(valid, off[safe + 1] - off[safe], 0)
    classes = tile_classes(bn)
    tile, slack = tile_rows(bn)

    def cls(rem: int) -> int:
        return 0 if classes == 1 else min((tile - rem) // 32, classes - 1)

    wide: list[tuple[int, int, int]] = []
    tiles: list[tuple[int, int, int]] = []
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(classes)]
    for slot, r in enumerate(rows.tolist()):
        full, rem = divmod(int(r), tile)
        joined = full > 0 and 0 < rem <= slack  # the remainder joins the last full tile
        tiles += [(slot, t * tile, tile) for t in range(full - joined)]
        if joined:
            wide.append((slot, (full - 1) * tile, tile + rem))
        elif rem:
            (tiles if cls(rem) == 0 else parts[cls(rem)]).append((slot, full * tile, rem))
    tiles = wide + tiles
    for c in range(1, classes):
        tiles += parts[c]
    return tiles


def block_items(n_items: int, grid: int, block: int, *, bn: int) -> list[int]:
    """NumPy transcription of the wgmma kernel's walk (gemm_items.cuh ``item_of_round``): the
    item indices that block ``block`` of a persistent grid of ``grid`` blocks takes, in order.
    Rounds of ``grid`` items; where ``bn``'s tiles take a remainder (:func:`tile_rows`) in block
    order on even rounds and in reverse on odd ones, else in block order."""
    snake = tile_rows(bn)[1] > 0
    out = []
    for r in range(_ceil_div(n_items, grid) + 1):
        index = r * grid + (grid - 1 - block if snake and r % 2 else block)
        if index >= n_items:
            break
        out.append(index)
    return out


def schedule_ref(
    expert_offsets: Any, active: Any, *, bn: int, col_blocks: int
) -> list[tuple[int, int, int, int]]:
    """Every work item of a launch in item order, as the kernels decode them:
    ``(expert, first expanded row, rows, column block)``. Row tiles major (:func:`row_tiles`),
    column block minor."""
    off = np.asarray(expert_offsets, dtype=np.int64)
    items = []
    for slot, first, rows in row_tiles(expert_offsets, active, bn):
        e = int(active[slot])
        items += [(e, int(off[e]) + first, rows, cb) for cb in range(col_blocks)]
    return items


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def wgmma_tiling(rows_per_expert: float) -> WgmmaConfig:
    """The wgmma kernel's tiling at an average of ``rows_per_expert`` rows per active expert:
    bn 64 up to :data:`WGMMA_NARROW_MAX_ROWS_PER_EXPERT`, bn 144 within
    :data:`WGMMA_SLACK_ROWS_PER_EXPERT`, else bn 128."""
    if rows_per_expert <= WGMMA_NARROW_MAX_ROWS_PER_EXPERT:
        return WgmmaConfig(*WGMMA_TILINGS[0])
    low, high = WGMMA_SLACK_ROWS_PER_EXPERT
    return WgmmaConfig(*WGMMA_TILINGS[2 if low < rows_per_expert <= high else 1])


def default_config(
    rows: int,
    n_experts: int,
    fmt_code: int,
    *,
    wgmma_min: float = WGMMA_MIN_ROWS_PER_EXPERT,
) -> GemmConfig | WgmmaConfig:
    """The analytic tiling of a call: the wgmma kernel where :func:`wgmma_enabled` and the
    average rows per active expert exceed ``wgmma_min`` (the shape's threshold,
    :func:`.handover.hand_over_for`; default :data:`WGMMA_MIN_ROWS_PER_EXPERT`) and its shared
    memory fits the device's block (for ``min(rows, n_experts)`` slots), with
    :func:`wgmma_tiling`; else :meth:`GemmConfig.for_rows` within the current device's shared
    memory."""
    slots = max(1, min(rows, n_experts))
    if rows / slots > wgmma_min and wgmma_enabled():
        wgmma = wgmma_tiling(rows / slots)
        # a layer of thousands of experts: the row-tile table leaves the block no room
        if wgmma.shared_bytes(fmt_code, slots) + wgmma.static_bytes <= max_shared_per_block():
            return wgmma
    return GemmConfig.for_rows(
        rows, n_experts, fmt_code=fmt_code, max_shared=max_shared_per_block()
    )


def _grid(
    spec: KernelSpec,
    config: GemmConfig | WgmmaConfig,
    smem: int,
    rows: int,
    slots: int,
    col_blocks: int,
) -> int:
    """Persistent grid: every resident block, or fewer when the items cannot fill them (at most
    ``ceil(rows / bn) + slots`` row tiles)."""
    resident = resident_blocks(spec, config.threads, smem) * sm_count()
    bound = (_ceil_div(rows, config.bn) + slots) * col_blocks
    return max(1, min(resident, bound))


def _plan(
    spec: KernelSpec,
    cfg: GemmConfig | WgmmaConfig,
    fmt_code: int,
    routing: Routing,
    rows: int,
    col_blocks: int,
) -> tuple[int, int, int]:
    """(active slots, dynamic shared bytes, persistent grid) of one launch."""
    slots = int(routing.active_experts.shape[0])
    smem = cfg.shared_bytes(fmt_code, slots)
    return slots, smem, _grid(spec, cfg, smem, rows, slots, col_blocks)


def _spec(cfg: GemmConfig | WgmmaConfig, op: str, head: tuple[str | int | bool, ...]) -> KernelSpec:
    """The specialisation of ``op`` ("fc1" / "fc2") for a tiling: the wgmma kernel (sm_90a) for a
    :class:`WgmmaConfig`, the mma.sync kernel for a :class:`GemmConfig`."""
    if isinstance(cfg, WgmmaConfig):
        return KernelSpec("gemm_sm90", f"gemm90_{op}", (*head, *cfg.key), target="sm_90a")
    return KernelSpec("gemm_fp4", f"gemm_{op}", (*head, *cfg.key))


def _check_runs_here(cfg: GemmConfig | WgmmaConfig, x: Any) -> None:
    if not isinstance(cfg, WgmmaConfig):
        return
    if not wgmma_enabled():
        raise ValueError(
            "config: a WgmmaConfig needs a compute capability 9.0 device (and CUPYMOE_WGMMA not "
            f"0); this device has {compute_capability()}"
        )
    if int(x.shape[1]) == 0:  # no K stage: the consumers would stage into no slot
        raise ValueError("x: the wgmma kernel needs K >= 1, got 0 columns")
    # The producer holds its rows' offsets in x as 32-bit counts of 16-byte pieces.
    if int(x.shape[0]) * (int(x.shape[1]) // 8) >= 2**32 - 1:
        raise ValueError(
            f"x: {tuple(x.shape)} is over the wgmma kernel's 64 GB of activations; pass a "
            "GemmConfig (the mma.sync kernel)"
        )


def _check_permuted(
    cfg: GemmConfig | WgmmaConfig, permuted_h: bool, permuted_x: bool = False
) -> None:
    for name, value in (("permuted_h", permuted_h), ("permuted_x", permuted_x)):
        if value and not isinstance(cfg, WgmmaConfig):
            raise ValueError(
                f"{name}: only the wgmma kernel reads or writes activations in the split k "
                f"order; this call runs the mma.sync tiling {cfg}"
            )


def _permuted_args(
    cfg: GemmConfig | WgmmaConfig, permuted_h: bool, permuted_x: bool | None = None
) -> tuple[np.int32, ...]:
    """The wgmma kernels' last arguments (Params::permuted_h, and FC1's permuted_x); the
    mma.sync kernels have none."""
    if not isinstance(cfg, WgmmaConfig):
        return ()
    if permuted_x is None:
        return (np.int32(permuted_h),)
    return (np.int32(permuted_h), np.int32(permuted_x))


def map_geometry(
    n_experts: int, tiles: int, chunks: int, unit_bytes: int
) -> tuple[tuple[int, int, int], tuple[int, int], tuple[int, int, int]]:
    """(dims, byte strides, box) of the wgmma kernel's 3-D tensor map over a split-layout array
    ``[E, tiles, chunks, unit_bytes]`` (weights: ``unit_bytes`` = rows per m-tile x 16; scale
    tiles: 32 NVFP4, 16 MXFP4) as 8-byte elements, innermost first: a tile's chunks, the
    m-tiles, the experts. The box is one pipeline stage of one block tile: 4 chunks of
    :attr:`WgmmaConfig.m_tiles` m-tiles of one expert (gemm_sm90.cu ``load_weights``)."""
    row = chunks * unit_bytes
    return (
        (row // 8, tiles, n_experts),
        (row, tiles * row),
        (4 * unit_bytes // 8, WgmmaConfig.m_tiles, 1),
    )


def _maps(
    cfg: GemmConfig | WgmmaConfig,
    mats: tuple[Any, ...],
    scales: Any,
    n_experts: int,
    n: int,
    k: int,
    rows_per_tile: int,
    fmt_code: int,
) -> tuple[TensorMap, ...]:
    """The wgmma kernels' tensor maps of each weight matrix and of the scale tiles (the same
    resident bytes the GEMV reads); the mma.sync kernels take none."""
    if not isinstance(cfg, WgmmaConfig):
        return ()
    tiles, chunks = _ceil_div(n, rows_per_tile), chunk_count(k)
    out = []
    for a, unit in [(m, rows_per_tile * 16) for m in mats] + [
        (scales, _SCALE_TILE_BYTES[fmt_code] // 4)
    ]:
        dims, strides, box = map_geometry(n_experts, tiles, chunks, unit)
        if a.nbytes < n_experts * strides[1]:
            raise ValueError(
                f"weights: {a.nbytes} bytes, fewer than the {n_experts * strides[1]} of "
                f"{n_experts} experts x {tiles} m-tiles x {chunks} chunks x {unit} bytes"
            )
        out.append(tiled(int(a.data.ptr), UINT64, dims, strides, box))
    return tuple(out)


def x_box_rows(bn: int) -> int:
    """Rows of one box of the wgmma FC2's map over h at tile width ``bn`` (gemm_sm90.cu
    ``Gemm90::kXBoxRows``): 48 at bn 144 (three per tile), else 32."""
    return 48 if bn == 144 else 32


def x_map_geometry(rows: int, k: int, bn: int) -> tuple[tuple[int, ...], ...]:
    """``(dims, strides, box)`` of the wgmma FC2's map over ``h [rows, k]`` of 16-bit elements,
    innermost first: boxes of 64 columns (128 bytes, the 128-byte swizzle of the B layout) by
    :func:`x_box_rows` rows (gemm_sm90.cu ``Gemm90::x_tma``)."""
    return (k, rows), (2 * k,), (64, x_box_rows(bn))


def _x_map(h: Any, permuted_h: bool, bn: int, fallback: TensorMap) -> TensorMap:
    """The wgmma FC2's last argument: the map over ``h``, which its producer reads where h holds
    the split k order (``permuted_h``); elsewhere ``fallback`` stands in, unread."""
    if not permuted_h:
        return fallback
    dims, strides, box = x_map_geometry(int(h.shape[0]), int(h.shape[1]), bn)
    return tiled(int(h.data.ptr), UINT16, dims, strides, box, swizzle=SWIZZLE_128B)


def _permute_spec(dtype: Any) -> KernelSpec:
    """The specialisation :func:`permute_split` launches for ``dtype`` (sm_90a)."""
    return KernelSpec("gemm_sm90", "permute_split", (CTYPE[np.dtype(dtype)],), target="sm_90a")


def permute_split(x: Any, out: Any = None, *, pdl: bool = False) -> Any:
    """``x [rows, k]`` with each whole 128-column stage in the split k order
    (:func:`.layouts.split_positions`; the columns of a last partial stage in place), for a wgmma
    FC1 with ``permuted_x``, whose producer then copies the activation tiles without regrouping
    them. ``k`` must be a multiple of 8. Capturable (no allocation with ``out``)."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 2:
        raise TypeError(f"x: expected a 2-D cupy.ndarray, got {type(x).__name__}")
    rows, k = (int(s) for s in shape)
    if k % 8:
        raise ValueError(f"x: permute_split needs k a multiple of 8, got {k}")
    dtype = check_activations(x, "x", k, aligned=True)
    out = device_output(out, (rows, k), dtype)
    if out.data.ptr % 16:
        raise ValueError("out: expected a 16-byte aligned array")
    nbytes = rows * k * dtype.itemsize
    if out.data.ptr < x.data.ptr + nbytes and x.data.ptr < out.data.ptr + nbytes:
        raise ValueError("out: must not overlap x (the regrouping reads columns others write)")
    if not wgmma_enabled():
        raise ValueError(
            "permute_split serves the wgmma kernel: it needs a compute capability 9.0 device "
            f"(and CUPYMOE_WGMMA not 0); this device has {compute_capability()}"
        )
    if rows == 0 or k == 0:
        return out
    whole = k // 128
    units = rows * (4 * whole + (k - 128 * whole))
    threads = 256
    grid = min(_ceil_div(units, threads), 8 * sm_count())
    launch(_permute_spec(dtype), grid, threads, (x, out, np.int32(rows), np.int32(k)), pdl=pdl)
    return out


def gemm_fc1(
    x: Any,
    weights: PreparedFc1,
    routing: Routing,
    *,
    act: ActivationSpec,
    top_k: int,
    shift: int,
    out: Any = None,
    config: GemmConfig | WgmmaConfig | None = None,
    pdl: bool = False,
    permuted_h: bool = False,
    permuted_x: bool = False,
) -> Any:
    """FC1 as a grouped GEMM: ``h[r] = act(x[t] Wg[e]^T + bg, x[t] Wu[e]^T + bu)``.

    Arguments as validated by :func:`.dispatch.fc1`: ``weights`` a :class:`.gemv.PreparedFc1` in
    the SPLIT layout, ``shift`` the MXFP4 scale shift (:func:`.gemv.scale_shift`). Returns
    ``h [rows, intermediate]`` in expanded order, dtype of ``x``. Capturable; bitwise
    deterministic for a given config. ``permuted_h`` (wgmma only): h's whole 128-column stages
    in the split k order, which the wgmma FC2 reads without staging
    (:func:`.layouts.split_positions`). ``permuted_x`` (wgmma only): ``x`` as
    :func:`permute_split` writes it, copied into the B tiles as it is.
    """
    g = weights.gate
    if weights.layout is not WeightLayout.SPLIT:
        raise ValueError(f"weights: the grouped GEMM reads the split layout, got {weights.layout}")
    dtype = np.dtype(x.dtype)
    rows = int(x.shape[0]) * top_k
    out = device_output(out, (rows, g.n), dtype)
    if rows == 0 or g.n == 0:
        return out
    cfg = default_config(rows, g.n_experts, g.format.code) if config is None else config
    _check_runs_here(cfg, x)
    _check_permuted(cfg, permuted_h, permuted_x)
    head = (g.format.code, CTYPE[dtype], act.kind.code, weights.gate_bias is not None)
    spec = _spec(cfg, "fc1", head)
    col_blocks = _ceil_div(_ceil_div(g.n, 8), cfg.m_tiles)  # m-tiles of 8 columns
    slots, smem, grid = _plan(spec, cfg, g.format.code, routing, rows, col_blocks)
    launch(
        spec,
        grid,
        cfg.threads,
        (
            *fc1_arrays(x, weights, routing, out),
            np.int32(g.n_experts),
            np.int32(slots),
            np.int32(g.n),
            np.int32(g.k),
            np.int32(chunk_count(g.k)),
            np.int32(top_k),
            np.int32(shift),
            np.float32(act.alpha),
            np.float32(act.beta),
            np.float32(act.limit),
            *_permuted_args(cfg, permuted_h, permuted_x),
            *_maps(
                cfg,
                (weights.kernel_gate, weights.kernel_up),
                weights.kernel_scales,
                g.n_experts,
                g.n,
                g.k,
                8,
                g.format.code,
            ),
        ),
        shared_mem=smem,
        pdl=pdl,
    )
    return out


def gemm_fc2(
    h: Any,
    weights: PreparedFc2,
    routing: Routing,
    *,
    shift: int,
    out: Any = None,
    config: GemmConfig | WgmmaConfig | None = None,
    pdl: bool = False,
    permuted_h: bool = False,
) -> Any:
    """FC2 as a grouped GEMM: ``y[r] = h[r] W[e]^T + b[e]`` (arguments as validated by
    :func:`.dispatch.fc2`; ``weights`` a :class:`.gemv.PreparedFc2` in the SPLIT layout).
    Returns ``y [rows, hidden]`` in expanded order, dtype of ``h``. A programmatic dependent
    launch (``pdl``) scans the routing maps before it waits for the previous kernel (FC1).
    ``permuted_h`` (wgmma only): ``h`` as :func:`gemm_fc1` writes it with ``permuted_h``."""
    rows = int(h.shape[0])
    return _gemm_single(
        h, weights, routing, rows, None, 1, shift, out, config, pdl, permuted_h, False
    )


def gemm_fc1_single(
    x: Any,
    weights: PreparedFc2,
    routing: Routing,
    *,
    act: ActivationSpec,
    top_k: int,
    shift: int,
    out: Any = None,
    config: GemmConfig | WgmmaConfig | None = None,
    pdl: bool = False,
    permuted_h: bool = False,
    permuted_x: bool = False,
) -> Any:
    """FC1 with a non-gated activation as a grouped GEMM: ``h[r] = act(x[t] W[e]^T + b[e])``
    (``weights`` the one ``[E, I, H]`` matrix, prepared like FC2; ``x`` in token order, read
    through ``routing.sorted_rows``). Returns ``h [rows, intermediate]``, dtype of ``x``;
    ``permuted_h`` and ``permuted_x`` as in :func:`gemm_fc1`."""
    rows = int(x.shape[0]) * top_k
    return _gemm_single(
        x, weights, routing, rows, act, top_k, shift, out, config, pdl, permuted_h, permuted_x
    )


def _gemm_single(
    x: Any,
    weights: PreparedFc2,
    routing: Routing,
    rows: int,
    act: ActivationSpec | None,
    top_k: int,
    shift: int,
    out: Any,
    config: GemmConfig | WgmmaConfig | None,
    pdl: bool,
    permuted_h: bool,
    permuted_x: bool,
) -> Any:
    """One matrix per expert: FC2 (``act`` None, ``x`` in expanded order) or non-gated FC1."""
    w = weights.down
    if weights.layout is not WeightLayout.SPLIT:
        raise ValueError(f"weights: the grouped GEMM reads the split layout, got {weights.layout}")
    dtype = np.dtype(x.dtype)
    out = device_output(out, (rows, w.n), dtype)
    if rows == 0 or w.n == 0:
        return out
    cfg = default_config(rows, w.n_experts, w.format.code) if config is None else config
    _check_runs_here(cfg, x)
    _check_permuted(cfg, permuted_h, permuted_x)
    head = (w.format.code, CTYPE[dtype])
    bias = weights.bias is not None
    arrays = fc2_arrays(x, weights, routing, out)
    if act is None:
        spec = _spec(cfg, "fc2", (*head, bias))
    else:
        spec = _spec(cfg, "fc1_single", (*head, act.kind.code, bias))
        arrays = (x, routing.sorted_rows, *arrays[1:])
    col_blocks = _ceil_div(_ceil_div(w.n, 16), cfg.m_tiles)  # m-tiles of 16 columns
    slots, smem, grid = _plan(spec, cfg, w.format.code, routing, rows, col_blocks)
    tail = (np.int32(top_k),) if act is not None else ()
    maps = _maps(
        cfg,
        (weights.kernel_packed,),
        weights.kernel_scales,
        w.n_experts,
        w.n,
        w.k,
        16,
        w.format.code,
    )
    if isinstance(cfg, WgmmaConfig) and act is None:
        maps = (*maps, _x_map(x, permuted_h, cfg.bn, maps[0]))
    launch(
        spec,
        grid,
        cfg.threads,
        (
            *arrays,
            np.int32(w.n_experts),
            np.int32(slots),
            np.int32(w.n),
            np.int32(w.k),
            np.int32(chunk_count(w.k)),
            *tail,
            np.int32(shift),
            *_permuted_args(cfg, permuted_h, None if act is None else permuted_x),
            *maps,
        ),
        shared_mem=smem,
        pdl=pdl,
    )
    return out


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation :func:`gemm_fc1` / :func:`gemm_fc1_single` / :func:`gemm_fc2` can
    select: 2 formats x 2 dtypes x 2 (bias) x (FC2 + 3 gated and 4 non-gated FC1 activations) x
    (len(GEMM_TILINGS) mma.sync tilings + len(WGMMA_TILINGS) wgmma tilings for sm_90a), and
    :func:`permute_split` for each dtype (sm_90a)."""
    specs = []
    for fmt in Fp4Format:
        for dtype in ACTIVATION_DTYPES:
            for bias in (False, True):
                head = (fmt.code, CTYPE[np.dtype(dtype)])
                configs: list[GemmConfig | WgmmaConfig] = [GemmConfig(*t) for t in GEMM_TILINGS]
                configs += [WgmmaConfig(*t) for t in WGMMA_TILINGS]
                for cfg in configs:
                    specs.append(_spec(cfg, "fc2", (*head, bias)))
                    specs += [
                        _spec(cfg, "fc1" if act.gated else "fc1_single", (*head, act.code, bias))
                        for act in Activation
                    ]
    specs += [_permute_spec(d) for d in ACTIVATION_DTYPES]
    return specs
