# SPDX-License-Identifier: Apache-2.0
"""The tuning cache: buckets, keys, atomic round trip, and tolerance of bad files (CPU), for the
GEMV tilings and the GEMV/GEMM hand-over (``gemm`` entries); the tuners' helpers (CPU); the
tuners on a GPU, and the dispatch that reads what they stored."""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from cupymoe.experts import cache, config, tune
from cupymoe.experts.activation import Activation, ActivationSpec
from cupymoe.experts.layouts import WeightLayout
from cupymoe.formats import Fp4Format, random_fp4_gpu
from cupymoe.presets import PRESETS
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


# ---- the gemm entries (CPU) ---------------------------------------------------------------------
_GEMM = dict(_PROBLEM, op="fc1", n_experts=256)


# average rows per active expert -> bucket: powers of two, the value itself up to 2,048
@pytest.mark.parametrize(
    ("per_expert", "bucket"),
    [(0.25, 1), (1, 1), (1.01, 2), (3, 4), (8, 8), (8.004, 16), (64, 64), (65, 128), (2048, 2048)],
)
def test_rows_per_expert_bucket(per_expert: float, bucket: int) -> None:
    assert cache.rows_per_expert_bucket(per_expert) == bucket
    assert cache.rows_per_expert_bucket(np.float64(per_expert)) == bucket
    assert bucket in cache.ROWS_PER_EXPERT_BUCKETS


def test_rows_per_expert_buckets_hold_the_analytic_thresholds() -> None:
    """No bucket straddles a threshold of the analytic tables: each is a bucket edge."""
    from cupymoe.experts.gemm import TILING_FOR_ROWS_PER_EXPERT, WGMMA_MIN_ROWS_PER_EXPERT
    from cupymoe.experts.handover import GEMV_MAX_ROWS_PER_EXPERT, HAND_OVERS

    limits = {GEMV_MAX_ROWS_PER_EXPERT, WGMMA_MIN_ROWS_PER_EXPERT}
    limits |= {limit for limit, _ in TILING_FOR_ROWS_PER_EXPERT}
    limits |= {h.gemv_max for _, h in HAND_OVERS} | {h.wgmma_min for _, h in HAND_OVERS}
    assert limits <= set(cache.ROWS_PER_EXPERT_BUCKETS)
    assert cache.rows_per_expert_bucket(10**6) == cache.ROWS_PER_EXPERT_BUCKETS[-1]


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "4", None])
def test_rows_per_expert_bucket_rejects(value: object) -> None:
    with pytest.raises(ValueError, match="per_expert"):
        cache.rows_per_expert_bucket(value)  # type: ignore[arg-type]


def test_gemm_cache_key() -> None:
    key = cache.gemm_cache_key(**_GEMM, rows_per_expert=20.5)
    assert key == "NVIDIA H200|gemm|fc1|nvfp4|bfloat16|512|2048|256|32"
    same = {**_GEMM, "fmt": Fp4Format.NVFP4, "dtype": "bfloat16"}
    assert cache.gemm_cache_key(**same, rows_per_expert=32) == key
    assert key != cache.cache_key(**_PROBLEM, rows=32, op="fc1")  # the GEMV kind never collides
    with pytest.raises(ValueError, match="op"):
        cache.gemm_cache_key(**{**_GEMM, "op": "fc1_single"}, rows_per_expert=1)
    with pytest.raises(TypeError, match="dtype"):
        cache.gemm_cache_key(**{**_GEMM, "dtype": np.float32}, rows_per_expert=1)


