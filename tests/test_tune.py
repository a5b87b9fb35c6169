# SPDX-License-Identifier: Apache-2.0
"""The GEMV tuning cache: buckets, keys, atomic round trip, and tolerance of bad files (CPU)."""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest

from cupymoe.experts import cache, config, tune
from cupymoe.experts.layouts import WeightLayout
from cupymoe.formats import Fp4Format, random_fp4_gpu
from cupymoe.routing import random_routing


def _fields(cta_n: int, threads: int) -> dict[str, int]:
    """What the cache stores of a ``GemvConfig``: its fields (any values: the file layer does
    not validate them, ``config.lookup_tuned`` does)."""
    return {"cta_n": cta_n, "threads": threads}


@pytest.fixture
def fake_config():  # type: ignore[no-untyped-def]
    cache.clear_cache()
    yield _fields
    cache.clear_cache()


_PROBLEM = dict(device_name="NVIDIA H200", fmt="nvfp4", dtype=ml_dtypes.bfloat16, n=512, k=2048)


# rows 3 -> 4: a bucket's winner was profiled at the bucket size; above the window -> 64
@pytest.mark.parametrize(
    ("rows", "bucket"),
    [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (17, 32), (33, 64), (64, 64), (1000, 64)],
)
def test_row_bucket(rows: int, bucket: int) -> None:
    assert cache.row_bucket(rows) == bucket
    assert cache.row_bucket(np.int32(rows)) == bucket


@pytest.mark.parametrize("rows", [0, -1, 2.0, True, "4"])
def test_row_bucket_rejects(rows: object) -> None:
    with pytest.raises(ValueError, match="rows"):
        cache.row_bucket(rows)  # type: ignore[arg-type]


def test_cache_path_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.cache_path() == tmp_path / "cupymoe" / "gemv_tune.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.cache_path().parts[-3:] == (".cache", "cupymoe", "gemv_tune.json")


def test_cache_key_normalises() -> None:
    a = cache.cache_key(**_PROBLEM, rows=3)
    b = cache.cache_key(**{**_PROBLEM, "fmt": Fp4Format.NVFP4, "dtype": "bfloat16"}, rows=4)
    assert a == b == "NVIDIA H200|fc2|split|nvfp4|bfloat16|512|2048|4"
    fc1 = cache.cache_key(**_PROBLEM, rows=3, op="fc1")
    assert fc1 == "NVIDIA H200|fc1|split|nvfp4|bfloat16|512|2048|4"
    pair = cache.cache_key(**_PROBLEM, rows=3, layout="pair")
    assert pair == "NVIDIA H200|fc2|pair|nvfp4|bfloat16|512|2048|4"
    with pytest.raises(ValueError, match="op"):
        cache.cache_key(**_PROBLEM, rows=1, op="fc3")
    with pytest.raises(ValueError, match="^layout"):
        cache.cache_key(**_PROBLEM, rows=1, layout="native")
    with pytest.raises(TypeError, match="dtype"):
        cache.cache_key(**{**_PROBLEM, "dtype": np.float32}, rows=1)
    with pytest.raises(ValueError, match="fmt"):
        cache.cache_key(**{**_PROBLEM, "fmt": "int4"}, rows=1)


def test_round_trip(tmp_path, fake_config) -> None:
    path = tmp_path / "sub" / "tune.json"
    assert cache.tuned_fields(**_PROBLEM, rows=8, path=path) is None  # no file: no entry
    key8 = cache.cache_key(**_PROBLEM, rows=8)
    key1 = cache.cache_key(**_PROBLEM, rows=1)
    cache.store_results({key8: {"config": {"cta_n": 4, "threads": 128}, "us": 3.0}}, path)
    cache.store_results({key1: {"config": {"cta_n": 2, "threads": 64}, "us": 2.0}}, path)  # merge
    data = json.loads(path.read_text())
    assert data["version"] == cache.CACHE_VERSION and set(data["entries"]) == {key1, key8}
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    for rows in (5, 6, 7, 8):  # the whole bucket maps to the one entry
        assert cache.tuned_fields(**_PROBLEM, rows=rows, path=path) == fake_config(4, 128)
    assert cache.tuned_fields(**_PROBLEM, rows=1, path=path) == fake_config(2, 64)
    assert cache.tuned_fields(**_PROBLEM, rows=2, path=path) is None
    assert cache.tuned_fields(**{**_PROBLEM, "n": 1024}, rows=8, path=path) is None
    assert cache.tuned_fields(**{**_PROBLEM, "device_name": "A100"}, rows=8, path=path) is None
    assert cache.tuned_fields(**_PROBLEM, rows=8, op="fc1", path=path) is None  # FC2's entry
    assert cache.tuned_fields(**_PROBLEM, rows=8, layout="pair", path=path) is None  # split's


