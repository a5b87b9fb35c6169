# SPDX-License-Identifier: Apache-2.0
"""The automatic choice of an expert call (CPU): the analytic hand-over table, the tuned ``gemm``
entries, stale entries, and the precedence of the environment (no GPU: the device queries are
replaced, the weights are their shapes only)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from cupymoe.experts import cache, dispatch, gemm, gemv, handover
from cupymoe.experts.config import ENV_GEMV_CONFIG, GemvConfig
from cupymoe.experts.gemm import (
    ENV_WGMMA,
    GEMM_TILINGS,
    WGMMA_MIN_ROWS_PER_EXPERT,
    WGMMA_TILINGS,
    GemmConfig,
    WgmmaConfig,
    wgmma_tiling,
)
from cupymoe.experts.gemv import PreparedFc1, PreparedFc2, ResidentExperts
from cupymoe.experts.handover import Backend, HandOver
from cupymoe.experts.layouts import WeightLayout
from cupymoe.formats import Fp4Format
from cupymoe.presets import PRESETS

BF16 = np.dtype(ml_dtypes.bfloat16)
NVFP4 = Fp4Format.NVFP4.code
DEVICE = "NVIDIA H200"
# Qwen3.6's FC1 (gate and up [256, 512, 2048]): 8 rows per expert at 256 tokens (2,048 rows)
E, N, K = 256, 512, 2048


def _weights(op: str = "fc1", *, n: int = N, k: int = K, e: int = E, layout: Any = None) -> Any:
    """Weights as the choice sees them: format, shape, layout (no arrays)."""
    w = ResidentExperts(Fp4Format.NVFP4, e, n, k, None)
    layout = WeightLayout.SPLIT if layout is None else layout
    if op == "fc1":
        return PreparedFc1(w, w, None, None, None, layout)
    return PreparedFc2(w, None, None, layout)


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> dict[str, Any]:
    """An H200 as far as the choice asks (name, compute capability 9.0, 227 KB of shared memory
    per block), a cache file in ``tmp_path``, and no environment overrides."""
    state: dict[str, Any] = {"cc": 90, "path": tmp_path / "tune.json"}
    for module in (handover, gemv):
        monkeypatch.setattr(module, "device_name", lambda: DEVICE)
    monkeypatch.setattr(gemm, "compute_capability", lambda: state["cc"])
    monkeypatch.setattr(gemm, "max_shared_per_block", lambda: 227 * 1024)
    monkeypatch.setattr(cache, "_default_file", lambda: str(state["path"]))
    for name in (ENV_WGMMA, ENV_GEMV_CONFIG):
        monkeypatch.delenv(name, raising=False)
    cache.clear_cache()
    handover._warn_unusable.cache_clear()
    yield state
    cache.clear_cache()
    handover._warn_unusable.cache_clear()


def _store(
    rows_per_expert: int, backend: str, config: dict[str, Any] | None, *, op: str = "fc1"
) -> str:
    key = cache.gemm_cache_key(
        device_name=DEVICE,
        op=op,
        fmt="nvfp4",
        dtype=BF16,
        n=N if op == "fc1" else K,
        k=K if op == "fc1" else N,
        n_experts=E,
        rows_per_expert=rows_per_expert,
    )
    cache.store_results({key: {"backend": backend, "config": config, "us": 1.0}})
    return key


def _mma(index: int) -> dict[str, Any]:
    return {
        "kind": "mma",
        **dict(zip(("warps_m", "warps_n", "mt", "nt", "stages"), GEMM_TILINGS[index], strict=True)),
    }


def _wgmma() -> dict[str, Any]:
    fields = dict(zip(("bn", "stages", "groups"), WGMMA_TILINGS[-1], strict=True))
    return {"kind": "wgmma", **fields}


def _rows(per_expert: float) -> int:
    return int(per_expert * E)


def _analytic(rows: int) -> tuple[Backend, Any]:
    """The analytic rule's choice for the test shape (FC1) at ``rows``."""
    return handover.analytic_choice(op="fc1", n=N, k=K, n_experts=E, rows=rows, fmt_code=NVFP4)


