# SPDX-License-Identifier: Apache-2.0
"""A world of ``W`` ranks in one process on the float64 reference: the exchange plan run end to
end in memory, the oracle of expert parallelism.

Each simulated rank holds only its experts (:class:`~.shard.ExpertShard`), routes only its own
tokens, sends rows through the plan (:mod:`.plan`), runs the reference stages on its experts'
weights, returns the results and finalizes. The outputs equal, bitwise, ``moe_reference`` of the
world's tokens concatenated in rank order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._runtime.backend import to_numpy
from ..experts.reference import fc1_ref, fc2_ref
from ..layer import MoELayer
from ..layer.finalize import finalize_ref
from ..routing import route_ref
from .placement import ExpertPlacement
from .plan import SendPlan, capacity, receive_plan, send_plan
from .shard import ExpertShard, check_same_options, layer_options

__all__ = ["simulate_expert_parallel"]


def _layers(layer: Any, world_size: int) -> list[MoELayer]:
    if isinstance(layer, MoELayer):
        return [layer] * world_size
    if isinstance(layer, Sequence) and not isinstance(layer, str):
        layers = list(layer)
        if len(layers) != world_size:
            raise ValueError(
                f"layer: expected {world_size} layers (one per rank), got {len(layers)}"
            )
        for r, lay in enumerate(layers):
            if not isinstance(lay, MoELayer):
                raise TypeError(f"layer[{r}]: expected a MoELayer, got {type(lay).__name__}")
        check_same_options([layer_options(lay) for lay in layers])
        return layers
    raise TypeError(
        f"layer: expected a MoELayer or one MoELayer per rank, got {type(layer).__name__}"
    )


def simulate_expert_parallel(
    x_per_rank: Sequence[Any],
    logits_per_rank: Sequence[Any],
    layer: MoELayer | Sequence[MoELayer],
    world_size: int,
    placement: ExpertPlacement | None = None,
) -> list[np.ndarray]:
    """Run ``layer`` spread over ``world_size`` simulated ranks; float64 ``[M_r, H]`` per rank.

    Parameters
    ----------
    x_per_rank : sequence of W arrays [M_r, H]
        Each rank's tokens (bf16 / fp16); ``M_r`` may differ and may be 0.
    logits_per_rank : sequence of W arrays [M_r, E]
    layer : MoELayer, or W MoELayers (one per rank)
        Per-rank layers must agree on every option (:func:`~.shard.layer_options`); rank ``r``
        uses only its experts' weights from its own layer.
    world_size : int
    placement : ExpertPlacement, optional
        Default: contiguous blocks (needs ``E % W == 0``).

    Returns
    -------
    list of numpy.ndarray float64 [M_r, H]
        Bitwise ``moe_reference(concatenate(x), concatenate(logits), layer)`` split by rank.
    """
    layers = _layers(layer, world_size)
    place = ExpertPlacement.resolve(placement, layers[0].n_experts, world_size)
    w = place.world_size
    for name, seq in (("x_per_rank", x_per_rank), ("logits_per_rank", logits_per_rank)):
        if len(seq) != w:
            raise ValueError(f"{name}: expected {w} arrays (one per rank), got {len(seq)}")
    xs = [to_numpy(x) for x in x_per_rank]
    logits = [to_numpy(g) for g in logits_per_rank]
    m = [lay.check_inputs(x, g) for lay, x, g in zip(layers, xs, logits, strict=True)]
    lay0 = layers[0]
    k, hidden = lay0.top_k, lay0.hidden
    # every rank sizes its segments for the largest home of the world (the eager agreement)
    cap = capacity(max(m), k, place.max_local_experts)
    shards = [ExpertShard.of(layers[r], place, r) for r in range(w)]

    # 1. route at home; pack the send buffers through the plan
    routings = [route_ref(logits[r], layers[r].router) for r in range(w)]
    plans: list[SendPlan] = [send_plan(routings[r], place, cap) for r in range(w)]
    send_x = []
    for r in range(w):
        buf = np.full((w * cap, hidden), np.nan, xs[r].dtype)  # padding reads fail loudly
        rows = np.asarray(routings[r].sorted_rows) // k
        buf[plans[r].slot] = xs[r][rows]
        send_x.append(buf)

    # 2. the exchange (all-to-all of the expert counts, then of the row segments)
    back = [np.full((w * cap, hidden), np.nan) for _ in range(w)]
    recv_ret = []
    for d in range(w):
        counts = np.stack([plans[s].counts_for(place, d) for s in range(w)])
        recv = np.concatenate([send_x[s][d * cap : (d + 1) * cap] for s in range(w)])
        rplan = receive_plan(counts, cap)
        # 3. the owner's experts, on only its weights, in local expert-major order
        shard = shards[d]
        x_local = recv[rplan.sorted_rows].astype(np.float64)
        h = fc1_ref(
            x_local,
            shard.gate,
            shard.up,
            rplan.expert_offsets,
            act=layers[d].activation,
            gate_bias=shard.gate_bias,
            up_bias=shard.up_bias,
        )
        y = fc2_ref(h, shard.down, rplan.expert_offsets, bias=shard.fc2_bias)
        ret = np.full((w * cap, hidden), np.nan)
        ret[rplan.sorted_rows] = y  # each result where its input arrived
        recv_ret.append(ret)
    # 4. the exchange back: owner d's segment s returns to home s as its segment d
    for s in range(w):
        for d in range(w):
            back[s][d * cap : (d + 1) * cap] = recv_ret[d][s * cap : (s + 1) * cap]
    # 5. finalize at home, in the fixed slot order
    return [finalize_ref(back[r][plans[r].slot], routings[r]) for r in range(w)]
