# SPDX-License-Identifier: Apache-2.0
"""Grouped FP4 GEMM: the tile schedule's NumPy transcription and the tiling table (CPU); the
kernels against fc1_ref / fc2_ref and the GEMV, and the layer across the GEMV/GEMM hand-over
(GPU)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from cupymoe.experts import dispatch
from cupymoe.experts.activation import ActivationSpec
from cupymoe.experts.gemm import (
    GEMM_TILINGS,
    TILING_FOR_ROWS_PER_EXPERT,
    WGMMA_MIN_ROWS_PER_EXPERT,
    WGMMA_TILINGS,
    GemmConfig,
    WgmmaConfig,
    block_items,
    permute_split,
    row_tiles,
    schedule_ref,
    tile_rows,
)
from cupymoe.experts.layouts import WeightLayout, split_positions
from cupymoe.experts.reference import fc1_ref, fc2_ref
from cupymoe.presets import random_fp4_experts
from cupymoe.routing import Routing, expert_maps_ref
from cupymoe.testing import assert_close, tolerance_for

BF16 = np.dtype(ml_dtypes.bfloat16)


def _close(ref: Any, out: Any, dtype: Any, name: str, *, roundings: int = 1) -> None:
    """Within the dtype's tolerance per rounding to it (a layer rounds h and then out)."""
    max_rel, rms_rel = tolerance_for(dtype)
    assert_close(ref, out, max_rel=roundings * max_rel, rms_rel=roundings * rms_rel, name=name)


# ---- the schedule (CPU) ------------------------------------------------------------------------
def _maps(rng: np.random.Generator, m: int, k: int, e: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32)
    offsets, _, _, active = expert_maps_ref(ids, e)
    return offsets, active


@pytest.mark.parametrize(("m", "k", "e", "bn"), [(1, 1, 4, 16), (9, 8, 256, 16), (300, 4, 32, 32)])
def test_schedule_covers_every_row_once(
    rng: np.random.Generator, m: int, k: int, e: int, bn: int
) -> None:
    offsets, active = _maps(rng, m, k, e)
    col_blocks = 3
    items = schedule_ref(offsets, active, bn=bn, col_blocks=col_blocks)
    covered = np.zeros((m * k, col_blocks), np.int64)
    for expert, row0, rows, cb in items:
        assert 1 <= rows <= bn
        assert offsets[expert] <= row0 and row0 + rows <= offsets[expert + 1]
        covered[row0 : row0 + rows, cb] += 1
    np.testing.assert_array_equal(covered, 1)  # every (row, column block) exactly once
    # row tiles major: consecutive items share a row tile across the column blocks
    assert [it[3] for it in items[:col_blocks]] == list(range(col_blocks))
    assert len({it[:2] for it in items[:col_blocks]}) == 1


def test_row_tiles_counts_and_padding_slots() -> None:
    offsets = np.array([0, 3, 3, 40, 41])  # expert 1 has no rows
    active = np.array([0, 2, 3, -1])  # padded active list
    # bn 16: one width class, slot order
    assert row_tiles(offsets, active, 16) == [
        (0, 0, 3),
        (1, 0, 16),
        (1, 16, 16),
        (1, 32, 5),
        (2, 0, 1),
    ]
    items = schedule_ref(offsets, active, bn=16, col_blocks=1)
    assert items == [(0, 0, 3, 0), (2, 3, 16, 0), (2, 19, 16, 0), (2, 35, 5, 0), (3, 40, 1, 0)]


def test_row_tiles_widest_first() -> None:
    # rows per expert: 70 (64 + 6), 40 (one tile of width 64), 5, 128 (two full), 97 (64 + 33)
    offsets = np.cumsum([0, 70, 40, 5, 128, 97])
    active = np.array([0, 1, 2, 3, 4, -1])
    assert row_tiles(offsets, active, 64) == [
        (0, 0, 64),
        (1, 0, 40),
        (3, 0, 64),
        (3, 64, 64),
        (4, 0, 64),
        (4, 64, 33),  # width 64
        (0, 64, 6),
        (2, 0, 5),  # width 32, slot order
    ]
    # bn 128: widths 128, 96, 64, 32 -- 97 rows is class 0 (width 128), 70 and 40 class 2
    assert row_tiles(offsets, active, 128) == [
        (3, 0, 128),
        (4, 0, 97),
        (0, 0, 70),
        (1, 0, 40),
        (2, 0, 5),
    ]


def test_row_tiles_with_slack() -> None:
    # bn 144: tiles of 128 rows; a remainder of up to 16 joins the last full tile
    assert tile_rows(144) == (128, 16) and tile_rows(128) == (128, 0) and tile_rows(16) == (16, 0)
    offsets = np.cumsum([0, 130, 144, 145, 128, 100, 270, 300, 16])
    active = np.arange(8)
    assert row_tiles(offsets, active, 144) == [
        (0, 0, 130),  # 128 + 2: one tile, joined (a wider wgmma), first
        (1, 0, 144),  # 128 + 16: one tile
        (5, 128, 142),  # 256 + 14: the second tile takes the remainder
        (2, 0, 128),  # 128 + 17: a full tile and a narrow one (class 3, below)
        (3, 0, 128),
        (4, 0, 100),  # class 0: wider than 96
        (5, 0, 128),
        (6, 0, 128),
        (6, 128, 128),
        (6, 256, 44),  # class 2
        (2, 128, 17),  # class 3, slot order
        (7, 0, 16),
    ]
    items = schedule_ref(offsets, active, bn=144, col_blocks=2)
    covered = np.zeros(int(offsets[-1]), np.int64)
    for _, row0, rows, cb in items:
        assert 1 <= rows <= 144
        covered[row0 : row0 + rows] += cb == 1
    np.testing.assert_array_equal(covered, 1)


@pytest.mark.parametrize("bn", [64, 128, 144])
@pytest.mark.parametrize(("n_items", "grid"), [(1, 1), (5, 8), (8, 8), (100, 7), (1076, 132)])
def test_block_items_rounds(n_items: int, grid: int, bn: int) -> None:
    walks = [block_items(n_items, grid, b, bn=bn) for b in range(grid)]
    taken = sorted(i for walk in walks for i in walk)
    assert taken == list(range(n_items))  # every item once
    snake = bn == 144  # the tiling whose tiles take a remainder
    for b, walk in enumerate(walks):
        assert walk == sorted(walk)
        for r, index in enumerate(walk):  # round r: block order, reversed on odd rounds (bn 144)
            assert index == r * grid + (grid - 1 - b if snake and r % 2 else b)
    # over items of descending cost the two ends of the grid take equal sums within two rounds
    if n_items >= 2 * grid:
        cost = np.arange(n_items)[::-1]
        first, last = cost[walks[0][:2]].sum(), cost[walks[-1][:2]].sum()
        assert (first == last) == snake


