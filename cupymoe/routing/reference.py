# SPDX-License-Identifier: Apache-2.0
"""The NumPy reference of the routing: ``route_ref`` chooses ``top_k`` experts per token and
``expert_maps_ref`` groups the expanded rows by expert.

``route`` (GPU) and ``route_ref`` (NumPy) make the same choices, bit for bit:

* **Keys.** Logits are converted to float32 (exact for float16 / bfloat16). Experts are ranked by
  a score, ties go to the lower expert id, always. A NaN score ranks below every number,
  including ``-inf``; ``-0.0`` equals ``+0.0``.
* **softmax_topk.** Selection by logit (softmax is monotone: selecting by logit is exact and
  avoids ties created by rounding the probabilities). ``m`` = the largest non-NaN logit;
  numerator ``q_i = exp(l_i - m)``, with ``q_i = 1`` where ``l_i == m`` (so with ``+inf`` logits
  the mass is shared by the ``+inf`` entries; with only ``-inf`` logits, by all of them) and
  ``q_i = 0`` for NaN. Weights ``q_j / sum_i q_i`` (all experts), or ``q_j / sum_{chosen} q``
  with ``renormalize``. A row of only NaN gets experts ``0..k-1`` with weight 0.
* **topk_softmax.** The same choice; weights ``q_j / sum_{chosen} q`` (identical to
  ``softmax_topk`` with ``renormalize``).
* **sigmoid_grouped.** ``s = sigmoid(l)`` and the choice score ``c = s + correction_bias`` in
  float32 by a *defined* sequence of IEEE round-to-nearest float32 operations
  (:func:`sigmoid_f32`, mirrored in ``cuda/routing_math.cuh``), so selection, which depends on the
  rounding of ``c``, is reproduced exactly. Group score = sum (float32) of the two largest ``c``
  of the group (a NaN expert counts as ``-inf``); the ``topk_group`` best groups are kept (ties:
  lower group); top-k of ``c`` over the kept experts (NaN experts of kept groups rank last).
  Weights ``s_j / sum_{chosen} s * routed_scaling_factor`` (``renormalize``; 0 when the sum is
  0) or ``s_j * routed_scaling_factor``; NaN experts have ``s = 0``.
* **sparse_mixer** (ONNX Runtime's sparse mixer top-2; ``top_k = 2``, 8 or 16 experts). The
  choice is ``softmax_topk``'s (round ``r``'s winner is the ``r``-th largest logit). Round ``r``
  with winner logit ``m``: expert ``i`` is masked when its logit is NaN, when it is round 1's
  winner (in round 2), or when ``(m - x_i) > 2 eps max(|x_i|, m)`` (``eps`` = 0.01; the test is
  made in IEEE float32: ``m - x_i`` and ``(2 eps) * max(...)`` each rounded once, ``2 eps`` =
  ``float32(0.02)``). The weight is ``1 / sum_{unmasked} q_i`` with ``q_i = exp(x_i - m)``,
  ``q_i = 1`` where ``x_i == m`` (so equal logits share, and ``-inf`` / ``+inf`` winners are
  defined); a NaN winner (a row with fewer than ``r`` numbers) gets weight 0.
* **router_weights** (ONNX Runtime's QMoE input 14: separate selection and mixing tensors). The
  top-k is taken on the logits (``softmax_topk`` / ``topk_softmax``) and the weights are
  gathered from ``router_weights [M, E]`` (float32) at the chosen experts; divided by their sum
  (0 when the sum is not > 0) with ``renormalize`` or ``topk_softmax``.

Weights of the GPU path equal the reference's to float32 rounding; ids and maps are exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from .._runtime.compile import CTYPE
from .types import (
    SPARSE_MIXER_EPS,
    Router,
    Routing,
    RoutingMethod,
    check_logits,
    check_router_weights,
)

__all__ = ["expert_maps_ref", "random_routing", "route_ref", "sigmoid_f32"]

_REF_DTYPES = (*CTYPE, np.dtype(np.float64))


def _f32(bits: int) -> np.float32:
    return np.float32(np.array([bits], np.uint32).view(np.float32)[0])


_EXP_CONSTANTS = tuple(
    _f32(b)
    for b in (
        0x3FB8AA3B,
        0x3F317200,
        0x35BFBE8E,
        0x39506967,
        0x3AB743CE,
        0x3C088908,
        0x3D2AA9C1,
        0x3E2AAAAA,
        0x3F000000,
    )
)


def sigmoid_f32(x: np.ndarray) -> np.ndarray:
    """The float32 sigmoid of the kernels, bit for bit: ``1 / (1 + exp(-x))``.

    ``exp`` is a Cody-Waite reduction and the Cephes polynomial, each step one IEEE
    round-to-nearest float32 operation (no fused multiply-add, no flush-to-zero); ``-x`` is
    clamped to ``[-150, 150]``. Within 3 ulp of the true sigmoid for ``|x| <= 88``; 0 where
    ``exp(-x)`` overflows float32 (``x < -88.72``); monotone; NaN in, NaN out.
    """
    x = np.asarray(x, np.float32)
    log2e, ln2_hi, ln2_lo, *poly = _EXP_CONSTANTS
    t = np.minimum(np.maximum(-x, np.float32(-150)), np.float32(150))
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        n = np.rint(t * log2e)
        r = (t - n * ln2_hi) - n * ln2_lo
        p = np.full_like(r, poly[0])
        for c in poly[1:]:
            p = p * r + c
        p = (p * (r * r) + r) + np.float32(1)
        ni = np.nan_to_num(n).astype(np.int32)
        n1 = ni >> 1
        n2 = ni - n1
        e = (p * ((n1 + 127) << 23).view(np.float32)) * ((n2 + 127) << 23).view(np.float32)
        s = np.float32(1) / (np.float32(1) + e)
    return np.where(np.isnan(x), np.float32(np.nan), s).astype(np.float32)


def _order_bits(v: np.ndarray) -> np.ndarray:
    """uint32 whose unsigned order is the float order; NaN -> 0 (lowest); -0 -> +0."""
    u = np.asarray(v, np.float32).view(np.uint32).copy()
    u[u == 0x80000000] = 0
    neg = (u & 0x80000000) != 0
    out = np.where(neg, ~u, u | np.uint32(0x80000000)).astype(np.uint32)
    out[np.isnan(v)] = 0
    return out


def _top_k_by_key(high: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest ``(high, -index)`` per row: stable sort of ``-high``."""
    return np.argsort(-high.astype(np.int64), axis=1, kind="stable")[:, :k].astype(np.int32)


