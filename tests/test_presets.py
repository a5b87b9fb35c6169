# SPDX-License-Identifier: Apache-2.0
"""Random preset weights: drawn as codes and scale bytes, unit output variance, and for the NumPy
backend only the experts the tokens select (the same bits as in the full layer)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import cupymoe as cm
from cupymoe.experts.reference import _CHUNK_BYTES, fc2_ref
from cupymoe.presets import PRESETS, random_fp4_experts, random_layer
from cupymoe.routing import route_ref


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_random_experts_have_unit_output_variance(fmt: str) -> None:
    w = random_fp4_experts(np.random.default_rng(0), 4, 256, 1024, fmt)
    x = np.random.default_rng(1).standard_normal((1024, 64))
    std = (w.dequantize(np.float64) @ x).std(axis=(1, 2))
    assert np.all((std > 0.6) & (std < 1.6)), std


def test_an_expert_does_not_depend_on_which_others_are_drawn() -> None:
    full = random_fp4_experts(np.random.default_rng(3), 6, 32, 64)
    some = random_fp4_experts(np.random.default_rng(3), 6, 32, 64, experts=[1, 4])
    for e in range(6):
        same = e in (1, 4)
        assert np.array_equal(some.packed[e], full.packed[e]) == same
        assert np.array_equal(some.scales[e], full.scales[e]) == same
        assert same or not some.packed[e].any() and not some.scales[e].any()
    with pytest.raises(ValueError, match=r"^experts: expected ids in \[0, 6\), got 6"):
        random_fp4_experts(np.random.default_rng(3), 6, 32, 64, experts=[6])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_only_for_draws_the_selected_experts_of_the_full_layer(name: str) -> None:
    shape = dataclasses.replace(PRESETS[name], n_experts=32, hidden=256, intermediate=128)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, shape.hidden)).astype(ml_dtypes.bfloat16)
    logits = rng.standard_normal((3, shape.n_experts)).astype(np.float32)
    full = cm.MoELayer(**random_layer(shape, np.random.default_rng(5), max_tokens=3))
    part = cm.MoELayer(**random_layer(shape, np.random.default_rng(5), only_for=logits))
    selected = np.unique(route_ref(logits, full.router).topk_ids)
    assert 0 < selected.size < shape.n_experts
    drawn = [e for e in range(shape.n_experts) if part.down.scales[e].any()]
    assert drawn == selected.tolist()
    ref = cm.moe_reference(x, logits, full)
    assert np.array_equal(cm.moe_reference(x, logits, part), ref)
    assert 0.1 < ref.std() < 2


def test_reference_decodes_in_chunks_exactly() -> None:
    """fc2_ref decodes a few rows at a time (and experts on threads): same float64 weights as
    ``dequantize``, so the same result up to the summation order of float64 matmuls."""
    k = 1024
    rows = _CHUNK_BYTES // (8 * k)
    w = random_fp4_experts(np.random.default_rng(2), 3, 2 * rows + 5, k, "nvfp4")  # a tail chunk
    x = np.random.default_rng(4).standard_normal((5, k))
    offsets = np.array([0, 2, 2, 5])
    out = fc2_ref(x, w, offsets)
    dense = w.dequantize(np.float64)
    ref = np.concatenate([x[:2] @ dense[0].T, x[2:] @ dense[2].T])
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
