# SPDX-License-Identifier: Apache-2.0
"""NumPy references of the expert GEMMs: ``fc1_ref`` (gate and up with the gated activation) and
``fc2_ref``, in float64 with the exact dequantized weights; the oracle of the GEMV, the batched
path and every later backend, and the NumPy backend itself. Only the experts that have rows are
decoded, a few rows at a time, and distinct experts run on threads.

``fc2_ref(h)[r] = h[r] @ W[e]^T + b[e]`` and
``fc1_ref(x)[r] = act(x[r] @ Wg[e]^T + bg[e], x[r] @ Wu[e]^T + bu[e])`` for every expanded row
``r`` of expert ``e`` (``expert_offsets[e] <= r < expert_offsets[e + 1]``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._runtime.backend import to_numpy
from .._runtime.validate import check_bias
from ..formats import E2M1_VALUES, Fp4Experts
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


#: Byte -> (E2M1 of its low nibble, E2M1 of its high nibble) as two float32 (exact), viewed as
#: one float64 so that ``np.take`` gathers both codes of a byte at once: about 8x faster than
#: indexing a float64 table with the unpacked nibbles.
_CODE_PAIRS = (
    np.stack([E2M1_VALUES[np.arange(256) & 15], E2M1_VALUES[np.arange(256) >> 4]], axis=1)
    .astype(np.float32)
    .reshape(-1)
    .view(np.float64)
)
_CODE_PAIRS.flags.writeable = False
#: Float64 bytes of weights decoded at a time: a few rows, so that memory stays bounded and the
#: decoded rows are still in cache when they are multiplied.
_CHUNK_BYTES = 1 << 20
#: Below this many weights in a call, one thread (a pool costs more than it saves).
_THREADED_WEIGHTS = 1 << 22


def _expert_rows_f64(w: Fp4Experts, e: int, lo: int, hi: int) -> np.ndarray:
    """Exact float64 rows ``lo:hi`` of expert ``e``, ``[hi - lo, K]``.

    E2M1 codes are exact in float32; block scale x global scale (at most 4 + 24 significant
    bits, or a power of two) and its product with a code (2 bits) are exact in float64.
    """
    codes = np.take(_CODE_PAIRS, w.packed[e, lo:hi]).view(np.float32)
    codes = codes.reshape(hi - lo, w.k // w.block_size, w.block_size)
    scales = w.format.decode_scales(w.scales[e, lo:hi]).astype(np.float64)
    scales *= float(w.global_scale[e])
    return np.multiply(codes, scales[..., None], dtype=np.float64).reshape(hi - lo, w.k)


def _expert_matmul(x: np.ndarray, w: Fp4Experts, e: int) -> np.ndarray:
    """``x [R, K] @ W_e^T`` in float64, decoding ``W_e`` a chunk of rows at a time."""
    rows = max(1, _CHUNK_BYTES // (8 * max(w.k, 1)))
    out = np.empty((x.shape[0], w.n), dtype=np.float64)
    for lo in range(0, w.n, rows):
        hi = min(lo + rows, w.n)
        out[:, lo:hi] = x @ _expert_rows_f64(w, e, lo, hi).T
    return out


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

    def expert(e: int) -> None:  # rows of distinct experts are disjoint: any order, same bits
        lo, hi = int(off[e]), int(off[e + 1])
        out[lo:hi] = _expert_matmul(x[lo:hi], weights, e)
        if b is not None:
            out[lo:hi] += b[e]

    used = [int(e) for e in np.flatnonzero(np.diff(off))]
    threads = min(len(used), os.cpu_count() or 1)
    if threads > 1 and len(used) * weights.n * weights.k >= _THREADED_WEIGHTS:
        with ThreadPoolExecutor(threads) as pool:  # NumPy's take, multiply and BLAS free the GIL
            list(pool.map(expert, used))
    else:
        for e in used:
            expert(e)
    return out


def fc1_ref(
    x_sorted: Any,
    gate: Fp4Experts,
    up: Fp4Experts | None,
    expert_offsets: Any,
    *,
    act: ActivationSpec,
    gate_bias: Any = None,
    up_bias: Any = None,
) -> np.ndarray:
    """FC1: ``act(fc2_ref(x, gate) + gate_bias, fc2_ref(x, up) + up_bias)``: float64 ``[R, I]``;
    for a non-gated ``act``, ``up=None`` and ``act(fc2_ref(x, gate) + gate_bias)``."""
    if up is None and not act.kind.gated:
        if not isinstance(gate, Fp4Experts):
            raise TypeError("gate: expected Fp4Experts")
        if up_bias is not None:
            raise ValueError("up_bias: a non-gated FC1 has no up matrix, expected None")
        return activation_ref(fc2_ref(x_sorted, gate, expert_offsets, bias=gate_bias), None, act)
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
