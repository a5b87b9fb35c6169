# SPDX-License-Identifier: Apache-2.0
"""Which backend runs an expert call: the seam where every expert GEMM backend is chosen.

``fc1`` / ``fc2`` check their arguments once, then :func:`backend_for` picks the backend:

* :attr:`Backend.GEMV` (:mod:`.gemv`): up to :data:`~.config.ROW_WINDOW` expanded rows, when the
  GEMV can fold the MXFP4 scales exactly; capturable in a CUDA graph;
* :attr:`Backend.BATCHED` (:mod:`.batched`): dequantize the active experts, then cuBLAS; every
  other call; reads the expert offsets on the host, so it cannot be recorded in a graph.

A new backend (a grouped GEMM for prefill sizes) is one more member, one more rule in
:func:`backend_for` and one more branch in :func:`fc1` / :func:`fc2`.
"""

from __future__ import annotations

import enum
from typing import Any

from .._runtime.backend import is_cupy_array
from .._runtime.validate import check_activations
from ..routing import Routing, check_device_routing
from .activation import ActivationSpec, check_activation
from .batched import fc1_batched, fc2_batched
from .config import ROW_WINDOW, GemvConfig
from .gemv import PreparedFc1, PreparedFc2, gemv_fc1, gemv_fc2, scale_shift

__all__ = ["ROW_WINDOW", "Backend", "backend_for", "capturable", "fc1", "fc2"]


class Backend(enum.Enum):
    """An implementation of the expert GEMMs."""

    #: The tensor-core GEMV (:mod:`.gemv`): decode sizes, capturable.
    GEMV = "gemv"
    #: Dequantize + cuBLAS (:mod:`.batched`): any size, not capturable.
    BATCHED = "batched"


def backend_for(rows: int, shift: int | None, *, row_window: int = ROW_WINDOW) -> Backend:
    """The backend of a call with ``rows`` expanded rows; ``shift`` is the GEMV's MXFP4 scale
    shift (:func:`.gemv.scale_shift`), ``None`` when the GEMV cannot fold the scales exactly."""
    if rows <= row_window and shift is not None:
        return Backend.GEMV
    return Backend.BATCHED


def capturable(rows: int) -> bool:
    """Whether calls of ``rows`` expanded rows can take a capturable backend (a CUDA graph can
    record them); the MXFP4 fp16 scale-range exception is a property of the weights."""
    return rows <= ROW_WINDOW


def fc1(
    x: Any,
    weights: PreparedFc1,
    routing: Routing,
    *,
    act: ActivationSpec,
    out: Any = None,
    config: GemvConfig | None = None,
    row_window: int = ROW_WINDOW,
    pdl: bool = False,
) -> Any:
    """FC1 with the gated activation: ``h[r] = act(x[t] Wg[e]^T + bg, x[t] Wu[e]^T + bu)``.

    Parameters
    ----------
    x : cupy.ndarray
        ``[n_tokens, hidden]`` bf16 or fp16, token order (read through ``routing.sorted_rows``).
    weights : PreparedFc1
    routing : Routing
        CuPy routing arrays (int32).
    act : ActivationSpec
    out : cupy.ndarray, optional
        ``[n_tokens * top_k, intermediate]`` of ``x.dtype``.
    config : GemvConfig, optional
        Tiling of the GEMV; default :meth:`GemvConfig.for_problem`.
    row_window : int
        Above this many expanded rows, :func:`.batched.fc1_batched` runs instead of the GEMV.
    pdl : bool
        Make the GEMV launch a programmatic dependent launch (:mod:`cupymoe._runtime.launch`):
        its blocks build their scale tables while the previous kernel finishes and wait for it
        before they read the routing maps. Safe after any kernel.

    Returns
    -------
    cupy.ndarray
        ``h [n_tokens * top_k, intermediate]`` in expanded order, dtype of ``x``.

    Notes
    -----
    Weights times block scales are exact 16-bit numbers (times a power of two); products and sums
    in fp32 on tensor cores; global scales (gate and up separately), biases and the activation in
    fp32; one rounding to ``x.dtype``. Capturable in a CUDA graph at or below the row window (no
    host read, no allocation with ``out``). Bitwise deterministic for a given config. MXFP4 with
    fp16 activations whose scales span more than :func:`.layouts.mx_scale_shift` can fold exactly
    takes the batched path.
    """
    if not isinstance(weights, PreparedFc1):
        raise TypeError(f"weights: expected PreparedFc1, got {type(weights).__name__}")
    check_activation(act)
    g = weights.gate
    if not is_cupy_array(x) or x.ndim != 2:
        raise TypeError(f"x: expected a 2-D cupy.ndarray [n_tokens, {g.k}], got {type(x).__name__}")
    dtype = check_activations(x, "x", g.k, x.shape[0], aligned=True)
    n_tokens, top_k = check_device_routing(routing, n_tokens=int(x.shape[0]), n_experts=g.n_experts)
    shift = scale_shift(weights, dtype)
    if backend_for(n_tokens * top_k, shift, row_window=row_window) is Backend.BATCHED:
        return fc1_batched(
            x,
            g,
            weights.up,
            routing,
            act=act,
            gate_bias=weights.gate_bias,
            up_bias=weights.up_bias,
            out=out,
        )
    assert shift is not None  # backend_for chose the GEMV
    return gemv_fc1(
        x, weights, routing, act=act, top_k=top_k, shift=shift, out=out, config=config, pdl=pdl
    )


def fc2(
    h: Any,
    weights: PreparedFc2,
    routing: Routing,
    *,
    out: Any = None,
    config: GemvConfig | None = None,
    row_window: int = ROW_WINDOW,
    pdl: bool = False,
) -> Any:
    """FC2: ``y[r] = h[r] W[e]^T + b[e]`` for every expanded row ``r`` of expert ``e``.

    ``h`` is ``[n_tokens * top_k, intermediate]`` bf16 or fp16 in expanded order; the result (or
    ``out``) ``y [n_tokens * top_k, hidden]`` in expanded order, dtype of ``h``. ``config`` and
    ``row_window`` as in :func:`fc1`; :func:`.batched.fc2_batched` runs above the window. ``pdl``:
    a programmatic dependent launch that reads the routing maps and builds its scale tables while
    the previous kernel finishes and waits for it only before it reads ``h``; only when the
    previous kernel on the stream ran after ``routing`` was complete (this call's :func:`fc1`, as
    in ``MoELayer``). Numerics and capturability as :func:`fc1`.
    """
    if not isinstance(weights, PreparedFc2):
        raise TypeError(f"weights: expected PreparedFc2, got {type(weights).__name__}")
    w = weights.down
    n_tokens, top_k = check_device_routing(routing, n_experts=w.n_experts)
    rows = n_tokens * top_k
    dtype = check_activations(h, "h", w.k, rows, aligned=True)
    shift = scale_shift(weights, dtype)
    if backend_for(rows, shift, row_window=row_window) is Backend.BATCHED:
        return fc2_batched(h, w, routing, bias=weights.bias, out=out)
    assert shift is not None  # backend_for chose the GEMV
    return gemv_fc2(h, weights, routing, shift=shift, out=out, config=config, pdl=pdl)
