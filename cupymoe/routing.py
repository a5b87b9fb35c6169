# SPDX-License-Identifier: Apache-2.0
"""Routing: choose ``top_k`` experts per token and group the expanded rows by expert.

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
  (:func:`sigmoid_f32`, mirrored in ``cuda/routing.cu``), so selection, which depends on the
  rounding of ``c``, is reproduced exactly. Group score = sum (float32) of the two largest ``c``
  of the group (a NaN expert counts as ``-inf``); the ``topk_group`` best groups are kept (ties:
  lower group); top-k of ``c`` over the kept experts (NaN experts of kept groups rank last).
  Weights ``s_j / sum_{chosen} s * routed_scaling_factor`` (``renormalize``; 0 when the sum is
  0) or ``s_j * routed_scaling_factor``; NaN experts have ``s = 0``.

Weights of the GPU path equal the reference's to float32 rounding; ids and maps are exact.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ._backend import is_cupy_array, require_cupy
from ._compile import KernelSpec
from ._launch import cluster_supported, launch
from .formats import parse_enum

__all__ = [
    "Router",
    "Routing",
    "RoutingMethod",
    "expert_maps",
    "expert_maps_ref",
    "kernel_specs",
    "route",
    "route_ref",
    "sigmoid_f32",
]

_CTYPE = {
    np.dtype(np.float32): "float",
    np.dtype(np.float16): "__half",
    np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16",
}
_REF_DTYPES = (*_CTYPE, np.dtype(np.float64))
#: GPU limits: warp kernels (and the fused decode launch) up to these; the block kernel beyond.
WARP_MAX_EXPERTS, WARP_MAX_TOP_K = 256, 8
GPU_MAX_EXPERTS, GPU_MAX_TOP_K = 2048, 64
#: One launch for routing and maps when M * k <= this (and the warp kernel applies).
FUSED_MAX_ROWS = 64
_TILE_ROWS, _TILE_MAX_EXPERTS, _SINGLE_BLOCK_MAX_ROWS = 1024, 1024, 2048


class RoutingMethod(enum.Enum):
    """How router logits become ``top_k`` experts and weights (``FORMATS.md``, Routing)."""

    #: softmax over all experts in float32, the k largest (by logit); ``renormalize`` divides
    #: the k weights by their sum (Qwen3 ``norm_topk_prob``).
    SOFTMAX_TOPK = "softmax_topk"
    #: the k largest logits, softmax over those k (gpt-oss, Mixtral).
    TOPK_SOFTMAX = "topk_softmax"
    #: sigmoid + correction bias, grouped top-k, weights = normalised sigmoid times
    #: ``routed_scaling_factor`` (DeepSeek-V3).
    SIGMOID_GROUPED = "sigmoid_grouped"

    @classmethod
    def parse(cls, value: str | RoutingMethod, name: str = "routing") -> RoutingMethod:
        """``RoutingMethod`` from a member or its string value (``"softmax_topk"``, ...)."""
        return parse_enum(cls, value, name)


def _int(name: str, value: Any, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected int, got {type(value).__name__}")
    return int(value)


@dataclass(frozen=True, eq=False)
class Router:
    """Validated routing parameters (host data).

    ``n_group`` / ``topk_group`` / ``correction_bias`` / ``routed_scaling_factor`` are for
    ``sigmoid_grouped`` only; ``n_group=None`` means one group (no group selection) and
    ``topk_group=None`` keeps all groups. ``correction_bias`` is stored as float32 ``[E]``.
    """

    n_experts: int
    top_k: int
    method: RoutingMethod = RoutingMethod.SOFTMAX_TOPK
    renormalize: bool = True
    n_group: int | None = None
    topk_group: int | None = None
    correction_bias: np.ndarray | None = None
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        put = functools.partial(object.__setattr__, self)
        e, k = _int("n_experts", self.n_experts), _int("top_k", self.top_k)
        assert e is not None and k is not None
        if e < 1:
            raise ValueError(f"n_experts: expected >= 1, got {e}")
        if not 1 <= k <= e:
            raise ValueError(f"top_k: expected 1 <= top_k <= n_experts = {e}, got {k}")
        method = RoutingMethod.parse(self.method)
        put("n_experts", e)
        put("top_k", k)
        put("method", method)
        if not isinstance(self.renormalize, bool | np.bool_):
            raise TypeError(f"renormalize: expected bool, got {type(self.renormalize).__name__}")
        put("renormalize", bool(self.renormalize))
        scale = float(self.routed_scaling_factor)
        grouped = method is RoutingMethod.SIGMOID_GROUPED
        if not grouped:
            for name in ("n_group", "topk_group", "correction_bias"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}: only used by sigmoid_grouped, got method {method.value!r}"
                    )
            if scale != 1.0:
                raise ValueError(
                    f"routed_scaling_factor: only used by sigmoid_grouped, got "
                    f"{scale} with method {method.value!r}"
                )
            return
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"routed_scaling_factor: expected finite > 0, got {scale}")
        put("routed_scaling_factor", scale)
        n_group = _int("n_group", self.n_group, optional=True)
        n_group = 1 if n_group is None else n_group
        topk_group = _int("topk_group", self.topk_group, optional=True)
        topk_group = n_group if topk_group is None else topk_group
        if n_group < 1 or e % n_group:
            raise ValueError(f"n_group: expected a divisor of n_experts = {e}, got {n_group}")
        if n_group > 1 and e // n_group < 2:
            raise ValueError(
                f"n_group: groups need >= 2 experts (top-2 score), got {n_group} "
                f"groups of {e // n_group}"
            )
        if not 1 <= topk_group <= n_group:
            raise ValueError(
                f"topk_group: expected 1 <= topk_group <= n_group = {n_group}, got {topk_group}"
            )
        if topk_group * (e // n_group) < k:
            raise ValueError(
                f"topk_group: {topk_group} groups of {e // n_group} experts hold "
                f"fewer than top_k = {k}"
            )
        put("n_group", n_group)
        put("topk_group", topk_group)
        bias = self.correction_bias
        if bias is None:
            bias = np.zeros(e, np.float32)
        if is_cupy_array(bias):
            raise TypeError("correction_bias: expected a NumPy array (host data), got cupy")
        bias = np.asarray(bias)
        if bias.dtype.kind != "f" and bias.dtype != ml_dtypes.bfloat16:
            raise TypeError(f"correction_bias: expected a float array, got {bias.dtype}")
        if bias.shape != (e,):
            raise ValueError(f"correction_bias: expected shape ({e},), got {bias.shape}")
        bias = bias.astype(np.float32)
        if not np.all(np.isfinite(bias)):
            raise ValueError("correction_bias: expected finite values, got NaN or inf")
        bias.setflags(write=False)
        put("correction_bias", bias)

    def device_bias(self) -> Any:
        """``correction_bias`` on the current GPU (cached: copied once per device)."""
        cupy = require_cupy()
        cache = self.__dict__.setdefault("_device_bias", {})
        dev = cupy.cuda.Device().id
        if dev not in cache:
            cache[dev] = cupy.asarray(self.correction_bias)
        return cache[dev]


@dataclass(frozen=True)
class Routing:
    """Top-k choice per token and the expert-major order of the ``M * k`` expanded rows.

    Invariants (``r`` = expanded row, ``token * top_k + slot`` = flat slot index)::

        topk_ids        int32 [M, k]        experts by descending score; ties -> lower id
        topk_weights    float32 [M, k]      mixing weights of those experts
        expert_offsets  int32 [E + 1]       expert e's rows are offsets[e]:offsets[e+1];
                                            offsets[0] = 0, offsets[E] = M * k
        sorted_rows     int32 [M * k]       r -> token * k + slot; within an expert ascending
                                            (stable); x_sorted[r] = x[sorted_rows[r] // k]
        inverse         int32 [M * k]       token * k + slot -> r (inverse permutation)
        active_experts  int32 [min(M*k, E)] experts with rows, ascending, padded with -1

    Arrays are NumPy (``*_ref``) or CuPy (GPU ops).
    """

    topk_ids: Any
    topk_weights: Any
    expert_offsets: Any
    sorted_rows: Any
    inverse: Any
    active_experts: Any

    @property
    def n_tokens(self) -> int:
        return int(self.topk_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1])

    @property
    def n_experts(self) -> int:
        return int(self.expert_offsets.shape[0]) - 1

    @classmethod
    def empty(cls, n_tokens: int, n_experts: int, top_k: int, *, xp: Any = None) -> Routing:
        """Uninitialised arrays of the right shapes (``xp`` = cupy by default): ``out=`` buffers."""
        xp = require_cupy() if xp is None else xp
        n = n_tokens * top_k
        return cls(
            xp.empty((n_tokens, top_k), np.int32),
            xp.empty((n_tokens, top_k), np.float32),
            xp.empty(n_experts + 1, np.int32),
            xp.empty(n, np.int32),
            xp.empty(n, np.int32),
            xp.empty(min(n, n_experts), np.int32),
        )

    def prefix(self, n_tokens: int) -> Routing:
        """Views for the first ``n_tokens`` tokens of buffers made for more (no allocation)."""
        n, e = n_tokens * self.top_k, self.n_experts
        return Routing(
            self.topk_ids[:n_tokens],
            self.topk_weights[:n_tokens],
            self.expert_offsets,
            self.sorted_rows[:n],
            self.inverse[:n],
            self.active_experts[: min(n, e)],
        )


# ------------------------------------------------------------------------------------------------
# NumPy reference
# ------------------------------------------------------------------------------------------------
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


def _check_logits(logits: Any, router: Router, dtypes: tuple[np.dtype, ...]) -> None:
    if not isinstance(router, Router):
        raise TypeError(f"router: expected a Router, got {type(router).__name__}")
    if logits.ndim != 2 or logits.shape[1] != router.n_experts:
        raise ValueError(
            f"logits: expected shape (n_tokens, {router.n_experts}), got {tuple(logits.shape)}"
        )
    if np.dtype(logits.dtype) not in dtypes:
        names = ", ".join(d.name for d in dtypes)
        raise TypeError(f"logits: expected dtype {names}, got {logits.dtype}")


def route_ref(logits: np.ndarray, router: Router) -> Routing:
    """NumPy reference of :func:`route` (float64 weights math, the kernels' exact choices).

    Parameters
    ----------
    logits : numpy.ndarray [n_tokens, n_experts]
        float16, bfloat16 (ml_dtypes), float32 or float64 (first rounded to float32).
    router : Router

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
    _check_logits(logits, router, _REF_DTYPES)
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


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------
def _kmethod(router: Router) -> int:
    if router.method is RoutingMethod.SIGMOID_GROUPED:
        return 2
    if router.method is RoutingMethod.TOPK_SOFTMAX or router.renormalize:
        return 1
    return 0


def _warp_keys(n_experts: int, top_k: int) -> int:
    per_lane = -(-n_experts // 32)
    return max(1 << (per_lane - 1).bit_length(), 1 << (top_k - 1).bit_length())


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation :func:`route` and :func:`expert_maps` can launch."""
    specs = [
        KernelSpec("routing", n)
        for n in (
            "maps_single",
            "maps_tile_rank",
            "maps_tile_scan",
            "maps_tile_place",
            "maps_scatter",
        )
    ]
    for ctype in _CTYPE.values():
        for method in (0, 1, 2):
            specs.append(KernelSpec("routing", "route_block", (ctype, method)))
            for n in (1, 2, 4, 8):
                specs.append(KernelSpec("routing", "route_warp", (ctype, method, n)))
                specs.append(KernelSpec("routing", "route_fused", (ctype, method, n)))
    return specs


def _check_device(name: str, a: Any, shape: tuple[int, ...], dtype: Any) -> None:
    if not is_cupy_array(a):
        raise TypeError(f"{name}: expected a cupy.ndarray, got {type(a).__name__}")
    if tuple(a.shape) != shape or a.dtype != np.dtype(dtype):
        raise ValueError(
            f"{name}: expected {np.dtype(dtype).name} {shape}, got {a.dtype} {tuple(a.shape)}"
        )
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")


def check_device_routing(
    routing: Any,
    *,
    n_tokens: int | None = None,
    n_experts: int | None = None,
    top_k: int | None = None,
    name: str = "routing",
) -> tuple[int, int]:
    """Check that ``routing`` holds C-contiguous CuPy arrays of the shapes and dtypes of a
    :class:`Routing` (no host read); return ``(n_tokens, top_k)``. ``None`` dimensions are taken
    from ``routing`` itself."""
    if not isinstance(routing, Routing):
        raise TypeError(f"{name}: expected a Routing, got {type(routing).__name__}")
    ids = routing.topk_ids
    if getattr(ids, "ndim", 0) != 2:
        raise ValueError(f"{name}.topk_ids: expected a 2-D array [n_tokens, top_k]")
    m = int(ids.shape[0]) if n_tokens is None else n_tokens
    k = int(ids.shape[1]) if top_k is None else top_k
    e = routing.n_experts if n_experts is None else n_experts
    n = m * k
    for field, shape, dtype in (
        ("topk_ids", (m, k), np.int32),
        ("topk_weights", (m, k), np.float32),
        ("expert_offsets", (e + 1,), np.int32),
        ("sorted_rows", (n,), np.int32),
        ("inverse", (n,), np.int32),
        ("active_experts", (min(n, e),), np.int32),
    ):
        _check_device(f"{name}.{field}", getattr(routing, field), shape, dtype)
    return m, k


def route(logits: Any, router: Router, *, out: Routing | None = None, pdl: bool = False) -> Routing:
    """Top-k routing and expert maps on the GPU; same semantics as :func:`route_ref`.

    Parameters
    ----------
    logits : cupy.ndarray [n_tokens, n_experts]
        float16, bfloat16 or float32; rows may be strided, the expert axis must be contiguous.
    router : Router
        ``n_experts <= 2048`` and ``top_k <= 64`` on the GPU.
    out : Routing, optional
        Preallocated CuPy arrays with exactly the shapes and dtypes of the result, C-contiguous
        (``Routing.empty(max_tokens, E, k).prefix(M)`` gives valid views). With ``out`` no
        memory is allocated and nothing synchronises: the call can be captured in a CUDA graph
        (after one warm-up call that compiles the kernels and copies ``correction_bias``).
    pdl : bool
        Make the one-launch path a programmatic dependent launch (:mod:`cupymoe._launch`): it
        may start while the previous kernel on the stream finishes, and waits for it before it
        reads ``logits`` or writes anything. Safe after any kernel.

    Returns
    -------
    Routing
        ``out`` when given. One launch when ``M * k <= 64``, ``E <= 256`` and ``k <= 8``;
        otherwise a routing launch then :func:`expert_maps`.
    """
    cupy = require_cupy()
    if not is_cupy_array(logits):
        raise TypeError(
            f"logits: expected cupy.ndarray (use route_ref for NumPy), got {type(logits).__name__}"
        )
    _check_logits(logits, router, tuple(_CTYPE))
    e, k, m = router.n_experts, router.top_k, int(logits.shape[0])
    if e > GPU_MAX_EXPERTS or k > GPU_MAX_TOP_K:
        raise ValueError(
            f"router: the GPU path supports n_experts <= {GPU_MAX_EXPERTS} and "
            f"top_k <= {GPU_MAX_TOP_K}, got {e} and {k}"
        )
    item = logits.dtype.itemsize
    if m > 1 and (logits.strides[0] % item or logits.strides[0] < e * item):
        raise ValueError(f"logits: expected a row stride that is a multiple of {item} bytes")
    if m > 0 and e > 1 and logits.strides[1] != item:  # an empty array's strides mean nothing
        raise ValueError("logits: the expert axis must be contiguous")
    if out is None:
        out = Routing.empty(m, e, k, xp=cupy)
    else:
        check_device_routing(out, n_tokens=m, n_experts=e, top_k=k, name="out")
    grouped = router.method is RoutingMethod.SIGMOID_GROUPED
    bias = router.device_bias() if grouped else None
    ld = np.int64(logits.strides[0] // item if m > 1 else e)
    kmethod, ctype = _kmethod(router), _CTYPE[np.dtype(logits.dtype)]
    head = (logits, ld)
    tail = (
        np.int32(router.n_group or 1),
        np.int32(router.topk_group or 1),
        np.float32(router.routed_scaling_factor),
        np.int32(router.renormalize),
        bias,
        out.topk_ids,
        out.topk_weights,
    )
    n = m * k
    if m == 0:
        _maps_launch(out.topk_ids, 0, e, out)
        return out
    if e <= WARP_MAX_EXPERTS and k <= WARP_MAX_TOP_K:
        keys = _warp_keys(e, k)
        if n <= FUSED_MAX_ROWS:
            spec = KernelSpec("routing", "route_fused", (ctype, kmethod, keys))
            ctas = fused_cluster_size(m, cluster_supported())
            launch(
                spec,
                ctas,
                32 * (min(-(-m // ctas), 8) + 1),  # routing warps + the maps warp
                (
                    *head,
                    np.int32(m),
                    np.int32(e),
                    np.int32(k),
                    *tail,
                    out.expert_offsets,
                    out.sorted_rows,
                    out.inverse,
                    out.active_experts,
                    np.int32(min(n, e)),
                ),
                pdl=pdl,
                cluster=ctas,
            )
            return out
        spec = KernelSpec("routing", "route_warp", (ctype, kmethod, keys))
        launch(spec, -(-m // 4), 128, (*head, np.int32(m), np.int32(e), np.int32(k), *tail))
    else:
        n_group = router.n_group or 1
        spec = KernelSpec("routing", "route_block", (ctype, kmethod))
        launch(
            spec,
            m,
            256,
            (*head, np.int32(e), np.int32(k), *tail),
            shared_mem=(2 * e + 2 * n_group) * 4,
        )
    _maps_launch(out.topk_ids, n, e, out)
    return out


def fused_cluster_size(m: int, clusters: bool) -> int:
    """Blocks (one thread-block cluster when above 1) of the one-launch routing of ``m`` tokens:
    enough for one routing warp per scheduler, ``ceil(m / 4)`` up to 8, where the device has
    clusters (``clusters``, sm_90+), else 1.

    H200 (``bench_routing.py``, E 256, top-8, µs, PDL): at M = 8 one block 2.65 (softmax top-k)
    and 3.52 (grouped sigmoid), ceil(M / 4) = 2 blocks 2.44 and 3.02, one block per token 2.43
    and 3.00: two routing warps on a scheduler (M > 4) cost every phase of a token. At M = 2 / 4 a
    block per token buys nothing (grouped 2.75 / 2.89 against 2.76 / 2.89), and ordinary launches
    of clusters cost more (grouped M = 2: 3.28 -> 3.52).
    """
    return min(-(-m // 4), 8) if clusters and m > 4 else 1


def _maps_launch(ids: Any, n: int, e: int, out: Routing) -> None:
    """The expert-map launches (one block for decode sizes, a 4-launch counting sort above)."""
    n_tiles = -(-n // _TILE_ROWS)
    active_len = np.int32(min(n, e))
    if n <= _SINGLE_BLOCK_MAX_ROWS or e > _TILE_MAX_EXPERTS or (e + 1) * n_tiles > n:
        launch(
            KernelSpec("routing", "maps_single"),
            1,
            256,
            (
                ids,
                np.int32(n),
                np.int32(e),
                out.expert_offsets,
                out.sorted_rows,
                out.inverse,
                out.active_experts,
                active_len,
            ),
            shared_mem=4 * (e + 1),
        )
        return
    tiles = out.sorted_rows  # (E + 1) * n_tiles counters, until maps_scatter overwrites them
    launch(
        KernelSpec("routing", "maps_tile_rank"),
        n_tiles,
        256,
        (ids, np.int32(n), np.int32(e), np.int32(n_tiles), tiles, out.inverse),
    )
    launch(
        KernelSpec("routing", "maps_tile_scan"),
        1,
        1024,
        (tiles, np.int32(n_tiles), np.int32(e), out.expert_offsets, out.active_experts, active_len),
    )
    launch(
        KernelSpec("routing", "maps_tile_place"),
        -(-n // 256),
        256,
        (ids, np.int32(n), np.int32(e), np.int32(n_tiles), tiles, out.inverse),
    )
    launch(
        KernelSpec("routing", "maps_scatter"),
        -(-n // 256),
        256,
        (np.int32(n), out.inverse, out.sorted_rows),
    )


def expert_maps(topk_ids: Any, n_experts: int, *, out: Routing | None = None) -> tuple[Any, ...]:
    """Expert maps of ``topk_ids`` on the GPU; same results as :func:`expert_maps_ref`.

    ``topk_ids`` is a C-contiguous int32 ``cupy.ndarray [n_tokens, top_k]``. Ids outside
    ``[0, n_experts)`` cannot be checked without a host sync: they are never read out of range
    (they are placed after every expert, and ``expert_offsets[E]`` counts only valid rows).
    ``out`` (optional) supplies ``expert_offsets``, ``sorted_rows``, ``inverse`` and
    ``active_experts`` (its ``topk_ids``/``topk_weights`` are not touched).

    Returns ``(expert_offsets, sorted_rows, inverse, active_experts)``.
    """
    cupy = require_cupy()
    e = _int("n_experts", n_experts)
    assert e is not None
    if not 1 <= e <= GPU_MAX_EXPERTS:
        raise ValueError(f"n_experts: expected 1..{GPU_MAX_EXPERTS}, got {e}")
    if not is_cupy_array(topk_ids) or topk_ids.ndim != 2:
        raise TypeError("topk_ids: expected a 2-D cupy.ndarray [n_tokens, top_k]")
    _check_device("topk_ids", topk_ids, tuple(topk_ids.shape), np.int32)
    m, k = (int(s) for s in topk_ids.shape)
    if out is None:
        n = m * k
        out = Routing(
            topk_ids,
            None,
            cupy.empty(e + 1, np.int32),
            cupy.empty(n, np.int32),
            cupy.empty(n, np.int32),
            cupy.empty(min(n, e), np.int32),
        )
    else:
        if not isinstance(out, Routing):
            raise TypeError(f"out: expected a Routing, got {type(out).__name__}")
        n = m * k
        for name, shape in (
            ("expert_offsets", (e + 1,)),
            ("sorted_rows", (n,)),
            ("inverse", (n,)),
            ("active_experts", (min(n, e),)),
        ):
            _check_device(f"out.{name}", getattr(out, name), shape, np.int32)
    _maps_launch(topk_ids, m * k, e, out)
    return out.expert_offsets, out.sorted_rows, out.inverse, out.active_experts
