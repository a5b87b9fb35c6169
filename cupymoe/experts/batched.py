# SPDX-License-Identifier: Apache-2.0
"""The expert GEMMs above the GEMV row window: dequantize the active experts, then cuBLAS.

``fc1_batched(x)[r] = act(x[t] W_gate[e]^T + b_gate[e], x[t] W_up[e]^T + b_up[e])`` and
``fc2_batched(h)[r] = h[r] W_down[e]^T + b_down[e]`` for every expanded row ``r`` of expert ``e``
(``expert_offsets[e] <= r < expert_offsets[e + 1]``), ``t = sorted_rows[r] // top_k``.

This path is **not capturable** in a CUDA graph: it reads ``routing.expert_offsets`` back to the
host (one synchronisation) to find the active experts and their row slices, and it allocates its
workspaces per call. :mod:`.dispatch` sends calls here above the GEMV row window (64 expanded
rows), where a prefill-sized batch amortises both.

Numerics: weights are dequantized exactly to float32 (global scale included, one fp32 rounding),
activations are widened to float32 (exact), and the experts' products are float32 batched
``cupy.matmul`` calls (cuBLAS SGEMM, fp32 accumulation), one per chunk of experts. 16-bit
``matmul`` would leave the compute type to CuPy's per-dtype defaults (and bf16 support to the
CuPy version), so correctness comes first here. Do not set ``CUPY_TF32=1`` when accuracy
matters: it lets cuBLAS round the inputs to TF32. Biases and the activation are applied in
float32, then one RNE rounding to the dtype of ``x`` / ``h``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from .._runtime.validate import check_activations, check_bias, device_output
from ..formats import DeviceFp4
from ..routing import Routing, check_device_routing
from .activation import ActivationSpec, activation_device
from .dequant import dequantize

__all__ = ["WORKSPACE_BYTES", "block_indices", "fc1_batched", "fc2_batched"]

#: Bytes of float32 dequantized weights held at once (the experts are decoded in chunks of this
#: size, so a DeepSeek-V3 layer of 256 x 2048 x 7168 never needs 15 GB at once).
WORKSPACE_BYTES = 512 << 20


def _device_bias(bias: Any, name: str, n_experts: int, n: int) -> Any:
    # Arrays only (NumPy or CuPy): this is the device-level API, where a nested list is a mistake.
    if bias is not None and not isinstance(bias, np.ndarray) and not is_cupy_array(bias):
        raise TypeError(f"{name}: expected a float32 array, got {type(bias).__name__}")
    b = check_bias(bias, name, (n_experts, n), finite=False)
    return None if b is None else require_cupy().asarray(b, dtype=np.float32)


def _routing_arrays(routing: Any, n_experts: int) -> tuple[int, Any, np.ndarray]:
    """``(top_k, sorted_rows, host expert_offsets)``; the one host synchronisation."""
    _, top_k = check_device_routing(routing, n_experts=n_experts)
    offsets = routing.expert_offsets
    if offsets.shape != (n_experts + 1,):
        raise ValueError(
            f"routing.expert_offsets: expected shape {(n_experts + 1,)} for {n_experts} experts, "
            f"got {offsets.shape}"
        )
    host = offsets.get() if is_cupy_array(offsets) else np.asarray(offsets)
    rows = int(routing.sorted_rows.shape[0])
    if host[0] != 0 or host[-1] != rows or np.any(np.diff(host) < 0):
        raise ValueError(
            f"routing.expert_offsets: expected non-decreasing offsets from 0 to {rows}, "
            f"got {host[0]} .. {host[-1]}"
        )
    return top_k, require_cupy().asarray(routing.sorted_rows), host.astype(np.int64)


def _expert_chunks(offsets: np.ndarray, weights: tuple[DeviceFp4, ...]) -> list[np.ndarray]:
    """The active experts (those with rows), split into chunks that fit ``WORKSPACE_BYTES``."""
    active = np.flatnonzero(np.diff(offsets) > 0)
    per_expert = sum(w.n * w.k * 4 for w in weights)
    size = max(1, WORKSPACE_BYTES // max(per_expert, 1))
    return [active[i : i + size] for i in range(0, active.size, size)]


def block_indices(
    offsets: np.ndarray, chunk: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Index arrays of one chunk's padded row block (host side of :func:`_grouped_matmul`).

    Returns ``gather [len(chunk), width]`` (the expanded row each block slot reads: the expert's
    rows, then its first row again as padding), ``dst`` (the expanded rows of the live slots, in
    block order) and ``src`` (those slots' flat positions in the block).

    >>> g, dst, src = block_indices(np.array([0, 2, 2, 5]), np.array([0, 2]), 3)
    >>> g.tolist(), dst.tolist(), src.tolist()
    ([[0, 1, 0], [2, 3, 4]], [0, 1, 2, 3, 4], [0, 1, 3, 4, 5])
    """
    first, counts = offsets[chunk], offsets[chunk + 1] - offsets[chunk]
    if counts.size and (counts.min() < 1 or counts.max() > width):
        raise ValueError(f"chunk: expected experts with 1..{width} rows, got counts {counts}")
    pos = np.arange(width)[None, :]
    live = pos < counts[:, None]
    gather = np.where(live, first[:, None] + pos, first[:, None])
    return gather, gather[live], np.flatnonzero(live.reshape(-1))


