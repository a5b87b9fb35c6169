# SPDX-License-Identifier: Apache-2.0
"""GemvConfig: validation, the analytic threshold table, the environment override (CPU only)."""

from __future__ import annotations

import dataclasses

import pytest

from cupymoe import tune
from cupymoe.config import ENV_GEMV_CONFIG, TILINGS, GemvConfig


@pytest.fixture(autouse=True)
def _no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_GEMV_CONFIG, raising=False)


def test_every_tiling_is_a_valid_config() -> None:
    for cta_n, threads in TILINGS:
        c = GemvConfig(cta_n, threads)
        assert c.lanes_k in (1, 2, 4, 8, 16, 32)
        assert threads % c.lanes_k == 0 and threads % 32 == 0


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


# (n, k) -> expected lanes: K <= 512 -> 8, K <= 1024 -> 16, longer -> 32 (chunks of 32 codes).
@pytest.mark.parametrize(
    "n, k, lanes",
    [
        (2048, 512, 8),  # Qwen FC2
        (512, 2048, 32),  # Qwen FC1 (n per matrix)
        (2880, 2880, 32),  # gpt-oss FC1 / FC2
        (7168, 2048, 32),  # DeepSeek FC2
        (2048, 7168, 32),  # DeepSeek FC1
        (64, 16, 8),  # smallest NVFP4 K: one (padded) chunk
        (64, 1024, 16),
        (64, 1040, 32),  # 33 chunks
        (64, 528, 16),  # 17 chunks
    ],
)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_analytic_table(n: int, k: int, lanes: int, fmt: str) -> None:
    for rows in (1, 8, 64):
        c = GemvConfig.for_problem(n=n, k=k, rows=rows, fmt=fmt, device_name="")
        assert c.lanes_k == lanes and c.threads == 128
        assert c == GemvConfig.analytic(n=n, k=k, rows=rows, fmt=fmt)


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
    assert got == GemvConfig.analytic(n=2048, k=512, rows=4, fmt="nvfp4")


def test_tune_cache_beats_table_and_env_beats_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    seen: list[dict[str, object]] = []

    def fake_lookup(**kwargs: object) -> GemvConfig:
        seen.append(kwargs)
        return GemvConfig(64, 128)

    monkeypatch.setattr(tune, "lookup_tuned", fake_lookup)
    kw = dict(n=512, k=2048, rows=8, fmt="nvfp4", device_name="NVIDIA H200", dtype="float16")
    assert GemvConfig.for_problem(**kw) == GemvConfig(64, 128)  # type: ignore[arg-type]
    assert seen and seen[0]["n"] == 512 and seen[0]["rows"] == 8
    # no device name or no dtype: the cache is not consulted
    seen.clear()
    GemvConfig.for_problem(n=512, k=2048, rows=8, fmt="nvfp4", device_name="")
    assert not seen
    monkeypatch.setenv(ENV_GEMV_CONFIG, "cta_n=32,threads=128")
    assert GemvConfig.for_problem(**kw) == GemvConfig(32, 128)  # type: ignore[arg-type]


@pytest.mark.parametrize("k", [16, 512, 2048, 7168])
def test_candidates(k: int) -> None:
    cands = GemvConfig.candidates(n=1024, k=k, fmt="mxfp4")
    assert cands and len(set(cands)) == len(cands)
    chunks = -(-k // 32)
    assert all(c.lanes_k <= max(chunks, 8) for c in cands)
    assert GemvConfig.analytic(n=1024, k=k, rows=1, fmt="mxfp4") in cands
