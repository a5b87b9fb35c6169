# SPDX-License-Identifier: Apache-2.0
"""GPU routing: choose ``top_k`` experts per token (``route``), then the expert maps.

``route`` makes the choices of :func:`~.reference.route_ref` bit for bit (the semantics of keys,
ties, NaN, infinities and each method are stated there); weights equal the reference's to float32
rounding. One launch at decode sizes (``cuda/route_fused.cu``: top-k and maps together); above,
with a workspace, the warp routing and the maps in two launches (``cuda/route.cu``: route_tiles,
maps_tiles_place); else a routing launch followed by :func:`~.maps.expert_maps`'s launches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from .._runtime.compile import CTYPE, KernelSpec, get_kernel_with_smem
from .._runtime.device import max_shared_per_block
from .._runtime.launch import cluster_supported, launch
from .maps import GPU_MAX_EXPERTS, maps_launch
from .types import (
    SPARSE_MIXER_EXPERTS,
    Router,
    Routing,
    RoutingMethod,
    check_device_routing,
    check_logits,
    check_router_weights,
)

__all__ = [
    "FUSED_MAX_ROWS",
    "GPU_MAX_EXPERTS",
    "GPU_MAX_TOP_K",
    "fused_cluster_size",
    "kernel_specs",
    "route",
    "route_tile_tokens",
    "route_workspace_words",
]

#: GPU limits: warp kernels (and the fused decode launch) up to these; the block kernel beyond.
WARP_MAX_EXPERTS, WARP_MAX_TOP_K = 256, 8
GPU_MAX_TOP_K = 64
#: One launch for routing and maps when M * k <= this (and the warp kernel applies): the maps in
#: one warp up to 64 rows, in the whole first block above (``cuda/route_fused.cu`` kFusedRows).
FUSED_MAX_ROWS = 512
#: route_tiles / maps_tiles_place (``cuda/route.cu``): tiles of 4 tokens up to 256 tokens, else
#: of 32 or more and at most 1,024 rows (route_tile_tokens); routing blocks of one warp per token
#: up to 32 warps; maps_tiles_place blocks of 1,024 threads.
_TILE_MIN_TOKENS, _TILE_MAX_ROWS, _TILE_TABLE_ROWS, _TILE_THREADS = 4, 1024, 128, 1024
_TILE_SMALL_BATCH = 256
#: route_tiles' static shared memory: ids_s[1024] and cnt[32 * 257] (ints).
_TILE_STATIC_SMEM = 4 * (1024 + 32 * 257)


def _kmethod(router: Router, gathered: bool) -> int:
    """The kernels' ``kMethod`` (``cuda/routing_math.cuh``)."""
    if router.method is RoutingMethod.SIGMOID_GROUPED:
        return 2
    if router.method is RoutingMethod.SPARSE_MIXER:
        return 3
    if gathered:
        return 4
    if router.method is RoutingMethod.TOPK_SOFTMAX or router.renormalize:
        return 1
    return 0


