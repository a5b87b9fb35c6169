# SPDX-License-Identifier: Apache-2.0
"""Which backend runs an expert call: the seam where every expert GEMM backend is chosen.

``fc1`` / ``fc2`` check their arguments once, then pick the backend and its tiling: an explicit
``config=`` or ``backend=`` first, else :func:`.handover.choose` (environment > tuning cache >
the analytic hand-over table, :data:`.handover.HAND_OVERS`):

* :attr:`Backend.GEMV` (:mod:`.gemv`): few expanded rows per active expert on the SPLIT layout
  (up to :data:`GEMV_MAX_ROWS_PER_EXPERT` by default), and every call on the PLAIN and PAIR
  layouts (which the grouped GEMM does not read);
* :attr:`Backend.GEMM` (:mod:`.gemm`): the grouped tensor-core GEMM, above that on SPLIT;
* :attr:`Backend.BATCHED` (:mod:`.batched`): dequantize the active experts, then cuBLAS; only
  for MXFP4 weights with fp16 activations whose block scales span more than the tensor-core
  decode folds exactly (:func:`.layouts.mx_scale_shift`). It reads the expert offsets on the
  host, so it cannot be recorded in a graph; the other two can, at every token count.

All three read the one resident copy of the weights (:class:`.gemv.PreparedFc1`); the batched
fallback rebuilds row-major copies of it per call.
"""

from __future__ import annotations

from typing import Any

from .._runtime.backend import is_cupy_array
from .._runtime.validate import check_activations
from ..routing import Routing, check_device_routing
from .activation import ActivationSpec, check_activation
from .batched import fc1_batched, fc2_batched
from .config import GemvConfig
from .gemm import GemmConfig, WgmmaConfig, gemm_fc1, gemm_fc1_single, gemm_fc2
from .gemv import PreparedFc1, PreparedFc2, gemv_fc1, gemv_fc1_single, gemv_fc2, scale_shift
from .handover import (
    DEFAULT_HAND_OVER,
    GEMV_MAX_ROWS_PER_EXPERT,
    Backend,
    HandOver,
    choose,
    rows_per_expert,
)
from .layouts import WeightLayout

__all__ = [
    "GEMV_MAX_ROWS_PER_EXPERT",
    "Backend",
    "backend_for",
    "capturable",
    "fc1",
    "fc2",
    "permutes_h",
    "permutes_x",
    "takes_wgmma",
]


def backend_for(
    rows: int,
    shift: int | None,
    *,
    layout: WeightLayout,
    n_experts: int,
    hand_over: HandOver = DEFAULT_HAND_OVER,
) -> Backend:
    """The analytic backend of a call with ``rows`` expanded rows over ``n_experts`` experts
    (no tuning cache): the GEMV up to ``hand_over.gemv_max`` rows per active expert; ``shift``
    is the MXFP4 scale shift (:func:`.gemv.scale_shift`), ``None`` when the tensor-core decode
    cannot fold the scales exactly. A call's own choice is :func:`.handover.choose`."""
    if shift is None:
        return Backend.BATCHED
    if layout is not WeightLayout.SPLIT:
        return Backend.GEMV
    return Backend.GEMV if rows_per_expert(rows, n_experts) <= hand_over.gemv_max else Backend.GEMM


def capturable(shift: int | None) -> bool:
    """Whether calls on weights with MXFP4 scale shift ``shift`` (:func:`.gemv.scale_shift`) can
    be recorded in a CUDA graph: at every token count, unless the batched fallback runs."""
    return shift is not None


