# SPDX-License-Identifier: Apache-2.0
"""ONNX Runtime's MoE / QMoE options (issue #21): the sparse mixer top-2, separate selection and
mixing tensors (``router_weights``), the non-gated activations and the general SwiGLU.

CPU: the references against hand-computed cases and a plain loop transcription of ONNX Runtime's
sparse mixer, and the layer's validation. GPU: every option against the reference, both formats,
M in {1, 4, 8, 65, 1024} (1-8: the one-launch routing and the GEMV; 65: the routing launch plus
maps, and the grouped GEMM; 1024: the same at scale); integer outputs exactly.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

import cupymoe as cm
from cupymoe._runtime.backend import gpu_available
from cupymoe.cli import cli
from cupymoe.experts.activation import Activation, ActivationSpec, activation_ref
from cupymoe.experts.gemm import kernel_specs as gemm_specs
from cupymoe.experts.gemv import kernel_specs as gemv_specs
from cupymoe.presets import random_fp4_experts
from cupymoe.routing import Router, RoutingMethod, route, route_ref
from cupymoe.routing.topk import kernel_specs as route_specs
from cupymoe.testing import assert_close, assert_equal, tolerance_for

BF16 = ml_dtypes.bfloat16
NAN, INF = np.nan, np.inf
SPARSE = RoutingMethod.SPARSE_MIXER
TOKENS = (1, 4, 8, 65, 1024)
NON_GATED = ("relu", "gelu", "silu", "identity")


def _sparse(e: int = 8) -> Router:
    return Router(n_experts=e, top_k=2, method=SPARSE)


def _route(rows: list[list[float]], e: int = 8) -> tuple[list[list[int]], np.ndarray]:
    r = route_ref(np.array(rows, np.float32), _sparse(e))
    return r.topk_ids.tolist(), r.topk_weights.astype(np.float64)


# ---- sparse mixer: the reference against hand-computed cases -----------------------------------
def test_sparse_mixer_all_equal_logits() -> None:
    ids, w = _route([[0.5] * 8])
    assert ids == [[0, 1]]  # ties: the lower expert, round 2 masks round 1's winner
    np.testing.assert_allclose(w, [[1 / 8, 1 / 7]], rtol=1e-7)


def test_sparse_mixer_ties_and_masked_set() -> None:
    # Round 1: m = 3 (expert 1); expert 3 ties (difference 0 is never masked), 2 and 0 are
    # masked (3 - 2 = 1 > 0.02 * 3). Round 2: expert 3, round 1's winner masked: alone.
    ids, w = _route([[1, 3, 2, 3, 0, 0, 0, 0]])
    assert ids == [[1, 3]]
    np.testing.assert_allclose(w, [[1 / 2, 1.0]], rtol=1e-7)


def test_sparse_mixer_threshold_in_float32() -> None:
    f = np.float32
    # 1 - f32(0.98) = 0.0199999809 < f32(0.02): kept; 1 - 0.97 = 0.03: masked. Round 2 (m = 0.98):
    # 0.98 - 0.97 = 0.01 < 0.02 * 0.98: kept.
    ids, w = _route([[1.0, 0.98, 0.97, -5, -5, -5, -5, -5]])
    assert ids == [[0, 1]]
    a, b, c = (float(f(v)) for v in (1.0, 0.98, 0.97))
    np.testing.assert_allclose(
        w, [[1 / (1 + math.exp(b - a)), 1 / (1 + math.exp(c - b))]], rtol=1e-7
    )
    # Negative winner: max(|x|, m) = |x| sets the threshold: -1.01 is kept against m = -1.
    ids, w = _route([[-1.0, -1.01, -1.5, -9, -9, -9, -9, -9]])
    x1 = float(f(-1.01))
    assert ids == [[0, 1]]
    np.testing.assert_allclose(w[0, 0], 1 / (1 + math.exp(x1 + 1)), rtol=1e-7)
    # Round 2, m = -1.01: -1.5 is 0.49 below, more than 0.02 * 1.5: masked.
    np.testing.assert_allclose(w[0, 1], 1.0, rtol=1e-7)


def test_sparse_mixer_infinities_and_nan() -> None:
    ids, w = _route(
        [
            [-INF] * 8,  # all -inf: the winner's value equals every other: shared
            [0, INF, 1, 2, -INF, 0, 0, 0],  # +inf wins alone; then 2 against 1 and the zeros
            [NAN] * 7 + [1.0],  # one number: round 2's winner is NaN, weight 0
            [NAN, 2, NAN, 2, 0, 0, 0, 0],  # NaN experts are never counted
            [NAN] * 8,
        ]
    )
    assert ids == [[0, 1], [1, 3], [7, 0], [1, 3], [0, 1]]
    expected = [[1 / 8, 1 / 7], [1.0, 1.0], [1.0, 0.0], [1 / 2, 1.0], [0.0, 0.0]]
    np.testing.assert_allclose(w, expected, rtol=1e-7)


def _sparse_mixer_loop(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ONNX Runtime's sparse_mixer_top2, one token and one expert at a time (finite logits)."""
    m_tokens, e = x.shape
    ids = np.zeros((m_tokens, 2), np.int32)
    w = np.zeros((m_tokens, 2))
    eps2 = np.float32(2) * np.float32(0.01)
    for t in range(m_tokens):
        for r in range(2):
            best = -1
            for i in range(e):
                if r == 1 and i == ids[t, 0]:
                    continue
                if best < 0 or x[t, i] > x[t, best]:
                    best = i
            ids[t, r] = best
            m = x[t, best]
            total = 0.0
            for i in range(e):
                masked = np.float32(m - x[t, i]) > np.float32(eps2 * max(abs(x[t, i]), m))
                if r == 1 and i == ids[t, 0]:
                    masked = True
                if not masked:
                    total += math.exp(float(x[t, i]) - float(m))
            w[t, r] = 1.0 / total
    return ids, w


