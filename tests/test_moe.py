# SPDX-License-Identifier: Apache-2.0
"""The whole layer: validation, the NumPy/CuPy contract, the reference against a hand-written
float64 loop, fc1 layouts and biases, and (GPU) the kernels against the reference."""

from __future__ import annotations

import dataclasses
import warnings

import ml_dtypes
import numpy as np
import pytest

import cupymoe as cm
import cupymoe.layer.moe as moe_mod
from cupymoe.presets import PRESETS, random_fp4_experts, random_layer
from cupymoe.testing import assert_close, tolerance_for

BF16 = ml_dtypes.bfloat16


def _small_layer(rng: np.random.Generator, **kw: object) -> cm.MoELayer:
    e, h, i = 4, 64, 32
    gate = random_fp4_experts(rng, e, i, h, "nvfp4")
    up = random_fp4_experts(rng, e, i, h, "nvfp4")
    down = random_fp4_experts(rng, e, h, i, "nvfp4")
    args = dict(top_k=2, max_tokens=16)
    args.update(kw)
    return cm.MoELayer((gate, up), down, **args)  # type: ignore[arg-type]


def _loop_reference(x: np.ndarray, logits: np.ndarray, layer: cm.MoELayer) -> np.ndarray:
    """softmax_topk + renormalize + swiglu, written as plainly as possible (float64)."""
    g = layer.gate.dequantize(np.float64)
    u = layer.up.dequantize(np.float64)
    d = layer.down.dequantize(np.float64)
    out = np.zeros((x.shape[0], layer.hidden))
    for t in range(x.shape[0]):
        z = logits[t].astype(np.float64)
        p = np.exp(z - z.max())
        p /= p.sum()
        order = sorted(range(len(z)), key=lambda e: (-z[e], e))[: layer.top_k]
        w = p[order] / p[order].sum()
        xt = x[t].astype(np.float64)
        for e, we in zip(order, w, strict=True):
            a, b = g[e] @ xt, u[e] @ xt
            h = a / (1 + np.exp(-a)) * b
            out[t] += we * (d[e] @ h)
    return out


def test_reference_matches_plain_loop(rng: np.random.Generator) -> None:
    layer = _small_layer(rng)
    x = rng.standard_normal((5, 64)).astype(BF16)
    logits = rng.standard_normal((5, 4)).astype(np.float32)
    ref = cm.moe_reference(x, logits, layer)
    assert ref.dtype == np.float64 and ref.shape == (5, 64)
    # route_ref's weights are float32 (the contract), the loop's float64: 1e-6 relative.
    loop = _loop_reference(x, logits, layer)
    np.testing.assert_allclose(ref, loop, rtol=1e-5, atol=1e-6 * np.abs(loop).max())


def test_empty_batch(rng: np.random.Generator) -> None:
    layer = _small_layer(rng)
    x = np.zeros((0, 64), BF16)
    logits = np.zeros((0, 4), np.float32)
    assert cm.moe_reference(x, logits, layer).shape == (0, 64)