def _choose(
    backend: Backend | None, config: Any, automatic: Backend
) -> tuple[Backend, GemvConfig | None, GemmConfig | WgmmaConfig | None]:
    """The backend of a call and its config: ``backend`` when given, else the one ``config``
    belongs to (a GemvConfig runs the GEMV, a GemmConfig or WgmmaConfig the GEMM), else
    ``automatic``."""
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"backend: expected a Backend or None, got {type(backend).__name__}")
    if config is not None and not isinstance(config, GemvConfig | GemmConfig | WgmmaConfig):
        raise TypeError(
            f"config: expected a GemvConfig, GemmConfig or WgmmaConfig, got {type(config).__name__}"
        )
    implied = {GemvConfig: Backend.GEMV, GemmConfig: Backend.GEMM, WgmmaConfig: Backend.GEMM}.get(
        type(config)
    )
    if backend is not None and implied is not None and backend is not implied:
        raise ValueError(
            f"config: a {type(config).__name__} tiles the {implied.value} backend, "
            f"got backend={backend.value}"
        )
    chosen = backend or implied or automatic
    if automatic is Backend.BATCHED and chosen is not Backend.BATCHED:
        raise ValueError(
            f"backend: {chosen.value} cannot fold these MXFP4 scales exactly; only the batched "
            "backend runs them"
        )
    return (
        chosen,
        config if isinstance(config, GemvConfig) else None,
        config if isinstance(config, GemmConfig | WgmmaConfig) else None,
    )


def _resolve(
    weights: PreparedFc1 | PreparedFc2,
    rows: int,
    dtype: Any,
    shift: int | None,
    backend: Backend | None,
    config: Any,
) -> tuple[Backend, GemvConfig | None, GemmConfig | WgmmaConfig | None]:
    """The backend and tiling of a call: :func:`_choose` checks what the caller gave; what it
    left open :func:`.handover.choose` fills in (the automatic choice, or the tiling of a forced
    backend)."""
    if backend is None and config is None:
        chosen, tiling = choose(weights, rows, dtype, shift)
    else:
        automatic = Backend.BATCHED if shift is None else Backend.GEMV  # only BATCHED is read
        chosen, gemv_cfg, gemm_cfg = _choose(backend, config, automatic)
        if config is not None:
            return chosen, gemv_cfg, gemm_cfg
        chosen, tiling = choose(weights, rows, dtype, shift, backend=chosen)
    return (
        chosen,
        tiling if isinstance(tiling, GemvConfig) else None,
        tiling if isinstance(tiling, GemmConfig | WgmmaConfig) else None,
    )


def _check_permuted(
    chosen: Backend, gemm_cfg: GemmConfig | WgmmaConfig | None, **flags: bool
) -> None:
    for name, value in flags.items():
        if value and not (chosen is Backend.GEMM and isinstance(gemm_cfg, WgmmaConfig)):
            kind = "the mma.sync GEMM" if chosen is Backend.GEMM else f"the {chosen.value} backend"
            raise ValueError(
                f"{name}: only the wgmma GEMM reads or writes activations in the split k order; "
                f"this call runs {kind}"
            )


def takes_wgmma(weights: PreparedFc1 | PreparedFc2, rows: int, dtype: Any) -> bool:
    """Whether an expert stage with ``weights`` at ``rows`` expanded rows runs the wgmma GEMM by
    the automatic choice."""
    shift = scale_shift(weights, dtype)
    if shift is None:
        return False
    chosen, tiling = choose(weights, rows, dtype, shift)
    return chosen is Backend.GEMM and isinstance(tiling, WgmmaConfig)


def permutes_h(
    fc1_weights: PreparedFc1 | PreparedFc2, fc2_weights: PreparedFc2, rows: int, dtype: Any
) -> bool:
    """Whether a layer's FC1 and FC2 at ``rows`` expanded rows both take the wgmma GEMM by the
    automatic choice, so that FC1 writes h for FC2 with ``permuted_h`` (FC2's activation tiles
    then go straight from global to shared memory, docs/kernels.md)."""
    return all(takes_wgmma(w, rows, dtype) for w in (fc1_weights, fc2_weights))


def permutes_x(fc1_weights: PreparedFc1 | PreparedFc2, rows: int, dtype: Any) -> bool:
    """Whether a layer's FC1 at ``rows`` expanded rows takes the wgmma GEMM by the automatic
    choice with at least one whole 128-column stage of x, so that x goes through
    :func:`.gemm.permute_split` first and FC1 reads it with ``permuted_x``."""
    k = (fc1_weights.down if isinstance(fc1_weights, PreparedFc2) else fc1_weights.gate).k
    return k >= 128 and takes_wgmma(fc1_weights, rows, dtype)