def _gemv_config(rows: int, op: str = "fc1") -> GemvConfig:
    n, k = (N, K) if op == "fc1" else (K, N)
    return GemvConfig.for_problem(
        n=n, k=k, rows=rows, fmt="nvfp4", device_name="", gated=op == "fc1", n_experts=E
    )


# ---- the analytic rule ------------------------------------------------------------------------
def test_defaults_are_todays_thresholds() -> None:
    assert handover.DEFAULT_HAND_OVER == HandOver(
        dispatch.GEMV_MAX_ROWS_PER_EXPERT, WGMMA_MIN_ROWS_PER_EXPERT
    )
    assert handover.hand_over_for("fc1", 3, 5, 7) == handover.DEFAULT_HAND_OVER  # unlisted shape


def test_hand_over_table_lists_the_presets() -> None:
    shapes = {key for key, _ in handover.HAND_OVERS}
    assert len(shapes) == len(handover.HAND_OVERS)  # one row per shape
    for p in PRESETS.values():
        assert ("fc1", p.intermediate, p.hidden, p.n_experts) in shapes
        assert ("fc2", p.hidden, p.intermediate, p.n_experts) in shapes
    for (op, *_), hand in handover.HAND_OVERS:
        assert op in cache.OPS and hand.gemv_max <= hand.wgmma_min


@pytest.mark.parametrize("value", [-1, True, "8", float("nan")])
def test_hand_over_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="gemv_max"):
        HandOver(value, 64)  # type: ignore[arg-type]


# Qwen3.6 FC1 over 256 experts: the GEMV up to 4 rows per expert, then on compute capability 9.0
# the wgmma kernel (bn 64 up to 32 rows per expert, bn 144 above 112 and up to 160, bn 128
# elsewhere above 32), elsewhere the mma.sync table
@pytest.mark.parametrize(
    ("per_expert", "cc", "want"),
    [
        (1 / 8, 90, "gemv"),  # one token
        (4, 90, "gemv"),
        (4 + 1 / 256, 90, "wgmma"),
        (8, 90, "wgmma"),
        (32, 90, "wgmma"),
        (32 + 1 / 256, 90, "wgmma"),
        (128, 90, "wgmma"),
        (512, 90, "wgmma"),
        (4 + 1 / 256, 80, "mma"),
        (512, 80, "mma"),
    ],
)
def test_analytic_choice(device: dict[str, Any], per_expert: float, cc: int, want: str) -> None:
    device["cc"] = cc
    rows = max(1, round(per_expert * E))
    backend, config = handover.choose(_weights(), rows, BF16, 0)
    kinds = {GemvConfig: "gemv", GemmConfig: "mma", WgmmaConfig: "wgmma"}
    assert kinds[type(config)] == want
    assert backend is (Backend.GEMV if want == "gemv" else Backend.GEMM)
    if want == "gemv":
        assert config == _gemv_config(rows)
    if want == "mma":
        assert config == GemmConfig.for_rows(rows, E, fmt_code=NVFP4, max_shared=227 * 1024)
    if want == "wgmma":
        assert config == wgmma_tiling(rows / min(rows, E))
    hand = handover.hand_over_for("fc1", N, K, E)
    got = dispatch.backend_for(rows, 0, layout=WeightLayout.SPLIT, n_experts=E, hand_over=hand)
    assert got is backend  # the analytic rule of dispatch agrees


