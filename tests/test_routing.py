# SPDX-License-Identifier: Apache-2.0
"""Routing: reference semantics (CPU), the GPU kernels against the reference (ids and maps
exact, weights to float32 rounding), determinism, CUDA-graph capture, and input validation."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

import cupymoe.routing.topk as routing_mod
from cupymoe._runtime.compile import kernel_source
from cupymoe._runtime.launch import ENV_CLUSTERS
from cupymoe.routing import (
    Router,
    Routing,
    RoutingMethod,
    expert_maps,
    expert_maps_ref,
    route,
    route_ref,
    route_workspace_words,
    sigmoid_f32,
)
from cupymoe.routing.maps import GPU_MAX_EXPERTS, single_block_warps
from cupymoe.testing import assert_close, assert_equal

BF16 = ml_dtypes.bfloat16
# The sparse mixer takes only E in {8, 16} and k = 2: its cases are in test_ort_options.py.
METHODS = tuple(m for m in RoutingMethod if m is not RoutingMethod.SPARSE_MIXER)


def _router(
    method: RoutingMethod, e: int, k: int, *, renormalize: bool = True, seed: int = 0
) -> Router:
    if method is not RoutingMethod.SIGMOID_GROUPED:
        return Router(e, k, method, renormalize)
    n_group = next(g for g in (8, 4, 2, 1) if e % g == 0 and (g == 1 or e // g >= 2))
    size = e // n_group
    topk_group = min(n_group, max(-(-k // size), n_group // 2))
    bias = (np.random.default_rng(seed).standard_normal(e) * 0.05).astype(np.float32)
    return Router(
        e,
        k,
        method,
        renormalize,
        n_group=n_group,
        topk_group=topk_group,
        correction_bias=bias,
        routed_scaling_factor=2.5,
    )


def _logits(kind: str, m: int, e: int, dtype: type, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((m, e)) * 3
    if kind == "ties":  # quantised: many exact ties
        x = np.round(x)
    elif kind == "equal":
        x = np.full((m, e), 0.5)
    elif kind == "wide":  # sigmoids down to the subnormals and 0 (x below about -87)
        x = rng.uniform(-160, 40, (m, e))
    elif kind == "inf":
        x[rng.random((m, e)) < 0.1] = np.inf
        x[rng.random((m, e)) < 0.1] = -np.inf
    elif kind == "nan":
        x[rng.random((m, e)) < 0.2] = np.nan
        x[rng.random((m, e)) < 0.05] = -np.inf
        if m > 1:
            x[1] = np.nan  # a row of only NaN
    return x.astype(dtype)


# ---- reference semantics (CPU) ------------------------------------------------------------------
def test_softmax_topk_hand_computed() -> None:
    logits = np.array([[1.0, 3.0, 2.0, 3.0]], np.float32)
    r = route_ref(logits, Router(4, 2, renormalize=False))
    assert r.topk_ids.tolist() == [[1, 3]]  # tie 3.0 / 3.0 -> lower id first
    p = np.exp([1.0, 3.0, 2.0, 3.0]) / np.exp([1.0, 3.0, 2.0, 3.0]).sum()
    np.testing.assert_allclose(r.topk_weights[0], p[[1, 3]], rtol=1e-6)
    r = route_ref(logits, Router(4, 3))
    assert r.topk_ids.tolist() == [[1, 3, 2]]
    np.testing.assert_allclose(r.topk_weights[0], p[[1, 3, 2]] / p[[1, 3, 2]].sum(), rtol=1e-6)
    assert r.expert_offsets.tolist() == [0, 0, 1, 2, 3]
    assert r.sorted_rows.tolist() == [0, 2, 1] and r.inverse.tolist() == [0, 2, 1]
    assert r.active_experts.tolist() == [1, 2, 3]


def test_nan_ranks_below_minus_inf_and_weighs_zero() -> None:
    logits = np.array([[np.nan, -np.inf, 0.0, np.nan]], np.float32)
    r = route_ref(logits, Router(4, 4, renormalize=False))
    assert r.topk_ids.tolist() == [[2, 1, 0, 3]]
    assert r.topk_weights.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    r = route_ref(np.full((1, 3), np.nan, np.float32), Router(3, 2))
    assert r.topk_ids.tolist() == [[0, 1]] and r.topk_weights.tolist() == [[0.0, 0.0]]


def test_infinities_share_the_mass() -> None:
    logits = np.array([[np.inf, 1.0, np.inf, -np.inf]], np.float32)
    r = route_ref(logits, Router(4, 3, renormalize=False))
    assert r.topk_ids.tolist() == [[0, 2, 1]]
    assert r.topk_weights.tolist() == [[0.5, 0.5, 0.0]]
    r = route_ref(np.full((1, 4), -np.inf, np.float32), Router(4, 2, renormalize=False))
    assert r.topk_weights.tolist() == [[0.25, 0.25]]


def test_topk_softmax_equals_renormalized_softmax_topk(rng: np.random.Generator) -> None:
    x = rng.standard_normal((16, 32)).astype(np.float32)
    a = route_ref(x, Router(32, 4, "topk_softmax"))
    b = route_ref(x, Router(32, 4, "softmax_topk", renormalize=True))
    assert_equal(a.topk_ids, b.topk_ids)
    np.testing.assert_array_equal(a.topk_weights, b.topk_weights)


def test_selection_is_by_logit_not_rounded_probability() -> None:
    # two distinct logits whose float32 probabilities round equal: the larger logit still wins
    x = np.array([[0.0, np.float32(1e-7), -40.0]], np.float32)
    assert route_ref(x, Router(3, 1)).topk_ids.tolist() == [[1]]


def test_sigmoid_grouped_hand_computed() -> None:
    logits = np.array([[0.0, 2.0, 1.0, -1.0, 3.0, -3.0]], np.float32)
    bias = np.array([0, 0, 0, 0, 0, 10], np.float32)  # group 2 wins on bias alone
    router = Router(
        6,
        2,
        "sigmoid_grouped",
        n_group=3,
        topk_group=1,
        correction_bias=bias,
        routed_scaling_factor=2.0,
    )
    r = route_ref(logits, router)
    assert r.topk_ids.tolist() == [[5, 4]]
    s = 1 / (1 + np.exp(-np.array([-3.0, 3.0])))
    np.testing.assert_allclose(r.topk_weights[0], 2.0 * s / s.sum(), rtol=1e-6)


def test_sigmoid_f32_is_accurate_and_monotone() -> None:
    x = np.linspace(-120, 120, 200001).astype(np.float32)
    s = sigmoid_f32(x)
    exact = 1 / (1 + np.exp(-x.astype(np.float64)))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    normal = np.abs(x) <= 88  # below -88.72, exp(-x) overflows float32 and s = 0 by definition
    assert np.max(np.abs(s - exact)[normal] / ulp[normal]) <= 3
    assert np.all(np.diff(s) >= 0)
    assert np.isnan(sigmoid_f32(np.float32(np.nan)))
    assert sigmoid_f32(np.float32(-1e30)) == 0 and sigmoid_f32(np.float32(1e30)) == 1


def test_expert_maps_ref_properties(rng: np.random.Generator) -> None:
    ids = rng.integers(0, 12, size=(33, 3)).astype(np.int32)  # duplicates within a token too
    offsets, rows, inverse, active = expert_maps_ref(ids, 12)
    flat = ids.ravel()
    assert offsets[0] == 0 and offsets[-1] == flat.size and np.all(np.diff(offsets) >= 0)
    assert np.array_equal(np.sort(rows), np.arange(flat.size))
    assert np.array_equal(inverse[rows], np.arange(flat.size))
    for e in range(12):
        seg = rows[offsets[e] : offsets[e + 1]]
        assert np.all(flat[seg] == e) and np.all(np.diff(seg) > 0)  # stable
    assert active[active >= 0].tolist() == sorted(set(flat.tolist()))


def test_empty_batch() -> None:
    r = route_ref(np.zeros((0, 8), np.float32), Router(8, 2))
    assert r.topk_ids.shape == (0, 2) and r.expert_offsets.tolist() == [0] * 9
    assert r.sorted_rows.shape == r.inverse.shape == r.active_experts.shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(n_experts=8, top_k=0), ValueError, "top_k"),
        (dict(n_experts=8, top_k=9), ValueError, "top_k"),
        (dict(n_experts=8, top_k=2.0), TypeError, "top_k"),
        (dict(n_experts=8, top_k=2, method="argmax"), ValueError, "routing"),
        (dict(n_experts=8, top_k=2, n_group=2), ValueError, "n_group"),
        (dict(n_experts=8, top_k=2, routed_scaling_factor=2.0), ValueError, "routed_scaling"),
        (dict(n_experts=8, top_k=2, correction_bias=np.zeros(8)), ValueError, "correction_bias"),
        (dict(n_experts=8, top_k=2, method="sigmoid_grouped", n_group=3), ValueError, "n_group"),
        (dict(n_experts=8, top_k=2, method="sigmoid_grouped", n_group=8), ValueError, "n_group"),
        (
            dict(n_experts=8, top_k=2, method="sigmoid_grouped", n_group=4, topk_group=5),
            ValueError,
            "topk_group",
        ),
        (
            dict(n_experts=8, top_k=5, method="sigmoid_grouped", n_group=4, topk_group=2),
            ValueError,
            "topk_group",
        ),
        (
            dict(n_experts=8, top_k=2, method="sigmoid_grouped", correction_bias=np.zeros(7)),
            ValueError,
            "correction_bias",
        ),
        (
            dict(
                n_experts=8,
                top_k=2,
                method="sigmoid_grouped",
                correction_bias=np.array([np.nan] * 8),
            ),
            ValueError,
            "correction_bias",
        ),
        (
            dict(n_experts=8, top_k=2, method="sigmoid_grouped", routed_scaling_factor=-1.0),
            ValueError,
            "routed_scaling",
        ),
    ],
)
def test_router_validation(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Router(**kwargs)


def test_route_ref_validation() -> None:
    router = Router(8, 2)
    with pytest.raises(ValueError, match="logits"):
        route_ref(np.zeros((2, 7), np.float32), router)
    with pytest.raises(TypeError, match="logits"):
        route_ref(np.zeros((2, 8), np.int32), router)
    with pytest.raises(ValueError, match="topk_ids"):
        expert_maps_ref(np.array([[0, 8]], np.int32), 8)


def test_method_parse() -> None:
    assert RoutingMethod.parse("TopK_Softmax") is RoutingMethod.TOPK_SOFTMAX
    assert Router(4, 1, "sigmoid_grouped").n_group == 1


# ---- GPU against the reference ------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    e: int
    k: int
    m: int
    method: RoutingMethod
    dtype: type


def _cases() -> list[Case]:
    # E spans the warp path (<= 256), the block path (384, 1024) and a non-power-of-two (60);
    # M * k spans the fused launch (<= 64), the one-block maps and the tiled maps (1000 * 8).
    out = []
    dtypes = (np.float32, BF16, np.float16)
    for i, (e, k, m) in enumerate(
        itertools.product(
            (8, 32, 60, 128, 256, 384, 1024), (1, 2, 4, 6, 8, 16), (1, 2, 4, 8, 33, 64, 1000)
        )
    ):
        if k <= e:
            out.append(Case(e, k, m, METHODS[i % 3], dtypes[(i // 3) % 3]))
    return out


def _device(a: np.ndarray):
    cupy = pytest.importorskip("cupy")
    try:
        return cupy.asarray(a)
    except Exception as error:  # a CuPy without bfloat16 support
        pytest.skip(f"cupy cannot hold {a.dtype}: {error}")


def _check_routing(ref: Routing, out: Routing) -> None:
    assert_equal(ref.topk_ids, out.topk_ids, name="topk_ids")
    assert_close(
        ref.topk_weights, out.topk_weights, max_rel=2e-6, rms_rel=1e-6, name="topk_weights"
    )
    for name in ("expert_offsets", "sorted_rows", "inverse", "active_experts"):
        assert_equal(getattr(ref, name), getattr(out, name), name=name)


def _poisoned(m: int, e: int, k: int) -> Routing:
    out = Routing.empty(m, e, k)
    for a in (out.topk_ids, out.expert_offsets, out.sorted_rows, out.inverse, out.active_experts):
        a.fill(-7)
    out.topk_weights.fill(np.nan)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("case", _cases(), ids=str)
def test_route_matches_reference(case: Case, rng: np.random.Generator) -> None:
    router = _router(case.method, case.e, case.k, renormalize=case.e % 3 != 0)
    x = _logits("random", case.m, case.e, case.dtype, rng)
    out = route(_device(x), router, out=_poisoned(case.m, case.e, case.k))
    _check_routing(route_ref(x, router), out)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ties", "equal", "inf", "nan"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("e", "k", "m"), [(60, 6, 4), (256, 8, 8), (256, 8, 64), (1024, 16, 5)])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_route_edge_values(
    kind: str, method: RoutingMethod, e: int, k: int, m: int, dtype: type, rng: np.random.Generator
) -> None:
    for renormalize in (True, False):
        router = _router(method, e, k, renormalize=renormalize)
        x = _logits(kind, m, e, dtype, rng)
        _check_routing(route_ref(x, router), route(_device(x), router))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "ties", "equal", "nan", "wide"])
@pytest.mark.parametrize(
    ("e", "n_group", "topk_group", "k"),
    [
        (256, 8, 4, 8),  # DeepSeek-V3: groups of 32, 4 lanes of 8 experts each
        (256, 8, 1, 8),
        (256, 8, 7, 6),
        (224, 7, 3, 8),  # groups of 32, lanes 28..31 past E
        (128, 4, 2, 6),
        (256, 4, 2, 8),  # groups of 64: 8 lanes
        (256, 32, 3, 8),  # groups of 8: one lane each
        (96, 6, 5, 4),  # groups of 16: 4 lanes of 4 experts
        (96, 4, 2, 4),  # groups of 24 = 6 lanes: the shared-memory group scan
        (60, 5, 2, 4),  # groups of 12 = 3 lanes: the shared-memory group scan
    ],
)
@pytest.mark.parametrize("m", [1, 4, 9, 40, 100])
def test_route_grouped_configurations(
    kind: str, e: int, n_group: int, topk_group: int, k: int, m: int, rng: np.random.Generator
) -> None:
    # Fused (M * k <= 512: maps by one warp, or by block 0 at m = 40 with k >= 2) and per-token
    # launches, both group-selection paths, tie-heavy inputs.
    bias = (rng.standard_normal(e) * 0.05).astype(np.float32)
    if kind == "ties":
        bias = np.round(bias * 40) / 40
    elif kind == "equal":
        bias[:] = 0
    router = Router(
        e,
        k,
        "sigmoid_grouped",
        renormalize=kind != "nan",
        n_group=n_group,
        topk_group=topk_group,
        correction_bias=bias,
        routed_scaling_factor=2.5,
    )
    x = _logits(kind, m, e, np.float32, rng)
    work = _garbage_workspace(m, e, rng)  # above 512 rows the two launches
    out = route(_device(x), router, out=_poisoned(m, e, k), workspace=work)
    _check_routing(route_ref(x, router), out)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [0, 1, 4, 200])
def test_route_deterministic_and_strided(m: int, rng: np.random.Generator) -> None:
    router = _router(RoutingMethod.SIGMOID_GROUPED, 256, 8)
    x = _logits("random", m, 300, np.float32, rng)
    xd = _device(x)[:, :256]  # strided rows
    first = route(xd, router)
    _check_routing(route_ref(np.ascontiguousarray(x[:, :256]), router), first)
    for _ in range(3):
        again = route(xd, router)
        for name in ("topk_ids", "topk_weights", "expert_offsets", "sorted_rows", "inverse"):
            assert np.array_equal(
                getattr(first, name).get().view(np.int32), getattr(again, name).get().view(np.int32)
            )


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
@pytest.mark.parametrize(("e", "k"), [(256, 8), (250, 8), (64, 2)])
def test_route_unaligned_rows(
    method: RoutingMethod, dtype: type, e: int, k: int, rng: np.random.Generator
) -> None:
    # Rows that start 1 element past a 16-byte boundary, and E not a multiple of a lane's run of
    # experts (250): the lanes read their runs with scalar loads instead of vector loads.
    router = _router(method, e, k)
    for m in (1, 5):
        x = _logits("ties", m, e + 3, dtype, rng)
        xd = _device(x)[:, 1 : e + 1]
        _check_routing(route_ref(np.ascontiguousarray(x[:, 1 : e + 1]), router), route(xd, router))


def test_single_block_warps() -> None:
    """One warp per 32 rows up to 32, within the 48 KB of per-warp counters at every expert
    count the GPU maps take."""
    rows = (1, 32, 33, 65, 1024, 1025, 10**6)
    assert [single_block_warps(n, 256) for n in rows] == [1, 1, 2, 3, 32, 32, 32]
    for e in range(1, GPU_MAX_EXPERTS + 1):
        w = single_block_warps(10**6, e)
        assert 1 <= w <= 32 and 4 * (w + 1) * (e + 1) <= 48 * 1024
        assert w == 32 or 4 * (w + 2) * (e + 1) > 48 * 1024  # as many as fit
    assert single_block_warps(10**6, 2048) == 4


def test_fused_rows_match_the_kernel() -> None:
    # The one-launch bound is the kernel's staging capacity; the block maps' counters hold the
    # widest block (8 routing warps and the maps warp) at the warp path's 256 experts.
    src = kernel_source("route_fused")
    rows = re.search(r"kWarpRows = (\d+), kFusedRows = (\d+);", src)
    assert rows and int(rows.group(2)) == routing_mod.FUSED_MAX_ROWS
    assert int(rows.group(1)) == 64 and "ids_s[kFusedRows]" in src
    words = re.search(r"kBlockMapWords = (\d+) \* (\d+);", src)
    assert words and int(words.group(1)) == 8 + 1 + 1
    assert int(words.group(2)) == routing_mod.WARP_MAX_EXPERTS + 1
    assert all(routing_mod.fused_cluster_size(m, True) <= 8 for m in range(1, 513))


def test_fused_cluster_size() -> None:
    # One routing warp per scheduler (4 per block) from M = 5 on, at most 8 blocks; one block
    # without clusters or while one block has a scheduler per token.
    got = [routing_mod.fused_cluster_size(m, True) for m in range(1, 65)]
    assert got == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4 + [6] * 4 + [7] * 4 + [8] * 36
    assert all(routing_mod.fused_cluster_size(m, False) == 1 for m in range(1, 65))


def _tile_maps(ids: np.ndarray, e: int, tile_rows: int) -> tuple[np.ndarray, ...]:
    """NumPy transcription of route_tiles + maps_tiles_place (cuda/route.cu): ranks within each
    tile of ``tile_rows`` rows, the table of per-tile bucket counts, every tile's own sums of the
    table (thread (q, b) over tiles [q C, q C + C)), then each row's place."""
    flat = ids.reshape(-1)
    n, L = flat.size, e + 1
    bucket = np.where((flat >= 0) & (flat < e), flat, e)
    g_tiles = -(-n // tile_rows)
    table = np.zeros((g_tiles, L), np.int64)
    local = np.zeros(n, np.int64)
    for g in range(g_tiles):
        rows = bucket[g * tile_rows : (g + 1) * tile_rows]
        for b in range(L):
            hit = np.flatnonzero(rows == b)
            local[g * tile_rows + hit] = np.arange(hit.size)
            table[g, b] = hit.size
    q_lanes = 1024 // L
    c = -(-g_tiles // q_lanes)
    offsets = np.zeros(L, np.int64)
    inverse = np.zeros(n, np.int64)
    for g in range(g_tiles):
        part_all = np.zeros((q_lanes, L), np.int64)
        part_before = np.zeros((q_lanes, L), np.int64)
        for q in range(q_lanes):
            tiles = np.arange(q * c, min(g_tiles, q * c + c))
            part_all[q] = table[tiles].sum(axis=0)
            part_before[q] = table[tiles[tiles < g]].sum(axis=0)
        totals = part_all.sum(axis=0)
        first = np.concatenate([[0], np.cumsum(totals)[:-1]])
        if g == 0:
            offsets = first
        start = first + part_before.sum(axis=0)
        rows = np.arange(g * tile_rows, min(n, (g + 1) * tile_rows))
        inverse[rows] = start[bucket[rows]] + local[rows]
    sorted_rows = np.empty(n, np.int64)
    sorted_rows[inverse] = np.arange(n)
    counts = np.bincount(flat[bucket < e], minlength=e)
    active = np.full(min(n, e), -1, np.int64)
    act = np.flatnonzero(counts)
    active[: act.size] = act
    return offsets, sorted_rows, inverse, active


@pytest.mark.parametrize(("m", "k", "e"), [(65, 8, 256), (1000, 8, 256), (300, 4, 32), (77, 6, 60)])
def test_tile_maps_transcription(m: int, k: int, e: int, rng: np.random.Generator) -> None:
    # The two-launch maps' arithmetic against the oracle, at the tile sizes route() picks, with
    # skewed ids and ids outside [0, E) (placed last, in row order).
    ids = rng.integers(0, e, size=(m, k)).astype(np.int32)
    ids[: m // 2] = rng.integers(0, 3, size=(m // 2, k))
    rows = routing_mod.route_tile_tokens(m, k) * k
    got = _tile_maps(ids, e, rows)
    for name, want, have in zip(
        ("offsets", "sorted_rows", "inverse", "active"), expert_maps_ref(ids, e), got, strict=True
    ):
        assert_equal(want, have.astype(np.int32), name=name)
    bad = ids.copy()
    bad[rng.random(ids.shape) < 0.1] = -1
    offsets, sorted_rows, inverse, _ = _tile_maps(bad, e, rows)
    valid = bad.reshape(-1) >= 0
    assert offsets[e] == valid.sum()
    assert_equal(np.flatnonzero(~valid), sorted_rows[offsets[e] :], name="invalid rows last")
    assert_equal(np.arange(m * k), sorted_rows[inverse], name="inverse")


def test_tile_sizes() -> None:
    # Tiles of 4 tokens up to 256, then of 32 tokens (one a warp) while the table keeps 128
    # tiles, then more per warp, never more than 1,024 rows; the workspace holds the largest
    # table of any M up to its size that takes the two launches.
    tokens = routing_mod.route_tile_tokens
    got = [tokens(m, 8) for m in (65, 256, 257, 4096, 4097, 8192, 12289, 16385, 10**6)]
    assert got == [4, 4, 32, 32, 64, 64, 128, 128, 128]
    assert [tokens(m, 4) for m in (129, 257, 32768, 10**6)] == [4, 32, 256, 256]
    assert tokens(10**6, 1) == 1024
    for e, k in ((256, 8), (32, 4), (60, 6), (8, 1), (128, 2)):
        words = route_workspace_words(200000, e)
        for m in range(1, 200001, 97):
            t = tokens(m, k)
            assert t * k <= 1024 and (t == 4 or t % 32 == 0)
            tiles = -(-m // t)
            applies = routing_mod._tiles_apply(m, k, 0)
            assert applies == (tiles <= 128)
            assert applies or t * k > 512  # only the largest tiles reach 129 tiles
            if applies:
                assert tiles * (e + 1) <= min(words, route_workspace_words(m, e))
    assert routing_mod._tiles_apply(16384, 8, 0) and not routing_mod._tiles_apply(16385, 8, 0)


@pytest.mark.parametrize(("limit", "small", "large"), [(101376, True, False), (232448, True, True)])
def test_tiles_fit_shared_memory(limit: int, small: bool, large: bool, monkeypatch) -> None:
    # The grouped sigmoid's 512 floats a routing warp on top of route_tiles' static counters: 4
    # warps fit every device, 32 warps (101 KB) not the 99 KB of sm_86 / sm_89 / sm_120, which
    # then keep the routing launch and the maps' launches. The other methods need no scratch.
    monkeypatch.setattr(routing_mod, "max_shared_per_block", lambda: limit)
    assert routing_mod._tiles_apply(200, 8, 2) is small  # tiles of 4 tokens
    assert routing_mod._tiles_apply(4096, 8, 2) is large  # tiles of 32
    assert routing_mod._tiles_apply(4096, 8, 0) and routing_mod._tiles_apply(4096, 8, 1)
    src = kernel_source("route")
    assert "ids_s[kTileMaxRows]" in src and "cnt[32 * 257]" in src
    assert routing_mod._TILE_STATIC_SMEM == 4 * (1024 + 32 * 257)

    src = kernel_source("route")
    assert "ids_s[kTileMaxRows]" in src and "kTileMaxRows = 1024;" in src
    assert "cnt[32 * 257]" in src and "part[2 * 1024]" in src and "start[257]" in src


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("m", "e", "k"),
    [(5, 256, 8), (8, 256, 8), (13, 60, 4), (64, 32, 1), (9, 256, 8), (64, 256, 8), (100, 60, 5)],
)
def test_route_cluster_matches_one_block(
    method: RoutingMethod, m: int, e: int, k: int, rng: np.random.Generator, monkeypatch
) -> None:
    # The fused launch as a cluster (tokens spread over blocks, ids gathered in block 0) gives
    # bitwise what one block gives, with the maps in one warp (up to 64 rows) or in block 0
    # (72, 512 and 500 rows); on sm_90+ the cluster path is really taken.
    cupy = pytest.importorskip("cupy")
    monkeypatch.delenv(ENV_CLUSTERS, raising=False)
    clusters = routing_mod.cluster_supported()
    assert clusters == (int(cupy.cuda.Device().compute_capability) >= 90)
    assert routing_mod.fused_cluster_size(m, clusters) == (min(-(-m // 4), 8) if clusters else 1)
    router = _router(method, e, k, renormalize=True)
    x = _device(_logits("ties", m, e, np.float32, rng))
    spread = route(x, router, out=_poisoned(m, e, k))
    monkeypatch.setattr(routing_mod, "cluster_supported", lambda: False)
    single = route(x, router, out=_poisoned(m, e, k))
    for name in (
        "topk_ids",
        "topk_weights",
        "expert_offsets",
        "sorted_rows",
        "inverse",
        "active_experts",
    ):
        a, b = getattr(spread, name).get(), getattr(single, name).get()
        assert np.array_equal(a.view(np.int32), b.view(np.int32)), name
    _check_routing(route_ref(x.get(), router), spread)


def _garbage_workspace(m: int, e: int, rng: np.random.Generator):
    cupy = pytest.importorskip("cupy")
    words = route_workspace_words(m, e) + 3
    return cupy.asarray(rng.integers(-(2**31), 2**31 - 1, words, dtype=np.int64).astype(np.int32))


# The two launches above 512 rows: tiles of 4, 32, 64 and 128 tokens (blocks of 4 or 32 warps,
# up to 4 tokens a warp), a last partial tile (65 tokens), 65 tiles (4,100 tokens: each block of
# maps_tiles_place sums 22 tiles per thread, two batches of loads), E = 32 (31 lanes per bucket),
# k = 1, E not a multiple of 32; past 128 tiles (20,000 tokens) the routing and maps launches.
TILE_SHAPES = [
    (256, 8, 65),
    (256, 8, 1000),
    (256, 8, 4100),
    (256, 8, 20000),
    (32, 4, 5000),
    (60, 6, 300),
    (8, 1, 600),
    (128, 2, 2000),
    (250, 8, 777),
]


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("e", "k", "m"), TILE_SHAPES)
def test_route_tiles_match_reference(
    e: int, k: int, m: int, method: RoutingMethod, rng: np.random.Generator
) -> None:
    dtype = (np.float32, BF16, np.float16)[(e + m) % 3]
    router = _router(method, e, k, renormalize=m % 2 == 0)
    x = _logits("ties" if m % 3 else "random", m, e, dtype, rng)
    out = route(_device(x), router, out=_poisoned(m, e, k), workspace=_garbage_workspace(m, e, rng))
    _check_routing(route_ref(x, router), out)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["inf", "nan", "equal"])
def test_route_tiles_edge_values(kind: str, rng: np.random.Generator) -> None:
    for method in METHODS:
        router = _router(method, 256, 8)
        x = _logits(kind, 200, 256, np.float32, rng)
        _check_routing(route_ref(x, router), route(_device(x), router))


@pytest.mark.gpu
def test_route_tiles_workspace_reused(rng: np.random.Generator) -> None:
    # One workspace and one set of buffers for calls of different sizes, larger and smaller,
    # each against the reference (nothing of an earlier call may leak into a later one); and
    # two calls with the same logits give the same bits.
    e, k = 256, 8
    work = _garbage_workspace(5000, e, rng)
    bufs = Routing.empty(5000, e, k)
    router = _router(RoutingMethod.SOFTMAX_TOPK, e, k)
    for m in (5000, 70, 3000, 65, 4096, 5000):
        x = _logits("random", m, e, BF16, rng)
        out = bufs.prefix(m)
        for a in (out.topk_ids, out.sorted_rows, out.inverse, out.active_experts):
            a.fill(-7)
        route(_device(x), router, out=out, workspace=work)
        _check_routing(route_ref(x, router), out)
    again = route(_device(x), router, out=Routing.empty(m, e, k), workspace=work)
    for name in ("topk_ids", "topk_weights", "expert_offsets", "sorted_rows", "inverse"):
        a, b = getattr(out, name).get(), getattr(again, name).get()
        assert np.array_equal(a.view(np.int32), b.view(np.int32)), name


@pytest.mark.gpu
def test_route_workspace_validation() -> None:
    cupy = pytest.importorskip("cupy")
    router = Router(256, 8)
    x = cupy.zeros((100, 256), np.float32)
    need = route_workspace_words(100, 256)
    with pytest.raises(TypeError, match="workspace"):
        route(x, router, workspace=np.zeros(need, np.int32))
    with pytest.raises(TypeError, match="workspace"):
        route(x, router, workspace=cupy.zeros((2, need), np.int32))
    with pytest.raises(TypeError, match="workspace"):
        route(x, router, workspace=cupy.zeros(need, np.float32))
    with pytest.raises(ValueError, match="workspace"):
        route(x, router, workspace=cupy.zeros(need - 1, np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "e", "k", "tiles"),
    [
        (4, 256, 8, False),
        (8, 256, 8, False),
        (64, 128, 4, False),
        (300, 256, 8, False),
        (300, 256, 8, True),
        (3000, 32, 4, True),
        (3, 512, 8, False),
    ],
)
def test_route_cuda_graph(m: int, e: int, k: int, tiles: bool, rng: np.random.Generator) -> None:
    cupy = pytest.importorskip("cupy")
    router = _router(RoutingMethod.SOFTMAX_TOPK, e, k)
    x = _logits("random", m, e, BF16, rng)
    xd = _device(x)
    out = Routing.empty(m + 5, e, k).prefix(m)
    work = cupy.empty(route_workspace_words(m + 5, e), np.int32) if tiles else None
    route(xd, router, out=out, workspace=work)  # warm-up: compile outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        route(xd, router, out=out, workspace=work)
        graph = stream.end_capture()
    for a in (out.topk_ids, out.sorted_rows, out.inverse):
        a.fill(-1)
    x2 = _logits("ties", m, e, BF16, rng)
    xd[...] = _device(x2)
    cupy.cuda.Device().synchronize()  # the copy ran on the null stream; the graph on `stream`
    graph.launch(stream)
    stream.synchronize()
    _check_routing(route_ref(x2, router), out)


# The one-block maps at 1, 3 and 32 warps (n / 32 rows each, the last warp's segment partial)
# and at the 4 warps that 2,048 experts leave room for; the tiled sort above the block's rows.
MAPS_SHAPES = [
    (1, 1, 1),
    (3, 5, 7),
    (64, 8, 256),
    (65, 1, 256),
    (97, 1, 256),
    (256, 8, 256),
    (257, 8, 128),
    (1024, 1, 2048),
    (700, 4, 1024),
    (3000, 8, 256),
    (2100, 1, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "k", "e"), MAPS_SHAPES)
def test_expert_maps_matches_reference(m: int, k: int, e: int, rng: np.random.Generator) -> None:
    ids = rng.integers(0, e, size=(m, k)).astype(np.int32)  # duplicates within tokens allowed
    if m * k > 3:  # a few experts hold most rows, as a skewed router gives
        ids[: m // 2] = rng.integers(0, min(e, 3), size=(m // 2, k))
    cupy = pytest.importorskip("cupy")
    n = m * k
    out = Routing(None, None, *(cupy.full(s, -7, np.int32) for s in (e + 1, n, n, min(n, e))))
    got = expert_maps(_device(ids), e, out=out)
    for name, r, o in zip(
        ("offsets", "sorted_rows", "inverse", "active"), expert_maps_ref(ids, e), got, strict=True
    ):
        assert_equal(r, o, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "k", "e"), [(5, 1, 8), (300, 8, 256), (1500, 8, 256)])
def test_expert_maps_place_invalid_ids_last(
    m: int, k: int, e: int, rng: np.random.Generator
) -> None:
    """Ids outside [0, E) (a corrupt router) are placed after every expert, in row order, and
    never counted in the offsets or the active list."""
    ids = rng.integers(0, e, size=(m, k)).astype(np.int32)
    bad = rng.random(ids.shape) < 0.1
    ids[bad] = rng.choice(np.array([-1, e, e + 5, -(2**31)], np.int32), size=int(bad.sum()))
    offsets, rows, inverse, active = (a.get() for a in expert_maps(_device(ids), e))
    valid = ~bad.reshape(-1)
    counts = np.bincount(ids.reshape(-1)[valid], minlength=e)
    assert_equal(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32), offsets, name="offsets")
    assert_equal(
        np.flatnonzero(counts).astype(np.int32), active[: np.count_nonzero(counts)], name="active"
    )
    assert np.all(active[np.count_nonzero(counts) :] == -1)
    assert_equal(np.flatnonzero(~valid).astype(np.int32), rows[offsets[e] :], name="invalid rows")
    assert_equal(np.arange(m * k, dtype=np.int32), rows[inverse], name="inverse")
    valid_rows = rows[: offsets[e]]  # each expert's rows in row order
    assert np.all(ids.reshape(-1)[valid_rows] == np.repeat(np.arange(e), counts))
    for lo, hi in zip(offsets[:-1], offsets[1:], strict=True):
        assert np.all(np.diff(rows[lo:hi]) > 0)


@pytest.mark.gpu
def test_route_validation_before_launch() -> None:
    cupy = pytest.importorskip("cupy")
    router = Router(8, 2)
    with pytest.raises(TypeError, match="logits"):
        route(np.zeros((2, 8), np.float32), router)
    with pytest.raises(TypeError, match="logits"):
        route(cupy.zeros((2, 8), np.float64), router)
    with pytest.raises(ValueError, match="logits"):
        route(cupy.zeros((2, 9), np.float32), router)
    with pytest.raises(ValueError, match="out.topk_ids"):
        route(cupy.zeros((2, 8), np.float32), router, out=Routing.empty(3, 8, 2))
    with pytest.raises(ValueError, match="n_experts"):
        route(cupy.zeros((1, 4096), np.float32), Router(4096, 2))
