# SPDX-License-Identifier: Apache-2.0
"""The batched path above the row window against a float64 NumPy computation (GPU), and its
host-side index math (CPU)."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

from cupymoe.formats import DeviceFp4
from cupymoe.presets import random_fp4_experts
from cupymoe.routing import random_routing
from cupymoe.testing import assert_close, tolerance_for

_HIDDEN, _INTER, _EXPERTS = 64, 96, 16  # K multiples of 32 (MXFP4 blocks) for FC1 and FC2
_ERF = np.vectorize(math.erf)


def _act_ref(kind: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """The activations of FORMATS.md in float64 (alpha 1.702, limit 7 for swiglu_oai)."""
    if kind == "swiglu":
        return gate / (1 + np.exp(-gate)) * up
    if kind == "geglu":
        return 0.5 * gate * (1 + _ERF(gate / math.sqrt(2))) * up
    g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    return g / (1 + np.exp(-1.702 * g)) * (u + 1)


def _gemm_ref(a: np.ndarray, w, offsets: np.ndarray, bias) -> np.ndarray:
    """Rows offsets[e]:offsets[e+1] of ``a`` times W_e^T (+ bias[e]) in float64."""
    dense = w.dequantize(np.float64)
    out = np.zeros((a.shape[0], w.n))
    for e in range(w.n_experts):
        lo, hi = offsets[e], offsets[e + 1]
        out[lo:hi] = a[lo:hi] @ dense[e].T + (0 if bias is None else bias[e])
    return out


def _act_spec(kind: str):
    from cupymoe.experts.activation import Activation, ActivationSpec

    return ActivationSpec(Activation(kind))


@dataclasses.dataclass(frozen=True)
class Case:
    rows: int  # expanded rows M * top_k, all above the 64-row window
    top_k: int
    fmt: str
    dtype: str
    act: str
    bias: bool


def _cases() -> list[Case]:
    # 65: just above the window (M = 13, top-5); 512: top-8 decode-verify scale; 1000: M = 125.
    base = [(65, 5), (512, 8), (1000, 8)]
    cases = [Case(r, k, "nvfp4", "bfloat16", "swiglu", False) for r, k in base]
    cases += [Case(r, k, "mxfp4", "float16", "swiglu_oai", True) for r, k in base]
    cases += [
        Case(512, 8, "nvfp4", "float16", "geglu", True),
        Case(65, 5, "mxfp4", "bfloat16", "geglu", False),
    ]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", _cases(), ids=repr)
def test_fc1_fc2_batched(rng: np.random.Generator, case: Case) -> None:
    import cupy

    from cupymoe.experts.batched import fc1_batched, fc2_batched

    dtype = np.dtype(ml_dtypes.bfloat16) if case.dtype == "bfloat16" else np.dtype(np.float16)
    n_tokens = case.rows // case.top_k
    gate = random_fp4_experts(rng, _EXPERTS, _INTER, _HIDDEN, case.fmt)
    up = random_fp4_experts(rng, _EXPERTS, _INTER, _HIDDEN, case.fmt)
    down = random_fp4_experts(rng, _EXPERTS, _HIDDEN, _INTER, case.fmt)
    biases = [
        rng.standard_normal((_EXPERTS, n)).astype(np.float32) * 0.1 if case.bias else None
        for n in (_INTER, _INTER, _HIDDEN)
    ]
    x = rng.standard_normal((n_tokens, _HIDDEN)).astype(dtype)
    routing = random_routing(rng, n_tokens, case.top_k, _EXPERTS)
    offsets = routing.expert_offsets.get()
    sorted_rows = routing.sorted_rows.get()

    x_sorted = x.astype(np.float64)[sorted_rows // case.top_k]
    g = _gemm_ref(x_sorted, gate, offsets, biases[0])
    u = _gemm_ref(x_sorted, up, offsets, biases[1])
    h_ref = _act_ref(case.act, g, u)

    out = cupy.full((case.rows, _INTER), np.nan, dtype=dtype)  # poison
    h = fc1_batched(
        cupy.asarray(x),
        DeviceFp4.from_experts(gate),
        DeviceFp4.from_experts(up),
        routing,
        act=_act_spec(case.act),
        gate_bias=biases[0],
        up_bias=biases[1],
        out=out,
    )
    assert h is out and h.dtype == dtype
    max_rel, rms_rel = tolerance_for(dtype)
    assert_close(h_ref, h, max_rel=max_rel, rms_rel=rms_rel, name="fc1")

    # FC2 from the kernel's own h: the reference sees exactly the same 16-bit input
    h_host = h.get()
    y_ref = _gemm_ref(h_host.astype(np.float64), down, offsets, biases[2])
    y = fc2_batched(h, DeviceFp4.from_experts(down), routing, bias=biases[2])
    assert y.shape == (case.rows, _HIDDEN) and y.dtype == dtype
    assert_close(y_ref, y, max_rel=max_rel, rms_rel=rms_rel, name="fc2")


@pytest.mark.gpu
def test_workspace_chunks_give_the_same_answer(rng, monkeypatch) -> None:
    import cupy

    from cupymoe.experts import batched

    down = DeviceFp4.from_experts(random_fp4_experts(rng, _EXPERTS, _HIDDEN, _INTER, "nvfp4"))
    routing = random_routing(rng, 40, 4, _EXPERTS)
    h = cupy.asarray(rng.standard_normal((160, _INTER)).astype(ml_dtypes.bfloat16))
    whole = batched.fc2_batched(h, down, routing).get()
    monkeypatch.setattr(batched, "WORKSPACE_BYTES", _HIDDEN * _INTER * 4 * 3)  # 3 experts a chunk
    chunked = batched.fc2_batched(h, down, routing).get()
    assert np.array_equal(whole.view(np.uint16), chunked.view(np.uint16))


@pytest.mark.gpu
def test_empty_batch(rng: np.random.Generator) -> None:
    import cupy

    from cupymoe.experts.batched import fc2_batched

    down = DeviceFp4.from_experts(random_fp4_experts(rng, 4, 32, 32, "nvfp4"))
    routing = random_routing(rng, 0, 2, 4)
    y = fc2_batched(cupy.zeros((0, 32), cupy.float16), down, routing)
    assert y.shape == (0, 32) and y.dtype == np.float16


@pytest.mark.gpu
def test_rejects_before_launch(rng: np.random.Generator) -> None:
    import cupy

    from cupymoe.experts.batched import fc1_batched, fc2_batched

    gate = DeviceFp4.from_experts(random_fp4_experts(rng, 4, 32, 64, "nvfp4"))
    down = DeviceFp4.from_experts(random_fp4_experts(rng, 4, 64, 32, "nvfp4"))
    routing = random_routing(rng, 20, 4, 4)
    x = cupy.zeros((20, 64), cupy.float16)
    act = _act_spec("swiglu")
    with pytest.raises(TypeError, match="x: expected dtype"):
        fc1_batched(x.astype(cupy.float32), gate, gate, routing, act=act)
    with pytest.raises(ValueError, match="x: expected shape"):
        fc1_batched(x[:, :32], gate, gate, routing, act=act)
    with pytest.raises(ValueError, match="up: expected the shape"):
        fc1_batched(x, gate, down, routing, act=act)
    with pytest.raises(ValueError, match="gate_bias: expected shape"):
        fc1_batched(x, gate, gate, routing, act=act, gate_bias=np.zeros((4, 31), np.float32))
    with pytest.raises(ValueError, match="out: expected float16"):
        fc1_batched(x, gate, gate, routing, act=act, out=cupy.empty((80, 31), cupy.float16))
    with pytest.raises(ValueError, match="routing: expected 21 tokens"):
        fc1_batched(cupy.zeros((21, 64), cupy.float16), gate, gate, routing, act=act)
    with pytest.raises(ValueError, match="h: expected shape"):
        fc2_batched(cupy.zeros((79, 32), cupy.float16), down, routing)
    with pytest.raises(ValueError, match="expert_offsets"):
        fc2_batched(
            cupy.zeros((80, 32), cupy.float16),
            DeviceFp4.from_experts(random_fp4_experts(rng, 5, 64, 32, "nvfp4")),
            routing,
        )


# ---- host index math (CPU) -----------------------------------------------------------------------
def test_block_indices_gather_every_row_once(rng: np.random.Generator) -> None:
    from cupymoe.experts.batched import block_indices

    counts = rng.integers(0, 7, size=40)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    chunk = np.flatnonzero(counts > 0)
    width = int(counts.max())
    gather, dst, src = block_indices(offsets, chunk, width)
    assert gather.shape == (chunk.size, width)
    assert sorted(dst.tolist()) == list(range(int(offsets[-1])))  # every row exactly once
    np.testing.assert_array_equal(gather.reshape(-1)[src], dst)  # src slots read dst rows
    for slot, e in enumerate(chunk):  # each slot reads its own expert's rows (padding: the first)
        lo, hi = offsets[e], offsets[e + 1]
        assert np.all((gather[slot] >= lo) & (gather[slot] < hi))
        np.testing.assert_array_equal(gather[slot, : hi - lo], np.arange(lo, hi))


def test_block_indices_rejects_empty_or_too_wide_experts() -> None:
    from cupymoe.experts.batched import block_indices

    offsets = np.array([0, 2, 2, 5])
    with pytest.raises(ValueError, match="chunk"):
        block_indices(offsets, np.array([0, 1]), 3)  # expert 1 has no rows
    with pytest.raises(ValueError, match="chunk"):
        block_indices(offsets, np.array([2]), 2)  # 3 rows do not fit a width of 2