@pytest.mark.parametrize("e", [8, 16])
@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0])  # near-ties: large kept sets; far apart
def test_sparse_mixer_matches_plain_loop(e: int, scale: float, rng: np.random.Generator) -> None:
    x = (rng.standard_normal((40, e)) * scale).astype(np.float32)
    x[:5] = np.round(x[:5])  # exact ties
    ref = route_ref(x, _sparse(e))
    ids, w = _sparse_mixer_loop(x)
    assert_equal(ids, ref.topk_ids, name="topk_ids")
    np.testing.assert_allclose(ref.topk_weights, w, rtol=1e-6)


@pytest.mark.parametrize(("e", "k"), [(8, 1), (8, 3), (4, 2), (32, 2), (12, 2), (16, 4)], ids=str)
def test_sparse_mixer_needs_k2_and_8_or_16_experts(e: int, k: int) -> None:
    with pytest.raises(ValueError, match="sparse_mixer needs top_k = 2 and n_experts in"):
        Router(n_experts=e, top_k=k, method=SPARSE)


# ---- separate selection and mixing tensors ------------------------------------------------------
def test_router_weights_gathered_exactly() -> None:
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, -INF, NAN]], np.float32)
    mix = np.array([[0.1, 0.2, 0.3, 0.4], [0.7, -0.25, 9.0, 9.0]], np.float32)
    plain = route_ref(logits, Router(4, 2, renormalize=False), router_weights=mix)
    assert plain.topk_ids.tolist() == [[1, 3], [0, 1]]  # the top-k is on the logits
    assert_equal(np.array([[0.2, 0.4], [0.7, -0.25]], np.float32), plain.topk_weights)
    for router in (Router(4, 2), Router(4, 2, RoutingMethod.TOPK_SOFTMAX, renormalize=False)):
        r = route_ref(logits, router, router_weights=mix)
        np.testing.assert_allclose(r.topk_weights, [[1 / 3, 2 / 3], [0.7 / 0.45, -0.25 / 0.45]])
    zero = route_ref(logits, Router(4, 2), router_weights=np.zeros_like(mix))
    assert_equal(np.zeros((2, 2), np.float32), zero.topk_weights)  # sum not > 0: weight 0


@pytest.mark.parametrize(
    ("router", "mix", "error", "match"),
    [
        (Router(4, 2, RoutingMethod.SIGMOID_GROUPED), np.ones((2, 4), np.float32), ValueError,
         "only with softmax_topk or topk_softmax"),
        (Router(8, 2, SPARSE), np.ones((2, 8), np.float32), ValueError, "only with"),
        (Router(4, 2), np.ones((2, 5), np.float32), ValueError, "shape of the logits"),
        (Router(4, 2), np.ones((2, 4), np.float64), TypeError, "float32"),
        (Router(4, 2), [[1.0] * 4] * 2, TypeError, "numpy.ndarray"),
    ],
)  # fmt: skip
def test_router_weights_validation(router: Router, mix: Any, error: type, match: str) -> None:
    logits = np.zeros((2, router.n_experts), np.float32)
    with pytest.raises(error, match=f"^router_weights: .*{match}"):
        route_ref(logits, router, router_weights=mix)


