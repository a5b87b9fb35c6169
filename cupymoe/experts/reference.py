# SPDX-License-Identifier: Apache-2.0
"""NumPy references of the expert GEMMs: ``fc1_ref`` (gate and up with the gated activation) and
``fc2_ref``, in float64 with the exact dequantized weights; the oracle of the GEMV, the batched
path and every later backend.

``fc2_ref(h)[r] = h[r] @ W[e]^T + b[e]`` and
``fc1_ref(x)[r] = act(x[r] @ Wg[e]^T + bg[e], x[r] @ Wu[e]^T + bu[e])`` for every expanded row
``r`` of expert ``e`` (``expert_offsets[e] <= r < expert_offsets[e + 1]``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.backend import to_numpy
from .._runtime.validate import check_bias
from ..formats import Fp4Experts, decode_e2m1, unpack_fp4
from .activation import ActivationSpec, activation_ref

__all__ = ["fc1_ref", "fc2_ref"]


def _host_offsets(expert_offsets: Any, n_experts: int, rows: int) -> np.ndarray:
    off = np.asarray(to_numpy(expert_offsets))
    if off.shape != (n_experts + 1,) or off.dtype.kind not in "iu":
        raise ValueError(
            f"expert_offsets: expected integers of shape {(n_experts + 1,)}, got "
            f"{off.dtype} {off.shape}"
        )
    off = off.astype(np.int64)
    if off[0] != 0 or off[-1] != rows or np.any(np.diff(off) < 0):
        raise ValueError(
            f"expert_offsets: expected non-decreasing offsets from 0 to {rows} rows, "
            f"got {off.tolist()[:4]}... ending at {int(off[-1])}"
        )
    return off


def _expert_f64(w: Fp4Experts, e: int) -> np.ndarray:
    """Exact float64 ``[N, K]`` of expert ``e`` (one expert at a time: bounded memory)."""
    values = decode_e2m1(unpack_fp4(w.packed[e])).astype(np.float64)
    scales = w.format.decode_scales(w.scales[e]).astype(np.float64)
    values = values.reshape(w.n, -1, w.block_size) * scales[..., None]
    return values.reshape(w.n, w.k) * float(w.global_scale[e])


def _bias_ref(bias: Any, name: str, w: Fp4Experts) -> np.ndarray | None:
    b = check_bias(bias, name, (w.n_experts, w.n), finite=False)
    return None if b is None else np.asarray(to_numpy(b), dtype=np.float64)


def fc2_ref(
    x_sorted: Any, weights: Fp4Experts, expert_offsets: Any, *, bias: Any = None
) -> np.ndarray:
    """FC2: ``out[r] = x_sorted[r] @ W[e]^T (+ bias[e])`` for the rows ``r`` of each expert ``e``.

    Parameters
    ----------
    x_sorted : array [R, K]
        Activations in expanded order (any float dtype; widened to float64).
    weights : Fp4Experts
        ``[E, N, K]``.
    expert_offsets : int array [E + 1]
        Rows ``offsets[e]:offsets[e+1]`` belong to expert ``e``.
    bias : array [E, N], optional

    Returns
    -------
    numpy.ndarray
        float64 ``[R, N]``; exact weights, float64 math.
    """
    if not isinstance(weights, Fp4Experts):
        raise TypeError(f"weights: expected Fp4Experts, got {type(weights).__name__}")
    x = np.asarray(to_numpy(x_sorted)).astype(np.float64)
    if x.ndim != 2 or x.shape[1] != weights.k:
        raise ValueError(f"x_sorted: expected shape (rows, {weights.k}), got {x.shape}")
    off = _host_offsets(expert_offsets, weights.n_experts, x.shape[0])
    b = _bias_ref(bias, "bias", weights)
    out = np.zeros((x.shape[0], weights.n), dtype=np.float64)
    for e in np.flatnonzero(np.diff(off)):
        lo, hi = int(off[e]), int(off[e + 1])
        out[lo:hi] = x[lo:hi] @ _expert_f64(weights, int(e)).T
        if b is not None:
            out[lo:hi] += b[e]
    return out


def fc1_ref(
    x_sorted: Any,
    gate: Fp4Experts,
    up: Fp4Experts,
    expert_offsets: Any,
    *,
    act: ActivationSpec,
    gate_bias: Any = None,
    up_bias: Any = None,
) -> np.ndarray:
    """FC1: ``act(fc2_ref(x, gate) + gate_bias, fc2_ref(x, up) + up_bias)``: float64 ``[R, I]``."""
    if not isinstance(up, Fp4Experts) or not isinstance(gate, Fp4Experts):
        raise TypeError("gate, up: expected Fp4Experts")
    if (up.n_experts, up.n, up.k) != (gate.n_experts, gate.n, gate.k):
        raise ValueError(
            f"up: expected the shape of gate {(gate.n_experts, gate.n, gate.k)}, "
            f"got {(up.n_experts, up.n, up.k)}"
        )
    _bias_ref(gate_bias, "gate_bias", gate)  # name the caller's argument
    _bias_ref(up_bias, "up_bias", up)
    g = fc2_ref(x_sorted, gate, expert_offsets, bias=gate_bias)
    u = fc2_ref(x_sorted, up, expert_offsets, bias=up_bias)
    return activation_ref(g, u, act)
