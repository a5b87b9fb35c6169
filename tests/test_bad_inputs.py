# SPDX-License-Identifier: Apache-2.0
"""The bad-input matrix: every public entry point with wrong shapes, dtypes, strides, devices,
empty batches, out-of-range ``top_k``, non-finite scales, mismatched expert counts and too many
tokens. Each case either raises a clear ``ValueError`` / ``TypeError`` whose message names the
argument, or gives the documented result (``M = 0`` -> an empty result, strided NumPy input ->
the same bits as contiguous input).

Cases are rows of a table (:class:`Case`). CPU cases run everywhere (the ``*_ref`` functions,
constructors, ``MoELayer`` with NumPy arrays, checkpoints, the CLI); GPU cases (marked ``gpu``)
call the CuPy ops. A case that exposes a library bug carries ``bug`` (strict xfail: it fails
today; when the library is fixed it passes and the mark must go). ``gpu_bug`` does the same for
a CPU case only where a GPU runs it (``MoELayer`` with NumPy input uses the GPU when present).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

import cupymoe as cm
from cupymoe import formats as fm
from cupymoe._runtime.backend import gpu_available, require_cupy
from cupymoe.cli import cli
from cupymoe.experts.activation import Activation, ActivationSpec, activation_ref
from cupymoe.experts.cache import cache_key, row_bucket
from cupymoe.experts.config import GemvConfig
from cupymoe.experts.dequant import dequantize_ref
from cupymoe.experts.reference import fc1_ref, fc2_ref
from cupymoe.io import checkpoint as ck
from cupymoe.layer.expand import expand_ref
from cupymoe.layer.finalize import finalize_ref
from cupymoe.presets import random_fp4_experts
from cupymoe.routing import Router, Routing, RoutingMethod, expert_maps_ref, route_ref
from cupymoe.testing import assert_close, tolerance_for

BF16 = ml_dtypes.bfloat16
E, H, I, TOP_K, M = 4, 64, 32, 2, 3
_RNG = np.random.default_rng(20261130)
GATE = random_fp4_experts(_RNG, E, I, H, "nvfp4")
UP = random_fp4_experts(_RNG, E, I, H, "nvfp4")
DOWN = random_fp4_experts(_RNG, E, H, I, "nvfp4")
MX_GATE = random_fp4_experts(_RNG, E, I, H, "mxfp4")
X = _RNG.standard_normal((M, H)).astype(BF16)
LOGITS = _RNG.standard_normal((M, E)).astype(np.float32)
ROUTER = Router(E, TOP_K)
ROUTING = route_ref(LOGITS, ROUTER)
SWIGLU = ActivationSpec("swiglu")


@dataclasses.dataclass(frozen=True)
class Case:
    """One row of the matrix: ``call()`` raises ``raises`` matching ``match``, or its result
    passes ``check`` (the documented result of an input the library accepts)."""

    id: str
    call: Callable[[], Any]
    raises: type[Exception] | None = None
    match: str | None = None  # regex searched in str(exception): names the argument
    check: Callable[[Any], None] | None = None
    bug: str | None = None  # "BUG: file:line ..." -> strict xfail everywhere
    gpu_bug: str | None = None  # strict xfail only where a GPU runs the case


def _build(rows: list[Case]) -> list[Case]:
    """Validate the table: unique ids, and exactly one of (raises + match) or check."""
    ids = [c.id for c in rows]
    duplicates = {i for i in ids if ids.count(i) > 1}
    assert not duplicates, f"duplicate case ids {duplicates}"
    for c in rows:
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+", c.id), c.id
        assert (c.raises is None) == (c.match is None), c.id
        assert (c.raises is None) != (c.check is None), c.id
        assert c.raises in (None, ValueError, TypeError, KeyError, FileNotFoundError), c.id
    return rows


def bad(id: str, raises: type[Exception], match: str, call: Callable[[], Any], **kw: Any) -> Case:
    return Case(id, call, raises=raises, match=match, **kw)


def ok(id: str, check: Callable[[Any], None], call: Callable[[], Any], **kw: Any) -> Case:
    return Case(id, call, check=check, **kw)


# ---- checks of accepted inputs -------------------------------------------------------------------
def _shape(*shape: int, dtype: Any = None) -> Callable[[Any], None]:
    def check(a: Any) -> None:
        assert tuple(a.shape) == shape, a.shape
        if dtype is not None:
            assert a.dtype == np.dtype(dtype), a.dtype

    return check


def _graph_of(n_tokens: int) -> Callable[[Any], None]:
    """A recorded ``LayerGraph`` with static buffers of ``n_tokens`` tokens (any count is
    capturable: the grouped GEMM serves the batches above the GEMV)."""

    def check(graph: Any) -> None:
        assert isinstance(graph, cm.LayerGraph) and graph.x.shape[0] == n_tokens

    return check


def _same_bits(expected: Callable[[], Any]) -> Callable[[Any], None]:
    """Bitwise equal (NaN-safe) to ``expected()``: the same call on contiguous input."""

    def check(a: Any) -> None:
        want, got = _host(expected()), _host(a)
        assert want.shape == got.shape and want.dtype == got.dtype
        np.testing.assert_array_equal(_bits(want), _bits(got))

    return check


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" or a.dtype == BF16 else a


def _host(a: Any) -> np.ndarray:
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _routing_equal(expected: Routing | Callable[[], Routing]) -> Callable[[Any], None]:
    def check(r: Any) -> None:
        want_all = expected() if callable(expected) else expected
        for f in dataclasses.fields(Routing):
            want, got = getattr(want_all, f.name), getattr(r, f.name)
            np.testing.assert_array_equal(_host(want), _host(got), err_msg=f.name)

    return check


def _empty_routing(r: Routing) -> None:
    assert r.topk_ids.shape == (0, TOP_K) and r.sorted_rows.shape == (0,)
    np.testing.assert_array_equal(_host(r.expert_offsets), np.zeros(E + 1, np.int32))


def _close(ref: Callable[[], Any], dtype: Any = BF16) -> Callable[[Any], None]:
    def check(a: Any) -> None:
        max_rel, rms_rel = tolerance_for(dtype)
        assert_close(ref(), a, max_rel=2 * max_rel, rms_rel=2 * rms_rel)

    return check


def _cli_exit(match: str, code: int = 2) -> Callable[[Any], None]:
    """Exit code 2 (click usage error) or 1 (the library's error, as ``Error: ...``)."""

    def check(result: Any) -> None:
        assert result.exit_code == code, result.output
        assert re.search(match, result.output), result.output

    return check


# ---- builders of inputs ------------------------------------------------------------------------
def _fp4(fmt: str = "nvfp4", **fields: Any) -> fm.Fp4Experts:
    base = GATE if fmt == "nvfp4" else MX_GATE
    kw = dict(packed=base.packed, scales=base.scales, global_scale=base.global_scale)
    kw.update(fields)
    return fm.Fp4Experts(fmt, kw["packed"], kw["scales"], kw["global_scale"])


def _with(a: np.ndarray, index: Any, value: Any) -> np.ndarray:
    b = np.array(a)
    b[index] = value
    return b


def _layer(fc1: Any = None, fc2: Any = None, **kw: Any) -> cm.MoELayer:
    args: dict[str, Any] = dict(top_k=TOP_K, max_tokens=8)
    args.update(kw)
    return cm.MoELayer((GATE, UP) if fc1 is None else fc1, DOWN if fc2 is None else fc2, **args)


@functools.lru_cache(maxsize=1)
def _cpu_layer() -> cm.MoELayer:
    return _layer()


def _run(x: Any, logits: Any = None, **kw: Any) -> Any:
    return _cpu_layer()(x, LOGITS[: len(x)] if logits is None else logits, **kw)


def _nan_token_row(out: np.ndarray) -> None:
    assert np.isnan(out[1].astype(np.float32)).all()
    assert np.isfinite(out[[0, 2]].astype(np.float32)).all()


_TMP = tempfile.TemporaryDirectory(prefix="cupymoe-bad-inputs-")
_counter = iter(range(1 << 30))


def _file(name: str = "model.safetensors") -> str:
    d = os.path.join(_TMP.name, str(next(_counter)))
    os.makedirs(d)
    return os.path.join(d, name)


def _saved(naming: str = "modelopt", mutate: Callable[[dict], Any] | None = None, **kw: Any) -> str:
    """A one-layer checkpoint of the shared weights, optionally with its tensors edited."""
    path = _file()
    if naming == "gpt-oss":
        fc1 = random_fp4_experts(np.random.default_rng(1), E, 2 * I, H, "mxfp4")
        fc2 = random_fp4_experts(np.random.default_rng(2), E, H, I, "mxfp4")
        ck.save_experts(path, layer=0, naming=naming, fc1=fc1, fc2=fc2, **kw)
    else:
        ck.save_experts(path, layer=0, naming=naming, fc1=(GATE, UP), fc2=DOWN, **kw)
    if mutate is not None:
        with ck.Checkpoint(path) as c:
            tensors = {n: c.read(n) for n in c}
        mutate(tensors)
        ck.write_safetensors(path, tensors)
    return path


def _raw_file(data: bytes) -> str:
    path = _file()
    with open(path, "wb") as f:
        f.write(data)
    return path


def _truncated() -> str:
    path = _saved()
    with open(path, "rb") as f:
        data = f.read()
    return _raw_file(data[:-7])


def _index_dir(weight_map: Any) -> str:
    """A directory with an index file (``weight_map=None``: an index without the key)."""
    path = _file("model.safetensors.index.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({} if weight_map is None else {"weight_map": weight_map}, f)
    return os.path.dirname(path)


_P = "model.layers.0.mlp.experts"


def _drop(*names: str) -> Callable[[dict], None]:
    return lambda t: [t.pop(n) for n in names]


def _set(name: str, value: Any) -> Callable[[dict], None]:
    return lambda t: t.__setitem__(name, value)


def _load(path_fn: Callable[[], str], layer: Any = 0, **kw: Any) -> Callable[[], Any]:
    return lambda: ck.load_experts(path_fn(), layer=layer, **kw)


def _cli(*args: str) -> Callable[[], Any]:
    return lambda: CliRunner().invoke(cli, list(args))


def _env(name: str, value: str, fn: Callable[[], Any]) -> Any:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


# fmt: off
# ================================================================================================
# CPU cases
# ================================================================================================
def _cpu_formats() -> list[Case]:
    nan_e4m3 = _with(GATE.scales, (1, 2, 0), 0x7F)
    return [
        bad("formats-encode_e2m1-nan", ValueError, "^x: NaN", lambda: fm.encode_e2m1([np.nan])),
        bad("formats-encode_e2m1-str", TypeError, "^x:", lambda: fm.encode_e2m1(["a"])),
        bad("formats-encode_e4m3-str", TypeError, "^x:", lambda: fm.encode_e4m3(["a"])),
        ok("formats-encode_e4m3-inf-is-nan-code", lambda a: a.tolist() == [0x7F, 0x7F],
           lambda: fm.encode_e4m3([np.inf, np.nan])),
        bad("formats-decode_e2m1-16", ValueError, "^codes:", lambda: fm.decode_e2m1([16])),
        bad("formats-decode_e2m1-negative", ValueError, "^codes:", lambda: fm.decode_e2m1([-1])),
        bad("formats-decode_e2m1-float", TypeError, "^codes:", lambda: fm.decode_e2m1([1.0])),
        bad("formats-decode_e4m3-256", ValueError, "^data:", lambda: fm.decode_e4m3([256])),
        bad("formats-decode_e4m3-float", TypeError, "^data:", lambda: fm.decode_e4m3([0.5])),
        bad("formats-decode_e8m0-256", ValueError, "^data:", lambda: fm.decode_e8m0([256])),
        bad("formats-decode_e8m0-float", TypeError, "^data:", lambda: fm.decode_e8m0([0.5])),
        bad("formats-encode_e8m0_exponent-float", TypeError, "^exponent:",
            lambda: fm.encode_e8m0_exponent([1.5])),
        bad("formats-pack_fp4-odd-k", ValueError, "^codes:", lambda: fm.pack_fp4([1, 2, 3])),
        bad("formats-pack_fp4-0d", ValueError, "^codes:", lambda: fm.pack_fp4(np.uint8(3))),
        bad("formats-pack_fp4-code-16", ValueError, "^codes:", lambda: fm.pack_fp4([16, 0])),
        ok("formats-pack_fp4-empty", _shape(0), lambda: fm.pack_fp4(np.zeros(0, np.uint8))),
        bad("formats-unpack_fp4-int32", TypeError, "^packed:",
            lambda: fm.unpack_fp4(np.zeros(4, np.int32))),
        bad("formats-unpack_fp4-0d", TypeError, "^packed:", lambda: fm.unpack_fp4(np.uint8(1))),
        bad("formats-to_pair_interleaved-k-not-8", ValueError, "^packed:",
            lambda: fm.to_pair_interleaved(np.zeros((2, 2), np.uint8))),
        bad("formats-from_pair_interleaved-k-not-8", ValueError, "^packed:",
            lambda: fm.from_pair_interleaved(np.zeros((2, 6), np.uint8))),
        bad("formats-Fp4Format-parse-unknown", ValueError, "^format:",
            lambda: cm.Fp4Format.parse("int4")),
        bad("formats-MxScaleRule-parse-unknown", ValueError, "^mx_scale_rule:",
            lambda: cm.MxScaleRule.parse("nearest")),
        # Fp4Experts(...) directly
        bad("formats-Fp4Experts-format-unknown", ValueError, "^format:",
            lambda: fm.Fp4Experts("fp8", GATE.packed, GATE.scales, GATE.global_scale)),
        bad("formats-Fp4Experts-packed-list", TypeError, "^packed:",
            lambda: _fp4(packed=GATE.packed.tolist())),
        bad("formats-Fp4Experts-packed-int8", TypeError, "^packed:",
            lambda: _fp4(packed=GATE.packed.view(np.int8))),
        bad("formats-Fp4Experts-packed-2d", ValueError, "^packed:",
            lambda: _fp4(packed=GATE.packed[0])),
        bad("formats-Fp4Experts-k-not-block-nvfp4", ValueError, "^packed: K = .* = 24 must",
            lambda: _fp4(packed=np.zeros((E, I, 12), np.uint8),
                         scales=np.zeros((E, I, 1), np.uint8))),
        bad("formats-Fp4Experts-k-not-block-mxfp4", ValueError, "^packed: K = .* = 48 must",
            lambda: _fp4("mxfp4", packed=np.zeros((E, I, 24), np.uint8),
                         scales=np.zeros((E, I, 1), np.uint8))),
        bad("formats-Fp4Experts-scales-shape", ValueError, "^scales:",
            lambda: _fp4(scales=GATE.scales[:, :, :-1])),
        bad("formats-Fp4Experts-scales-float32", TypeError, "^scales:",
            lambda: _fp4(scales=GATE.scales.astype(np.float32))),
        bad("formats-Fp4Experts-scales-expert-count", ValueError, "^scales:",
            lambda: _fp4(scales=GATE.scales[:-1])),
        bad("formats-Fp4Experts-global_scale-expert-count", ValueError, "^global_scale:",
            lambda: _fp4(global_scale=GATE.global_scale[:-1])),
        bad("formats-Fp4Experts-global_scale-float64", TypeError, "^global_scale:",
            lambda: _fp4(global_scale=GATE.global_scale.astype(np.float64))),
        *[
            bad(f"formats-Fp4Experts-global_scale-{name}", ValueError, "^global_scale:",
                functools.partial(lambda v: _fp4(global_scale=_with(GATE.global_scale, 2, v)), v))
            for name, v in (("zero", 0.0), ("negative", -1.0), ("nan", np.nan), ("inf", np.inf))
        ],
        bad("formats-Fp4Experts-scales-nan-e4m3-0x7f", ValueError, "^scales: 1 NaN",
            lambda: _fp4(scales=nan_e4m3)),
        bad("formats-Fp4Experts-scales-nan-e4m3-0xff", ValueError, "^scales: 1 NaN",
            lambda: _fp4(scales=_with(GATE.scales, (0, 0, 0), 0xFF))),
        bad("formats-Fp4Experts-scales-nan-e8m0-0xff", ValueError, "^scales: 1 NaN",
            lambda: _fp4("mxfp4", scales=_with(MX_GATE.scales, (0, 0, 0), 0xFF))),
        ok("formats-Fp4Experts-packed-noncontiguous-copied",
           lambda w: np.array_equal(w.packed, GATE.packed[:, ::2]) and w.packed.flags.c_contiguous,
           lambda: _fp4(packed=GATE.packed[:, ::2], scales=GATE.scales[:, ::2])),
        ok("formats-Fp4Experts-packed-negative-strides-copied",
           lambda w: np.array_equal(w.packed, GATE.packed[::-1]) and w.packed.flags.c_contiguous,
           lambda: _fp4(packed=GATE.packed[::-1], scales=GATE.scales[::-1])),
        # Fp4Experts.from_packed
        bad("formats-from_packed-scales-float32", TypeError, "^scales:",
            lambda: cm.Fp4Experts.from_packed(GATE.packed, GATE.scales.astype(np.float32))),
        bad("formats-from_packed-scales-e8m0-for-nvfp4", TypeError, "^scales:",
            lambda: cm.Fp4Experts.from_packed(
                GATE.packed, GATE.scales.view(ml_dtypes.float8_e8m0fnu), format="nvfp4")),
        bad("formats-from_packed-scales-e4m3-nan", ValueError, "^scales: 1 NaN",
            lambda: cm.Fp4Experts.from_packed(
                GATE.packed, nan_e4m3.view(ml_dtypes.float8_e4m3fn), GATE.global_scale)),
        bad("formats-from_packed-global_scale-scalar-many-experts", ValueError, "^global_scale:",
            lambda: cm.Fp4Experts.from_packed(GATE.packed, GATE.scales, 0.5)),
        bad("formats-from_packed-global_scale-str", TypeError, "^global_scale:",
            lambda: cm.Fp4Experts.from_packed(GATE.packed, GATE.scales, np.array(["a"] * E))),
        bad("formats-from_packed-global_scale-zero", ValueError, "^global_scale:",
            lambda: cm.Fp4Experts.from_packed(GATE.packed, GATE.scales, np.zeros(E))),
        bad("formats-from_packed-global_scale-expert-count", ValueError, "^global_scale:",
            lambda: cm.Fp4Experts.from_packed(GATE.packed, GATE.scales, np.ones(E + 1))),
        bad("formats-from_packed-format-unknown", ValueError, "^format:",
            lambda: cm.Fp4Experts.from_packed(GATE.packed, GATE.scales, format="nvfp8")),
        # Fp4Experts.quantize
        bad("formats-quantize-2d", ValueError, "^weights:",
            lambda: cm.Fp4Experts.quantize(np.zeros((4, 16), np.float32))),
        bad("formats-quantize-int32", TypeError, "^weights:",
            lambda: cm.Fp4Experts.quantize(np.zeros((1, 4, 16), np.int32))),
        bad("formats-quantize-k-not-block-nvfp4", ValueError, "^weights: k = 24",
            lambda: cm.Fp4Experts.quantize(np.ones((1, 4, 24), np.float32))),
        bad("formats-quantize-k-not-block-mxfp4", ValueError, "^weights: k = 48",
            lambda: cm.Fp4Experts.quantize(np.ones((1, 4, 48), np.float32), "mxfp4")),
        bad("formats-quantize-nan", ValueError, "^weights: 1 non-finite",
            lambda: cm.Fp4Experts.quantize(_with(np.ones((1, 4, 16)), (0, 1, 2), np.nan))),
        bad("formats-quantize-inf", ValueError, "^weights: 1 non-finite",
            lambda: cm.Fp4Experts.quantize(_with(np.ones((1, 4, 32)), (0, 0, 0), -np.inf),
                                           "mxfp4")),
        bad("formats-quantize-format-unknown", ValueError, "^format:",
            lambda: cm.Fp4Experts.quantize(np.ones((1, 4, 16)), "fp4")),
        bad("formats-quantize-mx_scale_rule-unknown", ValueError, "^mx_scale_rule:",
            lambda: cm.Fp4Experts.quantize(np.ones((1, 4, 32)), "mxfp4", mx_scale_rule="up")),
        bad("formats-quantize-amax-underflows-global-scale", ValueError, "^weights:",
            lambda: cm.Fp4Experts.quantize(np.full((1, 1, 16), 1e-45, np.float32))),
        ok("formats-quantize-all-zero-expert", lambda w: float(w.global_scale[0]) == 1.0,
           lambda: cm.Fp4Experts.quantize(np.zeros((1, 4, 16), np.float32))),
        bad("formats-dequantize-dtype-int8", TypeError, "^dtype:",
            lambda: GATE.dequantize(np.int8)),
        bad("formats-select_rows-out-of-range", ValueError, "^index:",
            lambda: GATE.select_rows(np.array([0, I]))),
        bad("formats-select_rows-2d", TypeError, "^index:",
            lambda: GATE.select_rows(np.zeros((2, 2), np.int64))),
        bad("formats-select_rows-float", TypeError, "^index:",
            lambda: GATE.select_rows(np.array([0.0, 1.0]))),
        ok("formats-select_rows-empty", lambda w: w.n == 0,
           lambda: GATE.select_rows(np.zeros(0, np.int64))),
    ]


def _cpu_routing() -> list[Case]:
    def grouped(**kw: Any) -> Router:
        args: dict[str, Any] = dict(method="sigmoid_grouped", n_group=2, topk_group=1)
        args.update(kw)
        return Router(8, 2, **args)

    nan_row = _with(LOGITS, 1, np.nan)
    return [
        bad("routing-RoutingMethod-parse-unknown", ValueError, "^routing:",
            lambda: RoutingMethod.parse("argmax")),
        bad("routing-Router-n_experts-0", ValueError, "^n_experts:", lambda: Router(0, 1)),
        bad("routing-Router-n_experts-float", TypeError, "^n_experts:", lambda: Router(4.0, 1)),
        bad("routing-Router-top_k-0", ValueError, "^top_k:", lambda: Router(E, 0)),
        bad("routing-Router-top_k-negative", ValueError, "^top_k:", lambda: Router(E, -1)),
        bad("routing-Router-top_k-above-E", ValueError, "^top_k:", lambda: Router(E, E + 1)),
        bad("routing-Router-top_k-bool", TypeError, "^top_k:", lambda: Router(E, True)),
        bad("routing-Router-top_k-float", TypeError, "^top_k:", lambda: Router(E, 2.0)),
        ok("routing-Router-top_k-equals-E", lambda r: r.top_k == E, lambda: Router(E, E)),
        ok("routing-Router-top_k-above-gpu-limit-cpu-ok", lambda r: r.top_k == 65,
           lambda: Router(72, 65)),
        bad("routing-Router-method-unknown", ValueError, "^routing:",
            lambda: Router(E, 1, method="softmax")),
        bad("routing-Router-renormalize-str", TypeError, "^renormalize:",
            lambda: Router(E, 1, renormalize="yes")),
        bad("routing-Router-n_group-for-softmax", ValueError, "^n_group:",
            lambda: Router(E, 1, n_group=2)),
        bad("routing-Router-correction_bias-for-softmax", ValueError, "^correction_bias:",
            lambda: Router(E, 1, correction_bias=np.zeros(E, np.float32))),
        bad("routing-Router-routed_scaling_factor-for-softmax", ValueError,
            "^routed_scaling_factor:", lambda: Router(E, 1, routed_scaling_factor=2.0)),
        bad("routing-Router-n_group-not-divisor", ValueError, "^n_group:",
            lambda: grouped(n_group=3)),
        bad("routing-Router-n_group-groups-of-1", ValueError, "^n_group:",
            lambda: grouped(n_group=8)),
        bad("routing-Router-n_group-float", TypeError, "^n_group:", lambda: grouped(n_group=2.0)),
        bad("routing-Router-topk_group-0", ValueError, "^topk_group:",
            lambda: grouped(topk_group=0)),
        bad("routing-Router-topk_group-above-n_group", ValueError, "^topk_group:",
            lambda: grouped(topk_group=3)),
        bad("routing-Router-topk_group-too-few-experts", ValueError, "^topk_group:",
            lambda: Router(8, 5, method="sigmoid_grouped", n_group=2, topk_group=1)),
        bad("routing-Router-correction_bias-expert-count", ValueError, "^correction_bias:",
            lambda: grouped(correction_bias=np.zeros(9, np.float32))),
        bad("routing-Router-correction_bias-nan", ValueError, "^correction_bias:",
            lambda: grouped(correction_bias=_with(np.zeros(8, np.float32), 3, np.nan))),
        bad("routing-Router-correction_bias-inf", ValueError, "^correction_bias:",
            lambda: grouped(correction_bias=_with(np.zeros(8, np.float32), 0, np.inf))),
        bad("routing-Router-correction_bias-int", TypeError, "^correction_bias:",
            lambda: grouped(correction_bias=np.zeros(8, np.int32))),
        *[
            bad(f"routing-Router-routed_scaling_factor-{name}", ValueError,
                "^routed_scaling_factor:",
                functools.partial(lambda v: grouped(routed_scaling_factor=v), v))
            for name, v in (("zero", 0.0), ("negative", -1.0), ("nan", np.nan), ("inf", np.inf))
        ],
        # route_ref
        bad("routing-route_ref-logits-list", TypeError, "^logits:",
            lambda: route_ref(LOGITS.tolist(), ROUTER)),
        bad("routing-route_ref-logits-1d", ValueError, "^logits:",
            lambda: route_ref(LOGITS[0], ROUTER)),
        bad("routing-route_ref-logits-expert-count", ValueError, "^logits:",
            lambda: route_ref(np.zeros((M, E + 1), np.float32), ROUTER)),
        bad("routing-route_ref-logits-int32", TypeError, "^logits:",
            lambda: route_ref(LOGITS.astype(np.int32), ROUTER)),
        bad("routing-route_ref-router-str", TypeError, "^router:",
            lambda: route_ref(LOGITS, "softmax_topk")),
        ok("routing-route_ref-M0-empty", _empty_routing,
           lambda: route_ref(np.zeros((0, E), np.float32), ROUTER)),
        ok("routing-route_ref-logits-noncontiguous", _routing_equal(ROUTING),
           lambda: route_ref(np.repeat(LOGITS, 2, axis=1)[:, ::2], ROUTER)),
        ok("routing-route_ref-logits-float64-rounded-to-float32", _routing_equal(ROUTING),
           lambda: route_ref(LOGITS.astype(np.float64), ROUTER)),
        ok("routing-route_ref-logits-fortran", _routing_equal(ROUTING),
           lambda: route_ref(np.asfortranarray(LOGITS), ROUTER)),
        ok("routing-route_ref-logits-negative-strides",
           _routing_equal(route_ref(np.ascontiguousarray(LOGITS[::-1]), ROUTER)),
           lambda: route_ref(LOGITS[::-1], ROUTER)),
        ok("routing-route_ref-nan-row-documented",
           lambda r: r.topk_ids[1].tolist() == [0, 1] and not r.topk_weights[1].any(),
           lambda: route_ref(nan_row, ROUTER)),
        ok("routing-route_ref-top_k-above-gpu-limit",
           lambda r: r.topk_ids.shape == (1, 65) and len(set(r.topk_ids[0].tolist())) == 65,
           lambda: route_ref(np.zeros((1, 72), np.float32), Router(72, 65))),
        # expert_maps_ref
        bad("routing-expert_maps_ref-float-ids", TypeError, "^topk_ids:",
            lambda: expert_maps_ref(np.zeros((2, 2)), E)),
        bad("routing-expert_maps_ref-1d", TypeError, "^topk_ids:",
            lambda: expert_maps_ref(np.zeros(4, np.int32), E)),
        bad("routing-expert_maps_ref-id-ge-E", ValueError, "^topk_ids:",
            lambda: expert_maps_ref(np.array([[0, E]], np.int32), E)),
        bad("routing-expert_maps_ref-id-negative", ValueError, "^topk_ids:",
            lambda: expert_maps_ref(np.array([[-1, 0]], np.int32), E)),
        ok("routing-expert_maps_ref-M0-empty",
           lambda maps: maps[0].tolist() == [0] * (E + 1) and maps[1].shape == (0,),
           lambda: expert_maps_ref(np.zeros((0, TOP_K), np.int32), E)),
    ]


def _cpu_stages() -> list[Case]:
    r0 = route_ref(np.zeros((0, E), np.float32), ROUTER)
    y = np.ones((M * TOP_K, H))
    xs = expand_ref(X, ROUTING).astype(np.float64)
    off = ROUTING.expert_offsets
    return [
        bad("expand-expand_ref-routing-none", TypeError, "^routing:", lambda: expand_ref(X, None)),
        bad("expand-expand_ref-x-token-count", ValueError, "^x:",
            lambda: expand_ref(X[:2], ROUTING)),
        bad("expand-expand_ref-x-1d", ValueError, "^x:", lambda: expand_ref(X[0], ROUTING)),
        ok("expand-expand_ref-x-noncontiguous", _same_bits(lambda: expand_ref(X, ROUTING)),
           lambda: expand_ref(np.repeat(X, 2, axis=1)[:, ::2], ROUTING)),
        ok("expand-expand_ref-M0-empty", _shape(0, H, dtype=BF16),
           lambda: expand_ref(np.zeros((0, H), BF16), r0)),
        bad("finalize-finalize_ref-routing-dict", TypeError, "^routing:",
            lambda: finalize_ref(y, vars(ROUTING))),
        bad("finalize-finalize_ref-y-rows", ValueError, "^y:",
            lambda: finalize_ref(y[1:], ROUTING)),
        bad("finalize-finalize_ref-y-1d", ValueError, "^y:", lambda: finalize_ref(y[0], ROUTING)),
        bad("finalize-finalize_ref-bias-shape", ValueError, "^bias:",
            lambda: finalize_ref(y, ROUTING, bias=np.zeros(H + 1))),
        ok("finalize-finalize_ref-M0-empty", _shape(0, H),
           lambda: finalize_ref(np.zeros((0, H)), r0)),
        bad("gemv-Activation-parse-unknown", ValueError, "^activation:",
            lambda: Activation.parse("tanh")),
        bad("gemv-ActivationSpec-kind-unknown", ValueError, "^kind:",
            lambda: ActivationSpec("tanh")),
        bad("gemv-ActivationSpec-alpha-nan", ValueError, "^alpha:",
            lambda: ActivationSpec("swiglu_oai", alpha=np.nan)),
        bad("gemv-ActivationSpec-alpha-str", TypeError, "^alpha:",
            lambda: ActivationSpec("swiglu_oai", alpha="1.7")),
        bad("gemv-ActivationSpec-limit-zero", ValueError, "^limit:",
            lambda: ActivationSpec("swiglu_oai", limit=0.0)),
        bad("gemv-ActivationSpec-limit-nan", ValueError, "^limit:",
            lambda: ActivationSpec("swiglu_oai", limit=np.nan)),
        bad("gemv-ActivationSpec-limit-float32-zero", ValueError, "^limit:",
            lambda: ActivationSpec("swiglu_oai", limit=1e-50)),
        ok("gemv-ActivationSpec-limit-past-float32-no-clamp", lambda a: a.limit == 1e300,
           lambda: ActivationSpec("swiglu_oai", limit=1e300)),
        bad("gemv-ActivationSpec-limit-bool", TypeError, "^limit:",
            lambda: ActivationSpec("swiglu_oai", limit=True)),
        ok("gemv-ActivationSpec-limit-inf-no-clamp", lambda a: a.limit == np.inf,
           lambda: ActivationSpec("swiglu_oai", limit=np.inf)),
        bad("gemv-activation_ref-act-str", TypeError, "^act:",
            lambda: activation_ref(np.zeros(2), np.zeros(2), "swiglu")),
        bad("gemv-activation_ref-shape-mismatch", ValueError, "^up:",
            lambda: activation_ref(np.zeros(2), np.zeros(3), SWIGLU)),
        bad("gemv-gemv_ref-weights-array", TypeError, "^weights:",
            lambda: fc2_ref(xs, GATE.packed, off)),
        bad("gemv-gemv_ref-x_sorted-width", ValueError, "^x_sorted:",
            lambda: fc2_ref(xs[:, 1:], GATE, off)),
        bad("gemv-gemv_ref-x_sorted-1d", ValueError, "^x_sorted:",
            lambda: fc2_ref(xs[0], GATE, off)),
        bad("gemv-gemv_ref-expert_offsets-expert-count", ValueError, "^expert_offsets:",
            lambda: fc2_ref(xs, GATE, off[:-1])),
        bad("gemv-gemv_ref-expert_offsets-float", ValueError, "^expert_offsets:",
            lambda: fc2_ref(xs, GATE, off.astype(np.float32))),
        bad("gemv-gemv_ref-expert_offsets-wrong-total", ValueError, "^expert_offsets:",
            lambda: fc2_ref(xs[1:], GATE, off)),
        bad("gemv-gemv_ref-expert_offsets-decreasing", ValueError, "^expert_offsets:",
            lambda: fc2_ref(xs, GATE, np.array([0, 4, 2, 6, 6]))),
        bad("gemv-gemv_ref-bias-shape", ValueError, "^bias:",
            lambda: fc2_ref(xs, GATE, off, bias=np.zeros((E, I + 1)))),
        bad("gemv-gemv_ref-bias-expert-count", ValueError, "^bias:",
            lambda: fc2_ref(xs, GATE, off, bias=np.zeros((E + 1, I)))),
        ok("gemv-gemv_ref-x_sorted-negative-strides",
           _same_bits(lambda: fc2_ref(xs[::-1].copy(), GATE, off)),
           lambda: fc2_ref(xs[::-1], GATE, off)),
        ok("gemv-gemv_ref-M0-empty", _shape(0, I),
           lambda: fc2_ref(np.zeros((0, H)), GATE, np.zeros(E + 1, np.int32))),
        bad("gemv-fc1_ref-gate-array", TypeError, "gate",
            lambda: fc1_ref(xs, GATE.packed, UP, off, act=SWIGLU)),
        bad("gemv-fc1_ref-up-shape", ValueError, "^up:",
            lambda: fc1_ref(xs, GATE, GATE.select_rows(slice(0, 16)), off, act=SWIGLU)),
        bad("gemv-fc1_ref-up-expert-count", ValueError, "^up:",
            lambda: fc1_ref(xs, GATE, random_fp4_experts(_RNG, E + 1, I, H), off, act=SWIGLU)),
        bad("gemv-fc1_ref-act-str", TypeError, "^act:",
            lambda: fc1_ref(xs, GATE, UP, off, act="swiglu")),
        bad("gemv-fc1_ref-gate_bias-shape", ValueError, "^gate_bias:",
            lambda: fc1_ref(xs, GATE, UP, off, act=SWIGLU, gate_bias=np.zeros((E, I - 1)))),
        bad("dequant-dequantize_ref-out_dtype-int8", TypeError, "^out_dtype:",
            lambda: dequantize_ref(GATE, out_dtype=np.int8)),
        bad("dequant-dequantize_ref-experts-out-of-range", ValueError, "^experts:",
            lambda: dequantize_ref(GATE, experts=[0, E])),
        bad("dequant-dequantize_ref-experts-2d", TypeError, "^experts:",
            lambda: dequantize_ref(GATE, experts=[[0]])),
        bad("dequant-dequantize_ref-experts-float", TypeError, "^experts:",
            lambda: dequantize_ref(GATE, experts=[0.5])),
        ok("dequant-dequantize_ref-experts-empty", _shape(0, I, H, dtype=np.float32),
           lambda: dequantize_ref(GATE, experts=np.zeros(0, np.int32))),
        bad("config-GemvConfig-not-compiled", ValueError, "cta_n", lambda: GemvConfig(8, 128)),
        bad("config-GemvConfig-cta_n-float", TypeError, "^cta_n:", lambda: GemvConfig(32.0, 128)),
        bad("config-GemvConfig-threads-bool", TypeError, "^threads:", lambda: GemvConfig(32, True)),
        bad("config-GemvConfig-parse-missing-field", ValueError, "^CUPYMOE_GEMV_CONFIG:",
            lambda: GemvConfig.parse("cta_n=32")),
        bad("config-GemvConfig-parse-unknown-field", ValueError, "^CUPYMOE_GEMV_CONFIG:",
            lambda: GemvConfig.parse("cta_n=32,threads=128,warps=4")),
        bad("config-GemvConfig-for_problem-fmt", ValueError, "^fmt:",
            lambda: GemvConfig.for_problem(n=64, k=64, rows=1, fmt="int4", device_name="")),
        bad("config-GemvConfig-for_problem-env", ValueError, "^CUPYMOE_GEMV_CONFIG:",
            lambda: _env("CUPYMOE_GEMV_CONFIG", "cta_n=7,threads=128", lambda: (
                GemvConfig.for_problem(n=64, k=64, rows=1, fmt="nvfp4", device_name="")))),
        bad("config-GemvConfig-for_problem-fmt-nvfp8", ValueError, "^fmt:",
            lambda: GemvConfig.for_problem(n=64, k=64, rows=1, fmt="nvfp8", device_name="X",
                                           dtype=BF16)),
        bad("tune-row_bucket-0", ValueError, "^rows:", lambda: row_bucket(0)),
        bad("tune-row_bucket-float", ValueError, "^rows:", lambda: row_bucket(2.0)),
        bad("tune-cache_key-dtype-float32", TypeError, "^dtype:",
            lambda: cache_key(device_name="d", fmt="nvfp4", dtype=np.float32, n=1, k=16, rows=1)),
        bad("tune-cache_key-fmt", ValueError, "^fmt:",
            lambda: cache_key(device_name="d", fmt="x", dtype=BF16, n=1, k=16, rows=1)),
        bad("presets-random_fp4_experts-k-not-block", ValueError, "^packed: K = .* = 24 must",
            lambda: random_fp4_experts(_RNG, 1, 4, 24, "nvfp4")),
        bad("presets-random_fp4_experts-format", ValueError, "^format:",
            lambda: random_fp4_experts(_RNG, 1, 4, 32, "fp4")),
    ]


def _cpu_layer_cases() -> list[Case]:
    gate_e5 = random_fp4_experts(_RNG, E + 1, I, H)
    single = fm.Fp4Experts.from_packed(
        np.concatenate([GATE.packed, UP.packed], 1), np.concatenate([GATE.scales, UP.scales], 1),
        GATE.global_scale,
    )
    odd = single.select_rows(slice(0, 2 * I - 1))
    x_nan = _with(X, (1, 5), np.nan)
    f32 = np.float32
    return [
        bad("moe-MoELayer-fc1-array", TypeError, "^fc1:", lambda: _layer(fc1=GATE.packed)),
        bad("moe-MoELayer-fc1-triple", TypeError, "^fc1:", lambda: _layer(fc1=(GATE, UP, UP))),
        bad("moe-MoELayer-fc1-pair-shape", ValueError, "^fc1:",
            lambda: _layer(fc1=(GATE, UP.select_rows(slice(0, 16))))),
        bad("moe-MoELayer-fc1-pair-expert-count", ValueError, "^fc1:",
            lambda: _layer(fc1=(GATE, gate_e5))),
        bad("moe-MoELayer-fc1-pair-format", ValueError, "^fc1:",
            lambda: _layer(fc1=(GATE, MX_GATE))),
        bad("moe-MoELayer-fc1_layout-with-pair", ValueError, "^fc1_layout:",
            lambda: _layer(fc1_layout="concatenated")),
        bad("moe-MoELayer-fc1_layout-missing", ValueError, "^fc1_layout:",
            lambda: _layer(fc1=single)),
        bad("moe-MoELayer-fc1_layout-unknown", ValueError, "^fc1_layout:",
            lambda: _layer(fc1=single, fc1_layout="blocked")),
        bad("moe-MoELayer-fc1-odd-rows", ValueError, "^fc1:",
            lambda: _layer(fc1=odd, fc1_layout="interleaved")),
        bad("moe-MoELayer-fc2-array", TypeError, "^fc2:", lambda: _layer(fc2=DOWN.packed)),
        bad("moe-MoELayer-fc2-expert-count", ValueError, "^fc2:",
            lambda: _layer(fc2=random_fp4_experts(_RNG, E + 1, H, I))),
        bad("moe-MoELayer-fc2-transposed", ValueError, "^fc2:",
            lambda: _layer(fc2=random_fp4_experts(_RNG, E, I, H))),
        bad("moe-MoELayer-hidden-zero", ValueError, "^fc1: expected hidden",
            lambda: _layer(fc1=(cm.Fp4Experts.quantize(np.zeros((E, I, 0)), format="nvfp4"),) * 2,
                           fc2=cm.Fp4Experts.quantize(np.zeros((E, 0, I)), format="nvfp4"))),
        ok("moe-MoELayer-fc2-other-format", lambda y: y.shape == (M, H),
           lambda: cm.moe_reference(X, LOGITS, _layer(fc2=random_fp4_experts(_RNG, E, H, I,
                                                                              "mxfp4")))),
        bad("moe-MoELayer-top_k-0", ValueError, "^top_k:", lambda: _layer(top_k=0)),
        bad("moe-MoELayer-top_k-above-E", ValueError, "^top_k:", lambda: _layer(top_k=E + 1)),
        bad("moe-MoELayer-top_k-str", TypeError, "^top_k:", lambda: _layer(top_k="2")),
        bad("moe-MoELayer-max_tokens-0", ValueError, "^max_tokens:", lambda: _layer(max_tokens=0)),
        bad("moe-MoELayer-weight_layout-unknown", ValueError, "^weight_layout:",
            lambda: _layer(weight_layout="native")),
        bad("moe-MoELayer-max_tokens-float", TypeError, "^max_tokens:",
            lambda: _layer(max_tokens=8.0)),
        bad("moe-MoELayer-max_tokens-bool", TypeError, "^max_tokens:",
            lambda: _layer(max_tokens=True)),
        bad("moe-MoELayer-routing-unknown", ValueError, "^routing:", lambda: _layer(routing="x")),
        bad("moe-MoELayer-activation-unknown", ValueError, "^activation:",
            lambda: _layer(activation="tanh")),
        bad("moe-MoELayer-activation-non-gated-pair", ValueError, "^fc1:",
            lambda: _layer(activation="relu")),
        bad("moe-MoELayer-activation_beta-nan", ValueError, "beta",
            lambda: _layer(activation="swiglu_oai", activation_beta=np.nan)),
        bad("moe-MoELayer-routing-sparse_mixer-top_k", ValueError, "^routing: sparse_mixer",
            lambda: _layer(routing="sparse_mixer", top_k=3)),
        bad("moe-MoELayer-activation_limit-zero", ValueError, "limit",
            lambda: _layer(activation="swiglu_oai", activation_limit=0.0)),
        bad("moe-MoELayer-activation_alpha-inf", ValueError, "alpha",
            lambda: _layer(activation="swiglu_oai", activation_alpha=np.inf)),
        bad("moe-MoELayer-correction_bias-expert-count", ValueError, "^correction_bias:",
            lambda: _layer(routing="sigmoid_grouped", correction_bias=np.zeros(E + 1, f32))),
        bad("moe-MoELayer-n_group-for-softmax", ValueError, "^n_group:",
            lambda: _layer(n_group=2)),
        bad("moe-MoELayer-fc1_bias-shape", ValueError, "^fc1_bias:",
            lambda: _layer(fc1_bias=np.zeros((E, I), f32))),
        bad("moe-MoELayer-fc1_bias-expert-count", ValueError, "^fc1_bias:",
            lambda: _layer(fc1_bias=np.zeros((E + 1, 2 * I), f32))),
        bad("moe-MoELayer-fc1_bias-int", TypeError, "^fc1_bias:",
            lambda: _layer(fc1_bias=np.zeros((E, 2 * I), np.int32))),
        bad("moe-MoELayer-fc1_bias-nan", ValueError, "^fc1_bias:",
            lambda: _layer(fc1_bias=_with(np.zeros((E, 2 * I), f32), (1, 1), np.nan))),
        bad("moe-MoELayer-fc2_bias-inf", ValueError, "^fc2_bias:",
            lambda: _layer(fc2_bias=_with(np.zeros((E, H), f32), (0, 3), np.inf))),
        bad("moe-MoELayer-fc2_bias-expert-count", ValueError, "^fc2_bias:",
            lambda: _layer(fc2_bias=np.zeros((E - 1, H), f32))),
        # __call__ with NumPy arrays
        bad("moe-call-x-list", TypeError, "^x:", lambda: _run(X.tolist())),
        bad("moe-call-router_logits-list", TypeError, "^router_logits:",
            lambda: _run(X, LOGITS.tolist())),
        bad("moe-call-x-hidden", ValueError, "^x:", lambda: _run(X[:, 1:])),
        bad("moe-call-x-1d", ValueError, "^x:", lambda: _run(X[0], LOGITS[:1])),
        bad("moe-call-x-3d", ValueError, "^x:", lambda: _run(X[None])),
        bad("moe-call-x-float32", TypeError, "^x:", lambda: _run(X.astype(f32))),
        bad("moe-call-x-int8", TypeError, "^x:", lambda: _run(X.astype(np.int8))),
        bad("moe-call-router_logits-expert-count", ValueError, "^router_logits:",
            lambda: _run(X, np.zeros((M, E + 1), f32))),
        bad("moe-call-router_logits-token-count", ValueError, "^router_logits:",
            lambda: _run(X, np.zeros((M + 1, E), f32))),
        bad("moe-call-router_logits-int32", TypeError, "^router_logits:",
            lambda: _run(X, LOGITS.astype(np.int32))),
        bad("moe-call-max_tokens-exceeded", ValueError, "max_tokens=8",
            lambda: _run(np.zeros((9, H), BF16), np.zeros((9, E), f32))),
        bad("moe-call-out-shape", ValueError, "^out:",
            lambda: _run(X, out=np.zeros((M, H + 1), BF16))),
        bad("moe-call-out-dtype", ValueError, "^out:", lambda: _run(X, out=np.zeros((M, H), f32))),
        bad("moe-call-out-list", TypeError, "^out:", lambda: _run(X, out=[[0.0] * H] * M)),
        ok("moe-call-M0-empty", _shape(0, H, dtype=BF16), lambda: _run(np.zeros((0, H), BF16))),
        ok("moe-call-M-equals-max_tokens", _shape(8, H, dtype=BF16),
           lambda: _run(np.ones((8, H), BF16), np.zeros((8, E), f32))),
        ok("moe-call-x-float16", _shape(M, H, dtype=np.float16), lambda: _run(X.astype("f2"))),
        ok("moe-call-router_logits-bfloat16", _shape(M, H, dtype=BF16),
           lambda: _run(X, LOGITS.astype(BF16))),
        ok("moe-call-router_logits-float16", _shape(M, H, dtype=BF16),
           lambda: _run(X, LOGITS.astype(np.float16))),
        ok("moe-MoELayer-top_k-equals-E", lambda y: y.shape == (M, H),
           lambda: _layer(top_k=E)(X, LOGITS)),
        ok("moe-call-out-filled", _same_bits(lambda: _run(X)),
           lambda: _run(X, out=np.full((M, H), np.nan, BF16))),
        ok("moe-call-x-noncontiguous", _same_bits(lambda: _run(X)),
           lambda: _run(np.repeat(X, 2, axis=0)[::2])),
        ok("moe-call-negative-strides",
           _same_bits(lambda: _run(X[::-1].copy(), LOGITS[::-1].copy())),
           lambda: _run(X[::-1], LOGITS[::-1])),
        ok("moe-call-x-fortran", _same_bits(lambda: _run(X)), lambda: _run(np.asfortranarray(X))),
        ok("moe-call-router_logits-fortran", _same_bits(lambda: _run(X)),
           lambda: _run(X, np.asfortranarray(LOGITS))),
        ok("moe-call-router_logits-float64", _same_bits(lambda: _run(X)),
           lambda: _run(X, LOGITS.astype(np.float64))),
        ok("moe-call-x-nan-token-propagates", _nan_token_row, lambda: _run(x_nan)),
        ok("moe-call-router_logits-nan-row-is-zero",
           lambda out: not out[1].astype(np.float32).any(),
           lambda: _run(X, _with(LOGITS, 1, np.nan))),
        bad("moe-moe_reference-layer-str", TypeError, "layer",
            lambda: cm.moe_reference(X, LOGITS, "layer")),
        bad("moe-moe_reference-x-float32", TypeError, "^x:",
            lambda: cm.moe_reference(X.astype(f32), LOGITS, _cpu_layer())),
        ok("moe-moe_reference-M0-empty", _shape(0, H, dtype=np.float64),
           lambda: cm.moe_reference(np.zeros((0, H), BF16), np.zeros((0, E), f32), _cpu_layer())),
    ]


def _cpu_checkpoint_cases() -> list[Case]:
    gs2 = f"{_P}.1.up_proj.weight_scale_2"
    nan_scale = f"{_P}.0.gate_proj.weight_scale"
    gpt = "model.layers.0.mlp.experts."

    def up_rows_doubled(t: dict) -> None:
        for e in range(E):
            w, s = f"{_P}.{e}.up_proj.weight", f"{_P}.{e}.up_proj.weight_scale"
            t[w], t[s] = np.concatenate([t[w], t[w]]), np.concatenate([t[s], t[s]])

    def nan_scale_byte(t: dict) -> None:
        t[nan_scale] = _with(t[nan_scale].view(np.uint8), (0, 0), 0x7F).view(t[nan_scale].dtype)

    return [
        bad("checkpoint-load_experts-missing-path", FileNotFoundError, "no such checkpoint",
            lambda: ck.load_experts(os.path.join(_TMP.name, "absent.safetensors"), layer=0)),
        bad("checkpoint-load_experts-layer-negative", ValueError, "^layer:",
            _load(_saved, layer=-1)),
        bad("checkpoint-load_experts-layer-float", ValueError, "^layer:",
            _load(_saved, layer=0.0)),
        bad("checkpoint-load_experts-layer-bool", ValueError, "^layer:",
            _load(_saved, layer=False)),
        bad("checkpoint-load_experts-naming-unknown", ValueError, "^naming:",
            _load(_saved, naming="safetensors")),
        bad("checkpoint-load_experts-layer-absent", ValueError, "no expert tensors of layer 1",
            _load(_saved, layer=1)),
        bad("checkpoint-load_experts-naming-mismatch", ValueError, "missing tensor",
            _load(_saved, naming="compressed-tensors")),
        bad("checkpoint-load_experts-file-4-bytes", ValueError, "truncated",
            _load(lambda: _raw_file(b"\x08\x00\x00\x00"))),
        bad("checkpoint-load_experts-file-truncated", ValueError, "out of range",
            _load(_truncated)),
        bad("checkpoint-load_experts-header-not-json", ValueError, "not UTF-8 JSON",
            _load(lambda: _raw_file(b"\x04\x00\x00\x00\x00\x00\x00\x00{{{{"))),
        bad("checkpoint-load_experts-missing-tensor", ValueError, "missing tensor.*up_proj",
            _load(lambda: _saved(mutate=_drop(f"{_P}.1.up_proj.weight_scale")))),
        bad("checkpoint-load_experts-expert-gap", ValueError, "expert ids",
            _load(lambda: _saved(mutate=lambda t: [t.pop(n) for n in list(t) if ".1." in n]))),
        bad("checkpoint-load_experts-weight-dtype", ValueError,
            r"up_proj\.weight.*expected dtype U8",
            _load(lambda: _saved(mutate=lambda t: t.__setitem__(
                f"{_P}.2.up_proj.weight", t[f"{_P}.2.up_proj.weight"].view(np.int8))))),
        bad("checkpoint-load_experts-weight-shape", ValueError, r"\.2\.gate_proj\.weight",
            _load(lambda: _saved(mutate=lambda t: t.__setitem__(
                f"{_P}.2.gate_proj.weight", t[f"{_P}.2.gate_proj.weight"][:, :-8])))),
        bad("checkpoint-load_experts-gate-up-mismatch", ValueError, "gate and up",
            _load(lambda: _saved(mutate=up_rows_doubled))),
        *[
            bad(f"checkpoint-load_experts-global-scale-{name}", ValueError, "weight_scale_2",
                functools.partial(
                    lambda v: ck.load_experts(_saved(mutate=_set(gs2, np.float32(v))), layer=0), v))
            for name, v in (("zero", 0.0), ("negative", -2.0), ("nan", np.nan), ("inf", np.inf))
        ],
        bad("checkpoint-load_experts-global-scale-compressed-zero", ValueError,
            "weight_global_scale",
            _load(lambda: _saved("compressed-tensors", mutate=_set(
                f"{_P}.0.down_proj.weight_global_scale", np.float32(0))), naming="auto")),
        bad("checkpoint-load_experts-scale-nan-byte", ValueError, "NaN",
            _load(lambda: _saved(mutate=nan_scale_byte))),
        bad("checkpoint-load_experts-bias-gate-only", ValueError, "gate and up need both",
            _load(lambda: _saved(mutate=lambda t: t.update(
                {f"{_P}.{e}.gate_proj.bias": np.zeros(I, np.float32) for e in range(E)})))),
        bad("checkpoint-load_experts-gpt-oss-blocks-3d", ValueError, "gate_up_proj_blocks",
            _load(lambda: _saved("gpt-oss", mutate=lambda t: t.__setitem__(
                gpt + "gate_up_proj_blocks", t[gpt + "gate_up_proj_blocks"][..., 0])))),
        bad("checkpoint-load_experts-gpt-oss-scale-nan", ValueError, "NaN",
            _load(lambda: _saved("gpt-oss", mutate=lambda t: t.__setitem__(
                gpt + "down_proj_scales", _with(t[gpt + "down_proj_scales"], (0, 0, 0), 255))))),
        bad("checkpoint-load_experts-gpt-oss-bias-shape", ValueError, "down_proj_bias",
            _load(lambda: _saved("gpt-oss", fc2_bias=np.zeros((E, H), np.float32), mutate=lambda t:
                t.__setitem__(gpt + "down_proj_bias", np.zeros((E, H - 1), np.float32))))),
        bad("checkpoint-load_experts-prefix-wrong", ValueError, "matches no naming",
            _load(_saved, prefix="model.layers.{layer}.moe")),
        ok("checkpoint-load_experts-roundtrip",
           lambda d: np.array_equal(d["fc1"][0].packed, GATE.packed)
           and np.array_equal(d["fc2"].global_scale, DOWN.global_scale),
           _load(_saved)),
        bad("checkpoint-Checkpoint-empty-dir", ValueError, "no model.safetensors.index.json",
            lambda: ck.Checkpoint(tempfile.mkdtemp(dir=_TMP.name))),
        bad("checkpoint-Checkpoint-index-no-weight_map", ValueError, "invalid index file",
            lambda: ck.Checkpoint(os.path.join(_index_dir(None), "model.safetensors.index.json"))),
        bad("checkpoint-Checkpoint-index-missing-shard", ValueError, "does not exist",
            lambda: ck.Checkpoint(_index_dir({"w": "absent.safetensors"})).read("w")),
        bad("checkpoint-Checkpoint-read-unknown", KeyError, "no tensor",
            lambda: ck.Checkpoint(_saved()).read("nope")),
        bad("checkpoint-read_tensor-unknown", KeyError, "no tensor",
            lambda: ck.read_tensor(_saved(), "nope")),
        bad("checkpoint-save_experts-fc1-single-for-modelopt", TypeError, "^fc1:",
            lambda: ck.save_experts(_file(), layer=0, naming="modelopt", fc1=GATE, fc2=DOWN)),
        bad("checkpoint-save_experts-mxfp4-for-modelopt", ValueError, r"^fc1\[0\]",
            lambda: ck.save_experts(_file(), layer=0, naming="modelopt", fc1=(MX_GATE, MX_GATE),
                                    fc2=DOWN)),
        bad("checkpoint-save_experts-nvfp4-for-gpt-oss", ValueError, "^fc1:",
            lambda: ck.save_experts(_file(), layer=0, naming="gpt-oss", fc1=GATE, fc2=DOWN)),
        bad("checkpoint-save_experts-fc2-shape", ValueError, "fc2",
            lambda: ck.save_experts(_file(), layer=0, naming="modelopt", fc1=(GATE, UP),
                                    fc2=GATE)),
        bad("checkpoint-save_experts-fc1_bias-int", TypeError, "^fc1_bias:",
            lambda: ck.save_experts(_file(), layer=0, naming="modelopt", fc1=(GATE, UP), fc2=DOWN,
                                    fc1_bias=np.zeros((E, 2 * I), np.int32))),
        bad("checkpoint-save_experts-fc2_bias-shape", ValueError, "^fc2_bias:",
            lambda: ck.save_experts(_file(), layer=0, naming="modelopt", fc1=(GATE, UP), fc2=DOWN,
                                    fc2_bias=np.zeros((E, H + 1), np.float32))),
        bad("checkpoint-save_experts-naming-unknown", ValueError, "^naming:",
            lambda: ck.save_experts(_file(), layer=0, naming="awq", fc1=(GATE, UP), fc2=DOWN)),
        bad("checkpoint-write_safetensors-empty-name", ValueError, "^tensors:",
            lambda: ck.write_safetensors(_file(), {"": np.zeros(1)})),
        bad("checkpoint-write_safetensors-metadata-name", ValueError, "^tensors:",
            lambda: ck.write_safetensors(_file(), {"__metadata__": np.zeros(1)})),
        bad("checkpoint-write_safetensors-complex128", TypeError, "^tensors",
            lambda: ck.write_safetensors(_file(), {"w": np.zeros(2, np.complex128)})),
        bad("checkpoint-write_safetensors-metadata-int", TypeError, "^metadata:",
            lambda: ck.write_safetensors(_file(), {"w": np.zeros(1)}, metadata={"a": 1})),
        ok("checkpoint-write_safetensors-empty-tensor", _shape(0, 3, dtype=np.float32),
           lambda: _roundtrip_empty()),
    ]


def _roundtrip_empty() -> np.ndarray:
    path = _file()
    ck.write_safetensors(path, {"w": np.zeros((0, 3), np.float32)})
    return ck.read_tensor(path, "w")


def _cpu_cli_cases() -> list[Case]:
    shape = ("--hidden", "64", "--inter", "32", "--experts", "4")
    return [
        ok("cli-" + re.sub(r"[^a-z0-9.]+", "_", "-".join(a.lstrip("-") for a in args[:3])),
           _cli_exit(match), _cli(*args))
        for args, match in (
            (("run", "--hidden", "0", "--inter", "32", "--experts", "4"), "--hidden"),
            (("run", "--inter", "0", "--hidden", "64", "--experts", "4"), "--inter"),
            (("run", "--experts", "0", "--hidden", "64", "--inter", "32"), "--experts"),
            (("run", "--top-k", "0", *shape), "--top-k"),
            (("run", "--top-k", "5", *shape), "--top-k"),
            (("run", "--top-k", "two", *shape), "--top-k"),
            (("run", "--tokens", "-1", *shape), "--tokens"),
            (("run", "--tokens", "1.5", *shape), "--tokens"),
            (("run", "--format", "int4", *shape), "--format"),
            (("run", "--dtype", "fp32", *shape), "--dtype"),
            (("run", "--seed", "abc", *shape), "--seed"),
            (("run", "--repeats", "0", *shape), "--repeats"),
            (("run", "--preset", "llama"), "--preset"),
            (("run", "--hidden", "64"), "--inter"),
            (("bench", "--tokens", "a,b"), "--tokens"),
            (("bench", "--tokens", "0,1"), "--tokens"),
            (("bench", "--layers", "0"), "--layers"),
            (("bench", "--repeats", "2"), "--repeats"),
            (("bench", "--dtype", "fp8"), "--dtype"),
            (("bench", "--preset", "gpt-5"), "--preset"),
            (("tune", "--rows", "x"), "--rows"),
            (("tune", "--rows", "-4"), "--rows"),
            (("tune", "--shape", "1,2,3"), "--shape"),
            (("tune", "--shape", "64"), "--shape"),
            (("tune", "--repeats", "1", "--shape", "64,64"), "--repeats"),
            (("tune", "--format", "int4", "--shape", "64,64"), "--format"),
            (("tune",), "--preset"),
            (("info", "--verbose"), "--verbose"),
            (("run", "--checkpoint", "/nonexistent/model.safetensors"), "--checkpoint"),
            (("run", "--layer", "-1", *shape), "--layer"),
            (("run", "--naming", "awq", *shape), "--naming"),
        )
    ] + [
        ok("cli-run-checkpoint-not-safetensors", _cli_exit("Error: .*truncated", code=1),
           lambda: CliRunner().invoke(cli, ["run", "--checkpoint", _raw_file(b"abc")])),
        ok("cli-run-checkpoint-layer-absent", _cli_exit("Error: .*no expert tensors", code=1),
           lambda: CliRunner().invoke(cli, ["run", "--checkpoint", _saved(), "--layer", "3"])),
    ]


CPU_CASES: list[Case] = _build(
    _cpu_formats() + _cpu_routing() + _cpu_stages() + _cpu_layer_cases() + _cpu_checkpoint_cases()
    + _cpu_cli_cases()
)


# ================================================================================================
# GPU cases (the CuPy ops); inputs are made on first use
# ================================================================================================
@functools.lru_cache(maxsize=1)
def _g() -> SimpleNamespace:
    from cupymoe.experts.dispatch import fc1, fc2
    from cupymoe.experts.gemv import prepare_fc1, prepare_fc2
    from cupymoe.routing import route

    cp = require_cupy()
    g = SimpleNamespace(cp=cp)
    g.x, g.logits = cp.asarray(X), cp.asarray(LOGITS)
    g.routing = route(g.logits, ROUTER)
    g.fc1w, g.fc2w = prepare_fc1(GATE, UP), prepare_fc2(DOWN)
    g.h = fc1(g.x, g.fc1w, g.routing, act=SWIGLU)
    g.y = fc2(g.h, g.fc2w, g.routing)
    g.down = g.fc2w.device_fp4()  # row-major copies rebuilt from the resident weights
    g.gate, g.up = g.fc1w.device_fp4()
    g.r0 = route(cp.zeros((0, E), cp.float32), ROUTER)
    g.big_logits = cp.asarray(_RNG.standard_normal((40, E)).astype(np.float32))
    g.big_x = cp.asarray(_RNG.standard_normal((40, H)).astype(BF16))
    g.big_routing = route(g.big_logits, ROUTER)  # 80 expanded rows: the batched path
    g.layer = _layer(max_tokens=40)
    return g


def _gz(shape: Any, dtype: Any = np.float32) -> Any:
    return _g().cp.zeros(shape, dtype)


def _misaligned(shape: tuple[int, int], dtype: Any = BF16) -> Any:
    flat = _gz(shape[0] * shape[1] + 8, dtype)
    return flat[1 : 1 + shape[0] * shape[1]].reshape(shape)


def _gpu_route_cases() -> list[Case]:
    from cupymoe.routing import expert_maps, route

    def r(logits: Callable[[], Any], router: Any = ROUTER, **kw: Any) -> Callable[[], Any]:
        return lambda: route(logits(), router, **kw)

    def out(**fields: Any) -> Routing:
        base = Routing.empty(M, E, TOP_K, xp=_g().cp)
        return dataclasses.replace(base, **{k: v() for k, v in fields.items()})

    maps = expert_maps
    ids = lambda: _g().routing.topk_ids  # noqa: E731
    return [
        bad("route-logits-numpy", TypeError, "^logits:", r(lambda: LOGITS)),
        bad("route-logits-float64", TypeError, "^logits:", r(lambda: _gz((M, E), np.float64))),
        bad("route-logits-int32", TypeError, "^logits:", r(lambda: _gz((M, E), np.int32))),
        bad("route-logits-expert-count", ValueError, "^logits:", r(lambda: _gz((M, E + 1)))),
        bad("route-logits-1d", ValueError, "^logits:", r(lambda: _gz(E))),
        bad("route-logits-expert-axis-strided", ValueError, "^logits:",
            r(lambda: _gz((M, 2 * E))[:, ::2])),
        bad("route-logits-negative-row-stride", ValueError, "^logits:",
            r(lambda: _g().logits[::-1])),
        ok("route-logits-row-strided", _routing_equal(lambda: route(_g().logits, ROUTER)),
           r(lambda: _g().cp.asarray(np.concatenate([LOGITS, LOGITS], 1))[:, :E])),
        bad("route-router-str", TypeError, "^router:", r(lambda: _g().logits, "softmax_topk")),
        bad("route-top_k-above-kernel-limit", ValueError, "^router:",
            r(lambda: _gz((2, 72)), Router(72, 65))),
        bad("route-n_experts-above-kernel-limit", ValueError, "^router:",
            r(lambda: _gz((1, 4096)), Router(4096, 2))),
        bad("route-out-tuple", TypeError, "^out:", r(lambda: _g().logits, out=(1, 2))),
        bad("route-out-token-count", ValueError, r"^out\.topk_ids:",
            lambda: route(_g().logits, ROUTER, out=Routing.empty(M + 1, E, TOP_K))),
        bad("route-out-numpy", TypeError, r"^out\.topk_ids:",
            lambda: route(_g().logits, ROUTER, out=Routing.empty(M, E, TOP_K, xp=np))),
        bad("route-out-weights-float16", ValueError, r"^out\.topk_weights:",
            lambda: route(_g().logits, ROUTER, out=out(topk_weights=lambda: _gz((M, 2), "f2")))),
        bad("route-out-ids-noncontiguous", ValueError, r"^out\.topk_ids:",
            lambda: route(_g().logits, ROUTER,
                          out=out(topk_ids=lambda: _gz((M, 4), np.int32)[:, ::2]))),
        ok("route-M0-empty", _empty_routing, r(lambda: _gz((0, E)))),
        ok("route-nan-row-documented",
           lambda rt: _host(rt.topk_ids)[1].tolist() == [0, 1]
           and not _host(rt.topk_weights)[1].any(),
           r(lambda: _g().cp.asarray(_with(LOGITS, 1, np.nan)))),
        bad("expert_maps-ids-numpy", TypeError, "^topk_ids:", lambda: maps(ROUTING.topk_ids, E)),
        bad("expert_maps-ids-int64", ValueError, "^topk_ids:",
            lambda: maps(ids().astype(np.int64), E)),
        bad("expert_maps-ids-1d", TypeError, "^topk_ids:", lambda: maps(ids().ravel(), E)),
        bad("expert_maps-ids-noncontiguous", ValueError, "^topk_ids:",
            lambda: maps(_gz((M, 4), np.int32)[:, ::2], E)),
        bad("expert_maps-n_experts-0", ValueError, "^n_experts:", lambda: maps(ids(), 0)),
        bad("expert_maps-n_experts-above-kernel-limit", ValueError, "^n_experts:",
            lambda: maps(ids(), 4096)),
        bad("expert_maps-n_experts-float", TypeError, "^n_experts:", lambda: maps(ids(), 4.0)),
        bad("expert_maps-out-tuple", TypeError, "^out:", lambda: maps(ids(), E, out=())),
        bad("expert_maps-out-expert-count", ValueError, r"^out\.expert_offsets:",
            lambda: maps(ids(), E, out=Routing.empty(M, E + 1, TOP_K))),
        ok("expert_maps-M0-empty",
           lambda mp: _host(mp[0]).tolist() == [0] * (E + 1) and mp[1].shape == (0,),
           lambda: maps(_gz((0, TOP_K), np.int32), E)),
        ok("expert_maps-id-out-of-range-documented",
           lambda mp: _host(mp[0]).tolist() == [0, 1, 2, 3, 3] and int(mp[1][3]) == 2,
           lambda: maps(_g().cp.asarray(np.array([[0, 1], [E, 2]], np.int32)), E)),
    ]


def _gpu_expand_finalize_cases() -> list[Case]:
    from cupymoe.layer.expand import expand
    from cupymoe.layer.finalize import finalize

    rt = lambda: _g().routing  # noqa: E731
    y = lambda: _g().y  # noqa: E731
    r65 = lambda: Routing.empty(1, 72, 65)  # noqa: E731
    return [
        bad("expand-x-numpy", TypeError, "^x:", lambda: expand(X, rt())),
        bad("expand-routing-none", TypeError, "^routing:", lambda: expand(_g().x, None)),
        bad("expand-x-token-count", ValueError, "^x:", lambda: expand(_g().x[:2], rt())),
        bad("expand-x-hidden-strided", ValueError, "^x:",
            lambda: expand(_gz((M, 2 * H), BF16)[:, ::2], rt())),
        bad("expand-out-shape", ValueError, "^out:",
            lambda: expand(_g().x, rt(), out=_gz((M, H), BF16))),
        bad("expand-out-dtype", ValueError, "^out:",
            lambda: expand(_g().x, rt(), out=_gz((M * TOP_K, H), np.float16))),
        bad("expand-out-numpy", ValueError, "^out:",
            lambda: expand(_g().x, rt(), out=np.zeros((M * TOP_K, H), BF16))),
        bad("expand-out-noncontiguous", ValueError, "^out:",
            lambda: expand(_g().x, rt(), out=_gz((M * TOP_K, 2 * H), BF16)[:, ::2])),
        bad("expand-routing-numpy", TypeError, "routing", lambda: expand(_g().x, ROUTING)),
        ok("expand-x-negative-row-stride",
           lambda a: np.array_equal(_bits(_host(a)), _bits(expand_ref(X[::-1], ROUTING))),
           lambda: expand(_g().x[::-1], rt())),
        ok("expand-M0-empty", _shape(0, H, dtype=BF16),
           lambda: expand(_gz((0, H), BF16), _g().r0)),
        bad("finalize-y-numpy", TypeError, "^y:", lambda: finalize(_host(y()), rt())),
        bad("finalize-y-float64", TypeError, "^y:",
            lambda: finalize(_gz((M * TOP_K, H), np.float64), rt())),
        bad("finalize-y-rows", ValueError, "^y:", lambda: finalize(y()[1:], rt())),
        bad("finalize-y-noncontiguous", ValueError, "^y:",
            lambda: finalize(_gz((M * TOP_K, 2 * H), BF16)[:, ::2], rt())),
        bad("finalize-bias-shape", ValueError, "^bias:",
            lambda: finalize(y(), rt(), bias=_gz(H + 1))),
        bad("finalize-bias-int32", TypeError, "^bias:",
            lambda: finalize(y(), rt(), bias=_gz(H, np.int32))),
        bad("finalize-bias-numpy", TypeError, "^bias:",
            lambda: finalize(y(), rt(), bias=np.zeros(H, np.float32))),
        bad("finalize-out-shape", ValueError, "^out:",
            lambda: finalize(y(), rt(), out=_gz((M, H + 1), BF16))),
        bad("finalize-out-int32", ValueError, "^out:",
            lambda: finalize(y(), rt(), out=_gz((M, H), np.int32))),
        bad("finalize-out-numpy", TypeError, "^out:",
            lambda: finalize(y(), rt(), out=np.zeros((M, H), BF16))),
        bad("finalize-out_dtype-int32", TypeError, "^out_dtype:",
            lambda: finalize(y(), rt(), out_dtype=np.int32)),
        bad("finalize-top_k-above-kernel-limit", ValueError, "^routing:",
            lambda: finalize(_gz((65, H), BF16), r65())),
        bad("finalize-routing-numpy", TypeError, "routing", lambda: finalize(y(), ROUTING)),
        bad("finalize-routing-weights-float64", ValueError, "topk_weights",
            lambda: finalize(y(), dataclasses.replace(
                rt(), topk_weights=rt().topk_weights.astype(np.float64)))),
        ok("finalize-M0-empty", _shape(0, H, dtype=BF16),
           lambda: finalize(_gz((0, H), BF16), _g().r0)),
    ]


def _gpu_gemv_cases() -> list[Case]:
    from cupymoe.experts.batched import fc1_batched, fc2_batched
    from cupymoe.experts.dequant import dequantize
    from cupymoe.experts.dispatch import fc1, fc2
    from cupymoe.experts.gemv import prepare_fc1, prepare_fc2
    from cupymoe.formats import DeviceFp4
    from cupymoe.routing import route

    g = _g
    f1 = lambda x, **kw: fc1(x, g().fc1w, kw.pop("routing", g().routing),  # noqa: E731
                             act=kw.pop("act", SWIGLU), **kw)
    f2 = lambda h, **kw: fc2(h, g().fc2w, kw.pop("routing", g().routing), **kw)  # noqa: E731
    rows = M * TOP_K
    gate48, up48 = (random_fp4_experts(np.random.default_rng(s), E, 24, 48) for s in (3, 4))
    down48 = random_fp4_experts(np.random.default_rng(5), E, 24, 48)
    x48 = np.random.default_rng(6).standard_normal((M, 48)).astype(BF16)
    h48 = np.random.default_rng(7).standard_normal((rows, 48)).astype(BF16)

    def dev(**kw: Any) -> Any:
        d = g().down
        fields = dict(format=d.format, packed=d.packed, scales=d.scales,
                      global_scale=d.global_scale)
        fields.update({k: v() for k, v in kw.items()})
        return DeviceFp4(**fields)

    fb1 = lambda **kw: fc1_batched(  # noqa: E731
        kw.pop("x", g().big_x), kw.pop("gate", g().gate), kw.pop("up", g().up),
        kw.pop("routing", g().big_routing), act=SWIGLU, **kw)
    return [
        bad("fc1-x-numpy", TypeError, "^x:", lambda: f1(X)),
        bad("fc1-x-float32", TypeError, "^x:", lambda: f1(_gz((M, H)))),
        bad("fc1-x-hidden", ValueError, "^x:", lambda: f1(_gz((M, H + 16), BF16))),
        bad("fc1-x-noncontiguous", ValueError, "^x:", lambda: f1(_gz((M, 2 * H), BF16)[:, ::2])),
        bad("fc1-x-negative-strides", ValueError, "^x:", lambda: f1(g().x[::-1])),
        bad("fc1-x-misaligned", ValueError, "^x:", lambda: f1(_misaligned((M, H)))),
        # one matrix (PreparedFc2) serves the non-gated activations only
        bad("fc1-weights-fc2", ValueError, "^weights: the activation 'swiglu' needs PreparedFc1",
            lambda: fc1(g().x, g().fc2w, g().routing, act=SWIGLU)),
        bad("fc1-act-str", TypeError, "^act:", lambda: f1(g().x, act="swiglu")),
        bad("fc1-routing-none", TypeError, "^routing:", lambda: f1(g().x, routing=None)),
        bad("fc1-routing-token-count", ValueError, r"^routing\.topk_ids:",
            lambda: f1(g().x, routing=route(g().logits[:2], ROUTER))),
        bad("fc1-routing-expert-count", ValueError, r"^routing\.expert_offsets:",
            lambda: f1(g().x, routing=route(_gz((M, E + 1)), Router(E + 1, TOP_K)))),
        bad("fc1-routing-numpy", TypeError, r"^routing\.topk_ids:",
            lambda: f1(g().x, routing=ROUTING)),
        bad("fc1-out-shape", ValueError, "^out:", lambda: f1(g().x, out=_gz((rows, I + 1), BF16))),
        bad("fc1-out-dtype", ValueError, "^out:", lambda: f1(g().x, out=_gz((rows, I), "f2"))),
        bad("fc1-out-numpy", TypeError, "^out:",
            lambda: f1(g().x, out=np.zeros((rows, I), BF16))),
        bad("fc1-out-noncontiguous", ValueError, "^out:",
            lambda: f1(g().x, out=_gz((rows, 2 * I), BF16)[:, ::2])),
        bad("fc1-batched-out-numpy", TypeError, "^out:",
            lambda: f1(g().big_x, routing=g().big_routing, out=np.zeros((80, I), BF16))),
        ok("fc1-M0-empty", _shape(0, I, dtype=BF16), lambda: f1(_gz((0, H), BF16),
                                                                 routing=g().r0)),
        ok("fc1-k48-n24-not-tile-multiples",
           _close(lambda: fc1_ref(expand_ref(x48, ROUTING), gate48, up48,
                                  ROUTING.expert_offsets, act=SWIGLU)),
           lambda: fc1(g().cp.asarray(x48), prepare_fc1(gate48, up48), g().routing, act=SWIGLU)),
        bad("fc2-h-numpy", TypeError, "^h:", lambda: f2(_host(g().h))),
        bad("fc2-h-float32", TypeError, "^h:", lambda: f2(_gz((rows, I)))),
        bad("fc2-h-width", ValueError, "^h:", lambda: f2(_gz((rows, I + 8), BF16))),
        bad("fc2-h-rows", ValueError, "^h:", lambda: f2(_gz((rows - 1, I), BF16))),
        bad("fc2-h-noncontiguous", ValueError, "^h:", lambda: f2(_gz((rows, 2 * I), BF16)[:, ::2])),
        bad("fc2-weights-fc1", TypeError, "^weights:", lambda: fc2(g().h, g().fc1w, g().routing)),
        bad("fc2-routing-numpy", TypeError, r"^routing\.topk_ids:",
            lambda: f2(g().h, routing=ROUTING)),
        bad("fc2-out-shape", ValueError, "^out:", lambda: f2(g().h, out=_gz((rows, H - 1), BF16))),
        ok("fc2-M0-empty", _shape(0, H, dtype=BF16), lambda: f2(_gz((0, I), BF16),
                                                                 routing=g().r0)),
        ok("fc2-k48-n24-not-tile-multiples",
           _close(lambda: fc2_ref(h48, down48, ROUTING.expert_offsets)),
           lambda: fc2(g().cp.asarray(h48), prepare_fc2(down48), g().routing)),
        bad("prepare_fc1-gate-array", TypeError, "^gate:", lambda: prepare_fc1(GATE.packed, UP)),
        bad("prepare_fc1-up-shape", ValueError, "^up:", lambda: prepare_fc1(GATE, gate48)),
        bad("prepare_fc1-up-format", ValueError, "^up:", lambda: prepare_fc1(GATE, MX_GATE)),
        bad("prepare_fc1-layout-nibble-order-mismatch", ValueError, "^gate:",
            lambda: prepare_fc1(DeviceFp4.from_experts(GATE, pair_interleaved=True), UP,
                                layout="plain")),
        bad("prepare_fc1-layout-unknown", ValueError, "^layout:",
            lambda: prepare_fc1(GATE, UP, layout="tiled")),
        bad("prepare_fc2-layout-unknown", ValueError, "^layout:",
            lambda: prepare_fc2(DOWN, layout="")),
        bad("prepare_fc1-gate_bias-shape", ValueError, "^gate_bias:",
            lambda: prepare_fc1(GATE, UP, gate_bias=np.zeros((E, I + 1), np.float32))),
        bad("prepare_fc1-gate_bias-int", TypeError, "^gate_bias:",
            lambda: prepare_fc1(GATE, UP, gate_bias=np.zeros((E, I), np.int32))),
        bad("prepare_fc1-up_bias-nan", ValueError, "^up_bias:",
            lambda: prepare_fc1(GATE, UP, up_bias=np.full((E, I), np.nan, np.float32))),
        bad("prepare_fc2-down-array", TypeError, "^down:", lambda: prepare_fc2(DOWN.packed)),
        bad("prepare_fc2-bias-shape", ValueError, "^bias:",
            lambda: prepare_fc2(DOWN, bias=np.zeros((E + 1, H), np.float32))),
        bad("DeviceFp4-format-str", TypeError, "^format:", lambda: dev(format=lambda: "nvfp4")),
        bad("DeviceFp4-packed-numpy", TypeError, "^packed:",
            lambda: dev(packed=lambda: DOWN.packed)),
        bad("DeviceFp4-packed-int8", TypeError, "^packed:",
            lambda: dev(packed=lambda: g().down.packed.view(np.int8))),
        bad("DeviceFp4-packed-noncontiguous", ValueError, "^packed:",
            lambda: dev(packed=lambda: g().cp.asarray(np.repeat(DOWN.packed, 2, 1))[:, ::2])),
        bad("DeviceFp4-scales-shape", ValueError, "^scales:",
            lambda: dev(scales=lambda: g().down.scales[:, :, :-1].copy())),
        bad("DeviceFp4-global_scale-expert-count", ValueError, "^global_scale:",
            lambda: dev(global_scale=lambda: g().down.global_scale[:-1].copy())),
        bad("DeviceFp4-global_scale-negative", ValueError, "^global_scale:",
            lambda: dev(global_scale=lambda: -g().down.global_scale)),
        bad("DeviceFp4-scales-nan-byte", ValueError, "^scales:",
            lambda: dev(scales=lambda: g().cp.full_like(g().down.scales, 0x7F))),
        bad("dequantize-w-host", TypeError, "^w:", lambda: dequantize(DOWN)),
        bad("dequantize-out_dtype-int8", TypeError, "^out_dtype:",
            lambda: dequantize(g().down, out_dtype=np.int8)),
        bad("dequantize-experts-out-of-range", ValueError, "^experts:",
            lambda: dequantize(g().down, experts=[E])),
        bad("dequantize-experts-2d", TypeError, "^experts:",
            lambda: dequantize(g().down, experts=[[0]])),
        bad("dequantize-experts-int64-unchecked", TypeError, "^experts:",
            lambda: dequantize(g().down, experts=g().cp.zeros(1, np.int64), check_experts=False)),
        bad("dequantize-out-numpy", TypeError, "^out:",
            lambda: dequantize(g().down, out=np.zeros((E, H, I), np.float32))),
        bad("dequantize-out-shape", ValueError, "^out:",
            lambda: dequantize(g().down, out=_gz((E, H, I + 1)))),
        bad("dequantize-out-dtype", ValueError, "^out:",
            lambda: dequantize(g().down, out=_gz((E, H, I), "f2"))),
        bad("dequantize-out-noncontiguous", ValueError, "^out:",
            lambda: dequantize(g().down, out=_gz((E, H, 2 * I))[:, :, ::2])),
        ok("dequantize-experts-empty", _shape(0, H, I, dtype=np.float32),
           lambda: dequantize(g().down, experts=np.zeros(0, np.int32))),
        ok("dequantize-k48-exact",
           lambda a: np.array_equal(_host(a), dequantize_ref(down48)),
           lambda: dequantize(prepare_fc2(down48).device_fp4())),
        bad("fc1_batched-gate-host", TypeError, "^gate:", lambda: fb1(gate=GATE)),
        bad("fc1_batched-up-shape", ValueError, "^up:",
            lambda: fb1(up=prepare_fc1(gate48, up48).device_fp4()[1])),
        bad("fc1_batched-x-numpy", TypeError, "^x:", lambda: fb1(x=_host(g().big_x))),
        bad("fc1_batched-x-float32", TypeError, "^x:", lambda: fb1(x=_gz((40, H)))),
        bad("fc1_batched-x-width", ValueError, "^x:", lambda: fb1(x=_gz((40, H + 16), BF16))),
        bad("fc1_batched-routing-token-count", ValueError, "^routing:",
            lambda: fb1(x=g().big_x[:39])),
        bad("fc1_batched-routing-expert-count", ValueError, r"^routing\.expert_offsets:",
            lambda: fb1(routing=route(_gz((40, E + 1)), Router(E + 1, TOP_K)))),
        bad("fc1_batched-gate_bias-shape", ValueError, "^gate_bias:",
            lambda: fb1(gate_bias=np.zeros((E, I + 1), np.float32))),
        bad("fc1_batched-gate_bias-list", TypeError, "^gate_bias:",
            lambda: fb1(gate_bias=[[0.0] * I] * E)),
        bad("fc1_batched-out-numpy", TypeError, "^out:", lambda: fb1(out=np.zeros((80, I), BF16))),
        bad("fc1_batched-out-shape", ValueError, "^out:", lambda: fb1(out=_gz((80, I - 1), BF16))),
        ok("fc1_batched-M0-empty", _shape(0, I, dtype=BF16),
           lambda: fb1(x=_gz((0, H), BF16), routing=g().r0)),
        bad("fc2_batched-down-host", TypeError, "^down:",
            lambda: fc2_batched(_gz((80, I), BF16), DOWN, g().big_routing)),
        bad("fc2_batched-h-rows", ValueError, "^h:",
            lambda: fc2_batched(_gz((79, I), BF16), g().down, g().big_routing)),
        bad("fc2_batched-bias-shape", ValueError, "^bias:",
            lambda: fc2_batched(_gz((80, I), BF16), g().down, g().big_routing,
                                bias=np.zeros((E, H - 1), np.float32))),
    ]


def _gpu_layer_cases() -> list[Case]:
    lay = lambda: _g().layer  # noqa: E731
    x, lg = (lambda: _g().x), (lambda: _g().logits)
    eager = lambda: lay()(x(), lg())  # noqa: E731
    return [
        bad("moe-gpu-mixed-devices", TypeError, "^x and router_logits:",
            lambda: lay()(x(), LOGITS)),
        bad("moe-gpu-x-numpy-logits-cupy", TypeError, "^x and router_logits:",
            lambda: lay()(X, lg())),
        bad("moe-gpu-x-float32", TypeError, "^x:", lambda: lay()(_gz((M, H)), lg())),
        bad("moe-gpu-x-hidden", ValueError, "^x:", lambda: lay()(_gz((M, H + 1), BF16), lg())),
        bad("moe-gpu-max_tokens-exceeded", ValueError, "max_tokens=40",
            lambda: lay()(_gz((41, H), BF16), _gz((41, E)))),
        bad("moe-gpu-out-numpy", TypeError, "^out:",
            lambda: lay()(x(), lg(), out=np.zeros((M, H), BF16))),
        bad("moe-gpu-out-shape", ValueError, "^out:",
            lambda: lay()(x(), lg(), out=_gz((M + 1, H), BF16))),
        bad("moe-gpu-out-dtype", ValueError, "^out:",
            lambda: lay()(x(), lg(), out=_gz((M, H), np.float16))),
        bad("moe-gpu-out-noncontiguous", ValueError, "^out:",
            lambda: lay()(x(), lg(), out=_gz((M, 2 * H), BF16)[:, ::2])),
        bad("moe-gpu-x-noncontiguous", ValueError, "^x:",
            lambda: lay()(_gz((M, 2 * H), BF16)[:, ::2], lg())),
        bad("moe-gpu-x-negative-strides", ValueError, "^x:", lambda: lay()(x()[::-1], lg())),
        bad("moe-gpu-logits-negative-strides", ValueError, "logits",
            lambda: lay()(x(), lg()[::-1])),
        bad("moe-gpu-top_k-above-kernel-limit", ValueError, "^router:",
            lambda: cm.MoELayer(tuple(random_fp4_experts(_RNG, 72, 16, 32) for _ in "gu"),
                                random_fp4_experts(_RNG, 72, 32, 16), top_k=65, max_tokens=1)(
                _gz((1, 32), BF16), _gz((1, 72)))),
        ok("moe-gpu-logits-float64", _same_bits(eager),
           lambda: lay()(x(), lg().astype(np.float64))),
        ok("moe-gpu-logits-row-strided", _same_bits(eager),
           lambda: lay()(x(), _g().cp.concatenate([lg(), lg()], 1)[:, :E])),
        ok("moe-gpu-M0-empty", _shape(0, H, dtype=BF16),
           lambda: lay()(_gz((0, H), BF16), _gz((0, E)))),
        ok("moe-gpu-out-filled", _same_bits(eager),
           lambda: lay()(x(), lg(), out=_g().cp.full((M, H), np.nan, BF16))),
        ok("moe-gpu-moe_reference-cupy-input",
           _same_bits(lambda: cm.moe_reference(X, LOGITS, lay())),
           lambda: cm.moe_reference(x(), lg(), lay())),
        bad("moe-gpu-graph-n_tokens-0", ValueError, "^n_tokens:", lambda: lay().graph(0)),
        bad("moe-gpu-graph-above-max_tokens", ValueError, "^n_tokens:", lambda: lay().graph(41)),
        ok("moe-gpu-graph-above-the-gemv", _graph_of(33), lambda: lay().graph(33)),
        bad("moe-gpu-graph-dtype-float32", TypeError, "^dtype:",
            lambda: lay().graph(2, dtype=np.float32)),
    ]


GPU_CASES: list[Case] = _build(
    _gpu_route_cases() + _gpu_expand_finalize_cases() + _gpu_gemv_cases() + _gpu_layer_cases()
)


# fmt: on
# ================================================================================================
# The tests
# ================================================================================================
def _params(cases: list[Case]) -> list[Any]:
    params = []
    for c in cases:
        reason = c.bug or (c.gpu_bug if gpu_available() else None)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(c, id=c.id, marks=marks))
    return params


def _check(case: Case) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "MoELayer runs the NumPy reference"
        if case.raises is None:
            assert case.check is not None
            result = case.call()
            verdict = case.check(result)
            assert verdict is None or bool(verdict), f"{case.id}: check returned {verdict!r}"
            return
        with pytest.raises(case.raises, match=case.match) as info:
            case.call()
    assert info.type is case.raises, f"{case.id}: {info.type.__name__}, not {case.raises.__name__}"


@pytest.mark.parametrize("case", _params(CPU_CASES))
def test_bad_input_cpu(case: Case) -> None:
    _check(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", _params(GPU_CASES))
def test_bad_input_gpu(case: Case) -> None:
    _check(case)


#: The matrix must not shrink silently: these are the case counts when it was written.
MIN_CPU_CASES, MIN_GPU_CASES = 305, 149


def test_case_count() -> None:
    n_bugs = sum(c.bug is not None for c in CPU_CASES + GPU_CASES)
    print(
        f"\nbad-input matrix: {len(CPU_CASES)} CPU cases, {len(GPU_CASES)} GPU cases, "
        f"{n_bugs} marked as library bugs"
    )
    assert len(CPU_CASES) >= MIN_CPU_CASES
    assert len(GPU_CASES) >= MIN_GPU_CASES