def _sparse_mixer_weights(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The sparse mixer's two weights per row (module notes): float64 ``[M, 2]``."""
    nan = np.isnan(x)
    two_eps = np.float32(2 * np.float32(SPARSE_MIXER_EPS))
    weights = np.zeros(ids.shape, np.float64)
    rows = np.arange(x.shape[0])
    for r in range(ids.shape[1]):
        m = x[rows, ids[:, r]][:, None]  # float32
        with np.errstate(invalid="ignore", over="ignore"):
            masked = (m - x) > two_eps * np.maximum(np.abs(x), m)  # float32 operations
            q = np.where(x == m, 1.0, np.exp(x.astype(np.float64) - m.astype(np.float64)))
        masked |= nan
        if r == 1:
            masked[rows, ids[:, 0]] = True
        total = np.where(masked, 0.0, q).sum(axis=1)
        ok = ~np.isnan(m[:, 0])
        weights[:, r] = np.divide(1.0, total, out=np.zeros_like(total), where=ok)
    return weights


def _gathered_weights(mix: np.ndarray, ids: np.ndarray, renorm: bool) -> np.ndarray:
    """Weights taken from the mixing tensor at the chosen experts (module notes)."""
    sel = np.take_along_axis(mix.astype(np.float64), ids, axis=1)
    if not renorm:
        return sel
    total = sel.sum(axis=1, keepdims=True)
    return np.divide(sel, total, out=np.zeros_like(sel), where=total > 0)


def route_ref(
    logits: np.ndarray, router: Router, *, router_weights: np.ndarray | None = None
) -> Routing:
    """NumPy reference of :func:`route` (float64 weights math, the kernels' exact choices).

    Parameters
    ----------
    logits : numpy.ndarray [n_tokens, n_experts]
        float16, bfloat16 (ml_dtypes), float32 or float64 (first rounded to float32).
    router : Router
    router_weights : numpy.ndarray [n_tokens, n_experts], optional
        float32 mixing weights (ONNX Runtime's ``router_weights``): the top-k is taken on
        ``logits`` and the weights gathered from here (softmax_topk / topk_softmax only).

    Returns
    -------
    Routing
        NumPy arrays; ``topk_weights`` float32 (computed in float64). See the module notes for
        ties, NaN and infinities.

    Examples
    --------
    >>> r = route_ref(np.array([[1.0, 3.0, 2.0]], np.float32), Router(n_experts=3, top_k=2))
    >>> r.topk_ids.tolist(), r.expert_offsets.tolist()
    ([[1, 2]], [0, 0, 1, 2])
    """
    if is_cupy_array(logits) or not isinstance(logits, np.ndarray):
        raise TypeError(f"logits: expected numpy.ndarray, got {type(logits).__name__}")
    check_logits(logits, router, _REF_DTYPES)
    if router_weights is not None:
        check_router_weights(router_weights, logits, router)
    x = logits.astype(np.float32)
    m_tokens, k = x.shape[0], router.top_k
    if m_tokens == 0:
        empty = np.zeros((0, k), np.int32)
        return Routing(empty, empty.astype(np.float32), *expert_maps_ref(empty, router.n_experts))
    nan = np.isnan(x)
    if router.method is RoutingMethod.SIGMOID_GROUPED:
        s = sigmoid_f32(x)
        with np.errstate(invalid="ignore"):
            c = (s + router.correction_bias).astype(np.float32)
        high = np.where(nan, np.uint32(1), _order_bits(c))
        n_group, topk_group = router.n_group or 1, router.topk_group or 1
        if n_group > 1 and topk_group < n_group:
            groups = np.where(nan, -np.inf, c).astype(np.float32)
            groups = groups.reshape(m_tokens, n_group, -1)
            top2 = -np.sort(-groups, axis=2)[:, :, :2]
            score = (top2[:, :, 0] + top2[:, :, 1]).astype(np.float32)  # float32 sum, as the GPU
            rank = np.argsort(-score.astype(np.float64), axis=1, kind="stable")
            kept = np.zeros_like(score, dtype=bool)
            np.put_along_axis(kept, rank[:, :topk_group], True, axis=1)
            high = np.where(np.repeat(kept, x.shape[1] // n_group, axis=1), high, 0)
        ids = _top_k_by_key(high, k)
        sel = np.take_along_axis(np.where(nan, 0, s), ids, axis=1).astype(np.float64)
        weights = sel
        if router.renormalize:
            total = sel.sum(axis=1, keepdims=True)
            weights = np.divide(sel, total, out=np.zeros_like(sel), where=total > 0)
        weights = weights * router.routed_scaling_factor
    elif router.method is RoutingMethod.SPARSE_MIXER:
        ids = _top_k_by_key(_order_bits(x), k)
        weights = _sparse_mixer_weights(x, ids)
    elif router_weights is not None:
        ids = _top_k_by_key(_order_bits(x), k)
        renorm = router.method is RoutingMethod.TOPK_SOFTMAX or router.renormalize
        weights = _gathered_weights(router_weights, ids, renorm)
    else:
        ids = _top_k_by_key(_order_bits(x), k)
        xd = x.astype(np.float64)
        finite_rows = ~nan.all(axis=1) if x.shape[1] else np.zeros(m_tokens, bool)
        m = np.where(finite_rows, np.max(np.where(nan, -np.inf, xd), axis=1, initial=-np.inf), 0)
        with np.errstate(invalid="ignore", over="ignore"):
            q = np.where(xd == m[:, None], 1.0, np.exp(xd - m[:, None]))
        q = np.where(nan, 0.0, q)
        sel = np.take_along_axis(q, ids, axis=1)
        renorm = router.method is RoutingMethod.TOPK_SOFTMAX or router.renormalize
        total = sel.sum(axis=1, keepdims=True) if renorm else q.sum(axis=1, keepdims=True)
        weights = np.divide(sel, total, out=np.zeros_like(sel), where=total > 0)
    offsets, rows, inverse, active = expert_maps_ref(ids, router.n_experts)
    return Routing(ids, weights.astype(np.float32), offsets, rows, inverse, active)


def expert_maps_ref(topk_ids: np.ndarray, n_experts: int) -> tuple[np.ndarray, ...]:
    """NumPy reference of :func:`expert_maps`: a stable counting sort of the flat slots.

    Returns ``(expert_offsets [E+1], sorted_rows [M*k], inverse [M*k], active_experts
    [min(M*k, E)])``, all int32 (see :class:`Routing`). Ids must lie in ``[0, n_experts)``.
    """
    ids = np.asarray(topk_ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise TypeError(
            f"topk_ids: expected an integer array [n_tokens, top_k], got {ids.dtype} {ids.shape}"
        )
    flat = ids.reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= n_experts):
        raise ValueError(
            f"topk_ids: expected ids in [0, {n_experts}), got [{flat.min()}, {flat.max()}]"
        )
    rows = np.argsort(flat, kind="stable").astype(np.int32)
    counts = np.bincount(flat, minlength=n_experts)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    inverse = np.empty_like(rows)
    inverse[rows] = np.arange(flat.size, dtype=np.int32)
    active = np.full(min(flat.size, n_experts), -1, np.int32)
    present = np.flatnonzero(counts).astype(np.int32)
    active[: present.size] = present
    return offsets, rows, inverse, active


def random_routing(
    rng: np.random.Generator, n_tokens: int, top_k: int, n_experts: int, *, device: bool = True
) -> Routing:
    """A ``Routing`` of ``n_tokens`` tokens, each sent to ``top_k`` distinct random experts.

    The maps are :func:`expert_maps_ref` of the random ids; weights 1/top_k; CuPy arrays when
    ``device`` (else NumPy). For tuning and benchmarks: no logits, no router.
    """
    ids = np.argsort(rng.random((n_tokens, n_experts)), axis=1)[:, :top_k].astype(np.int32)
    weights = np.full((n_tokens, top_k), 1.0 / top_k, np.float32)
    fields: list[Any] = [ids, weights, *expert_maps_ref(ids, n_experts)]
    if device:
        cupy = require_cupy()
        fields = [cupy.asarray(a) for a in fields]
    return Routing(*fields)