# ---- activations ---------------------------------------------------------------------------------
def test_non_gated_activations_hand_computed() -> None:
    v = np.array([-2.0, -0.0, 0.5, 3.0, NAN, -INF])
    gelu = [0.5 * a * (1 + math.erf(a / math.sqrt(2))) for a in (-2.0, 0.0, 0.5, 3.0)]
    silu = [a / (1 + math.exp(-a)) for a in (-2.0, 0.0, 0.5, 3.0)]
    cases = {
        "relu": [0.0, -0.0, 0.5, 3.0, NAN, 0.0],
        "gelu": [*gelu, NAN, NAN],  # -inf * 0, as the kernels' fp32 formula
        "silu": [*silu, NAN, NAN],
        "identity": list(v),
    }
    for name, expected in cases.items():
        with np.errstate(invalid="ignore"):
            out = activation_ref(v, None, ActivationSpec(name))
        np.testing.assert_allclose(out, expected, rtol=1e-15, atol=0, err_msg=name)
        assert not Activation(name).gated


def test_general_swiglu_beta() -> None:
    act = ActivationSpec("swiglu_oai", alpha=1.0, limit=2.0, beta=0.5)
    g, u = np.array([1.0, 5.0, -1.0]), np.array([0.25, -7.0, 3.0])
    gc, uc = np.array([1.0, 2.0, -1.0]), np.array([0.25, -2.0, 2.0])  # min(g, 2), clip(u, +-2)
    expected = gc / (1 + np.exp(-gc)) * (uc + 0.5)
    np.testing.assert_allclose(activation_ref(g, u, act), expected, rtol=1e-15)
    oai = ActivationSpec("swiglu_oai")  # beta 1: gpt-oss
    assert oai.beta == 1.0
    with pytest.raises(ValueError, match="^beta:"):
        ActivationSpec("swiglu_oai", beta=INF)


def test_activation_operands_checked() -> None:
    with pytest.raises(ValueError, match="^up: the gated"):
        activation_ref(np.zeros(2), None, ActivationSpec("swiglu"))
    with pytest.raises(ValueError, match="^up: the activation 'relu' is not gated"):
        activation_ref(np.zeros(2), np.zeros(2), ActivationSpec("relu"))


def test_activation_codes() -> None:
    codes = {a.value: a.code for a in Activation}
    assert codes == {
        "swiglu": 1, "geglu": 2, "swiglu_oai": 3,
        "relu": 4, "gelu": 5, "silu": 6, "identity": 7,
    }  # fmt: skip


def test_kernel_specs_list_the_new_specialisations() -> None:
    names = {(s.name, s.args[-2] if s.name.endswith("single") else None) for s in gemv_specs()}
    assert {("gemv_fc1_single", a.code) for a in Activation if not a.gated} <= names
    for prefix in ("gemm", "gemm90"):  # the mma.sync kernel and the sm_90a wgmma kernel
        gemm = {(s.name, s.args[2]) for s in gemm_specs() if s.name.startswith(prefix + "_fc1")}
        kinds = {(f"{prefix}_fc1" + ("" if a.gated else "_single"), a.code) for a in Activation}
        assert gemm == kinds
    methods = {(s.name, s.args[1]) for s in route_specs() if s.args}  # maps_tiles_place: none
    assert {
        ("route_fused", 3),
        ("route_warp", 3),
        ("route_fused", 4),
        ("route_block", 4),
    } <= methods
    assert ("route_block", 3) not in methods


# ---- the layer: arguments, validation, reference -------------------------------------------------
E, H, I = 8, 64, 32