def fc1(
    x: Any,
    weights: PreparedFc1 | PreparedFc2,
    routing: Routing,
    *,
    act: ActivationSpec,
    out: Any = None,
    config: GemvConfig | GemmConfig | WgmmaConfig | None = None,
    backend: Backend | None = None,
    pdl: bool = False,
    permuted_h: bool = False,
    permuted_x: bool = False,
) -> Any:
    """FC1 with the gated activation: ``h[r] = act(x[t] Wg[e]^T + bg, x[t] Wu[e]^T + bu)``, or a
    non-gated one: ``h[r] = act(x[t] W[e]^T + b)``.

    Parameters
    ----------
    x : cupy.ndarray
        ``[n_tokens, hidden]`` bf16 or fp16, token order (read through ``routing.sorted_rows``).
    weights : PreparedFc1 or PreparedFc2
        Gate and up (:func:`.gemv.prepare_fc1`) for a gated ``act``; the one ``[E, I, H]``
        matrix prepared like FC2 (:func:`.gemv.prepare_fc2`) for a non-gated one.
    routing : Routing
        CuPy routing arrays (int32).
    act : ActivationSpec
    out : cupy.ndarray, optional
        ``[n_tokens * top_k, intermediate]`` of ``x.dtype``.
    config : GemvConfig, GemmConfig or WgmmaConfig, optional
        A tiling; it also selects its backend (a GemvConfig runs the GEMV, a GemmConfig or
        WgmmaConfig the GEMM). Default: :func:`.handover.choose`, the tuned entry of the
        problem (``cupymoe tune``) or the analytic hand-over, and that backend's tiling.
    backend : Backend, optional
        Force a backend (benchmarks and tests); its tiling is then the tuned one when the
        cache's winner is that backend, else its table. The GEMM needs the SPLIT layout; MXFP4
        scales the tensor cores cannot fold need the batched backend (``ValueError`` otherwise).
    pdl : bool
        A programmatic dependent launch (:mod:`cupymoe._runtime.launch`): the blocks build their
        scale tables while the previous kernel finishes and wait for it before they read the
        routing maps. Safe after any kernel.
    permuted_h : bool
        Write h with its whole 128-column stages in the split k order
        (:func:`.layouts.split_positions`), for an :func:`fc2` with ``permuted_h`` that then
        reads them without staging (``MoELayer`` passes it where :func:`permutes_h`). Only the
        wgmma GEMM does: ``ValueError`` where the call resolves to another backend.
    permuted_x : bool
        ``x`` holds its whole 128-column stages in the split k order, as
        :func:`.gemm.permute_split` writes it (``MoELayer`` does where :func:`permutes_x`):
        the wgmma GEMM then copies its activation tiles without regrouping them. Wgmma only,
        as ``permuted_h``.

    Returns
    -------
    cupy.ndarray
        ``h [n_tokens * top_k, intermediate]`` in expanded order, dtype of ``x``.

    Notes
    -----
    Weights times block scales are exact 16-bit numbers (times a power of two); products and sums
    in fp32 on tensor cores; global scales (gate and up separately), biases and the activation in
    fp32; one rounding to ``x.dtype``. The GEMV and the GEMM are capturable in a CUDA graph at
    every token count (no host read, no allocation with ``out``) and bitwise deterministic for a
    given config. MXFP4 with fp16 activations whose scales span more than
    :func:`.layouts.mx_scale_shift` can fold exactly takes the batched path.
    """
    if not isinstance(weights, PreparedFc1 | PreparedFc2):
        raise TypeError(
            f"weights: expected PreparedFc1 or PreparedFc2, got {type(weights).__name__}"
        )
    check_activation(act)
    if isinstance(weights, PreparedFc2) == act.kind.gated:
        need = "PreparedFc1 (gate, up)" if act.kind.gated else "PreparedFc2 (one matrix)"
        raise ValueError(
            f"weights: the activation {act.kind.value!r} needs {need}, got {type(weights).__name__}"
        )
    g = weights.down if isinstance(weights, PreparedFc2) else weights.gate
    if not is_cupy_array(x) or x.ndim != 2:
        raise TypeError(f"x: expected a 2-D cupy.ndarray [n_tokens, {g.k}], got {type(x).__name__}")
    dtype = check_activations(x, "x", g.k, x.shape[0], aligned=True)
    n_tokens, top_k = check_device_routing(routing, n_tokens=int(x.shape[0]), n_experts=g.n_experts)
    shift = scale_shift(weights, dtype)
    rows = n_tokens * top_k
    chosen, gemv_cfg, gemm_cfg = _resolve(weights, rows, dtype, shift, backend, config)
    _check_permuted(chosen, gemm_cfg, permuted_h=permuted_h, permuted_x=permuted_x)
    if chosen is Backend.BATCHED and isinstance(weights, PreparedFc2):
        return fc1_batched(
            x, weights.device_fp4(), None, routing, act=act, gate_bias=weights.bias, out=out
        )
    if chosen is Backend.BATCHED:
        assert isinstance(weights, PreparedFc1)
        gate, up = weights.device_fp4()
        return fc1_batched(
            x,
            gate,
            up,
            routing,
            act=act,
            gate_bias=weights.gate_bias,
            up_bias=weights.up_bias,
            out=out,
        )
    assert shift is not None  # the tensor-core backends fold the scales
    if isinstance(weights, PreparedFc2):
        if chosen is Backend.GEMM:
            return gemm_fc1_single(
                x,
                weights,
                routing,
                act=act,
                top_k=top_k,
                shift=shift,
                out=out,
                config=gemm_cfg,
                pdl=pdl,
                permuted_h=permuted_h,
                permuted_x=permuted_x,
            )
        return gemv_fc1_single(
            x,
            weights,
            routing,
            act=act,
            top_k=top_k,
            shift=shift,
            out=out,
            config=gemv_cfg,
            pdl=pdl,
        )
    if chosen is Backend.GEMM:
        return gemm_fc1(
            x,
            weights,
            routing,
            act=act,
            top_k=top_k,
            shift=shift,
            out=out,
            config=gemm_cfg,
            pdl=pdl,
            permuted_h=permuted_h,
            permuted_x=permuted_x,
        )
    return gemv_fc1(
        x, weights, routing, act=act, top_k=top_k, shift=shift, out=out, config=gemv_cfg, pdl=pdl
    )


