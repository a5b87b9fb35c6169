# SPDX-License-Identifier: Apache-2.0
"""The routing types: ``RoutingMethod``, ``Router`` (validated parameters) and ``Routing`` (the
top-k choice and the expert maps), with the checks every stage makes of them."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from .._runtime.validate import check_device_array, check_int, parse_enum

__all__ = [
    "SPARSE_MIXER_EPS",
    "SPARSE_MIXER_EXPERTS",
    "Router",
    "Routing",
    "RoutingMethod",
    "check_device_routing",
    "check_logits",
    "check_router_weights",
]

#: ONNX Runtime's sparse mixer: its expert counts and its jitter epsilon (``jitter_eps``).
SPARSE_MIXER_EXPERTS = (8, 16)
SPARSE_MIXER_EPS = 0.01


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
    #: ONNX Runtime's sparse mixer top-2 (``use_sparse_mixer=1``, Phi-3.5-MoE): ``top_k = 2``
    #: of 8 or 16 experts; each round's weight is the winner's softmax over the experts its
    #: jitter mask keeps (``reference.route_ref`` states it exactly).
    SPARSE_MIXER = "sparse_mixer"

    @classmethod
    def parse(cls, value: str | RoutingMethod, name: str = "routing") -> RoutingMethod:
        """``RoutingMethod`` from a member or its string value (``"softmax_topk"``, ...)."""
        return parse_enum(cls, value, name)


@dataclass(frozen=True, eq=False)
class Router:
    """Validated routing parameters (host data).

    ``n_group`` / ``topk_group`` / ``correction_bias`` / ``routed_scaling_factor`` are for
    ``sigmoid_grouped`` only; ``n_group=None`` means one group (no group selection) and
    ``topk_group=None`` keeps all groups. ``correction_bias`` is stored as float32 ``[E]``.
    ``sparse_mixer`` needs ``top_k = 2`` and 8 or 16 experts (as ONNX Runtime) and ignores
    ``renormalize``.
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
        e, k = check_int("n_experts", self.n_experts), check_int("top_k", self.top_k)
        assert e is not None and k is not None
        if e < 1:
            raise ValueError(f"n_experts: expected >= 1, got {e}")
        if not 1 <= k <= e:
            raise ValueError(f"top_k: expected 1 <= top_k <= n_experts = {e}, got {k}")
        method = RoutingMethod.parse(self.method)
        if method is RoutingMethod.SPARSE_MIXER and (k != 2 or e not in SPARSE_MIXER_EXPERTS):
            raise ValueError(
                f"routing: sparse_mixer needs top_k = 2 and n_experts in "
                f"{SPARSE_MIXER_EXPERTS} (as ONNX Runtime), got top_k = {k}, n_experts = {e}"
            )
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
        n_group = check_int("n_group", self.n_group, optional=True)
        n_group = 1 if n_group is None else n_group
        topk_group = check_int("topk_group", self.topk_group, optional=True)
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


def check_logits(logits: Any, router: Router, dtypes: tuple[np.dtype, ...]) -> None:
    if not isinstance(router, Router):
        raise TypeError(f"router: expected a Router, got {type(router).__name__}")
    if logits.ndim != 2 or logits.shape[1] != router.n_experts:
        raise ValueError(
            f"logits: expected shape (n_tokens, {router.n_experts}), got {tuple(logits.shape)}"
        )
    if np.dtype(logits.dtype) not in dtypes:
        names = ", ".join(d.name for d in dtypes)
        raise TypeError(f"logits: expected dtype {names}, got {logits.dtype}")


def check_router_weights(router_weights: Any, logits: Any, router: Router) -> None:
    """Check a mixing-weights tensor (ONNX Runtime's QMoE ``router_weights``): the shape of
    ``logits``, float32, and a router whose top-k is by logit (softmax_topk / topk_softmax)."""
    if router.method not in (RoutingMethod.SOFTMAX_TOPK, RoutingMethod.TOPK_SOFTMAX):
        raise ValueError(
            f"router_weights: only with softmax_topk or topk_softmax (top-k on the logits), "
            f"got routing {router.method.value!r}"
        )
    if is_cupy_array(router_weights) != is_cupy_array(logits) or not hasattr(
        router_weights, "shape"
    ):
        kind = "cupy.ndarray" if is_cupy_array(logits) else "numpy.ndarray"
        raise TypeError(
            f"router_weights: expected a {kind} like the logits, got "
            f"{type(router_weights).__name__}"
        )
    if tuple(router_weights.shape) != tuple(logits.shape):
        raise ValueError(
            f"router_weights: expected the shape of the logits {tuple(logits.shape)}, "
            f"got {tuple(router_weights.shape)}"
        )
    if np.dtype(router_weights.dtype) != np.float32:
        raise TypeError(f"router_weights: expected dtype float32, got {router_weights.dtype}")


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
        check_device_array(f"{name}.{field}", getattr(routing, field), shape, dtype)
    return m, k