def _weights(rng: np.random.Generator, fmt: str = "nvfp4", e: int = E, h: int = H, i: int = I):
    w1 = random_fp4_experts(rng, e, i, h, fmt)
    pair = (w1, random_fp4_experts(rng, e, i, h, fmt))
    return w1, pair, random_fp4_experts(rng, e, h, i, fmt)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(routing="sparse_mixer", top_k=3), ValueError, "^routing: sparse_mixer needs"),
        (dict(activation="relu"), ValueError, "^fc1: the non-gated activation 'relu'"),
        (dict(activation="gelu", single=True, fc1_layout="concatenated"), ValueError,
         "^fc1_layout: the non-gated"),
        (dict(activation="silu", single=True, fc1_bias=np.zeros((E, 2 * I), np.float32)),
         ValueError, "^fc1_bias:"),
        (dict(single=True), ValueError, "fc1_layout"),  # a gated activation of one tensor
        (dict(activation="swiglu_oai", activation_beta=NAN), ValueError, "^beta:"),
    ],
)  # fmt: skip
def test_layer_validation(rng: np.random.Generator, change: dict, error: type, match: str) -> None:
    w1, pair, down = _weights(rng)
    kw = dict(top_k=2)
    kw.update(change)
    fc1 = w1 if kw.pop("single", False) else pair
    with pytest.raises(error, match=match):
        cm.MoELayer(fc1, down, **kw)


def test_layer_sparse_mixer_needs_8_or_16_experts(rng: np.random.Generator) -> None:
    _, pair, down = _weights(rng, e=4)
    with pytest.raises(ValueError, match="n_experts in"):
        cm.MoELayer(pair, down, top_k=2, routing="sparse_mixer")


def test_layer_router_weights_validation(rng: np.random.Generator) -> None:
    _, pair, down = _weights(rng)
    layer = cm.MoELayer(pair, down, top_k=2)
    x = rng.standard_normal((3, H)).astype(BF16)
    logits = rng.standard_normal((3, E)).astype(np.float32)
    with pytest.raises(ValueError, match="^router_weights: expected the shape"):
        cm.moe_reference(x, logits, layer, router_weights=np.ones((3, E + 1), np.float32))
    sparse = cm.MoELayer(pair, down, top_k=2, routing="sparse_mixer")
    with pytest.raises(ValueError, match="^router_weights: only with"):
        cm.moe_reference(x, logits, sparse, router_weights=np.ones((3, E), np.float32))


def _plain_ffn(x: np.ndarray, layer: cm.MoELayer, routing: Any) -> np.ndarray:
    """``sum_j w_j W2 act(W1 x + b1) + b2``, token by token, from dense float64 weights."""
    w1 = layer.gate.dequantize().astype(np.float64)
    w2 = layer.down.dequantize().astype(np.float64)
    b1 = (
        np.zeros((layer.n_experts, layer.intermediate))
        if layer.gate_bias is None
        else layer.gate_bias
    )
    out = np.zeros((x.shape[0], layer.hidden))
    for t in range(x.shape[0]):
        for j in range(layer.top_k):
            e = routing.topk_ids[t, j]
            h = activation_ref(w1[e] @ x[t].astype(np.float64) + b1[e], None, layer.activation)
            out[t] += float(routing.topk_weights[t, j]) * (w2[e] @ h)
    return out


@pytest.mark.parametrize("activation", NON_GATED)
def test_reference_non_gated_matches_plain_loop(activation: str, rng: np.random.Generator) -> None:
    w1, _, down = _weights(rng)
    bias = rng.standard_normal((E, I)).astype(np.float32)
    layer = cm.MoELayer(w1, down, top_k=2, routing="sparse_mixer", activation=activation,
                        fc1_bias=bias)  # fmt: skip
    assert layer.up is None and layer.weight_nbytes == w1.nbytes + down.nbytes
    x = rng.standard_normal((5, H)).astype(BF16)
    logits = rng.standard_normal((5, E)).astype(np.float32)
    ref = cm.moe_reference(x, logits, layer)
    plain = _plain_ffn(x, layer, route_ref(logits, layer.router))
    # dequantize() rounds w = code * scale * global_scale to float32; the reference is exact.
    np.testing.assert_allclose(ref, plain, rtol=1e-5, atol=1e-5 * np.abs(plain).max())