def fc2(
    h: Any,
    weights: PreparedFc2,
    routing: Routing,
    *,
    out: Any = None,
    config: GemvConfig | GemmConfig | WgmmaConfig | None = None,
    backend: Backend | None = None,
    pdl: bool = False,
    permuted_h: bool = False,
) -> Any:
    """FC2: ``y[r] = h[r] W[e]^T + b[e]`` for every expanded row ``r`` of expert ``e``.

    ``h`` is ``[n_tokens * top_k, intermediate]`` bf16 or fp16 in expanded order; the result (or
    ``out``) ``y [n_tokens * top_k, hidden]`` in expanded order, dtype of ``h``. ``config`` and
    ``backend`` as in :func:`fc1`. ``pdl``: a programmatic dependent launch that reads the
    routing maps (and builds its scale tables) while the previous kernel finishes and waits for
    it only before it reads ``h``; only when the previous kernel on the stream ran after
    ``routing`` was complete (this call's :func:`fc1`, as in ``MoELayer``). Numerics and
    capturability as :func:`fc1`.
    """
    if not isinstance(weights, PreparedFc2):
        raise TypeError(f"weights: expected PreparedFc2, got {type(weights).__name__}")
    w = weights.down
    n_tokens, top_k = check_device_routing(routing, n_experts=w.n_experts)
    rows = n_tokens * top_k
    dtype = check_activations(h, "h", w.k, rows, aligned=True)
    shift = scale_shift(weights, dtype)
    chosen, gemv_cfg, gemm_cfg = _resolve(weights, rows, dtype, shift, backend, config)
    _check_permuted(chosen, gemm_cfg, permuted_h=permuted_h)
    if chosen is Backend.BATCHED:
        return fc2_batched(h, weights.device_fp4(), routing, bias=weights.bias, out=out)
    assert shift is not None  # the tensor-core backends fold the scales
    if chosen is Backend.GEMM:
        return gemm_fc2(
            h,
            weights,
            routing,
            shift=shift,
            out=out,
            config=gemm_cfg,
            pdl=pdl,
            permuted_h=permuted_h,
        )
    return gemv_fc2(h, weights, routing, shift=shift, out=out, config=gemv_cfg, pdl=pdl)