def test_gemm_round_trip_next_to_gemv_entries(tmp_path, fake_config) -> None:
    path = tmp_path / "tune.json"
    mma = {"kind": "mma", "warps_m": 1, "warps_n": 2, "mt": 3, "nt": 4, "stages": 5}  # unchecked
    gemm_key = cache.gemm_cache_key(**_GEMM, rows_per_expert=16)
    gemv_key = cache.cache_key(**_PROBLEM, rows=8)
    entry = {"backend": "gemm", "config": mma, "us": 2.5, "candidates": {"gemv 16x128": 3.0}}
    cache.store_results({gemm_key: entry}, path)
    cache.store_results({gemv_key: {"config": fake_config(16, 128)}}, path)
    found = cache.tuned_gemm(**_GEMM, rows_per_expert=9, path=path)  # 9..16: the one entry
    assert found == ("gemm", tuple(sorted(mma.items())))
    assert cache.tuned_gemm(**_GEMM, rows_per_expert=17, path=path) is None
    assert cache.tuned_gemm(**{**_GEMM, "n_experts": 128}, rows_per_expert=16, path=path) is None
    assert cache.tuned_fields(**_PROBLEM, rows=8, path=path) == fake_config(16, 128)
    assert cache.summary(path) == {"gemv": 1, "gemm": 1}
    assert json.loads(path.read_text())["entries"][gemm_key] == entry  # as stored
    gemv_only = cache.gemm_cache_key(**_GEMM, rows_per_expert=1)
    cache.store_results({gemv_only: {"backend": "gemv", "config": None}}, path)
    assert cache.tuned_gemm(**_GEMM, rows_per_expert=1, path=path) == ("gemv", ())


def test_version_3_file_is_read_and_upgraded(tmp_path, fake_config) -> None:
    """Version 4 only adds the gemm kind: a version 3 file's GEMV entries keep serving."""
    path = tmp_path / "tune.json"
    gemv_key = cache.cache_key(**_PROBLEM, rows=4)
    old = {"version": 3, "entries": {gemv_key: {"config": fake_config(32, 128), "us": 1.0}}}
    path.write_text(json.dumps(old))
    assert cache.tuned_fields(**_PROBLEM, rows=4, path=path) == fake_config(32, 128)
    gemm_key = cache.gemm_cache_key(**_GEMM, rows_per_expert=4)
    cache.store_results({gemm_key: {"backend": "gemv", "config": None}}, path)
    data = json.loads(path.read_text())
    assert data["version"] == cache.CACHE_VERSION == 4 and set(data["entries"]) == {
        gemv_key,
        gemm_key,
    }


def test_gemm_lookup_is_memoised_until_store(tmp_path, fake_config) -> None:
    path = tmp_path / "tune.json"
    key = cache.gemm_cache_key(**_GEMM, rows_per_expert=2)
    cache.store_results({key: {"backend": "gemv", "config": None}}, path)
    assert cache.tuned_gemm(**_GEMM, rows_per_expert=2, path=path) == ("gemv", ())
    path.write_text(json.dumps({"version": cache.CACHE_VERSION, "entries": {}}))
    assert cache.tuned_gemm(**_GEMM, rows_per_expert=2, path=path) == ("gemv", ())
    cache.clear_cache()
    assert cache.tuned_gemm(**_GEMM, rows_per_expert=2, path=path) is None


def test_stored_choice_decodes_to_the_same_config() -> None:
    """What tune_gemm stores is what the dispatch builds again, for every compiled tiling."""
    from cupymoe.experts import handover
    from cupymoe.experts.gemm import GEMM_TILINGS, WGMMA_TILINGS, GemmConfig, WgmmaConfig

    configs = [GemmConfig(*t) for t in GEMM_TILINGS] + [WgmmaConfig(*t) for t in WGMMA_TILINGS]
    for cfg in [*configs, config.GemvConfig(16, 128)]:
        stored = json.loads(json.dumps(tune._stored_choice(cfg)))  # through the file
        fields = stored["config"] or {}
        decoded = handover._decode((stored["backend"], tuple(sorted(fields.items()))))
        if isinstance(cfg, config.GemvConfig):
            assert decoded == (handover.Backend.GEMV, None)  # the GEMV keeps its own tiling
        else:
            assert decoded == (handover.Backend.GEMM, cfg)
        label = tune.candidate_label(cfg)
        assert (
            label.split(" ")[0] == {"gemv": "gemv", "gemm": fields.get("kind")}[stored["backend"]]
        )


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_problem_tokens_hit_their_bucket(preset: str) -> None:
    from cupymoe.experts.handover import rows_per_expert

    p = PRESETS[preset]
    for bucket in cache.ROWS_PER_EXPERT_BUCKETS:
        tokens = tune._problem_tokens(bucket, p.n_experts, p.top_k)
        got = rows_per_expert(tokens * p.top_k, p.n_experts)
        assert cache.rows_per_expert_bucket(got) == bucket and bucket / 2 < got <= bucket