def _fc1_single(gate: cm.Fp4Experts, up: cm.Fp4Experts, layout: str) -> cm.Fp4Experts:
    if layout == "concatenated":
        packed = np.concatenate([gate.packed, up.packed], axis=1)
        scales = np.concatenate([gate.scales, up.scales], axis=1)
    else:
        packed = np.stack([gate.packed, up.packed], axis=2).reshape(gate.n_experts, -1, gate.k // 2)
        scales = np.stack([gate.scales, up.scales], axis=2).reshape(
            gate.n_experts, -1, gate.scales.shape[-1]
        )
    return cm.Fp4Experts.from_packed(packed, scales, gate.global_scale, format=gate.format)


@pytest.mark.parametrize("layout", ["concatenated", "interleaved"])
def test_fc1_layouts_and_bias_order(rng: np.random.Generator, layout: str) -> None:
    e, h, i = 3, 64, 32  # K = 32 is the smallest MXFP4 block
    gate = random_fp4_experts(rng, e, i, h, "mxfp4")
    up = random_fp4_experts(rng, e, i, h, "mxfp4")
    down = random_fp4_experts(rng, e, h, i, "mxfp4")
    gate_bias = rng.standard_normal((e, i)).astype(np.float32)
    up_bias = rng.standard_normal((e, i)).astype(np.float32)
    pair = cm.MoELayer(
        (gate, up),
        down,
        top_k=2,
        fc1_bias=np.concatenate([gate_bias, up_bias], 1),
        activation="swiglu_oai",
    )
    if layout == "concatenated":
        bias = np.concatenate([gate_bias, up_bias], 1)
    else:
        bias = np.stack([gate_bias, up_bias], 2).reshape(e, 2 * i)
    single = cm.MoELayer(
        _fc1_single(gate, up, layout),
        down,
        top_k=2,
        fc1_layout=layout,
        fc1_bias=bias,
        activation="swiglu_oai",
    )
    np.testing.assert_array_equal(single.gate_bias, gate_bias)
    np.testing.assert_array_equal(single.up_bias, up_bias)
    x = rng.standard_normal((4, h)).astype(np.float16)
    logits = rng.standard_normal((4, e)).astype(np.float32)
    np.testing.assert_array_equal(
        cm.moe_reference(x, logits, single), cm.moe_reference(x, logits, pair)
    )


def test_separate_global_scales_are_kept(rng: np.random.Generator) -> None:
    layer = _small_layer(rng)
    assert not np.array_equal(layer.gate.global_scale, layer.up.global_scale)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_k=5), ValueError, "top_k"),
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(activation="relu"), ValueError, "relu"),
        (dict(routing="argmax"), ValueError, "argmax"),
        (dict(fc2_bias=np.zeros((4, 63), np.float32)), ValueError, "fc2_bias"),
        (dict(fc1_bias=np.zeros((4, 32), np.float32)), ValueError, "fc1_bias"),
        (dict(fc1_bias=np.full((4, 64), np.nan, np.float32)), ValueError, "fc1_bias"),
        (dict(fc1_bias=np.zeros((4, 64), np.int32)), TypeError, "fc1_bias"),
        (dict(fc1_layout="interleaved"), ValueError, "fc1_layout"),
    ],
)
def test_layer_validation(rng: np.random.Generator, change: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _small_layer(rng, **change)


def test_fc1_fc2_shape_mismatch(rng: np.random.Generator) -> None:
    gate = random_fp4_experts(rng, 4, 32, 64)
    down_bad = random_fp4_experts(rng, 4, 64, 16)
    with pytest.raises(ValueError, match="fc2"):
        cm.MoELayer((gate, gate), down_bad, top_k=2)
    with pytest.raises(ValueError, match="fc1"):
        cm.MoELayer((gate, random_fp4_experts(rng, 4, 16, 64)), down_bad, top_k=2)
    with pytest.raises(TypeError, match="fc1"):
        cm.MoELayer(gate.packed, down_bad, top_k=2)
    with pytest.raises(ValueError, match="fc1_layout"):
        cm.MoELayer(gate, down_bad, top_k=2)


@pytest.mark.parametrize(
    ("x_shape", "x_dtype", "l_shape", "l_dtype", "error", "match"),
    [
        ((2, 63), BF16, (2, 4), np.float32, ValueError, "x: expected shape"),
        ((2, 64), np.float32, (2, 4), np.float32, TypeError, "x: expected dtype"),
        ((2, 64), BF16, (3, 4), np.float32, ValueError, "router_logits"),
        ((2, 64), BF16, (2, 5), np.float32, ValueError, "router_logits"),
        ((2, 64), BF16, (2, 4), np.int32, TypeError, "router_logits"),
        ((17, 64), BF16, (17, 4), np.float32, ValueError, "max_tokens"),
        ((64,), BF16, (1, 4), np.float32, ValueError, "x: expected shape"),
    ],
)
def test_call_validation(
    rng: np.random.Generator, x_shape, x_dtype, l_shape, l_dtype, error, match
) -> None:
    layer = _small_layer(rng)
    with pytest.raises(error, match=match):
        layer(np.zeros(x_shape, x_dtype), np.zeros(l_shape, l_dtype))
    with pytest.raises(TypeError, match="x"):
        layer([[0.0] * 64], np.zeros((1, 4), np.float32))


def test_reference_backend_numpy_in_numpy_out(
    rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(moe_mod, "gpu_available", lambda: False)
    layer = _small_layer(rng)
    x = rng.standard_normal((3, 64)).astype(BF16)
    logits = rng.standard_normal((3, 4)).astype(np.float32)
    with pytest.warns(RuntimeWarning, match="NumPy reference"):
        out = layer(x, logits)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once only
        out2 = layer(x, logits)
    assert isinstance(out, np.ndarray) and out.dtype == BF16 and out.shape == (3, 64)
    np.testing.assert_array_equal(out.view(np.uint16), out2.view(np.uint16))
    ref = cm.moe_reference(x, logits, layer)
    np.testing.assert_array_equal(out, ref.astype(BF16))
    buf = np.full((3, 64), np.nan, BF16)
    assert layer(x, logits, out=buf) is buf
    np.testing.assert_array_equal(buf, out)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_run_reference(name: str, rng: np.random.Generator) -> None:
    shape = dataclasses.replace(PRESETS[name], hidden=128, intermediate=64)
    layer = cm.MoELayer(**random_layer(shape, rng, max_tokens=4))
    x = rng.standard_normal((2, 128)).astype(BF16)
    logits = rng.standard_normal((2, shape.n_experts)).astype(np.float32)
    ref = cm.moe_reference(x, logits, layer)
    assert ref.shape == (2, 128) and np.all(np.isfinite(ref))
    # Random weights are scaled for unit output variance per expert: the layer output is O(1).
    assert 0.05 < float(np.std(ref)) < 20.0


# ---------------------------------------------------------------------------------------------
# GPU: the whole layer against the reference
# ---------------------------------------------------------------------------------------------


def _gpu_case(name: str, rng: np.random.Generator, experts: int | None = None):
    shape = PRESETS[name]
    if experts is not None:
        shape = dataclasses.replace(shape, n_experts=experts)
    return shape, cm.MoELayer(**random_layer(shape, rng, max_tokens=128))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tokens", [1, 4, 8, 9, 100])
@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_layer_gpu_matches_reference(name: str, tokens: int, dtype, rng) -> None:
    import cupy

    # 32 experts keeps the host quantization fast; 9 and 100 tokens cross the 64-row window
    # (top-8) into the batched path.
    shape, layer = _gpu_case(name, rng, experts=32)
    x = rng.standard_normal((tokens, shape.hidden)).astype(dtype)
    logits = rng.standard_normal((tokens, shape.n_experts)).astype(np.float32)
    ref = cm.moe_reference(x, logits, layer)
    out = layer(cupy.asarray(x), cupy.asarray(logits))
    assert isinstance(out, cupy.ndarray) and out.dtype == dtype
    max_rel, rms_rel = tolerance_for(dtype)
    assert_close(ref, out, max_rel=2 * max_rel, rms_rel=2 * rms_rel, name=f"{name} M={tokens}")
    host = layer(x, logits)  # NumPy in -> NumPy out, same bits
    assert isinstance(host, np.ndarray)
    np.testing.assert_array_equal(host.view(np.uint16), out.get().view(np.uint16))


@pytest.mark.gpu
def test_layer_gpu_deterministic_and_out(rng: np.random.Generator) -> None:
    import cupy

    shape, layer = _gpu_case("qwen3.6-35b-a3b", rng, experts=64)
    x = cupy.asarray(rng.standard_normal((8, shape.hidden)).astype(BF16))
    logits = cupy.asarray(rng.standard_normal((8, shape.n_experts)).astype(np.float32))
    first = layer(x, logits).view(cupy.uint16)
    for _ in range(20):
        assert bool((layer(x, logits).view(cupy.uint16) == first).all())
    buf = cupy.full((8, shape.hidden), cupy.nan, dtype=BF16)
    assert layer(x, logits, out=buf) is buf
    assert bool((buf.view(cupy.uint16) == first).all())


@pytest.mark.gpu
def test_torch_tensors_in_and_out_without_copies(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    import cupy

    layer = _small_layer(rng)
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(3, 4, device="cuda", dtype=torch.float32)
    out = layer(x, logits)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.bfloat16
    ref = layer(cupy.from_dlpack(x), cupy.from_dlpack(logits))
    assert bool((cupy.from_dlpack(out).view(cupy.uint16) == ref.view(cupy.uint16)).all())
    buf = torch.full((3, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert layer(x, logits, out=buf) is buf  # written in place: the same memory
    assert torch.equal(buf, out)
    # zero-copy input: the kernels read torch's memory (DLPack shares the pointer)
    assert cupy.from_dlpack(x).data.ptr == x.data_ptr()
