# SPDX-License-Identifier: Apache-2.0
"""Finalize: the reference by hand (CPU), the kernel against it, determinism, validation."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupymoe.layer.finalize import finalize, finalize_ref
from cupymoe.routing import Router, route_ref
from cupymoe.testing import assert_close, tolerance_for

BF16 = ml_dtypes.bfloat16


def test_finalize_ref_by_hand() -> None:
    logits = np.log(np.array([[1.0, 3.0]], np.float32))  # weights 0.25 (e0), 0.75 (e1)
    r = route_ref(logits, Router(2, 2))
    y = np.array([[4.0, 8.0], [8.0, 0.0]])  # expanded rows: expert 0, expert 1
    out = finalize_ref(y, r, bias=np.array([1.0, -1.0]))
    np.testing.assert_allclose(out, [[0.25 * 4 + 0.75 * 8 + 1, 0.25 * 8 - 1]], rtol=1e-6)


def test_finalize_ref_validation() -> None:
    r = route_ref(np.zeros((2, 4), np.float32), Router(4, 2))
    with pytest.raises(ValueError, match="y"):
        finalize_ref(np.zeros((3, 8)), r)
    with pytest.raises(ValueError, match="bias"):
        finalize_ref(np.zeros((4, 8)), r, bias=np.zeros(7))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, np.float16, np.float32])
@pytest.mark.parametrize("out_dtype", [None, np.float32])
@pytest.mark.parametrize("bias", [None, "float32", "same"])
@pytest.mark.parametrize(
    ("m", "hidden", "k"),
    [(0, 64, 2), (1, 2048, 8), (4, 2880, 4), (33, 7, 3), (64, 2048, 8), (3, 100, 16)],
)
def test_finalize_matches_reference(
    dtype: type,
    out_dtype: type | None,
    bias: str | None,
    m: int,
    hidden: int,
    k: int,
    rng: np.random.Generator,
) -> None:
    cupy = pytest.importorskip("cupy")
    from cupymoe.routing import route

    e = 32
    logits = rng.standard_normal((m, e)).astype(np.float32)
    router = Router(e, k)
    y = rng.standard_normal((m * k, hidden)).astype(dtype)
    b = (
        None
        if bias is None
        else rng.standard_normal(hidden).astype(np.float32 if bias == "float32" else dtype)
    )
    ref = finalize_ref(y, route_ref(logits, router), bias=b)
    try:
        yd = cupy.asarray(y)
    except Exception as error:
        pytest.skip(f"cupy cannot hold {y.dtype}: {error}")
    routing = route(cupy.asarray(logits), router)
    bd = None if b is None else cupy.asarray(b)
    out = finalize(yd, routing, bias=bd, out_dtype=out_dtype)
    assert out.dtype == np.dtype(out_dtype or dtype) and out.shape == (m, hidden)
    max_rel, rms_rel = tolerance_for(out.dtype)
    assert_close(ref, out, max_rel=max_rel, rms_rel=rms_rel, name="finalize")
    again = finalize(yd, routing, bias=bd, out_dtype=out_dtype)
    assert np.array_equal(out.get().view(np.uint8), again.get().view(np.uint8))


@pytest.mark.gpu
def test_finalize_validation() -> None:
    cupy = pytest.importorskip("cupy")
    from cupymoe.routing import route

    routing = route(cupy.zeros((2, 4), np.float32), Router(4, 2))
    with pytest.raises(ValueError, match="y"):
        finalize(cupy.zeros((3, 8), np.float32), routing)
    with pytest.raises(TypeError, match="y"):
        finalize(cupy.zeros((4, 8), np.int32), routing)
    with pytest.raises(TypeError, match="bias"):
        finalize(cupy.zeros((4, 8), np.float32), routing, bias=cupy.zeros(8, np.float64))
    with pytest.raises(TypeError, match="out_dtype"):
        finalize(cupy.zeros((4, 8), np.float32), routing, out_dtype=np.float64)