def _warp_keys(n_experts: int, top_k: int) -> int:
    per_lane = -(-n_experts // 32)
    return max(1 << (per_lane - 1).bit_length(), 1 << (top_k - 1).bit_length())


def route_tile_tokens(n_tokens: int, top_k: int) -> int:
    """Tokens per tile (and block) of route_tiles. Up to 256 tokens, tiles of 4: a routing warp
    per scheduler of up to 64 SMs (with 32 tokens a block, 8 warps shared each scheduler of a
    few SMs: 10.2 µs at M = 65 against 6.5 for the routing and maps launches, H100). Above, 32
    tokens a warp each, and more per warp from 4,096 tokens on so that the table keeps 128 tiles
    (every block of maps_tiles_place reads all of it: 64 or 128 tiles of 8 tokens cost Qwen3.6
    M = 1,024 16.8 µs against 11.2 for 32 of 32), at most 1,024 rows per tile. H100 figures:
    docs/measurements.md, session 29."""
    if n_tokens <= _TILE_SMALL_BATCH:
        return _TILE_MIN_TOKENS
    per_warp = -(-n_tokens // (32 * _TILE_TABLE_ROWS))
    return 32 * max(1, min(per_warp, _TILE_MAX_ROWS // (32 * top_k)))


def route_workspace_words(n_tokens: int, n_experts: int) -> int:
    """int32 words of the ``workspace`` that :func:`route` takes for up to ``n_tokens`` tokens
    (any top-k up to 8): the tile table, one row of ``E + 1`` counts for each of at most 128
    tiles."""
    return (n_experts + 1) * max(1, min(-(-n_tokens // _TILE_MIN_TOKENS), _TILE_TABLE_ROWS))


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation :func:`route` can launch (the maps: :func:`.maps.kernel_specs`)."""
    specs = []
    # The sparse mixer (3) has 8 or 16 experts and k = 2: two keys per lane, never the block.
    sparse_keys = sorted({_warp_keys(e, 2) for e in SPARSE_MIXER_EXPERTS})
    for ctype in dict.fromkeys(CTYPE.values()):
        for method in (0, 1, 2, 3, 4):
            if method != 3:
                specs.append(KernelSpec("route", "route_block", (ctype, method)))
            for n in sparse_keys if method == 3 else (1, 2, 4, 8):
                specs.append(KernelSpec("route", "route_warp", (ctype, method, n)))
                specs.append(KernelSpec("route_fused", "route_fused", (ctype, method, n)))
                specs.append(KernelSpec("route", "route_tiles", (ctype, method, n)))
    specs.append(KernelSpec("route", "maps_tiles_place"))
    return specs


def route(
    logits: Any,
    router: Router,
    *,
    router_weights: Any = None,
    out: Routing | None = None,
    workspace: Any = None,
    pdl: bool = False,
) -> Routing:
    """Top-k routing and expert maps on the GPU; same semantics as :func:`route_ref`.

    Parameters
    ----------
    logits : cupy.ndarray [n_tokens, n_experts]
        float16, bfloat16 or float32; rows may be strided, the expert axis must be contiguous.
    router : Router
        ``n_experts <= 2048`` and ``top_k <= 64`` on the GPU.
    router_weights : cupy.ndarray [n_tokens, n_experts], optional
        C-contiguous float32 mixing weights (ONNX Runtime's ``router_weights``): the top-k is
        taken on ``logits``, the weights gathered from here (softmax_topk / topk_softmax).
    out : Routing, optional
        Preallocated CuPy arrays with exactly the shapes and dtypes of the result, C-contiguous
        (``Routing.empty(max_tokens, E, k).prefix(M)`` gives valid views). With ``out`` no
        memory is allocated and nothing synchronises: the call can be captured in a CUDA graph
        (after one warm-up call that compiles the kernels and copies ``correction_bias``).
    workspace : cupy.ndarray, optional
        int32 scratch of at least :func:`route_workspace_words` ``(M, E)`` words (any contents).
        With it, ``M * k > 512`` (``E <= 256``, ``k <= 8``, up to 128 tiles: 16,384 tokens at
        top-8) takes two launches instead of three to five; without it, and without ``out``,
        one is allocated. Calls that may run at the same time need workspaces of their own.
    pdl : bool
        Make the first launch a programmatic dependent launch (:mod:`cupymoe._launch`) where it
        is the one-launch path or route_tiles: it may start while the previous kernel on the
        stream finishes, and waits for it before it reads ``logits`` or writes anything. Safe
        after any kernel. (maps_tiles_place, after route_tiles, is always one.)

    Returns
    -------
    Routing
        ``out`` when given. One launch when ``M * k <= 512``, ``E <= 256`` and ``k <= 8``; two
        above with a workspace; otherwise a routing launch then :func:`expert_maps`.
    """
    cupy = require_cupy()
    if not is_cupy_array(logits):
        raise TypeError(
            f"logits: expected cupy.ndarray (use route_ref for NumPy), got {type(logits).__name__}"
        )
    check_logits(logits, router, tuple(CTYPE))
    e, k, m = router.n_experts, router.top_k, int(logits.shape[0])
    if e > GPU_MAX_EXPERTS or k > GPU_MAX_TOP_K:
        raise ValueError(
            f"router: the GPU path supports n_experts <= {GPU_MAX_EXPERTS} and "
            f"top_k <= {GPU_MAX_TOP_K}, got {e} and {k}"
        )
    item = logits.dtype.itemsize
    if m > 1 and (logits.strides[0] % item or logits.strides[0] < e * item):
        raise ValueError(f"logits: expected a row stride that is a multiple of {item} bytes")
    if m > 0 and e > 1 and logits.strides[1] != item:  # an empty array's strides mean nothing
        raise ValueError("logits: the expert axis must be contiguous")
    if router_weights is not None:
        check_router_weights(router_weights, logits, router)
        if m > 0 and not router_weights.flags.c_contiguous:
            raise ValueError("router_weights: expected a C-contiguous array")
    if workspace is not None:
        if not is_cupy_array(workspace) or workspace.ndim != 1 or workspace.dtype != np.int32:
            raise TypeError("workspace: expected a 1-D cupy.ndarray of int32")
        need = route_workspace_words(m, e)
        if int(workspace.size) < need or not workspace.flags.c_contiguous:
            raise ValueError(
                f"workspace: expected at least {need} contiguous int32 words for {m} tokens "
                f"and {e} experts, got {int(workspace.size)}"
            )
    allocates = out is None  # then a workspace too, where the two launches run
    if out is None:
        out = Routing.empty(m, e, k, xp=cupy)
    else:
        check_device_routing(out, n_tokens=m, n_experts=e, top_k=k, name="out")
    grouped = router.method is RoutingMethod.SIGMOID_GROUPED
    bias = router.device_bias() if grouped else router_weights  # the kernels' `bias` argument
    ld = np.int64(logits.strides[0] // item if m > 1 else e)
    kmethod, ctype = _kmethod(router, router_weights is not None), CTYPE[np.dtype(logits.dtype)]
    head = (logits, ld)
    tail = (
        np.int32(router.n_group or 1),
        np.int32(router.topk_group or 1),
        np.float32(router.routed_scaling_factor),
        np.int32(router.renormalize or router.method is RoutingMethod.TOPK_SOFTMAX),
        bias,
        out.topk_ids,
        out.topk_weights,
    )
    n = m * k
    if m == 0:
        maps_launch(out.topk_ids, 0, e, out)
        return out
    if e <= WARP_MAX_EXPERTS and k <= WARP_MAX_TOP_K:
        keys = _warp_keys(e, k)
        if n <= FUSED_MAX_ROWS:
            spec = KernelSpec("route_fused", "route_fused", (ctype, kmethod, keys))
            ctas = fused_cluster_size(m, cluster_supported())
            launch(
                spec,
                ctas,
                32 * (min(-(-m // ctas), 8) + 1),  # routing warps + the maps warp
                (
                    *head,
                    np.int32(m),
                    np.int32(e),
                    np.int32(k),
                    *tail,
                    out.expert_offsets,
                    out.sorted_rows,
                    out.inverse,
                    out.active_experts,
                    np.int32(min(n, e)),
                ),
                pdl=pdl,
                cluster=ctas,
            )
            return out
        if (workspace is not None or allocates) and _tiles_apply(m, k, kmethod):
            if workspace is None:
                workspace = cupy.empty(route_workspace_words(m, e), np.int32)
            _route_tiles(head, tail, m, e, k, ctype, kmethod, keys, out, workspace, pdl)
            return out
        spec = KernelSpec("route", "route_warp", (ctype, kmethod, keys))
        launch(spec, -(-m // 4), 128, (*head, np.int32(m), np.int32(e), np.int32(k), *tail))
    else:
        n_group = router.n_group or 1
        spec = KernelSpec("route", "route_block", (ctype, kmethod))
        launch(
            spec,
            m,
            256,
            (*head, np.int32(e), np.int32(k), *tail),
            shared_mem=(2 * e + 2 * n_group) * 4,
        )
    maps_launch(out.topk_ids, n, e, out)
    return out


def _tiles_apply(m: int, k: int, kmethod: int) -> bool:
    """Whether route_tiles runs this call (else the routing launch and the maps' launches): at
    most 128 tiles (every block of maps_tiles_place reads the whole table, so its L2 reads grow
    as the square of the tiles), and, for kMethod 2, the block's static and dynamic shared memory
    within the device's opt-in limit (37 + 64 KB of 32 warps exceed sm_86/89/120's 99 KB)."""
    tokens = route_tile_tokens(m, k)
    if -(-m // tokens) > _TILE_TABLE_ROWS:
        return False
    return kmethod != 2 or _TILE_STATIC_SMEM + _tile_scratch(tokens) <= max_shared_per_block()


def _tile_scratch(tokens: int) -> int:
    """route_tiles' dynamic shared memory for kMethod 2: 512 floats per routing warp."""
    return 4 * 512 * min(tokens, 32)


def _route_tiles(
    head: tuple[Any, ...],
    tail: tuple[Any, ...],
    m: int,
    e: int,
    k: int,
    ctype: str,
    kmethod: int,
    keys: int,
    out: Routing,
    workspace: Any,
    pdl: bool,
) -> None:
    """The two launches above the fused sizes (``cuda/route.cu``: route_tiles, then
    maps_tiles_place as a programmatic dependent launch)."""
    tokens = route_tile_tokens(m, k)
    tiles, rows, warps = -(-m // tokens), tokens * k, min(tokens, 32)
    spec = KernelSpec("route", "route_tiles", (ctype, kmethod, keys))
    smem = _tile_scratch(tokens) if kmethod == 2 else 0
    if _TILE_STATIC_SMEM + smem > 48 * 1024:
        get_kernel_with_smem(spec, smem)
    launch(
        spec,
        tiles,
        32 * warps,
        (
            *head,
            np.int32(m),
            np.int32(e),
            np.int32(k),
            *tail,
            out.inverse,
            np.int32(tokens),
            workspace,
        ),
        shared_mem=smem,
        pdl=pdl,
    )
    launch(
        KernelSpec("route", "maps_tiles_place"),
        tiles,
        _TILE_THREADS,
        (
            out.topk_ids,
            np.int32(m * k),
            np.int32(e),
            np.int32(rows),
            workspace,
            out.expert_offsets,
            out.sorted_rows,
            out.inverse,
            out.active_experts,
            np.int32(min(m * k, e)),
        ),
        pdl=True,
    )


def fused_cluster_size(m: int, clusters: bool) -> int:
    """Blocks (one thread-block cluster when above 1) of the one-launch routing of ``m`` tokens:
    enough for one routing warp per scheduler, ``ceil(m / 4)`` up to 8, where the device has
    clusters (``clusters``, sm_90+), else 1.

    H200 (``bench_routing.py``, E 256, top-8, µs, PDL): at M = 8 one block 2.65 (softmax top-k)
    and 3.52 (grouped sigmoid), ceil(M / 4) = 2 blocks 2.44 and 3.02, one block per token 2.43
    and 3.00: two routing warps on a scheduler (M > 4) cost every phase of a token. At M = 2 / 4 a
    block per token buys nothing (grouped 2.75 / 2.89 against 2.76 / 2.89), and ordinary launches
    of clusters cost more (grouped M = 2: 3.28 -> 3.52).
    """
    return min(-(-m // 4), 8) if clusters and m > 4 else 1
