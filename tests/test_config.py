# SPDX-License-Identifier: Apache-2.0
"""GemvConfig: validation, the analytic threshold table, the environment override (CPU only)."""

from __future__ import annotations

import dataclasses

import pytest

from cupymoe.experts import config as config_mod
from cupymoe.experts.config import ENV_GEMV_CONFIG, TILINGS, GemvConfig
from cupymoe.experts.layouts import WeightLayout


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_GEMV_CONFIG, raising=False)


def test_every_tiling_is_a_valid_config() -> None:
    for cta_n, threads in TILINGS:
        c = GemvConfig(cta_n, threads)
        assert c.cta_n % 16 == 0 and threads % 32 == 0 and threads >= 64  # m-tiles, 2+ warps
        assert c.cta_n // 16 * 32 <= threads  # one epilogue lane per (m-tile, lane)


@pytest.mark.parametrize("cta_n, threads", [(8, 128), (16, 64), (32, 100), (0, 128)])
def test_uncompiled_tiling_is_rejected(cta_n: int, threads: int) -> None:
    with pytest.raises(ValueError, match="not compiled"):
        GemvConfig(cta_n, threads)


def test_wrong_types_are_rejected() -> None:
    with pytest.raises(TypeError, match="cta_n"):
        GemvConfig(16.0, 128)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="threads"):
        GemvConfig(16, True)  # type: ignore[arg-type]


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        GemvConfig(16, 128).cta_n = 32  # type: ignore[misc]


# (n, k, rows, gated, n_experts) -> cta_n: blocks = ceil(rows_w / cta_n) * min(rows, E), 64 at
# >= 480 blocks, else 32 at >= 300 (with 8 warps up to WIDE_MAX_BLOCKS when K >= 2048), else 16
# (the measured presets of BLOCKS_FOR_CTA_N).
@pytest.mark.parametrize(
    "n, k, rows, gated, n_experts, cta_n",
    [
        (512, 2048, 8, True, 256, 16),  # Qwen FC1 M=1: 128 blocks at 64, 256 at 32
        (512, 2048, 32, True, 256, 64),  # Qwen FC1 M=4: 480
        (2048, 512, 8, False, 256, 32),  # Qwen FC2 M=1: 256 at 64, 512 at 32
        (2048, 512, 32, False, 256, 64),  # Qwen FC2 M=4: 1024
        (2880, 2880, 4, False, 32, (32, 256)),  # gpt-oss FC2 M=1: 180 at 64, 360 at 32 (wide)
        (2880, 1024, 4, False, 32, 32),  # the same blocks with K < 2048: 4 warps
        (2880, 2880, 5, False, 32, 32),  # 450 blocks at 32: more than a wave of 8-warp blocks
        (2880, 2880, 4, True, 32, 32),  # gpt-oss FC1 M=1: 360 at 64
        (2048, 7168, 8, True, 256, 64),  # DeepSeek FC1 M=1: 512
        (7168, 2048, 8, False, 256, 64),  # DeepSeek FC2 M=1: 896
        (64, 16, 64, False, 2, 16),  # 64 rows on 2 experts: 2 blocks whatever the tile
        (7168, 2048, 64, False, None, 64),  # no expert count: rows bound the experts
    ],
)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_analytic_table(
    n: int,
    k: int,
    rows: int,
    gated: bool,
    n_experts: int | None,
    cta_n: int | tuple[int, int],
    fmt: str,
) -> None:
    kw = dict(n=n, k=k, rows=rows, gated=gated, n_experts=n_experts)
    c = GemvConfig.for_problem(**kw, fmt=fmt, device_name="")  # type: ignore[arg-type]
    assert c == (GemvConfig(*cta_n) if isinstance(cta_n, tuple) else GemvConfig(cta_n, 128))
    assert c == GemvConfig.analytic(**kw)  # type: ignore[arg-type]


def test_bad_format_is_rejected() -> None:
    with pytest.raises(ValueError, match="fmt"):
        GemvConfig.for_problem(n=64, k=64, rows=1, fmt="int4", device_name="")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("cta_n=32,threads=128", GemvConfig(32, 128)),
        (" threads=128 , cta_n=64 ", GemvConfig(64, 128)),
        ("cta_n=16,threads=128,", GemvConfig(16, 128)),
    ],
)
def test_env_override(monkeypatch: pytest.MonkeyPatch, text: str, expected: GemvConfig) -> None:
    monkeypatch.setenv(ENV_GEMV_CONFIG, text)
    got = GemvConfig.for_problem(n=2048, k=512, rows=4, fmt="nvfp4", device_name="X")
    assert got == expected


@pytest.mark.parametrize(
    "text",
    [
        "cta_n=32",
        "cta_n=32,threads=64",
        "cta=32,threads=128",
        "cta_n=x,threads=128",
        "cta_n=32,cta_n=32,threads=128",
        "garbage",
    ],
)
def test_env_override_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(ENV_GEMV_CONFIG, text)
    with pytest.raises(ValueError, match=ENV_GEMV_CONFIG):
        GemvConfig.for_problem(n=2048, k=512, rows=4, fmt="nvfp4", device_name="X")


def test_empty_env_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_GEMV_CONFIG, "  ")
    got = GemvConfig.for_problem(n=2048, k=512, rows=4, fmt="nvfp4", device_name="")
    assert got == GemvConfig.analytic(n=2048, k=512, rows=4)


def test_tune_cache_beats_table_and_env_beats_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    seen: list[dict[str, object]] = []

    def fake_lookup(**kwargs: object) -> GemvConfig:
        seen.append(kwargs)
        return GemvConfig(64, 128)

    monkeypatch.setattr(config_mod, "lookup_tuned", fake_lookup)
    kw = dict(n=512, k=2048, rows=8, fmt="nvfp4", device_name="NVIDIA H200", dtype="float16")
    assert GemvConfig.for_problem(**kw) == GemvConfig(64, 128)  # type: ignore[arg-type]
    assert seen and seen[0]["n"] == 512 and seen[0]["rows"] == 8 and seen[0]["op"] == "fc2"
    # the default layout of prepare_fc1 / prepare_fc2
    assert WeightLayout.parse(seen[0]["layout"]) is WeightLayout.SPLIT  # type: ignore[arg-type]
    GemvConfig.for_problem(**kw, gated=True)  # type: ignore[arg-type]
    assert seen[-1]["op"] == "fc1"
    GemvConfig.for_problem(**kw, layout="pair")  # type: ignore[arg-type]
    assert WeightLayout.parse(seen[-1]["layout"]) is WeightLayout.PAIR  # type: ignore[arg-type]
    # no device name or no dtype: the cache is not consulted
    seen.clear()
    GemvConfig.for_problem(n=512, k=2048, rows=8, fmt="nvfp4", device_name="")
    assert not seen
    monkeypatch.setenv(ENV_GEMV_CONFIG, "cta_n=32,threads=128")
    assert GemvConfig.for_problem(**kw) == GemvConfig(32, 128)  # type: ignore[arg-type]


@pytest.mark.parametrize("k", [16, 512, 2048, 7168])
def test_candidates(k: int) -> None:
    cands = GemvConfig.candidates()
    assert cands and len(set(cands)) == len(cands)
    assert {(c.cta_n, c.threads) for c in cands} == set(TILINGS)
    for rows in (1, 8, 64):
        assert GemvConfig.analytic(n=1024, k=k, rows=rows) in cands
