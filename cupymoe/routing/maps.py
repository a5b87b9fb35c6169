# SPDX-License-Identifier: Apache-2.0
"""Expert maps on the GPU: a stable counting sort of the ``M * k`` flat slots by expert.

``expert_maps(topk_ids)`` gives ``(expert_offsets, sorted_rows, inverse, active_experts)``, the
results of :func:`~.reference.expert_maps_ref` exactly. Decode sizes take one block
(``cuda/maps.cu``: ``maps_single``); larger ones a deterministic counting sort in four launches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from .._runtime.compile import KernelSpec
from .._runtime.launch import launch
from .._runtime.validate import check_device_array, check_int
from .types import Routing

__all__ = ["GPU_MAX_EXPERTS", "expert_maps", "kernel_specs", "maps_launch", "single_block_warps"]

#: The largest expert count of the GPU routing and maps.
GPU_MAX_EXPERTS = 2048
#: The one block up to 2,048 rows, the tiled sort above: H200, one graph node, µs at E = 32 /
#: 128 / 256, block against tiled: 2,048 rows 7.3 / 8.6 / 8.9 against 9.2 / 9.7 / 9.3; 4,096 rows
#: 10.2 / 12.7 / 13.2 against 9.3 / 9.9 / 9.7 (docs/measurements.md, session 20).
_TILE_ROWS, _TILE_MAX_EXPERTS, _SINGLE_BLOCK_MAX_ROWS = 1024, 1024, 2048
#: The one-block maps keep a row of E + 1 counters per warp in shared memory, within the static
#: 48 KB, and use at most 32 warps (1,024 threads).
_SINGLE_BLOCK_SMEM, _SINGLE_BLOCK_MAX_WARPS = 48 * 1024, 32


def single_block_warps(n: int, e: int) -> int:
    """Warps of the one-block maps of ``n`` rows and ``e`` experts: one per 32 rows, at most 32,
    and as many as ``(W + 1) * (e + 1)`` counters allow in 48 KB (at least one)."""
    fit = _SINGLE_BLOCK_SMEM // (4 * (e + 1)) - 1
    return max(1, min(_SINGLE_BLOCK_MAX_WARPS, -(-n // 32), fit))


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation :func:`maps_launch` can launch."""
    names = ("maps_single", "maps_tile_rank", "maps_tile_scan", "maps_tile_place", "maps_scatter")
    return [KernelSpec("maps", name) for name in names]


def maps_launch(ids: Any, n: int, e: int, out: Routing) -> None:
    """The expert-map launches (one block for decode sizes, a 4-launch counting sort above)."""
    n_tiles = -(-n // _TILE_ROWS)
    active_len = np.int32(min(n, e))
    if n <= _SINGLE_BLOCK_MAX_ROWS or e > _TILE_MAX_EXPERTS or (e + 1) * n_tiles > n:
        warps = single_block_warps(n, e)
        launch(
            KernelSpec("maps", "maps_single"),
            1,
            32 * warps,
            (
                ids,
                np.int32(n),
                np.int32(e),
                out.expert_offsets,
                out.sorted_rows,
                out.inverse,
                out.active_experts,
                active_len,
            ),
            shared_mem=4 * (warps + 1) * (e + 1),
        )
        return
    tiles = out.sorted_rows  # (E + 1) * n_tiles counters, until maps_scatter overwrites them
    launch(
        KernelSpec("maps", "maps_tile_rank"),
        n_tiles,
        256,
        (ids, np.int32(n), np.int32(e), np.int32(n_tiles), tiles, out.inverse),
    )
    launch(
        KernelSpec("maps", "maps_tile_scan"),
        1,
        1024,
        (tiles, np.int32(n_tiles), np.int32(e), out.expert_offsets, out.active_experts, active_len),
    )
    launch(
        KernelSpec("maps", "maps_tile_place"),
        -(-n // 256),
        256,
        (ids, np.int32(n), np.int32(e), np.int32(n_tiles), tiles, out.inverse),
    )
    launch(
        KernelSpec("maps", "maps_scatter"),
        -(-n // 256),
        256,
        (np.int32(n), out.inverse, out.sorted_rows),
    )


def expert_maps(topk_ids: Any, n_experts: int, *, out: Routing | None = None) -> tuple[Any, ...]:
    """Expert maps of ``topk_ids`` on the GPU; same results as :func:`expert_maps_ref`.

    ``topk_ids`` is a C-contiguous int32 ``cupy.ndarray [n_tokens, top_k]``. Ids outside
    ``[0, n_experts)`` cannot be checked without a host sync: they are never read out of range
    (they are placed after every expert, and ``expert_offsets[E]`` counts only valid rows).
    ``out`` (optional) supplies ``expert_offsets``, ``sorted_rows``, ``inverse`` and
    ``active_experts`` (its ``topk_ids``/``topk_weights`` are not touched).

    Returns ``(expert_offsets, sorted_rows, inverse, active_experts)``.
    """
    cupy = require_cupy()
    e = check_int("n_experts", n_experts)
    assert e is not None
    if not 1 <= e <= GPU_MAX_EXPERTS:
        raise ValueError(f"n_experts: expected 1..{GPU_MAX_EXPERTS}, got {e}")
    if not is_cupy_array(topk_ids) or topk_ids.ndim != 2:
        raise TypeError("topk_ids: expected a 2-D cupy.ndarray [n_tokens, top_k]")
    check_device_array("topk_ids", topk_ids, tuple(topk_ids.shape), np.int32)
    m, k = (int(s) for s in topk_ids.shape)
    if out is None:
        n = m * k
        out = Routing(
            topk_ids,
            None,
            cupy.empty(e + 1, np.int32),
            cupy.empty(n, np.int32),
            cupy.empty(n, np.int32),
            cupy.empty(min(n, e), np.int32),
        )
    else:
        if not isinstance(out, Routing):
            raise TypeError(f"out: expected a Routing, got {type(out).__name__}")
        n = m * k
        for name, shape in (
            ("expert_offsets", (e + 1,)),
            ("sorted_rows", (n,)),
            ("inverse", (n,)),
            ("active_experts", (min(n, e),)),
        ):
            check_device_array(f"out.{name}", getattr(out, name), shape, np.int32)
    maps_launch(topk_ids, m * k, e, out)
    return out.expert_offsets, out.sorted_rows, out.inverse, out.active_experts
