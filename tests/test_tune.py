# SPDX-License-Identifier: Apache-2.0
"""The GEMV tuning cache: buckets, keys, atomic round trip, and tolerance of bad files (CPU)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import ml_dtypes
import numpy as np
import pytest

from cupymoe import tune
from cupymoe.formats import Fp4Format


@dataclasses.dataclass(frozen=True)
class _FakeConfig:
    """Stands in for ``cupymoe.config.GemvConfig``: the cache only needs ``**fields``."""

    cta_n: int
    threads: int


@pytest.fixture
def fake_config(monkeypatch: pytest.MonkeyPatch) -> type[_FakeConfig]:
    module = types.ModuleType("cupymoe.config")
    module.GemvConfig = _FakeConfig  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupymoe.config", module)
    tune.clear_cache()
    yield _FakeConfig
    tune.clear_cache()


_PROBLEM = dict(device_name="NVIDIA H200", fmt="nvfp4", dtype=ml_dtypes.bfloat16, n=512, k=2048)


# rows 3 -> 4: a bucket's winner was profiled at the bucket size; above the window -> 64
@pytest.mark.parametrize(
    ("rows", "bucket"),
    [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (17, 32), (33, 64), (64, 64), (1000, 64)],
)
def test_row_bucket(rows: int, bucket: int) -> None:
    assert tune.row_bucket(rows) == bucket
    assert tune.row_bucket(np.int32(rows)) == bucket


@pytest.mark.parametrize("rows", [0, -1, 2.0, True, "4"])
def test_row_bucket_rejects(rows: object) -> None:
    with pytest.raises(ValueError, match="rows"):
        tune.row_bucket(rows)  # type: ignore[arg-type]


def test_cache_path_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune.cache_path() == tmp_path / "cupymoe" / "gemv_tune.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tune.cache_path().parts[-3:] == (".cache", "cupymoe", "gemv_tune.json")


def test_cache_key_normalises() -> None:
    a = tune.cache_key(**_PROBLEM, rows=3)
    b = tune.cache_key(**{**_PROBLEM, "fmt": Fp4Format.NVFP4, "dtype": "bfloat16"}, rows=4)
    assert a == b == "NVIDIA H200|fc2|split|nvfp4|bfloat16|512|2048|4"
    fc1 = tune.cache_key(**_PROBLEM, rows=3, op="fc1")
    assert fc1 == "NVIDIA H200|fc1|split|nvfp4|bfloat16|512|2048|4"
    pair = tune.cache_key(**_PROBLEM, rows=3, layout="pair")
    assert pair == "NVIDIA H200|fc2|pair|nvfp4|bfloat16|512|2048|4"
    with pytest.raises(ValueError, match="op"):
        tune.cache_key(**_PROBLEM, rows=1, op="fc3")
    with pytest.raises(ValueError, match="^layout"):
        tune.cache_key(**_PROBLEM, rows=1, layout="native")
    with pytest.raises(TypeError, match="dtype"):
        tune.cache_key(**{**_PROBLEM, "dtype": np.float32}, rows=1)
    with pytest.raises(ValueError, match="fmt"):
        tune.cache_key(**{**_PROBLEM, "fmt": "int4"}, rows=1)


def test_round_trip(tmp_path, fake_config) -> None:
    path = tmp_path / "sub" / "tune.json"
    assert tune.lookup_tuned(**_PROBLEM, rows=8, path=path) is None  # no file: no entry
    key8 = tune.cache_key(**_PROBLEM, rows=8)
    key1 = tune.cache_key(**_PROBLEM, rows=1)
    tune.store_results({key8: {"config": {"cta_n": 4, "threads": 128}, "us": 3.0}}, path)
    tune.store_results({key1: {"config": {"cta_n": 2, "threads": 64}, "us": 2.0}}, path)  # merge
    data = json.loads(path.read_text())
    assert data["version"] == tune.CACHE_VERSION and set(data["entries"]) == {key1, key8}
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    for rows in (5, 6, 7, 8):  # the whole bucket maps to the one entry
        assert tune.lookup_tuned(**_PROBLEM, rows=rows, path=path) == fake_config(4, 128)
    assert tune.lookup_tuned(**_PROBLEM, rows=1, path=path) == fake_config(2, 64)
    assert tune.lookup_tuned(**_PROBLEM, rows=2, path=path) is None
    assert tune.lookup_tuned(**{**_PROBLEM, "n": 1024}, rows=8, path=path) is None
    assert tune.lookup_tuned(**{**_PROBLEM, "device_name": "A100"}, rows=8, path=path) is None
    assert tune.lookup_tuned(**_PROBLEM, rows=8, op="fc1", path=path) is None  # FC2's entry
    assert tune.lookup_tuned(**_PROBLEM, rows=8, layout="pair", path=path) is None  # split's


def test_lookup_is_memoised_until_store(tmp_path, fake_config) -> None:
    path = tmp_path / "tune.json"
    key = tune.cache_key(**_PROBLEM, rows=1)
    tune.store_results({key: {"config": {"cta_n": 4, "threads": 128}}}, path)
    assert tune.lookup_tuned(**_PROBLEM, rows=1, path=path) == fake_config(4, 128)
    path.write_text(json.dumps({"version": tune.CACHE_VERSION, "entries": {}}))
    assert tune.lookup_tuned(**_PROBLEM, rows=1, path=path) == fake_config(4, 128)  # memoised
    tune.clear_cache()
    assert tune.lookup_tuned(**_PROBLEM, rows=1, path=path) is None


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
        assert tune.lookup_tuned(**_PROBLEM, rows=1, path=path) is None
    key = tune.cache_key(**_PROBLEM, rows=1)
    tune.store_results({key: {"config": {"cta_n": 1, "threads": 32}}}, path)  # replaces it
    assert tune.lookup_tuned(**_PROBLEM, rows=1, path=path) == fake_config(1, 32)


def test_stale_entry_fields_are_ignored(tmp_path, fake_config) -> None:
    path = tmp_path / "tune.json"
    key = tune.cache_key(**_PROBLEM, rows=1)
    tune.store_results({key: {"config": {"rows_per_block": 4}}}, path)
    with pytest.warns(UserWarning, match="unusable"):
        assert tune.lookup_tuned(**_PROBLEM, rows=1, path=path) is None


def test_real_config_round_trip(tmp_path) -> None:
    config = pytest.importorskip("cupymoe.config")
    tune.clear_cache()
    candidates = config.GemvConfig.candidates(n=512, k=2048, fmt=Fp4Format.NVFP4)
    assert candidates
    path = tmp_path / "tune.json"
    key = tune.cache_key(**_PROBLEM, rows=4)
    tune.store_results({key: {"config": dataclasses.asdict(candidates[-1])}}, path)
    assert tune.lookup_tuned(**_PROBLEM, rows=4, path=path) == candidates[-1]
    tune.clear_cache()


def test_random_routing_contract() -> None:
    routing = tune.random_routing(np.random.default_rng(0), 5, 3, 8, device=False)
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
    from cupymoe import gemv
    from cupymoe.config import GemvConfig

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
    assert key == tune.cache_key(
        device_name=tune.device_name(),
        fmt="nvfp4",
        dtype=ml_dtypes.bfloat16,
        n=64,
        k=128,
        rows=2,
        layout=layout,
    )
    assert entry["layout"] == layout
    assert set(entry["candidates"]) == {
        repr(c) for c in GemvConfig.candidates(n=64, k=128, fmt="nvfp4")
    }
    winner = GemvConfig(**entry["config"])
    assert entry["us"] == min(entry["candidates"].values()) and winner in GemvConfig.candidates(
        n=64, k=128, fmt="nvfp4"
    )

    seen: list[str] = []
    real = tune.lookup_tuned

    def spy(**kwargs: object) -> object:
        seen.append(str(kwargs["layout"]))
        return real(**{**kwargs, "path": path})  # type: ignore[arg-type]

    monkeypatch.setattr(tune, "lookup_tuned", spy)
    order = "split" if layout == "split" else "native"
    weights = gemv.prepare_fc2(tune.random_fp4_gpu(4, 64, 128, "nvfp4"), gemv_order=order)
    routing = tune.random_routing(np.random.default_rng(0), 1, 2, 4)
    h = cupy.asarray(np.random.default_rng(1).standard_normal((2, 128)).astype(ml_dtypes.bfloat16))
    gemv.fc2(h, weights, routing)
    assert seen == [layout]
