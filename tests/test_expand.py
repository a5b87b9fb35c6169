# SPDX-License-Identifier: Apache-2.0
"""Expand: the reference by hand (CPU), the kernel against it (bitwise) on edge shapes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupymoe.layer.expand import expand, expand_ref
from cupymoe.routing import Router, route_ref


def test_expand_ref_by_hand() -> None:
    logits = np.array([[0.0, 2.0, 1.0], [3.0, 0.0, 2.0]], np.float32)
    r = route_ref(logits, Router(3, 2))  # token 0 -> (1, 2); token 1 -> (0, 2)
    x = np.array([[1, 1], [2, 2]], np.float32)
    assert expand_ref(x, r).tolist() == [[2, 2], [1, 1], [1, 1], [2, 2]]


def test_expand_ref_shape_check() -> None:
    r = route_ref(np.zeros((2, 3), np.float32), Router(3, 2))
    with pytest.raises(ValueError, match="x"):
        expand_ref(np.zeros((3, 4)), r)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32])
@pytest.mark.parametrize(
    ("m", "hidden", "k"),
    [(0, 64, 2), (1, 2048, 8), (4, 2880, 4), (33, 7, 3), (64, 2049, 2), (5, 1, 1)],
)
def test_expand_matches_reference(
    dtype: type, m: int, hidden: int, k: int, rng: np.random.Generator
) -> None:
    cupy = pytest.importorskip("cupy")
    from cupymoe.routing import route

    e = 16
    logits = rng.standard_normal((m, e)).astype(np.float32)
    router = Router(e, k)
    x = rng.standard_normal((m, hidden)).astype(dtype)
    ref = expand_ref(x, route_ref(logits, router))
    try:
        xd = cupy.asarray(x)
    except Exception as error:
        pytest.skip(f"cupy cannot hold {x.dtype}: {error}")
    routing = route(cupy.asarray(logits), router)
    out = cupy.full((m * k, hidden), np.nan, np.float32).astype(xd.dtype)
    expand(xd, routing, out=out)
    assert np.array_equal(ref.view(np.uint8), out.get().view(np.uint8))
    if m > 1:  # strided rows
        wide = cupy.zeros((m, hidden + 3), xd.dtype)
        wide[:, :hidden] = xd
        assert np.array_equal(
            ref.view(np.uint8), expand(wide[:, :hidden], routing).get().view(np.uint8)
        )