def test_gemm_candidates_fit_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from cupymoe.experts.gemm import GEMM_TILINGS, WGMMA_TILINGS, GemmConfig, WgmmaConfig

    every = [GemmConfig(*t) for t in GEMM_TILINGS] + [WgmmaConfig(*t) for t in WGMMA_TILINGS]
    monkeypatch.setattr(tune, "wgmma_enabled", lambda: True)
    monkeypatch.setattr(tune, "max_shared_per_block", lambda: 227 * 1024)
    assert tune.gemm_candidates(4096, 256, 0) == every  # everything fits an H200 block
    monkeypatch.setattr(tune, "wgmma_enabled", lambda: False)
    assert tune.gemm_candidates(4096, 256, 0) == every[: len(GEMM_TILINGS)]
    monkeypatch.setattr(tune, "max_shared_per_block", lambda: 99 * 1024)  # sm_89 / sm_120
    narrow = tune.gemm_candidates(4096, 256, 0)
    assert narrow and all(c.shared_bytes(0, 256) <= 99 * 1024 for c in narrow)
    assert len(narrow) < len(GEMM_TILINGS)
    monkeypatch.setattr(tune, "max_shared_per_block", lambda: 227 * 1024)
    monkeypatch.setattr(tune, "wgmma_enabled", lambda: True)
    total = tune.count_gemm_trials(
        [(512, 2048), (2048, 512)], fmt="nvfp4", rows_per_expert=[3, 4, 8], n_experts=256
    )
    assert total == 2 * 2 * (1 + len(every))  # buckets 4 and 8, the GEMV and every tiling