def test_reference_router_weights_in_the_layer(rng: np.random.Generator) -> None:
    _, pair, down = _weights(rng)
    layer = cm.MoELayer(pair, down, top_k=2, renormalize=False)
    x = rng.standard_normal((3, H)).astype(BF16)
    logits = rng.standard_normal((3, E)).astype(np.float32)
    ones = cm.moe_reference(x, logits, layer, router_weights=np.ones((3, E), np.float32))
    half = cm.moe_reference(x, logits, layer, router_weights=np.full((3, E), 0.5, np.float32))
    np.testing.assert_allclose(half, ones / 2, rtol=1e-14)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        if not gpu_available():
            out = layer(x, logits, router_weights=np.ones((3, E), np.float32))
            np.testing.assert_array_equal(out, ones.astype(BF16))


def test_cli_run_options() -> None:
    runner = CliRunner()
    base = ["run", "--hidden", "64", "--inter", "32", "--experts", "8", "--top-k", "2"]
    for extra in (
        ["--routing", "sparse_mixer", "--activation", "relu"],
        ["--activation", "identity", "--tokens", "3"],
        ["--router-weights", "--activation", "swiglu_oai"],
    ):
        result = runner.invoke(cli, [*base, *extra])
        assert result.exit_code == 0, result.output
        assert "output" in result.output
    bad = runner.invoke(cli, [*base[:-1], "3", "--routing", "sparse_mixer"])
    assert bad.exit_code != 0 and "sparse_mixer needs top_k = 2" in bad.output
    bad = runner.invoke(cli, [*base, "--routing", "sigmoid_grouped", "--router-weights"])
    assert bad.exit_code != 0 and "--router-weights" in bad.output


# ---- GPU against the reference ------------------------------------------------------------------
def _cupy() -> Any:
    return pytest.importorskip("cupy")


def _logits(kind: str, m: int, e: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((m, e)) * 3
    if kind == "ties":
        x = np.round(x)
    elif kind == "near":  # kept sets of several experts: differences around the jitter mask
        x = 1.0 + rng.standard_normal((m, e)) * 0.02
    elif kind == "equal":
        x = np.full((m, e), 0.5)
    elif kind == "inf":
        x[rng.random((m, e)) < 0.15] = INF
        x[rng.random((m, e)) < 0.15] = -INF
    elif kind == "nan":
        x[rng.random((m, e)) < 0.2] = NAN
        x[0] = NAN
    return x.astype(np.float32)


def _check_routing(ref: Any, out: Any, *, exact_weights: bool = False) -> None:
    assert_equal(ref.topk_ids, out.topk_ids, name="topk_ids")
    if exact_weights:
        assert_equal(ref.topk_weights.view(np.int32), out.topk_weights.get().view(np.int32))
    else:
        assert_close(ref.topk_weights, out.topk_weights, max_rel=2e-6, rms_rel=1e-6,
                     name="topk_weights")  # fmt: skip
    for name in ("expert_offsets", "sorted_rows", "inverse", "active_experts"):
        assert_equal(getattr(ref, name), getattr(out, name), name=name)


def _poisoned(m: int, e: int, k: int) -> Any:
    out = cm.Routing.empty(m, e, k)
    for a in (out.topk_ids, out.expert_offsets, out.sorted_rows, out.inverse, out.active_experts):
        a.fill(-7)
    out.topk_weights.fill(np.nan)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["random", "ties", "near", "equal", "inf", "nan"])
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("e", [8, 16])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_route_sparse_mixer_gpu(kind: str, m: int, e: int, dtype: Any, rng) -> None:
    cupy = _cupy()
    x = _logits(kind, m, e, rng).astype(dtype)
    router = _sparse(e)
    out = route(cupy.asarray(x), router, out=_poisoned(m, e, 2))
    _check_routing(route_ref(x, router), out)


@pytest.mark.gpu
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize(
    ("e", "k"),
    [(8, 2), (64, 4), (256, 8), (300, 8), (512, 16)],  # 300, 512: the block kernel
)
def test_route_router_weights_gpu(renormalize: bool, m: int, e: int, k: int, rng) -> None:
    cupy = _cupy()
    for kind in ("random", "ties", "nan"):
        x = _logits(kind, m, e, rng)
        mix = rng.random((m, e)).astype(np.float32)
        mix[:, ::7] = 0.0
        router = Router(e, k, renormalize=renormalize)
        out = route(cupy.asarray(x), router, router_weights=cupy.asarray(mix),
                       out=_poisoned(m, e, k))  # fmt: skip
        ref = route_ref(x, router, router_weights=mix)
        _check_routing(ref, out, exact_weights=not renormalize)  # a gather is exact


