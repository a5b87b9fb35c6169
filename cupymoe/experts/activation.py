# SPDX-License-Identifier: Apache-2.0
"""The gated activation of FC1, ``h = act(gate, up)``: the enum, its parameters, and the formulas.

The formulas are written once (:func:`_gated`) over a small set of primitives; the float64
NumPy reference (:func:`activation_ref`) and the float32 CuPy version of the batched path
(:func:`activation_device`) supply those primitives. The GEMV computes the same formulas in its
fp32 epilogue (``cuda/gemv_fp4.cu``, template argument ``kAct`` = :attr:`Activation.code`).
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
    """Gated activation of FC1: ``h = act(gate, up)``, computed in fp32 in the GEMV epilogue."""

    #: ``silu(gate) * up`` (Qwen, DeepSeek, Mixtral).
    SWIGLU = "swiglu"
    #: ``gelu(gate) * up`` with the exact (erf) GELU.
    GEGLU = "geglu"
    #: gpt-oss: ``g * sigmoid(alpha * g) * (u + 1)``, ``g = min(gate, limit)``,
    #: ``u = clip(up, -limit, limit)``.
    SWIGLU_OAI = "swiglu_oai"

    @property
    def code(self) -> int:
        """The GEMV's ``kAct`` template argument (1 swiglu, 2 geglu, 3 swiglu_oai)."""
        return 1 + list(Activation).index(self)

    @classmethod
    def parse(cls, value: str | Activation, name: str = "activation") -> Activation:
        """``Activation`` from a member or its value (case-insensitive)."""
        return parse_enum(cls, value, name)


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """An activation and its parameters (``alpha`` and ``limit`` are used by swiglu_oai only)."""

    kind: Activation
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Activation.parse(self.kind, "kind"))
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
                raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
            object.__setattr__(self, name, float(value))
        if not math.isfinite(self.alpha):
            raise ValueError(f"alpha: expected a finite float, got {self.alpha}")
        if not self.limit > 0:  # +inf is allowed: no clamping
            raise ValueError(f"limit: expected > 0 (inf for no clamping), got {self.limit}")


def check_activation(act: Any, name: str = "act") -> ActivationSpec:
    """``act`` checked to be an :class:`ActivationSpec`."""
    if not isinstance(act, ActivationSpec):
        raise TypeError(f"{name}: expected an ActivationSpec, got {type(act).__name__}")
    return act


@dataclasses.dataclass(frozen=True)
class _Ops:
    """The primitives of one array backend: ``times_sigmoid(g, z) = g * sigmoid(z)``,
    ``gelu(g) = 0.5 g (1 + erf(g / sqrt 2))``, ``minimum``, ``clip`` and a scalar constructor."""

    times_sigmoid: Callable[[Any, Any], Any]
    gelu: Callable[[Any], Any]
    minimum: Callable[[Any, Any], Any]
    clip: Callable[[Any, Any, Any], Any]
    scalar: Callable[[float], Any]


def _gated(gate: Any, up: Any, act: ActivationSpec, ops: _Ops) -> Any:
    """The formulas of :class:`Activation`, once."""
    if act.kind is Activation.SWIGLU:
        return ops.times_sigmoid(gate, gate) * up
    if act.kind is Activation.GEGLU:
        return ops.gelu(gate) * up
    alpha, limit = ops.scalar(act.alpha), ops.scalar(act.limit)
    g = ops.minimum(gate, limit)
    u = ops.clip(up, -limit, limit)
    return ops.times_sigmoid(g, alpha * g) * (u + 1.0)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    e = np.exp(-np.abs(z))  # never overflows
    return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


_erf = np.frompyfunc(math.erf, 1, 1)

_NUMPY_OPS = _Ops(
    times_sigmoid=lambda g, z: g * _sigmoid(z),
    gelu=lambda g: 0.5 * g * (1.0 + np.asarray(_erf(g / math.sqrt(2.0)), dtype=np.float64)),
    minimum=np.minimum,
    clip=np.clip,
    scalar=float,
)


def activation_ref(gate: Any, up: Any, act: ActivationSpec) -> np.ndarray:
    """``act(gate, up)`` in float64 (the formulas of :class:`Activation`).

    >>> activation_ref(np.array([0.0, 100.0]), np.array([3.0, 2.0]), ActivationSpec("swiglu"))
    array([  0., 200.])
    """
    check_activation(act)
    g = np.asarray(to_numpy(gate), dtype=np.float64)
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
        scalar=np.float32,
    )


def activation_device(gate: Any, up: Any, act: ActivationSpec) -> Any:
    """``act(gate, up)`` of float32 CuPy arrays, in float32 array operations (the batched path)."""
    return _gated(gate, up, check_activation(act), _cupy_ops())