def test_gemm_table() -> None:
    from cupymoe.experts.gemm import GEMM_TILINGS, GemmConfig

    key = cache.gemm_cache_key(**_GEMM, rows_per_expert=16)
    fast, slow = (tune.candidate_label(GemmConfig(*t)) for t in GEMM_TILINGS[:2])
    candidates = {"gemv 64x128": 30.0, fast: 20.0, slow: 25.0}
    results = {key: {"backend": "gemm", "tokens": 512, "candidates": candidates}}
    lines = tune.gemm_table(results).splitlines()
    head = "op N K E rows/exp tokens gemv us mma us wgmma us winner"
    assert lines[0].split() == head.split()
    assert lines[1].split() == f"fc1 512 2048 256 16 512 30.0 20.0 - {fast}".split()


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


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fc1", "fc2"])
def test_tune_gemm_entries_drive_the_dispatch(
    op: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tune_gemm stores a winner per bucket out of the GEMV and every tiling that runs here; a
    dispatch call in that bucket then runs the stored backend and tiling (every candidate in
    turn, stored by hand) and matches the float64 reference."""
    cupy = pytest.importorskip("cupy")
    from cupymoe._runtime.device import device_name
    from cupymoe.experts import dispatch, gemv, handover
    from cupymoe.experts.reference import fc1_ref, fc2_ref
    from cupymoe.presets import random_fp4_experts
    from cupymoe.routing import Routing, expert_maps_ref
    from cupymoe.testing import assert_close, tolerance_for

    path = tmp_path / "tune.json"
    monkeypatch.setattr(cache, "_default_file", lambda: str(path))  # dispatch reads this file
    cache.clear_cache()
    e, top_k, n, k = 8, 2, 64, 256
    got = tune.tune_gemm(
        [(n, k)],
        fmt="nvfp4",
        rows_per_expert=[2, 16],
        op=op,
        n_experts=e,
        top_k=top_k,
        warmup=1,
        repeats=3,
        l2_defeat_bytes=1,
    )
    keys = {
        b: cache.gemm_cache_key(
            device_name=device_name(),
            op=op,
            fmt="nvfp4",
            dtype=ml_dtypes.bfloat16,
            n=n,
            k=k,
            n_experts=e,
            rows_per_expert=b,
        )
        for b in (2, 16)
    }
    assert set(got) == set(keys.values())
    assert set(json.loads(path.read_text())["entries"]) == set(got)
    for bucket, key in keys.items():
        entry = got[key]
        rows = entry["tokens"] * top_k
        code = Fp4Format.NVFP4.code
        tilings = {tune.candidate_label(c) for c in tune.gemm_candidates(rows, e, code)}
        assert tilings <= set(entry["candidates"])
        assert [c.split()[0] for c in set(entry["candidates"]) - tilings] == ["gemv"]
        assert entry["us"] == min(entry["candidates"].values())
        assert entry["rows_per_expert"] == bucket and entry["backend"] in ("gemv", "gemm")

    rng = np.random.default_rng(3)
    mats = [random_fp4_experts(rng, e, n, k, "nvfp4") for _ in range(2 if op == "fc1" else 1)]
    weights = gemv.prepare_fc1(*mats) if op == "fc1" else gemv.prepare_fc2(*mats)
    n_tokens = 16 * e // top_k  # 16 rows per expert
    ids = np.argsort(rng.random((n_tokens, e)), axis=1)[:, :top_k].astype(np.int32)
    fields = [ids, np.full(ids.shape, 1.0 / top_k, np.float32), *expert_maps_ref(ids, e)]
    routing = Routing(*[cupy.asarray(a) for a in fields])
    offsets, sorted_rows = fields[2], fields[3]
    act = ActivationSpec(Activation.SWIGLU)
    x = rng.standard_normal((n_tokens if op == "fc1" else n_tokens * top_k, k))
    x = x.astype(ml_dtypes.bfloat16)
    if op == "fc1":
        ref = fc1_ref(x[sorted_rows // top_k], mats[0], mats[1], offsets, act=act)
    else:
        ref = fc2_ref(x, mats[0], offsets)

    seen: list[Any] = []

    def spy(real: Any, *args: Any, **kw: Any) -> Any:
        seen.append(kw["config"])
        return real(*args, **kw)

    for name in ("gemv_fc1", "gemv_fc2", "gemm_fc1", "gemm_fc2"):
        monkeypatch.setattr(dispatch, name, functools.partial(spy, getattr(dispatch, name)))

    def call() -> Any:
        seen.clear()
        if op == "fc1":
            out = dispatch.fc1(cupy.asarray(x), weights, routing, act=act)
        else:
            out = dispatch.fc2(cupy.asarray(x), weights, routing)
        max_rel, rms_rel = tolerance_for(ml_dtypes.bfloat16)
        assert_close(ref, out, max_rel=max_rel, rms_rel=rms_rel, name=f"{op} {seen}")
        (config,) = seen
        return config

    rows = n_tokens * top_k
    gemv_cfg = gemv.default_config(
        weights.gate if op == "fc1" else weights.down,
        rows,
        ml_dtypes.bfloat16,
        gated=op == "fc1",
        layout=WeightLayout.SPLIT,
    )
    winner = handover._decode(cache.tuned_gemm(**_tuned_problem(keys[16]), path=path))
    assert call() == (winner[1] or gemv_cfg)  # the tuned winner of the bucket
    for candidate in [gemv_cfg, *tune.gemm_candidates(rows, e, Fp4Format.NVFP4.code)]:
        cache.store_results({keys[16]: tune._stored_choice(candidate)}, path)
        assert call() == candidate


def _tuned_problem(key: str) -> dict[str, Any]:
    """The keywords of cache.tuned_gemm for a gemm key (device|gemm|op|fmt|dtype|N|K|E|bucket)."""
    device, _, op, fmt, dtype, n, k, e, bucket = key.split("|")
    return dict(
        device_name=device,
        op=op,
        fmt=fmt,
        dtype=dtype,
        n=int(n),
        k=int(k),
        n_experts=int(e),
        rows_per_expert=int(bucket),
    )