@pytest.mark.gpu
def test_route_existing_kinds_ignore_the_new_arguments(rng: np.random.Generator) -> None:
    # The same logits through the existing kinds: unchanged by a mixing tensor of another call.
    cupy = _cupy()
    x = cupy.asarray(_logits("random", 8, 64, rng))
    router = Router(64, 4)
    first = route(x, router)
    route(x, router, router_weights=cupy.ones((8, 64), np.float32))
    again = route(x, router)
    assert_equal(first.topk_weights.get().view(np.int32), again.topk_weights.get().view(np.int32))


def _layer_case(
    rng: np.random.Generator,
    fmt: str,
    activation: str,
    routing: str,
    *,
    bias: bool = True,
    layout: str = "split",
) -> cm.MoELayer:
    e, h, i = 16, 256, 128
    gated = Activation(activation).gated
    w1 = random_fp4_experts(rng, e, i, h, fmt)
    fc1: Any = (w1, random_fp4_experts(rng, e, i, h, fmt)) if gated else w1
    down = random_fp4_experts(rng, e, h, i, fmt)
    kw: dict[str, Any] = dict(
        top_k=2, routing=routing, activation=activation, max_tokens=1024, weight_layout=layout
    )
    if activation == "swiglu_oai":
        kw.update(activation_alpha=1.2, activation_beta=0.25, activation_limit=3.0)
    if bias:
        kw["fc1_bias"] = (rng.standard_normal((e, (2 if gated else 1) * i)) * 0.1).astype(
            np.float32
        )
        kw["fc2_bias"] = (rng.standard_normal((e, h)) * 0.1).astype(np.float32)
    return cm.MoELayer(fc1, down, **kw)


def _layer_check(layer: cm.MoELayer, m: int, dtype: Any, rng, *, mix: bool = False) -> None:
    cupy = _cupy()
    x = rng.standard_normal((m, layer.hidden)).astype(dtype)
    logits = rng.standard_normal((m, layer.n_experts)).astype(np.float32)
    weights = rng.random((m, layer.n_experts)).astype(np.float32) if mix else None
    out = layer(cupy.asarray(x), cupy.asarray(logits),
                router_weights=None if weights is None else cupy.asarray(weights))  # fmt: skip
    ref = cm.moe_reference(x, logits, layer, router_weights=weights)
    max_rel, rms_rel = tolerance_for(dtype)
    assert_close(ref, out, max_rel=2 * max_rel, rms_rel=2 * rms_rel, name=f"M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("activation", [*NON_GATED, "swiglu_oai"])
def test_layer_activations_gpu(activation: str, fmt: str, m: int, rng) -> None:
    layer = _layer_case(rng, fmt, activation, "softmax_topk", bias=m != 4)
    _layer_check(layer, m, BF16, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", NON_GATED)
@pytest.mark.parametrize("m", [8, 65])
def test_layer_non_gated_fp16_and_layouts_gpu(activation: str, m: int, rng) -> None:
    for layout in ("split", "pair", "plain"):
        layer = _layer_case(rng, "nvfp4", activation, "topk_softmax", layout=layout)
        _layer_check(layer, m, np.float16, rng)


@pytest.mark.gpu
@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize(("routing", "mix"), [("sparse_mixer", False), ("softmax_topk", True)])
def test_layer_routing_options_gpu(routing: str, mix: bool, fmt: str, m: int, rng) -> None:
    layer = _layer_case(rng, fmt, "swiglu" if mix else "relu", routing)
    _layer_check(layer, m, BF16, rng, mix=mix)


@pytest.mark.gpu
def test_layer_non_gated_graph_replay_bitwise(rng: np.random.Generator) -> None:
    cupy = _cupy()
    layer = _layer_case(rng, "nvfp4", "gelu", "sparse_mixer")
    for m in (4, 65):
        x = cupy.asarray(rng.standard_normal((m, layer.hidden)).astype(BF16))
        logits = cupy.asarray(rng.standard_normal((m, layer.n_experts)).astype(np.float32))
        eager = layer(x, logits).view(np.int16).get()  # synchronises: workspaces are shared
        graph = layer.graph(m)
        with graph.stream:
            graph.x[...] = x
            graph.logits[0][...] = logits
            replayed = graph.replay().view(np.int16).get()
        assert_equal(eager, replayed, name=f"M={m}")
