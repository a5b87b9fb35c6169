# SPDX-License-Identifier: Apache-2.0
"""The activation of FC1: gated, ``h = act(gate, up)`` with FC1 ``[E, 2I, H]``, or non-gated,
``h = act(v)`` with FC1 ``[E, I, H]``: the enum, its parameters, and the formulas.

The formulas are written once (:func:`_gated`, :func:`_single`) over a small set of primitives;
the float64 NumPy reference (:func:`activation_ref`) and the float32 CuPy version of the batched
path (:func:`activation_device`) supply those primitives. The GEMV and the grouped GEMM compute
the same formulas in their fp32 epilogues (``cuda/fp4_mma.cuh``: ``activate<kAct>`` for the
gated kinds, ``activate1<kAct>`` for the others; ``kAct`` = :attr:`Activation.code`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .._runtime.backend import require_cupy, to_numpy
from .._runtime.validate import parse_enum

__all__ = [
    "Activation",
    "ActivationSpec",
    "activation_device",
    "activation_ref",
    "check_activation",
]


class Activation(enum.Enum):
    """Activation of FC1, computed in fp32 in the kernels' epilogues.

    The first three are gated (FC1 ``[E, 2I, H]``: gate and up rows); the last four are not
    (FC1 ``[E, I, H]``, one matrix like FC2), as ONNX Runtime's ``activation_type``.
    """

    #: ``silu(gate) * up`` (Qwen, DeepSeek, Mixtral).
    SWIGLU = "swiglu"
    #: ``gelu(gate) * up`` with the exact (erf) GELU.
    GEGLU = "geglu"
    #: The general SwiGLU of ONNX Runtime (gpt-oss: alpha 1.702, beta 1, limit 7):
    #: ``g * sigmoid(alpha * g) * (u + beta)``, ``g = min(gate, limit)``,
    #: ``u = clip(up, -limit, limit)``.
    SWIGLU_OAI = "swiglu_oai"
    #: ``max(v, 0)`` (NaN stays NaN).
    RELU = "relu"
    #: ``gelu(v)``, the exact (erf) GELU.
    GELU = "gelu"
    #: ``v * sigmoid(v)``.
    SILU = "silu"
    #: ``v``.
    IDENTITY = "identity"

    @property
    def code(self) -> int:
        """The kernels' ``kAct`` template argument, the one table of the codes:
        0 none (FC2), 1 swiglu, 2 geglu, 3 swiglu_oai (gated), 4 relu, 5 gelu, 6 silu,
        7 identity (non-gated)."""
        return 1 + list(Activation).index(self)

    @property
    def gated(self) -> bool:
        """Whether FC1 holds gate and up rows (``[E, 2I, H]``) for this activation."""
        return self in (Activation.SWIGLU, Activation.GEGLU, Activation.SWIGLU_OAI)

    @classmethod
    def parse(cls, value: str | Activation, name: str = "activation") -> Activation:
        """``Activation`` from a member or its value (case-insensitive)."""
        return parse_enum(cls, value, name)


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """An activation and its parameters (``alpha``, ``beta`` and ``limit`` are used by
    swiglu_oai only)."""

    kind: Activation
    alpha: float = 1.702
    limit: float = 7.0
    beta: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Activation.parse(self.kind, "kind"))
        for name in ("alpha", "limit", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
                raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
            object.__setattr__(self, name, float(value))
        for name in ("alpha", "beta"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: expected a finite float, got {getattr(self, name)}")
        # The kernels clamp with a float32 limit (min.NaN / max.NaN, exact for a limit > 0):
        # a positive limit that rounds to 0 in float32 is refused too.
        with np.errstate(over="ignore"):  # a limit past float32's range clamps nothing
            limit32 = np.float32(self.limit)
        if not limit32 > 0:  # +inf is allowed: no clamping
            raise ValueError(
                f"limit: expected > 0 in float32 (inf for no clamping), got {self.limit}"
            )


def check_activation(act: Any, name: str = "act") -> ActivationSpec:
    """``act`` checked to be an :class:`ActivationSpec`."""
    if not isinstance(act, ActivationSpec):
        raise TypeError(f"{name}: expected an ActivationSpec, got {type(act).__name__}")
    return act


@dataclasses.dataclass(frozen=True)
class _Ops:
    """The primitives of one array backend: ``times_sigmoid(g, z) = g * sigmoid(z)``,
    ``gelu(g) = 0.5 g (1 + erf(g / sqrt 2))``, ``minimum``, ``clip``, ``where`` and a scalar
    constructor."""

    times_sigmoid: Callable[[Any, Any], Any]
    gelu: Callable[[Any], Any]
    minimum: Callable[[Any, Any], Any]
    clip: Callable[[Any, Any, Any], Any]
    where: Callable[[Any, Any, Any], Any]
    scalar: Callable[[float], Any]


def _gated(gate: Any, up: Any, act: ActivationSpec, ops: _Ops) -> Any:
    """The formulas of :class:`Activation`, once."""
    if act.kind is Activation.SWIGLU:
        return ops.times_sigmoid(gate, gate) * up
    if act.kind is Activation.GEGLU:
        return ops.gelu(gate) * up
    alpha, limit, beta = ops.scalar(act.alpha), ops.scalar(act.limit), ops.scalar(act.beta)
    g = ops.minimum(gate, limit)
    u = ops.clip(up, -limit, limit)
    return ops.times_sigmoid(g, alpha * g) * (u + beta)


def _single(v: Any, act: ActivationSpec, ops: _Ops) -> Any:
    """The non-gated formulas of :class:`Activation`, once."""
    if act.kind is Activation.RELU:
        return ops.where(v < 0, ops.scalar(0.0), v)  # NaN < 0 is false: NaN passes
    if act.kind is Activation.GELU:
        return ops.gelu(v)
    if act.kind is Activation.SILU:
        return ops.times_sigmoid(v, v)
    return v


def _sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))  # never overflows
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


_erf = np.frompyfunc(math.erf, 1, 1)

_NUMPY_OPS = _Ops(
    times_sigmoid=lambda g, z: g * _sigmoid(z),
    gelu=lambda g: 0.5 * g * (1.0 + np.asarray(_erf(g / math.sqrt(2.0)), dtype=np.float64)),
    minimum=np.minimum,
    clip=np.clip,
    where=np.where,
    scalar=float,
)


def _check_operands(up: Any, act: ActivationSpec) -> None:
    if act.kind.gated and up is None:
        raise ValueError(f"up: the gated activation {act.kind.value!r} needs gate and up")
    if not act.kind.gated and up is not None:
        raise ValueError(f"up: the activation {act.kind.value!r} is not gated, expected None")


def activation_ref(gate: Any, up: Any, act: ActivationSpec) -> np.ndarray:
    """``act(gate, up)`` (gated kinds) or ``act(gate)`` (``up=None``, the non-gated kinds) in
    float64 (the formulas of :class:`Activation`).

    >>> activation_ref(np.array([0.0, 100.0]), np.array([3.0, 2.0]), ActivationSpec("swiglu"))
    array([  0., 200.])
    >>> activation_ref(np.array([-1.0, 2.0]), None, ActivationSpec("relu"))
    array([0., 2.])
    """
    check_activation(act)
    _check_operands(up, act)
    g = np.asarray(to_numpy(gate), dtype=np.float64)
    if up is None:
        return np.asarray(_single(g, act, _NUMPY_OPS), dtype=np.float64)
    u = np.asarray(to_numpy(up), dtype=np.float64)
    if g.shape != u.shape:
        raise ValueError(f"up: expected the shape of gate {g.shape}, got {u.shape}")
    return _gated(g, u, act, _NUMPY_OPS)


def _cupy_ops() -> _Ops:
    cupy = require_cupy()
    from cupyx.scipy.special import erf

    half, inv_sqrt2 = np.float32(0.5), np.float32(1.0 / math.sqrt(2.0))
    return _Ops(
        times_sigmoid=lambda g, z: g / (1.0 + cupy.exp(-z)),
        gelu=lambda g: half * g * (1.0 + erf(g * inv_sqrt2)),
        minimum=cupy.minimum,
        clip=cupy.clip,
        where=cupy.where,
        scalar=np.float32,
    )


def activation_device(gate: Any, up: Any, act: ActivationSpec) -> Any:
    """``act(gate, up)`` (or ``act(gate)``, ``up=None``) of float32 CuPy arrays, in float32 array
    operations (the batched path)."""
    check_activation(act)
    _check_operands(up, act)
    if up is None:
        return _single(gate, act, _cupy_ops())
    return _gated(gate, up, act, _cupy_ops())