def test_lookup_is_memoised_until_store(tmp_path, fake_config) -> None:
    path = tmp_path / "tune.json"
    key = cache.cache_key(**_PROBLEM, rows=1)
    cache.store_results({key: {"config": {"cta_n": 4, "threads": 128}}}, path)
    assert cache.tuned_fields(**_PROBLEM, rows=1, path=path) == fake_config(4, 128)
    path.write_text(json.dumps({"version": cache.CACHE_VERSION, "entries": {}}))
    assert cache.tuned_fields(**_PROBLEM, rows=1, path=path) == fake_config(4, 128)  # memoised
    cache.clear_cache()
    assert cache.tuned_fields(**_PROBLEM, rows=1, path=path) is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "corrupt"),
        ('["a list"]', "entries"),
        ('{"version": 999, "entries": {}}', "version"),
        ('{"entries": {}}', "version"),
    ],
)
def test_bad_file_is_ignored_with_a_warning(tmp_path, fake_config, text: str, match: str) -> None:
    path = tmp_path / "tune.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match=match):
        assert cache.tuned_fields(**_PROBLEM, rows=1, path=path) is None
    key = cache.cache_key(**_PROBLEM, rows=1)
    cache.store_results({key: {"config": {"cta_n": 1, "threads": 32}}}, path)  # replaces it
    assert cache.tuned_fields(**_PROBLEM, rows=1, path=path) == fake_config(1, 32)


def test_stale_entry_fields_are_ignored(tmp_path, fake_config) -> None:
    path = tmp_path / "tune.json"
    key = cache.cache_key(**_PROBLEM, rows=1)
    cache.store_results({key: {"config": {"rows_per_block": 4}}}, path)
    with pytest.warns(UserWarning, match="unusable"):
        assert config.lookup_tuned(**_PROBLEM, rows=1, path=path) is None


def test_real_config_round_trip(tmp_path) -> None:
    cache.clear_cache()
    candidates = config.GemvConfig.candidates()
    assert candidates
    path = tmp_path / "tune.json"
    key = cache.cache_key(**_PROBLEM, rows=4)
    cache.store_results({key: {"config": dataclasses.asdict(candidates[-1])}}, path)
    assert config.lookup_tuned(**_PROBLEM, rows=4, path=path) == candidates[-1]
    cache.clear_cache()


def test_random_routing_contract() -> None:
    routing = random_routing(np.random.default_rng(0), 5, 3, 8, device=False)
    flat = routing.topk_ids.reshape(-1)
    assert all(len(set(row)) == 3 for row in routing.topk_ids.tolist())  # distinct experts
    assert np.array_equal(np.sort(routing.sorted_rows), np.arange(15))
    assert np.array_equal(routing.inverse[routing.sorted_rows], np.arange(15))
    expert_of_row = flat[routing.sorted_rows]
    for e in range(8):
        lo, hi = routing.expert_offsets[e], routing.expert_offsets[e + 1]
        assert np.all(expert_of_row[lo:hi] == e)
        assert np.all(np.diff(routing.sorted_rows[lo:hi]) > 0)  # stable: ascending token


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["split", "pair"])
def test_tune_gemv_per_layout(layout: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tuned entry is stored under the layout it timed, and a GEMV on weights in that layout
    asks the cache for that layout (the split copy and the native bytes are different kernels)."""
    cupy = pytest.importorskip("cupy")
    from cupymoe._runtime.device import device_name
    from cupymoe.experts import dispatch, gemv
    from cupymoe.experts.config import GemvConfig

    path = tmp_path / "tune.json"
    got = tune.tune_gemv(
        [(64, 128)],
        fmt="nvfp4",
        rows_list=[2],
        layout=layout,
        n_experts=4,
        warmup=1,
        repeats=3,
        l2_defeat_bytes=1,
        path=path,
    )
    ((key, entry),) = got.items()
    assert key == cache.cache_key(
        device_name=device_name(),
        fmt="nvfp4",
        dtype=ml_dtypes.bfloat16,
        n=64,
        k=128,
        rows=2,
        layout=layout,
    )
    assert entry["layout"] == layout
    assert set(entry["candidates"]) == {repr(c) for c in GemvConfig.candidates()}
    winner = GemvConfig(**entry["config"])
    assert entry["us"] == min(entry["candidates"].values()) and winner in GemvConfig.candidates()

    seen: list[str] = []
    real = config.lookup_tuned

    def spy(**kwargs: object) -> object:
        seen.append(WeightLayout.parse(kwargs["layout"]).key)  # type: ignore[arg-type]
        return real(**{**kwargs, "path": path})

    monkeypatch.setattr(config, "lookup_tuned", spy)
    weights = gemv.prepare_fc2(random_fp4_gpu(4, 64, 128, "nvfp4"), layout=layout)
    routing = random_routing(np.random.default_rng(0), 1, 2, 4)
    h = cupy.asarray(np.random.default_rng(1).standard_normal((2, 128)).astype(ml_dtypes.bfloat16))
    dispatch.fc2(h, weights, routing)
    assert seen == [layout]