def test_per_shape_table_moves_the_hand_over(
    device: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    table = {("fc1", N, K, E): HandOver(2, 16)}
    monkeypatch.setattr(handover, "_BY_SHAPE", table)
    assert handover.choose(_weights(), _rows(2), BF16, 0)[0] is Backend.GEMV
    assert isinstance(handover.choose(_weights(), _rows(4), BF16, 0)[1], GemmConfig)
    assert isinstance(handover.choose(_weights(), _rows(32), BF16, 0)[1], WgmmaConfig)
    # FC2 of the same layer is another shape: the default thresholds
    assert handover.choose(_weights("fc2", n=K, k=N), _rows(4), BF16, 0)[0] is Backend.GEMV


def test_what_the_weights_allow(device: dict[str, Any]) -> None:
    _store(512, "gemm", _wgmma())  # a tuned entry the PAIR layout must not use
    assert handover.choose(_weights(), _rows(512), BF16, None) == (Backend.BATCHED, None)
    pair = _weights(layout=WeightLayout.PAIR)
    backend, config = handover.choose(pair, _rows(512), BF16, 0)
    assert backend is Backend.GEMV and isinstance(config, GemvConfig)
    assert handover.choose(_weights(), 0, BF16, 0) == (Backend.GEMV, None)  # nothing to launch


# ---- the tuned entries ------------------------------------------------------------------------
def test_tuned_entry_decides_its_bucket(device: dict[str, Any]) -> None:
    _store(4, "gemm", _mma(1))  # the GEMM from 3-4 rows per expert on (analytic: the GEMV)
    _store(16, "gemv", None)  # the GEMV at 9-16 (analytic: the GEMM)
    _store(128, "gemm", _wgmma())
    for per_expert in (3, 4):
        assert handover.choose(_weights(), _rows(per_expert), BF16, 0) == (
            Backend.GEMM,
            GemmConfig(*GEMM_TILINGS[1]),
        )
    assert handover.choose(_weights(), _rows(2), BF16, 0)[0] is Backend.GEMV  # no entry
    for per_expert in (9, 16):
        rows = _rows(per_expert)
        assert handover.choose(_weights(), rows, BF16, 0) == (Backend.GEMV, _gemv_config(rows))
    assert handover.choose(_weights(), _rows(100), BF16, 0) == (
        Backend.GEMM,
        WgmmaConfig(*WGMMA_TILINGS[-1]),
    )
    # the key: another op, dtype, device or expert count has no entry
    assert handover.choose(_weights("fc2", n=K, k=N), _rows(4), BF16, 0)[0] is Backend.GEMV
    assert handover.choose(_weights(), _rows(4), np.float16, 0)[0] is Backend.GEMV
    assert handover.choose(_weights(), _rows(4), BF16, 0, n_experts=128)[0] is Backend.GEMV
    assert cache.summary() == {"gemv": 0, "gemm": 3}


def test_expert_parallel_count_is_the_key(device: dict[str, Any]) -> None:
    """A shard of 32 of the 256 experts asks with the whole layer's count and rows."""
    _store(4, "gemm", _mma(0))
    shard = _weights(e=32)
    assert handover.choose(shard, _rows(4), BF16, 0, n_experts=E) == (
        Backend.GEMM,
        GemmConfig(*GEMM_TILINGS[0]),
    )


def test_wgmma_off_replaces_a_tuned_wgmma_entry(
    device: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _store(128, "gemm", _wgmma())
    rows = _rows(128)
    mma = GemmConfig.for_rows(rows, E, fmt_code=NVFP4, max_shared=227 * 1024)
    monkeypatch.setenv(ENV_WGMMA, "0")
    assert handover.choose(_weights(), rows, BF16, 0) == (Backend.GEMM, mma)
    monkeypatch.delenv(ENV_WGMMA)
    device["cc"] = 100  # a device the sm_90a cubin does not run on
    assert handover.choose(_weights(), rows, BF16, 0) == (Backend.GEMM, mma)
    device["cc"] = 90
    assert handover.choose(_weights(), rows, BF16, 0)[1] == WgmmaConfig(*WGMMA_TILINGS[-1])


def test_gemv_override_fixes_the_tiling_not_the_backend(
    device: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _store(4, "gemm", _mma(1))
    monkeypatch.setenv(ENV_GEMV_CONFIG, "cta_n=32,threads=256")
    assert handover.choose(_weights(), _rows(4), BF16, 0) == (
        Backend.GEMM,
        GemmConfig(*GEMM_TILINGS[1]),
    )
    assert handover.choose(_weights(), _rows(2), BF16, 0) == (Backend.GEMV, GemvConfig(32, 256))


def test_forced_backend_gets_its_own_tiling(device: dict[str, Any]) -> None:
    _store(4, "gemm", _mma(1))
    _store(16, "gemv", None)
    gemm_backend, gemv_backend = Backend.GEMM, Backend.GEMV
    # the tuned winner is the forced backend: its tuned tiling
    assert handover.choose(_weights(), _rows(4), BF16, 0, backend=gemm_backend)[1] == GemmConfig(
        *GEMM_TILINGS[1]
    )
    # it is not: that backend's table
    rows = _rows(16)
    want = _analytic(rows)
    assert want[1] == WgmmaConfig(*WGMMA_TILINGS[0])  # 16 rows per expert: wgmma bn 64
    assert handover.choose(_weights(), rows, BF16, 0, backend=gemm_backend) == want
    assert handover.choose(_weights(), _rows(4), BF16, 0, backend=gemv_backend) == (
        Backend.GEMV,
        _gemv_config(_rows(4)),
    )
    assert handover.choose(_weights(), 8, BF16, 0, backend=Backend.BATCHED) == (
        Backend.BATCHED,
        None,
    )


def test_dispatch_resolve_precedence(device: dict[str, Any]) -> None:
    """An explicit config beats everything; a forced backend gets its tiling; else the cache."""
    _store(4, "gemm", _mma(1))
    w, rows = _weights(), _rows(4)
    explicit = GemmConfig(*GEMM_TILINGS[0])
    assert dispatch._resolve(w, rows, BF16, 0, None, explicit) == (Backend.GEMM, None, explicit)
    gemv_cfg = GemvConfig(16, 128)
    assert dispatch._resolve(w, rows, BF16, 0, None, gemv_cfg) == (Backend.GEMV, gemv_cfg, None)
    tuned = GemmConfig(*GEMM_TILINGS[1])
    assert dispatch._resolve(w, rows, BF16, 0, None, None) == (Backend.GEMM, None, tuned)
    assert dispatch._resolve(w, rows, BF16, 0, Backend.GEMM, None) == (Backend.GEMM, None, tuned)
    assert dispatch._resolve(w, rows, BF16, 0, Backend.GEMV, None) == (
        Backend.GEMV,
        _gemv_config(rows),
        None,
    )
    with pytest.raises(ValueError, match="only the batched"):
        dispatch._resolve(w, rows, BF16, None, Backend.GEMM, None)
    assert dispatch._resolve(w, rows, BF16, None, None, None) == (Backend.BATCHED, None, None)


@pytest.mark.parametrize(
    ("backend", "config", "match"),
    [
        (
            "gemm",
            {"kind": "mma", "warps_m": 99, "warps_n": 1, "mt": 2, "nt": 2, "stages": 4},
            "not compiled",
        ),
        ("gemm", {"kind": "wgmma", "bn": 48, "stages": 4}, "not compiled"),
        # bn 64 tuned on two consumer groups, before it ran on four
        ("gemm", {"kind": "wgmma", "bn": 64, "stages": 5}, "not compiled"),
        ("gemm", {"kind": "mma", "rows_per_block": 4}, "rows_per_block"),  # an older layout
        ("gemm", {"kind": "sparse"}, "kind"),
        ("gemm", {"kind": "mma", "warps_m": [4], "nested": {"a": 1}}, "backend"),  # hand-edited
        ("gemm", None, "kind"),
        ("cublas", None, "backend"),
    ],
)
def test_stale_entry_is_ignored_with_one_warning(
    device: dict[str, Any], backend: str, config: dict[str, Any] | None, match: str
) -> None:
    _store(16, backend, config)
    rows = _rows(16)
    analytic = _analytic(rows)
    with pytest.warns(UserWarning, match=match):
        assert handover.choose(_weights(), rows, BF16, 0) == analytic
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per entry, not on every call
        assert handover.choose(_weights(), rows, BF16, 0) == analytic


def test_entry_without_a_backend_is_ignored(device: dict[str, Any]) -> None:
    key = _store(16, "gemm", _mma(0))
    data = json.loads(device["path"].read_text())
    data["entries"][key] = ["not", "a", "dict"]
    device["path"].write_text(json.dumps(data))
    cache.clear_cache()
    with pytest.warns(UserWarning, match="backend"):
        assert handover.choose(_weights(), _rows(16), BF16, 0) == _analytic(_rows(16))


def test_outdated_file_is_ignored(device: dict[str, Any]) -> None:
    device["path"].write_text(json.dumps({"version": 2, "entries": {}}))
    with pytest.warns(UserWarning, match="version 2"):
        assert handover.choose(_weights(), _rows(4), BF16, 0)[0] is Backend.GEMV