def _grouped_matmul(
    a: Any, weights: tuple[DeviceFp4, ...], biases: tuple[Any, ...], offsets: np.ndarray
) -> list[Any]:
    """Per weight set j: float32 [R, N_j]; rows of expert e get ``a W_j[e]^T + b_j[e]``.

    One batched SGEMM per chunk of experts and weight set: the chunk's rows are gathered into a
    ``[experts, max_rows, K]`` block (short experts padded with a copy of one of their rows, whose
    results are dropped), multiplied by the ``[experts, K, N]`` dequantized weights, and the live
    rows scattered back. The index arrays are built on the host from ``offsets``.
    """
    cupy = require_cupy()
    results = [cupy.empty((a.shape[0], w.n), dtype=cupy.float32) for w in weights]
    width = int(np.diff(offsets).max(initial=0))  # one block shape for every chunk
    for chunk in _expert_chunks(offsets, weights):
        dense = [dequantize(w, experts=chunk, out_dtype=np.float32) for w in weights]
        gather, dst_host, src_host = block_indices(offsets, chunk, width)
        dst, src = cupy.asarray(dst_host), cupy.asarray(src_host)
        block = a[cupy.asarray(gather.reshape(-1))].reshape(len(chunk), width, a.shape[1])
        for j, (w_dense, bias) in enumerate(zip(dense, biases, strict=True)):
            # W [experts, N, K] @ block^T: the big operand stays contiguous (no copy of it).
            yt = cupy.matmul(w_dense, block.transpose(0, 2, 1))  # [experts, N, width]
            y = cupy.ascontiguousarray(yt.transpose(0, 2, 1)).reshape(-1, yt.shape[1])
            if bias is not None:
                y = y.reshape(len(chunk), width, -1)
                y += bias[cupy.asarray(chunk)][:, None, :]
                y = y.reshape(len(chunk) * width, -1)
            results[j][dst] = y[src]
    return results


def fc1_batched(
    x: Any,
    gate: DeviceFp4,
    up: DeviceFp4 | None,
    routing: Routing,
    *,
    act: ActivationSpec,
    gate_bias: Any = None,
    up_bias: Any = None,
    out: Any = None,
) -> Any:
    """FC1 with the gated activation for every expanded row, via dequantize + cuBLAS.

    ``x [n_tokens, hidden]`` (bf16 or fp16, token order: row ``r`` reads token
    ``sorted_rows[r] // top_k``) times ``gate`` and ``up`` (``DeviceFp4 [n_experts,
    intermediate, hidden]``, each with its own global scales), plus the float32 biases
    ``[n_experts, intermediate]``, through ``act``; ``routing`` holds CuPy (or NumPy) arrays and
    its ``expert_offsets`` is read back to the host. Returns (or fills ``out``) ``h [n_tokens *
    top_k, intermediate]`` in expanded order, dtype of ``x``. A non-gated ``act`` takes
    ``up=None``: ``gate`` is then FC1's one matrix and ``gate_bias`` its bias.

    Not capturable (one host synchronisation, per-call workspaces); float32 SGEMM, fp32 bias and
    activation, one rounding to ``x.dtype``.
    """
    cupy = require_cupy()
    for name, w in (("gate", gate), ("up", gate if up is None else up)):
        if not isinstance(w, DeviceFp4):
            raise TypeError(f"{name}: expected a DeviceFp4, got {type(w).__name__}")
    if up is not None and (up.n_experts, up.n, up.k) != (gate.n_experts, gate.n, gate.k):
        raise ValueError(
            f"up: expected the shape of gate {(gate.n_experts, gate.n, gate.k)}, "
            f"got {(up.n_experts, up.n, up.k)}"
        )
    n_experts, inter, hidden = gate.n_experts, gate.n, gate.k
    check_activations(x, "x", hidden)
    top_k, sorted_rows, offsets = _routing_arrays(routing, n_experts)
    if routing.topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"routing: expected {x.shape[0]} tokens (x.shape[0]), got {routing.topk_ids.shape[0]}"
        )
    gate_bias = _device_bias(gate_bias, "gate_bias", n_experts, inter)
    up_bias = _device_bias(up_bias, "up_bias", n_experts, inter)
    rows = int(sorted_rows.shape[0])
    out = device_output(out, (rows, inter), x.dtype)
    if rows == 0:
        return out
    x_sorted = x[sorted_rows // top_k].astype(cupy.float32)
    if up is None:
        (v,) = _grouped_matmul(x_sorted, (gate,), (gate_bias,), offsets)
        out[...] = activation_device(v, None, act).astype(x.dtype)
        return out
    g, u = _grouped_matmul(x_sorted, (gate, up), (gate_bias, up_bias), offsets)
    out[...] = activation_device(g, u, act).astype(x.dtype)
    return out


def fc2_batched(
    h: Any, down: DeviceFp4, routing: Routing, *, bias: Any = None, out: Any = None
) -> Any:
    """FC2 for every expanded row, via dequantize + cuBLAS.

    ``h [n_tokens * top_k, intermediate]`` (bf16 or fp16, expanded order) times ``down``
    (``DeviceFp4 [n_experts, hidden, intermediate]``) plus the float32 ``bias [n_experts,
    hidden]``; ``routing`` as in :func:`fc1_batched`. Returns (or fills ``out``) ``y [n_tokens *
    top_k, hidden]`` in expanded order, dtype of ``h``.

    Not capturable (one host synchronisation, per-call workspaces); float32 SGEMM and bias, one
    rounding to ``h.dtype``.
    """
    cupy = require_cupy()
    if not isinstance(down, DeviceFp4):
        raise TypeError(f"down: expected a DeviceFp4, got {type(down).__name__}")
    _, sorted_rows, offsets = _routing_arrays(routing, down.n_experts)  # h: expanded order
    rows = int(sorted_rows.shape[0])
    check_activations(h, "h", down.k, rows)
    bias = _device_bias(bias, "bias", down.n_experts, down.n)
    out = device_output(out, (rows, down.n), h.dtype)
    if rows == 0:
        return out
    (y,) = _grouped_matmul(h.astype(cupy.float32), (down,), (bias,), offsets)
    out[...] = y.astype(h.dtype)
    return out