@pytest.mark.parametrize("bn", [64, 128])
def test_schedule_widths_never_grow(rng: np.random.Generator, bn: int) -> None:
    offsets, active = _maps(rng, 1000, 8, 64)  # about 125 rows per expert: every width occurs
    widths = [min(bn, -(-rows // 32) * 32) for _, _, rows in row_tiles(offsets, active, bn)]
    assert widths == sorted(widths, reverse=True)
    assert set(widths) >= {bn, 32}
    items = schedule_ref(offsets, active, bn=bn, col_blocks=2)
    covered = np.zeros(1000 * 8, np.int64)
    for _, row0, rows, cb in items:
        covered[row0 : row0 + rows] += cb == 0
    np.testing.assert_array_equal(covered, 1)


def test_gemm_config_table() -> None:
    with pytest.raises(ValueError, match="not compiled"):
        GemmConfig(4, 1, 2, 3, 4)
    with pytest.raises(TypeError, match="nt"):
        GemmConfig(4, 1, 2, 2.0, 4)  # type: ignore[arg-type]
    assert GemmConfig.for_rows(16 * 8, 256).key == TILING_FOR_ROWS_PER_EXPERT[0][1]
    assert GemmConfig.for_rows(1024 * 8, 256).key == TILING_FOR_ROWS_PER_EXPERT[1][1]
    assert GemmConfig.for_rows(4096 * 4, 32).key == GEMM_TILINGS[-1]
    # sm_89 / sm_120 blocks get 99 KB: the bn 128 tiling does not fit, the widest that does serves
    narrow = GemmConfig.for_rows(4096 * 4, 32, max_shared=99 * 1024)
    assert narrow.key == GEMM_TILINGS[1] and narrow.shared_bytes(0, 32) <= 99 * 1024
    assert GemmConfig.for_rows(4096 * 4, 32, max_shared=227 * 1024).key == GEMM_TILINGS[-1]
    with pytest.raises(ValueError, match="max_shared"):
        GemmConfig.for_rows(64, 8, max_shared=1024)
    for tiling in GEMM_TILINGS:  # every tiling fits the 227 KB a Hopper block may have
        cfg = GemmConfig(*tiling)
        assert cfg.shared_bytes(0, 2048) <= 227 * 1024
        assert cfg.bn == 8 * cfg.warps_n * cfg.nt


def test_wgmma_config_table() -> None:
    with pytest.raises(ValueError, match="not compiled"):
        WgmmaConfig(48, 4)
    with pytest.raises(ValueError, match="not compiled"):
        WgmmaConfig(64, 6)
    with pytest.raises(ValueError, match="not compiled"):
        WgmmaConfig(64, 5, 2)
    with pytest.raises(TypeError, match="bn"):
        WgmmaConfig(True, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="groups"):
        WgmmaConfig(64, 5, 4.0)  # type: ignore[arg-type]
    assert WgmmaConfig(128, 4) == WgmmaConfig(128, 4, 2)  # two consumer groups unless named
    assert 4 <= WGMMA_MIN_ROWS_PER_EXPERT < 16  # between the measured ties and wins
    # wgmma_tiling: the narrow tiling first, then bn 128 and bn 144 (bn 128 with 16 rows of slack)
    assert [t[0] for t in WGMMA_TILINGS] == [64, 128, 144]
    for tiling in WGMMA_TILINGS:  # one block per SM within the 227 KB of a Hopper block
        cfg = WgmmaConfig(*tiling)
        for fmt in (0, 1):  # a layer of 1,024 experts fits (bn 128: up to 1,384, bn 64: 6,502)
            assert cfg.shared_bytes(fmt, 1024) + cfg.static_bytes <= 227 * 1024
        assert cfg.shared_bytes(0, 1384) + cfg.static_bytes <= 227 * 1024
        assert cfg.threads == 128 * (1 + cfg.groups) and cfg.m_tiles == 16
        assert cfg.m_tiles % (4 * cfg.groups) == 0  # whole m-tiles per consumer warp


def test_default_config_leaves_wgmma_where_its_shared_memory_does_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cupymoe.experts import gemm

    monkeypatch.setattr(gemm, "compute_capability", lambda: 90)
    monkeypatch.setattr(gemm, "max_shared_per_block", lambda: 227 * 1024)
    monkeypatch.delenv(gemm.ENV_WGMMA, raising=False)
    wgmma, wide = WgmmaConfig(*WGMMA_TILINGS[2]), WgmmaConfig(*WGMMA_TILINGS[1])
    assert gemm.default_config(256 * 128, 256, 0) == wgmma
    # bn 64 up to its limit of rows per expert, bn 144 within its window, bn 128 around it
    narrow, limit = WgmmaConfig(*WGMMA_TILINGS[0]), gemm.WGMMA_NARROW_MAX_ROWS_PER_EXPERT
    low, high = (int(b) for b in gemm.WGMMA_SLACK_ROWS_PER_EXPERT)
    assert gemm.default_config(256 * limit, 256, 0) == narrow
    assert gemm.default_config(256 * limit + 1, 256, 0) == wide
    assert gemm.default_config(256 * low, 256, 0) == wide
    assert gemm.default_config(256 * low + 1, 256, 0) == wgmma
    assert gemm.default_config(256 * high, 256, 0) == wgmma
    assert gemm.default_config(256 * high + 1, 256, 0) == wide
    assert gemm.default_config(256 * 9, 256, 0, wgmma_min=8) == narrow
    assert isinstance(gemm.default_config(256 * 8, 256, 0, wgmma_min=8), GemmConfig)

    def largest_fit(cfg: WgmmaConfig) -> int:
        return max(
            s for s in range(1, 1 << 15) if cfg.shared_bytes(0, s) + cfg.static_bytes <= 227 * 1024
        )

    big = largest_fit(narrow) + 1
    assert isinstance(gemm.default_config(big * 16, big, 0), GemmConfig)
    # the largest expert count whose row-tile table fits beside the stages, and one more
    fits = largest_fit(wgmma)
    assert fits >= 1024  # every expert count in use (DeepSeek-V3 256, Kimi K2 384)
    assert gemm.default_config(fits * 128, fits, 0) == wgmma
    assert isinstance(gemm.default_config((fits + 1) * 128, fits + 1, 0), GemmConfig)
    assert isinstance(gemm.default_config(256 * 128, 256, 0, wgmma_min=128), GemmConfig)


def test_wgmma_refuses_x_it_cannot_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from cupymoe.experts import gemm

    monkeypatch.setattr(gemm, "wgmma_enabled", lambda: True)
    cfg = WgmmaConfig(*WGMMA_TILINGS[2])
    gemm._check_runs_here(cfg, SimpleNamespace(shape=(2**22, 8 * 1023)))  # 2^32 - 2^22 pieces
    with pytest.raises(ValueError, match="64 GB"):
        gemm._check_runs_here(cfg, SimpleNamespace(shape=(2**22, 8 * 1024)))
    gemm._check_runs_here(GemmConfig(*GEMM_TILINGS[0]), SimpleNamespace(shape=(2**22, 8 * 1024)))
    with pytest.raises(ValueError, match="K >= 1"):
        gemm._check_runs_here(cfg, SimpleNamespace(shape=(16, 0)))


def test_wgmma_specs_target_sm90a() -> None:
    from cupymoe._runtime.offline import target_arch
    from cupymoe.experts.gemm import kernel_specs

    wgmma = [s for s in kernel_specs() if s.stage == "gemm_sm90"]
    permutes = [s for s in wgmma if s.name == "permute_split"]
    assert len(wgmma) == 2 * 2 * 2 * 8 * len(WGMMA_TILINGS) + 2  # FC2 + 7 FC1 activations
    assert sorted(s.args for s in permutes) == [("__half",), ("__nv_bfloat16",)]
    assert {s.target for s in wgmma} == {"sm_90a"}
    assert {target_arch(s, "sm_90") for s in wgmma} == {"sm_90a"}
    assert {target_arch(s, "sm_80") for s in wgmma} == {None}


def test_backend_rule() -> None:
    gemv, gemm = dispatch.Backend.GEMV, dispatch.Backend.GEMM
    split = WeightLayout.SPLIT
    assert dispatch.backend_for(64, 0, layout=split, n_experts=256) is gemv
    # the default hand-over (8 rows per expert; the presets' own rows hand over at 4), E 256:
    # 8 rows per expert stays on the GEMV, 9 per expert does not
    assert dispatch.backend_for(2048, 0, layout=split, n_experts=256) is gemv
    assert dispatch.backend_for(2049 + 255, 0, layout=split, n_experts=256) is gemm
    assert dispatch.backend_for(10**6, 0, layout=WeightLayout.PAIR, n_experts=8) is gemv
    assert dispatch.backend_for(8, None, layout=split, n_experts=8) is dispatch.Backend.BATCHED
    assert dispatch.capturable(0) and not dispatch.capturable(None)


# ---- kernels against the references (GPU) ------------------------------------------------------
def _device_routing(ids: np.ndarray, e: int) -> Routing:
    import cupy

    m, k = ids.shape
    fields = [ids, np.full((m, k), 1.0 / k, np.float32), *expert_maps_ref(ids, e)]
    return Routing(*[cupy.asarray(a) for a in fields])


def _random_ids(rng: np.random.Generator, m: int, k: int, e: int) -> np.ndarray:
    return np.argsort(rng.random((m, e)), axis=1)[:, :k].astype(np.int32)


CASES = [
    # (fmt, dtype, E, H, I, M, k, activation, bias, ids): N and K tails (I = 112: 14 column tiles
    # of 8, K of FC2 = 3.5 chunks; H = 336: FC2 N = 21 tiles of 16, FC1 K = 2.6 stages)
    ("nvfp4", BF16, 8, 336, 112, 40, 2, "swiglu", False, "random"),
    ("mxfp4", BF16, 8, 352, 160, 50, 2, "swiglu_oai", True, "random"),
    ("nvfp4", np.float16, 8, 256, 96, 33, 2, "geglu", True, "random"),
    ("mxfp4", np.float16, 6, 320, 64, 70, 3, "swiglu", False, "random"),
    ("nvfp4", BF16, 16, 256, 128, 200, 4, "swiglu", False, "same"),  # one expert set: every row
    ("nvfp4", BF16, 4, 256, 128, 1024, 4, "swiglu", True, "all"),  # every expert active
    ("nvfp4", BF16, 64, 512, 256, 9, 8, "swiglu", False, "random"),  # experts with zero rows
    # every wgmma K-loop width at and above its edge (8 / 16 / 32 / 48 / 64 / 128 / 144;
    # _EDGE_ROWS) (I = 192: FC1's last column block half full, FC2's K 1.5 stages)
    ("nvfp4", BF16, 24, 256, 192, 1557, 1, "swiglu", True, "edges"),
]

#: Rows per expert of the "edges" case: each K-loop width of the wgmma kernel (8, 16, 32, 48, 64,
#: 128 rows; the last, partial tile of an expert) at and one above its edge, 15 and 31 below two
#: of them, 40 and 41 (one or two n8 blocks in the width-48 loop's last 16-row chunk), one row,
#: and idle experts; bn 144's slack (a remainder of up to 16 rows joins the tile before it: 143,
#: 144 and 272 rows, not 145).
_EDGE_ROWS = (1, 8, 9, 15, 16, 17, 31, 32, 33, 0, 40, 41, 48, 49, 64, 65, 127, 128, 129, 0, 143,
              144, 145, 272)  # fmt: skip


def _case_ids(rng: np.random.Generator, kind: str, m: int, k: int, e: int) -> np.ndarray:
    if kind == "same":
        return np.tile(np.arange(k, dtype=np.int32)[::-1], (m, 1))
    if kind == "all":
        return np.tile(np.arange(k, dtype=np.int32), (m, 1)) % e
    if kind == "edges":
        assert k == 1 and e == len(_EDGE_ROWS) and m == sum(_EDGE_ROWS)
        ids = np.repeat(np.arange(e, dtype=np.int32), _EDGE_ROWS)
        return rng.permutation(ids).reshape(m, 1)
    return _random_ids(rng, m, k, e)


def _tiling_id(tiling: tuple[Any, ...] | None) -> str:
    return "auto" if tiling is None else "x".join(map(str, tiling))


def _config(tiling: tuple[Any, ...] | None) -> GemmConfig | WgmmaConfig | None:
    """None (the default), a GemmConfig, or a WgmmaConfig for ("wgmma", bn, stages); skips the
    wgmma tilings where the device cannot run them (anything but compute capability 9.0)."""
    if tiling is None:
        return None
    if tiling[0] != "wgmma":
        return GemmConfig(*tiling)
    from cupymoe.experts.gemm import wgmma_enabled

    if not wgmma_enabled():
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")
    return WgmmaConfig(*tiling[1:])


TILINGS = [None, *GEMM_TILINGS, *(("wgmma", *t) for t in WGMMA_TILINGS)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{np.dtype(c[1]).name}-{c[-1]}")
@pytest.mark.parametrize("tiling", TILINGS, ids=_tiling_id)
def test_gemm_matches_references(
    rng: np.random.Generator, case: tuple[Any, ...], tiling: tuple[Any, ...] | None
) -> None:
    import cupy

    from cupymoe.experts.gemm import gemm_fc1, gemm_fc2
    from cupymoe.experts.gemv import prepare_fc1, prepare_fc2, scale_shift

    fmt, dtype, e, h, i, m, k, act_name, bias, kind = case
    dtype = np.dtype(dtype)
    gate, up = (random_fp4_experts(rng, e, i, h, fmt) for _ in range(2))
    down = random_fp4_experts(rng, e, h, i, fmt)
    biases = [rng.standard_normal(s).astype(np.float32) if bias else None for s in ((e, i),) * 2]
    fc2_bias = rng.standard_normal((e, h)).astype(np.float32) if bias else None
    w1 = prepare_fc1(gate, up, gate_bias=biases[0], up_bias=biases[1])
    w2 = prepare_fc2(down, bias=fc2_bias)
    act = ActivationSpec(act_name)
    ids = _case_ids(rng, kind, m, k, e)
    routing = _device_routing(ids, e)
    cfg = _config(tiling)
    x = rng.standard_normal((m, h)).astype(dtype)

    def run_fc1(permuted_h: bool = False, permuted_x: bool = False) -> Any:
        out = cupy.full((m * k, i), np.nan, dtype)  # poisoned: every element must be written
        shift = scale_shift(w1, dtype)
        gemm_fc1(
            permute_split(cupy.asarray(x)) if permuted_x else cupy.asarray(x),
            w1,
            routing,
            act=act,
            top_k=k,
            shift=shift,
            out=out,
            config=cfg,
            permuted_h=permuted_h,
            permuted_x=permuted_x,
        )
        return out

    h_out = run_fc1()
    offsets, rows, _, _ = expert_maps_ref(ids, e)
    ref1 = fc1_ref(x[rows // k], gate, up, offsets, act=act, gate_bias=biases[0], up_bias=biases[1])
    _close(ref1, h_out, dtype, "fc1")
    hin = rng.standard_normal((m * k, i)).astype(dtype)
    y = cupy.full((m * k, h), np.nan, dtype)
    gemm_fc2(cupy.asarray(hin), w2, routing, shift=scale_shift(w2, dtype), out=y, config=cfg)
    _close(fc2_ref(hin, down, offsets, bias=fc2_bias), y, dtype, "fc2")
    # bitwise deterministic over repeated calls
    again = cupy.full_like(y, np.nan)
    gemm_fc2(cupy.asarray(hin), w2, routing, shift=scale_shift(w2, dtype), out=again, config=cfg)
    assert bool((again.view(np.uint16) == y.view(np.uint16)).all())
    if isinstance(cfg, WgmmaConfig):  # h in the split k order between the wgmma stages
        pos = cupy.asarray(split_positions(i))
        h_perm = run_fc1(permuted_h=True)
        assert bool((h_perm[:, pos].view(np.uint16) == h_out.view(np.uint16)).all()), "fc1"
        h_from_split = run_fc1(permuted_x=True)  # x in the split order: the same h
        assert bool((h_from_split.view(np.uint16) == h_out.view(np.uint16)).all()), "fc1 x"
        hin_perm = cupy.empty_like(y[:, :i])
        hin_perm[:, pos] = cupy.asarray(hin)
        y_perm = cupy.full_like(y, np.nan)
        shift2 = scale_shift(w2, dtype)
        gemm_fc2(hin_perm, w2, routing, shift=shift2, out=y_perm, config=cfg, permuted_h=True)
        assert bool((y_perm.view(np.uint16) == y.view(np.uint16)).all()), "fc2"


@pytest.mark.gpu
@pytest.mark.parametrize("act_name", ["relu", "identity", "silu", "gelu"])
@pytest.mark.parametrize("tiling", TILINGS[1:], ids=_tiling_id)
def test_gemm_non_gated_fc1_at_every_width(
    rng: np.random.Generator, act_name: str, tiling: tuple[Any, ...]
) -> None:
    """The non-gated FC1 (one matrix, FC2's tiles, FC1's token-order rows) through every K-loop
    width: relu, identity and silu take the wgmma kernel's width-8 and width-16 loops at 1-16 rows
    per expert (four consumer groups), gelu keeps the width-32 loop there; the "edges" rows, N and K
    tails (I = 112: 7 m-tiles of 16; H = 336: 2.6 stages), bias, and x in the split order."""
    import cupy

    from cupymoe.experts.gemm import gemm_fc1_single
    from cupymoe.experts.gemv import prepare_fc2, scale_shift

    e, h, i, k = len(_EDGE_ROWS), 336, 112, 1
    m = sum(_EDGE_ROWS)
    w = random_fp4_experts(rng, e, i, h, "nvfp4")
    bias = rng.standard_normal((e, i)).astype(np.float32)
    prepared = prepare_fc2(w, bias=bias)
    act = ActivationSpec(act_name)
    ids = _case_ids(rng, "edges", m, k, e)
    routing = _device_routing(ids, e)
    cfg = _config(tiling)
    x = rng.standard_normal((m, h)).astype(BF16)
    offsets, rows, _, _ = expert_maps_ref(ids, e)
    ref = fc1_ref(x[rows // k], w, None, offsets, act=act, gate_bias=bias)
    shift = scale_shift(prepared, BF16)
    permuted = [False, True] if isinstance(cfg, WgmmaConfig) else [False]
    outs = []
    for permuted_x in permuted:
        out = cupy.full((m * k, i), np.nan, BF16)  # poisoned: every element must be written
        xin = permute_split(cupy.asarray(x)) if permuted_x else cupy.asarray(x)
        gemm_fc1_single(xin, prepared, routing, act=act, top_k=k, shift=shift, out=out,
                        config=cfg, permuted_x=permuted_x)  # fmt: skip
        _close(ref, out, BF16, f"fc1 {act_name} permuted_x={permuted_x}")
        outs.append(out.view(np.uint16))
    assert all(bool((o == outs[0]).all()) for o in outs[1:]), "x in the split order: the same h"


@pytest.mark.gpu
def test_gemm_and_gemv_agree_on_both_sides_of_the_hand_over(rng: np.random.Generator) -> None:
    """The layer across the GEMV/GEMM boundary: one row below, at and above it, against the
    reference; the GEMM result equals its graph replay bitwise."""
    import cupymoe as cm

    e, h, i, k = 16, 256, 128, 2
    gate, up = (random_fp4_experts(rng, e, i, h, "nvfp4") for _ in range(2))
    down = random_fp4_experts(rng, e, h, i, "nvfp4")
    layer = cm.MoELayer((gate, up), down, top_k=k, max_tokens=200)
    limit = dispatch.GEMV_MAX_ROWS_PER_EXPERT * e // k  # 64 tokens: 8 rows for every expert
    for m, want in ((limit - 1, "gemv"), (limit, "gemv"), (limit + 1, "gemm"), (199, "gemm")):
        got = dispatch.backend_for(m * k, 0, layout=WeightLayout.SPLIT, n_experts=e)
        assert got is dispatch.Backend(want)
        x = rng.standard_normal((m, h)).astype(BF16)
        logits = rng.standard_normal((m, e)).astype(np.float32)
        _close(cm.moe_reference(x, logits, layer), layer(x, logits), BF16, f"M={m}", roundings=2)
    import cupy

    m = 150
    x = cupy.asarray(rng.standard_normal((m, h)).astype(BF16))
    logits = cupy.asarray(rng.standard_normal((m, e)).astype(np.float32))
    eager = layer(x, logits)
    graph = layer.graph(m)
    with graph.stream:
        graph.x[...] = x
        graph.logits[0][...] = logits
    graph.replay()
    graph.stream.synchronize()
    assert bool((graph.out.view(np.uint16) == eager.view(np.uint16)).all())


def _both_sides(limit: float, e: int, k: int) -> list[int]:
    """Token counts of ``limit - 1``, ``limit`` and ``limit + 1`` average rows per active expert
    (``m * k >= e``: every count is the average over all ``e`` experts)."""
    return [max(1, round((limit + d) * e / k)) for d in (-1, 0, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fc1", "fc2"])
def test_backends_agree_at_the_hand_overs(
    rng: np.random.Generator, op: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One row per expert either side of each threshold of the shape's analytic hand-over
    (:func:`.handover.hand_over_for`): the GEMV and the grouped GEMM, then the mma.sync tiling
    and each wgmma tiling, against the reference and against each other; with an empty tuning
    cache the automatic call picks the side of each threshold its rows are on, and gives
    bitwise what its chosen backend gives."""
    import cupy

    from cupymoe._runtime.device import max_shared_per_block
    from cupymoe.experts import cache, handover
    from cupymoe.experts.gemm import wgmma_enabled
    from cupymoe.experts.gemv import prepare_fc1, prepare_fc2, scale_shift

    e, h, i, k = 16, 256, 128, 4
    act = ActivationSpec("swiglu")
    if op == "fc1":
        gate, up = (random_fp4_experts(rng, e, i, h, "nvfp4") for _ in range(2))
        weights: Any = prepare_fc1(gate, up)
        n, kk = i, h
    else:
        down = random_fp4_experts(rng, e, h, i, "nvfp4")
        weights = prepare_fc2(down)
        n, kk = h, i
    hand = handover.hand_over_for(op, n, kk, e)
    # an empty tuning cache, the analytic rule (the kernel cache, under the same base, stays)
    monkeypatch.setattr(cache, "_default_file", lambda: str(tmp_path / "gemv_tune.json"))

    def run(ids: np.ndarray, x: np.ndarray, **kw: Any) -> Any:
        routing = _device_routing(ids, e)
        if op == "fc1":
            return dispatch.fc1(cupy.asarray(x), weights, routing, act=act, **kw)
        return dispatch.fc2(cupy.asarray(x), weights, routing, **kw)

    def reference(ids: np.ndarray, x: np.ndarray) -> np.ndarray:
        offsets, rows, _, _ = expert_maps_ref(ids, e)
        if op == "fc1":
            return fc1_ref(x[rows // k], gate, up, offsets, act=act)
        return fc2_ref(x, down, offsets)

    backends = dispatch.Backend
    wgmmas = [WgmmaConfig(*t) for t in WGMMA_TILINGS] if wgmma_enabled() else []
    for limit, pair in ((hand.gemv_max, "gemv/gemm"), (hand.wgmma_min, "mma/wgmma")):
        for m in _both_sides(limit, e, k):
            ids = _random_ids(rng, m, k, e)
            x = rng.standard_normal((m if op == "fc1" else m * k, kk)).astype(BF16)
            ref = reference(ids, x)
            if pair == "gemv/gemm":
                outs = {"gemv": run(ids, x, backend=backends.GEMV)}
                outs["gemm"] = run(ids, x, backend=backends.GEMM)
            else:
                mma = GemmConfig.for_rows(m * k, e, max_shared=max_shared_per_block())
                outs = {"mma": run(ids, x, config=mma)}
                for wgmma in wgmmas:  # each tiling the analytic rule may pick there
                    outs[f"wgmma bn {wgmma.bn}"] = run(ids, x, config=wgmma)
            for name, out in outs.items():
                _close(ref, out, BF16, f"{op} {name} M={m} ({m * k / e:g} rows per expert)")
            first, *others = outs.values()
            for other in others:  # the two sides of the hand-over agree with each other
                _close(first, other, BF16, f"{op} {pair} M={m}", roundings=2)
            # the automatic choice runs exactly one of the two
            shift = scale_shift(weights, BF16)
            chosen, config = handover.choose(weights, m * k, BF16, shift)
            per_expert = m * k / min(m * k, e)
            gemv_side = per_expert <= hand.gemv_max
            assert chosen is (backends.GEMV if gemv_side else backends.GEMM), (op, m, chosen)
            if not gemv_side:
                wgmma_side = per_expert > hand.wgmma_min and bool(wgmmas)
                assert isinstance(config, WgmmaConfig if wgmma_side else GemmConfig), (m, config)
            auto = run(ids, x)
            again = run(ids, x, backend=chosen, config=config)
            assert bool((auto.view(np.uint16) == again.view(np.uint16)).all())


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("preset", "m"),
    [
        ("qwen3.6-35b-a3b", 65),
        ("qwen3.6-35b-a3b", 1024),
        ("gpt-oss-20b", 9),
        ("gpt-oss-20b", 65),
        ("gpt-oss-20b", 256),
    ],
)
def test_preset_shapes_above_the_window(rng: np.random.Generator, preset: str, m: int) -> None:
    import cupymoe as cm
    from cupymoe.presets import PRESETS, random_layer

    shape = PRESETS[preset]
    layer = cm.MoELayer(**random_layer(shape, rng, max_tokens=m))
    x = rng.standard_normal((m, shape.hidden)).astype(BF16)
    logits = rng.standard_normal((m, shape.n_experts)).astype(np.float32)
    _close(cm.moe_reference(x, logits, layer), layer(x, logits), BF16, preset, roundings=2)


@pytest.mark.gpu
def test_resident_bytes_are_the_format_bytes(rng: np.random.Generator) -> None:
    """One copy of the weights: codes and scales once (N a multiple of 16, K of 32: no padding)."""
    import cupymoe as cm

    e, h, i = 4, 256, 128
    gate, up = (random_fp4_experts(rng, e, i, h, "nvfp4") for _ in range(2))
    down = random_fp4_experts(rng, e, h, i, "nvfp4")
    layer = cm.MoELayer((gate, up), down, top_k=2, max_tokens=8)
    fmt_bytes = sum(
        w.packed.nbytes + w.scales.nbytes + w.global_scale.nbytes for w in (gate, up, down)
    )
    assert layer.resident_bytes == fmt_bytes


# ---- one resident copy: the inverse layouts (CPU) ----------------------------------------------
@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize(("n", "k", "rows"), [(40, 96, 8), (33, 352, 16), (16, 64, 16)])
def test_packed_from_layout_inverts_gemv_layout(
    rng: np.random.Generator, pair: bool, n: int, k: int, rows: int
) -> None:
    from cupymoe.experts import layouts
    from cupymoe.formats.codes import to_pair_interleaved

    packed = rng.integers(0, 256, (3, n, k // 2), dtype=np.uint8)
    uploaded = to_pair_interleaved(packed) if pair else packed
    tiled = layouts.gemv_layout(uploaded, k, pair, rows)
    np.testing.assert_array_equal(layouts.packed_from_layout(tiled, n, k), packed)
    back = layouts.packed_from_layout(tiled, n, k, pair_interleaved=pair)
    np.testing.assert_array_equal(back, uploaded)
    words = rng.integers(0, 2**32, (5, 7), dtype=np.uint64).astype(np.uint32)
    np.testing.assert_array_equal(
        layouts.unsplit_words(layouts.split_words(words, pair), pair), words
    )


@pytest.mark.parametrize(
    ("block", "matrices", "n"), [(16, 2, 37), (32, 2, 8), (16, 1, 45), (32, 1, 16)]
)
def test_scales_from_tiles_inverts_tile_scales(
    rng: np.random.Generator, block: int, matrices: int, n: int
) -> None:
    from cupymoe.experts import layouts

    k = 224  # 7 chunks: a partial last chunk for NVFP4's two blocks per chunk
    scales = [rng.integers(0, 256, (3, n, k // block), dtype=np.uint8) for _ in range(matrices)]
    tiled = layouts.tile_scales(scales, k, block)
    for want, got in zip(
        scales, layouts.scales_from_tiles(tiled, n, k, block, matrices), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_backend_override_errors() -> None:
    from cupymoe.experts.config import GemvConfig

    gemv_cfg, gemm_cfg = GemvConfig(16, 128), GemmConfig(*GEMM_TILINGS[0])
    auto = dispatch.Backend.GEMM
    assert dispatch._choose(None, gemv_cfg, auto)[0] is dispatch.Backend.GEMV  # config decides
    wg = WgmmaConfig(*WGMMA_TILINGS[0])
    assert dispatch._choose(dispatch.Backend.GEMM, wg, dispatch.Backend.GEMV)[2] is wg
    assert dispatch._choose(None, None, auto)[0] is auto
    assert dispatch._choose(dispatch.Backend.GEMV, None, auto)[0] is dispatch.Backend.GEMV
    with pytest.raises(ValueError, match="tiles the gemm backend"):
        dispatch._choose(dispatch.Backend.GEMV, gemm_cfg, auto)
    with pytest.raises(ValueError, match="only the batched"):
        dispatch._choose(dispatch.Backend.GEMM, None, dispatch.Backend.BATCHED)
    with pytest.raises(TypeError, match="backend"):
        dispatch._choose("gemv", None, auto)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        dispatch._choose(None, (16, 128), auto)


def _split_order_by_the_producer(n: int) -> np.ndarray:
    """The wgmma producer's register path, transcribed: lane group q loads the 8-element pieces
    32t + 8q (t = 0..3) of a stage and stores word c of piece t as word t of logical chunk
    4 (q % 2) + c of half q // 2. Returns, per column, the position it is stored at."""
    pos = np.arange(n)
    for s0 in range(0, n // 128 * 128, 128):
        for q in range(4):
            for t in range(4):
                for c in range(4):
                    for e in range(2):
                        col = s0 + 32 * t + 8 * q + 2 * c + e
                        pos[col] = s0 + 64 * (q // 2) + 8 * (4 * (q % 2) + c) + 2 * t + e
    return pos


@pytest.mark.parametrize("n", [0, 64, 128, 160, 512, 2880])
def test_split_positions_are_the_producers_b_order(n: int) -> None:
    """FC1's permuted h puts each column where the FC2 producer used to store it, a bijection
    per whole stage; a last partial stage stays in place."""
    pos = split_positions(n)
    assert np.array_equal(pos, _split_order_by_the_producer(n))
    assert np.array_equal(np.sort(pos), np.arange(n))
    tail = n // 128 * 128
    assert np.array_equal(pos[tail:], np.arange(tail, n))
    with pytest.raises(ValueError, match="n: expected an int >= 0"):
        split_positions(-1)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("inter", [128, 256])
def test_wgmma_epilogue_copies_rows_that_are_not_16_byte_aligned(
    rng: np.random.Generator, fmt: str, inter: int
) -> None:
    """The wgmma epilogue copies staged rows out 16 bytes at a time only where every row starts
    16-byte aligned: FC1 at n = 100 (200-byte rows) and FC2 into an ``out`` that starts 2 bytes
    past an allocation take the element-wise copy; both against the references, NaN-poisoned.
    FC2's K of one and of two stages (``inter``): items of a single stage and of several."""
    import cupy

    from cupymoe.experts.gemm import gemm_fc1, gemm_fc2, wgmma_enabled
    from cupymoe.experts.gemv import prepare_fc1, prepare_fc2, scale_shift

    if not wgmma_enabled():
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")
    e, h, i, m, k = 4, 256, 100, 300, 2  # 150 rows per expert: a full and a partial row tile
    gate, up = (random_fp4_experts(rng, e, i, h, fmt) for _ in range(2))
    down = random_fp4_experts(rng, e, h, inter, fmt)
    w1, w2 = prepare_fc1(gate, up), prepare_fc2(down)
    ids = _random_ids(rng, m, k, e)
    routing = _device_routing(ids, e)
    offsets, rows, _, _ = expert_maps_ref(ids, e)
    cfg = WgmmaConfig(*WGMMA_TILINGS[1])
    x = rng.standard_normal((m, h)).astype(BF16)
    out = cupy.full((m * k, i), np.nan, BF16)
    gemm_fc1(
        cupy.asarray(x),
        w1,
        routing,
        act=ActivationSpec("swiglu"),
        top_k=k,
        shift=scale_shift(w1, BF16),
        out=out,
        config=cfg,
    )
    _close(fc1_ref(x[rows // k], gate, up, offsets, act=ActivationSpec("swiglu")), out, BF16, "fc1")
    hin = rng.standard_normal((m * k, inter)).astype(BF16)
    flat = cupy.full(m * k * h + 1, np.nan, BF16)
    y = flat[1:].reshape(m * k, h)  # 2 bytes past the allocation's 256-byte alignment
    assert y.data.ptr % 16 == 2
    gemm_fc2(cupy.asarray(hin), w2, routing, shift=scale_shift(w2, BF16), out=y, config=cfg)
    _close(fc2_ref(hin, down, offsets), y, BF16, "fc2")
    assert bool(cupy.isnan(flat[0]))  # nothing written before out


def test_permuted_h_needs_the_wgmma_kernel(rng: np.random.Generator) -> None:
    """permuted_h on a call that resolves to another backend is a ValueError before any kernel
    (here on the CPU: the checks come before the launch)."""
    from cupymoe.experts import dispatch, gemm
    from cupymoe.experts.dispatch import Backend

    mma, wg = GemmConfig(*GEMM_TILINGS[0]), WgmmaConfig(*WGMMA_TILINGS[0])
    with pytest.raises(ValueError, match="permuted_h: only the wgmma kernel"):
        gemm._check_permuted(mma, True)
    with pytest.raises(ValueError, match="permuted_x: only the wgmma kernel"):
        gemm._check_permuted(mma, False, True)
    gemm._check_permuted(mma, False, False)
    gemm._check_permuted(wg, True, True)
    with pytest.raises(ValueError, match="permuted_h: only the wgmma GEMM .* runs the gemv"):
        dispatch._check_permuted(Backend.GEMV, None, permuted_h=True)
    with pytest.raises(ValueError, match="permuted_x: .* runs the mma.sync GEMM"):
        dispatch._check_permuted(Backend.GEMM, mma, permuted_h=False, permuted_x=True)
    dispatch._check_permuted(Backend.GEMM, wg, permuted_h=True, permuted_x=True)
    assert gemm._permuted_args(mma, False, True) == ()
    assert gemm._permuted_args(wg, True) == (np.int32(1),)  # FC2: permuted_h only
    assert gemm._permuted_args(wg, False, True) == (np.int32(0), np.int32(1))
    with pytest.raises(ValueError, match="multiple of 8"):
        gemm.permute_split(np.zeros((2, 12), np.float16))
    with pytest.raises(TypeError, match="expected a cupy.ndarray"):
        gemm.permute_split(np.zeros((2, 16), np.float16))
    with pytest.raises(TypeError, match="2-D"):
        gemm.permute_split([[0.0] * 16])


def test_permutes_h_asks_both_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer passes h in the split order only where FC1 and FC2 both take the wgmma GEMM."""
    from cupymoe.experts import dispatch
    from cupymoe.experts.dispatch import Backend

    wg, mma = WgmmaConfig(*WGMMA_TILINGS[0]), GemmConfig(*GEMM_TILINGS[0])
    monkeypatch.setattr(dispatch, "scale_shift", lambda w, dtype: 0)
    for picks, want in (
        ({"a": (Backend.GEMM, wg), "b": (Backend.GEMM, wg)}, True),
        ({"a": (Backend.GEMM, wg), "b": (Backend.GEMM, mma)}, False),
        ({"a": (Backend.GEMV, None), "b": (Backend.GEMM, wg)}, False),
    ):
        monkeypatch.setattr(dispatch, "choose", lambda w, rows, dtype, shift, p=picks: p[w])
        assert dispatch.permutes_h("a", "b", 512, BF16) is want  # type: ignore[arg-type]
    monkeypatch.setattr(dispatch, "scale_shift", lambda w, dtype: None)  # the batched fallback
    assert dispatch.permutes_h("a", "b", 512, BF16) is False  # type: ignore[arg-type]


def test_permutes_x_needs_the_wgmma_fc1_and_a_whole_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer regroups x for FC1 only where FC1 takes the wgmma GEMM and x has a whole
    128-column stage."""
    import types

    from cupymoe.experts import dispatch
    from cupymoe.experts.dispatch import Backend

    wg, mma = WgmmaConfig(*WGMMA_TILINGS[0]), GemmConfig(*GEMM_TILINGS[0])
    monkeypatch.setattr(dispatch, "scale_shift", lambda w, dtype: 0)
    for k, pick, want in (
        (256, (Backend.GEMM, wg), True),
        (128, (Backend.GEMM, wg), True),
        (96, (Backend.GEMM, wg), False),
        (256, (Backend.GEMM, mma), False),
        (256, (Backend.GEMV, None), False),
    ):
        monkeypatch.setattr(dispatch, "choose", lambda w, rows, dtype, shift, p=pick: p)
        weights = types.SimpleNamespace(gate=types.SimpleNamespace(k=k))
        assert dispatch.permutes_x(weights, 512, BF16) is want  # type: ignore[arg-type]
    monkeypatch.setattr(dispatch, "choose", lambda w, rows, dtype, shift: (Backend.GEMM, wg))
    weights = types.SimpleNamespace(gate=types.SimpleNamespace(k=256))
    assert dispatch.permutes_x(weights, 512, BF16) is True  # type: ignore[arg-type]
    monkeypatch.setattr(dispatch, "scale_shift", lambda w, dtype: None)  # the batched fallback
    assert dispatch.permutes_x(weights, 512, BF16) is False  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.float16])
@pytest.mark.parametrize("k", [8, 120, 128, 320, 2880])
def test_permute_split_writes_the_split_positions(
    rng: np.random.Generator, k: int, dtype: Any
) -> None:
    """permute_split moves column c to split_positions(k)[c] (a last partial stage, and a k below
    one stage, in place), writing every element of a NaN-poisoned output."""
    import cupy

    from cupymoe.experts.gemm import wgmma_enabled

    if not wgmma_enabled():
        pytest.skip("permute_split serves the wgmma kernel (compute capability 9.0)")
    x = rng.standard_normal((37, k)).astype(dtype)
    out = cupy.full((37, k), np.nan, dtype)
    assert permute_split(cupy.asarray(x), out=out) is out
    want = np.empty_like(x)
    want[:, split_positions(k)] = x
    assert np.array_equal(out.get().view(np.uint16), want.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("activation", "i", "m"),
    [("swiglu", 320, 512), ("relu", 256, 512), ("swiglu_oai", 96, 512), ("swiglu", 320, 8192)],
)
def test_layer_passes_h_in_the_split_order(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch, activation: str, i: int, m: int
) -> None:
    """Where both expert stages run the wgmma kernel the layer passes h in the split k order
    (I = 320: two whole stages and a partial one; 96: none whole) and gives FC1 x so regrouped
    (H = 320); the result equals the natural-order layer bitwise and the float64 reference.
    M = 8,192 makes more work items than blocks (FC1 384, FC2 256), so a block's regrouped K-tail
    stage is followed by the next item's directly copied stages."""
    import cupy

    import cupymoe as cm
    from cupymoe.experts.gemm import wgmma_enabled
    from cupymoe.layer import device

    if not wgmma_enabled():
        pytest.skip("the wgmma kernel runs on compute capability 9.0 only")
    e, h, k = 8, 320, 2  # 128 or 2,048 rows per expert: the wgmma kernel for both stages
    gated = activation != "relu"
    fmt = "mxfp4" if activation == "swiglu_oai" else "nvfp4"
    w1 = random_fp4_experts(rng, e, i, h, fmt)
    fc1: Any = (w1, random_fp4_experts(rng, e, i, h, fmt)) if gated else w1
    layer = cm.MoELayer(fc1, random_fp4_experts(rng, e, h, i, fmt), top_k=k, max_tokens=m,
                        activation=activation)  # fmt: skip
    x = rng.standard_normal((m, h)).astype(BF16)
    logits = rng.standard_normal((m, e)).astype(np.float32)
    xd, ld = cupy.asarray(x), cupy.asarray(logits)
    dl = layer.device_layer()
    assert device.permutes_h(dl.fc1_weights, dl.fc2_weights, m * k, BF16)
    assert device.permutes_x(dl.fc1_weights, m * k, BF16)
    split = layer(xd, ld, replay=False)
    graph = layer(xd, ld)
    monkeypatch.setattr(device, "permutes_h", lambda *args: False)
    monkeypatch.setattr(device, "permutes_x", lambda *args: False)
    natural = layer(xd, ld, replay=False)
    assert bool((split.view(np.uint16) == natural.view(np.uint16)).all())
    assert bool((graph.view(np.uint16) == natural.view(np.uint16)).all())
    max_rel, rms_rel = tolerance_for(BF16)
    some = slice(0, 512)  # the float64 reference of 512 tokens (each token's rows are its own)
    ref = cm.moe_reference(x[some], logits[some], layer)
    assert_close(ref, split[some], max_rel=2 * max_rel, rms_rel=2 * rms_rel, name=activation)


# ---- the wgmma kernel's tensor maps (CPU) ------------------------------------------------------
def _tma_box(
    data: np.ndarray, dims: tuple, strides: tuple, box: tuple, coords: tuple
) -> np.ndarray:
    """A tiled TMA box of 8-byte elements as the copy engine writes it to shared memory: dense,
    innermost dimension fastest, elements outside ``dims`` zero."""
    flat = data.reshape(-1).view(np.uint8)
    out = np.zeros((box[2], box[1], box[0] * 8), np.uint8)
    for i2 in range(box[2]):
        for i1 in range(box[1]):
            for i0 in range(box[0]):
                c = (coords[0] + i0, coords[1] + i1, coords[2] + i2)
                if all(ci < d for ci, d in zip(c, dims, strict=True)):
                    at = c[0] * 8 + c[1] * strides[0] + c[2] * strides[1]
                    out[i2, i1, 8 * i0 : 8 * i0 + 8] = flat[at : at + 8]
    return out.reshape(-1)


@pytest.mark.parametrize(
    ("n_experts", "tiles", "chunks", "unit"),
    [(3, 20, 9, 128), (2, 13, 4, 256), (2, 40, 6, 32), (3, 7, 90, 16)],  # gate/up, w, scales
)
def test_stage_boxes_are_the_block_tiles_chunks(
    rng: np.random.Generator, n_experts: int, tiles: int, chunks: int, unit: int
) -> None:
    """Each stage's box (load_weights: chunk bytes 4 ks unit, m-tile 16 cblock, expert e) holds
    m-tiles 16 cblock .. + 15 x chunks 4 ks .. + 3 of expert e, each m-tile's 4 chunks
    contiguous (the consumers' layout), zero past the last m-tile and the last chunk."""
    from cupymoe._runtime.tensormap import UINT64, check_geometry
    from cupymoe.experts.gemm import map_geometry

    data = rng.integers(0, 256, (n_experts, tiles, chunks, unit), dtype=np.uint8)
    dims, strides, box = map_geometry(n_experts, tiles, chunks, unit)
    check_geometry(1 << 20, UINT64, dims, strides, box)
    m_tiles = WgmmaConfig.m_tiles
    padded = np.zeros(
        (n_experts, -(-tiles // m_tiles) * m_tiles, -(-chunks // 4) * 4, unit), np.uint8
    )
    padded[:, :tiles, :chunks] = data
    for e in range(n_experts):
        for cblock in range(-(-tiles // m_tiles)):
            for ks in range(-(-chunks // 4)):
                got = _tma_box(data, dims, strides, box, (ks * 4 * unit // 8, cblock * m_tiles, e))
                want = padded[e, cblock * m_tiles : (cblock + 1) * m_tiles, 4 * ks : 4 * ks + 4]
                np.testing.assert_array_equal(got, want.reshape(-1), err_msg=f"{e} {cblock} {ks}")


@pytest.mark.parametrize("preset", ["qwen3.6-35b-a3b", "gpt-oss-20b", "deepseek-v3"])
def test_preset_tensor_maps_are_valid(preset: str) -> None:
    """Every preset's four weight maps and two scale maps meet the driver's rules."""
    from cupymoe._runtime.tensormap import UINT64, check_geometry
    from cupymoe.experts.gemm import map_geometry
    from cupymoe.experts.layouts import chunk_count
    from cupymoe.formats import Fp4Format
    from cupymoe.presets import PRESETS

    s = PRESETS[preset]
    scale_unit = 32 if Fp4Format.parse(s.format) is Fp4Format.NVFP4 else 16
    for n, k, rows_per_tile in ((s.intermediate, s.hidden, 8), (s.hidden, s.intermediate, 16)):
        tiles = -(-n // rows_per_tile)
        for unit in (rows_per_tile * 16, scale_unit):
            dims, strides, box = map_geometry(s.n_experts, tiles, chunk_count(k), unit)
            check_geometry(1 << 30, UINT64, dims, strides, box)
            assert box[0] * 8 * box[1] in (8192, 16384, 2048, 1024)  # one stage's bytes


def _swizzled_box(h: np.ndarray, box: tuple, c0: int, c1: int) -> np.ndarray:
    """A TMA box of 16-bit elements ``box = (64, rows)`` at (column c0, row c1) of ``h`` as the
    copy engine writes it with the 128-byte swizzle to a 1024-byte aligned address: row r's
    16-byte piece j at piece j ^ (r % 8); rows past h zero."""
    out = np.zeros((box[1], 8, 8), h.dtype)
    for r in range(box[1]):
        if c1 + r < h.shape[0]:
            row = h[c1 + r, c0 : c0 + box[0]].reshape(8, 8)
            for j in range(8):
                out[r, j ^ (r % 8)] = row[j]
    return out


@pytest.mark.parametrize(("k", "rows", "bn"), [(128, 40, 64), (320, 150, 144), (256, 9, 128)])
def test_fc2_h_boxes_are_the_b_layout(rng: np.random.Generator, k: int, rows: int, bn: int) -> None:
    """FC2's producer (gemm_sm90.cu x_tma) copies each whole stage of h, held in the split k order
    (split_positions), as boxes of x_map_geometry into the swizzled B layout that the wgmma
    descriptors read: in half kh, row n, piece j ^ (n % 8) holds core matrix kc = j % 2 of k16
    step s = 4 kh + j / 2 = 2 q + hh, whose word t is h[n, 32 t + 8 q + 4 hh + 2 kc .. + 1] of
    the natural order; rows past h come zero. The boxes of any item stay within its tile's
    bn rows and start at whole swizzle atoms (8 rows of 128 bytes)."""
    from cupymoe._runtime.tensormap import SWIZZLE_128B, UINT16, check_geometry
    from cupymoe.experts.gemm import x_box_rows, x_map_geometry

    per = x_box_rows(bn)
    assert per % 8 == 0
    assert all(-(-item // per) * per <= bn for item in range(1, bn + 1))
    h = rng.integers(1, 2**16, (rows, k), dtype=np.uint16)
    split = np.empty_like(h)
    split[:, split_positions(k)] = h
    dims, strides, box = x_map_geometry(rows, k, bn)
    check_geometry(1 << 20, UINT16, dims, strides, box, SWIZZLE_128B)
    assert box == (64, per) and dims == (k, rows) and strides == (2 * k,)
    for row0 in (0, rows - rows // 2):
        item = min(bn, rows - row0 + 5)  # past h's end: zeros
        boxes = -(-item // per)
        for ks in range(k // 128):
            got = np.zeros((2, boxes * per, 8, 8), h.dtype)
            for kh in range(2):
                for b in range(boxes):
                    got[kh, per * b : per * (b + 1)] = _swizzled_box(
                        split, box, 128 * ks + 64 * kh, row0 + per * b
                    )
            want = np.zeros_like(got)
            for n in range(min(boxes * per, rows - row0)):
                for kh in range(2):
                    for j in range(8):
                        s_, kc = 4 * kh + j // 2, j % 2
                        q, hh = s_ // 2, s_ % 2
                        cols = [
                            128 * ks + 32 * t + 8 * q + 4 * hh + 2 * kc + e
                            for t in range(4)
                            for e in range(2)
                        ]
                        want[kh, n, j ^ (n % 8)] = h[row0 + n, cols]
            np.testing.assert_array_equal(got, want, err_msg=f"row0 {row0} stage {ks}")


def test_h_box_rows_are_the_kernels() -> None:
    """The host's box height (x_box_rows) is the kernel's Gemm90::kXBoxRows for every tiling: the
    stage's expected bytes count the kernel's boxes, so a mismatch would hang the stage (host
    boxes smaller) or overrun the B region (larger)."""
    import re
    from pathlib import Path

    from cupymoe.experts.gemm import x_box_rows

    text = (Path(__file__).parents[1] / "cupymoe" / "cuda" / "gemm_sm90.cu").read_text()
    found = re.findall(r"static constexpr int kXBoxRows = kBN == (\d+) \? (\d+) : (\d+);", text)
    assert len(found) == 1, found
    bn_special, rows_special, rows_other = (int(v) for v in found[0])
    for bn, _, _ in WGMMA_TILINGS:
        assert x_box_rows(bn) == (rows_special if bn == bn_special else rows_other), bn


@pytest.mark.parametrize("preset", ["qwen3.6-35b-a3b", "gpt-oss-20b", "deepseek-v3"])
def test_preset_h_maps_are_valid(preset: str) -> None:
    """FC2's map over every preset's h, at any row count, meets the driver's rules."""
    from cupymoe._runtime.tensormap import SWIZZLE_128B, UINT16, check_geometry
    from cupymoe.experts.gemm import x_map_geometry
    from cupymoe.presets import PRESETS

    s = PRESETS[preset]
    for bn, _, _ in WGMMA_TILINGS:
        for rows in (1, 17, 16384 * s.top_k):
            geometry = x_map_geometry(rows, s.intermediate, bn)
            check_geometry(1 << 30, UINT16, *geometry, SWIZZLE_128B)


def test_tensor_map_geometry_errors() -> None:
    from cupymoe._runtime.tensormap import SWIZZLE_128B, UINT8, UINT16, UINT64, check_geometry

    good = ((64, 20, 3), (512, 10240), (64, 16, 1))
    check_geometry(256, UINT64, *good)
    with pytest.raises(ValueError, match="16-byte aligned"):
        check_geometry(8, UINT64, *good)
    with pytest.raises(ValueError, match="multiple of 16"):
        check_geometry(256, UINT64, (64, 20, 3), (520, 10400), (64, 16, 1))
    with pytest.raises(ValueError, match="outside 1..256"):
        check_geometry(256, UINT8, (512, 20, 3), (512, 10240), (512, 16, 1))
    with pytest.raises(ValueError, match="inner box"):
        check_geometry(256, UINT8, (512, 20, 3), (512, 10240), (8, 16, 1))
    with pytest.raises(ValueError, match="outside 1..2"):
        check_geometry(256, UINT64, (0, 20, 3), (512, 10240), (64, 16, 1))
    with pytest.raises(ValueError, match="rank"):
        check_geometry(256, UINT64, (64, 20), (512, 10240), (64, 16))
    with pytest.raises(ValueError, match="more than 128"):
        check_geometry(256, UINT16, (512, 64), (1024,), (128, 16), SWIZZLE_128B)
    with pytest.raises(ValueError, match="swizzle"):
        check_geometry(256, UINT16, (512, 64), (1024,), (64, 16), 2)
    check_geometry(256, UINT16, (512, 64), (1024,), (64, 16), SWIZZLE_128B)
