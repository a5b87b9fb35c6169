# SPDX-License-Identifier: Apache-2.0
"""What one rank holds of a layer: :class:`ExpertShard` (its experts' weights and biases), and
:func:`layer_options` (everything every rank must agree on, compared before the first call)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..formats import Fp4Experts
from ..layer import MoELayer
from .placement import ExpertPlacement, select_experts

__all__ = ["ExpertShard", "check_same_options", "layer_options", "options_digest"]


def layer_options(layer: MoELayer) -> dict[str, Any]:
    """The options of ``layer`` that every rank of a world must share (not the weights: each
    rank may load only its own experts). Values are plain, comparable Python objects."""
    if not isinstance(layer, MoELayer):
        raise TypeError(f"layer: expected a MoELayer, got {type(layer).__name__}")
    r, a = layer.router, layer.activation
    bias = r.correction_bias
    return {
        "n_experts": layer.n_experts,
        "hidden": layer.hidden,
        "intermediate": layer.intermediate,
        "top_k": layer.top_k,
        "routing": r.method.value,
        "renormalize": r.renormalize,
        "n_group": r.n_group,
        "topk_group": r.topk_group,
        "correction_bias": None if bias is None else hashlib.sha256(bias.tobytes()).hexdigest(),
        "routed_scaling_factor": r.routed_scaling_factor,
        "activation": a.kind.value,
        "activation_alpha": float(a.alpha),
        "activation_limit": float(a.limit),
        "fc1_format": layer.gate.format.value,
        "fc2_format": layer.down.format.value,
        "fc1_bias": layer.gate_bias is not None,
        "fc2_bias": layer.fc2_bias is not None,
        "max_tokens": layer.max_tokens,
        "weight_layout": layer.weight_layout.value,
    }


def options_digest(layer: MoELayer) -> bytes:
    """32 bytes that equal on two ranks exactly when their :func:`layer_options` do."""
    text = repr(sorted(layer_options(layer).items()))
    return hashlib.sha256(text.encode()).digest()


def check_same_options(options: list[dict[str, Any]]) -> None:
    """``ValueError`` naming the first option on which a rank differs from rank 0."""
    for rank, opts in enumerate(options[1:], start=1):
        for key, value in options[0].items():
            if opts.get(key) != value:
                raise ValueError(
                    f"layer: option {key!r} differs across ranks: rank 0 has {value!r}, "
                    f"rank {rank} has {opts.get(key)!r} (every rank must build the same layer)"
                )


@dataclass(frozen=True, eq=False)
class ExpertShard:
    """Rank ``rank``'s experts of a layer: ``experts`` (ascending global ids) and their weights,
    local expert ``j`` = global expert ``experts[j]``; biases sliced the same way."""

    rank: int
    experts: np.ndarray  # int32 [E_local]
    gate: Fp4Experts  # [E_local, I, H]
    up: Fp4Experts  # [E_local, I, H]
    down: Fp4Experts  # [E_local, H, I]
    gate_bias: np.ndarray | None  # float32 [E_local, I]
    up_bias: np.ndarray | None
    fc2_bias: np.ndarray | None  # float32 [E_local, H]

    @classmethod
    def of(cls, layer: MoELayer, placement: ExpertPlacement, rank: int) -> ExpertShard:
        """Copy rank ``rank``'s experts out of ``layer`` (host arrays)."""
        rank = placement.check_rank(rank)
        if layer.up is None:
            raise ValueError(
                f"layer: expert parallelism runs gated FC1 only, got the activation "
                f"{layer.activation.kind.value!r}"
            )
        mine = placement.experts_of(rank)

        def bias(b: np.ndarray | None) -> np.ndarray | None:
            return None if b is None else np.ascontiguousarray(b[mine])

        return cls(
            rank,
            mine,
            select_experts(layer.gate, mine),
            select_experts(layer.up, mine),
            select_experts(layer.down, mine),
            bias(layer.gate_bias),
            bias(layer.up_bias),
            bias(layer.fc2_bias),
        )

    @property
    def n_local(self) -> int:
        return int(self.experts.shape[0])
