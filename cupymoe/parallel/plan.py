# SPDX-License-Identifier: Apache-2.0
"""The exchange plan of expert parallelism (pure NumPy): which expanded rows go where and how
they come back, so that every expert sees its rows in the order one GPU would give them.

Terms: rank ``h`` is a token's *home* (it routed the token and finalizes it); rank ``d`` is the
*owner* of expert ``e`` (``placement.owner[e]``). Every exchange buffer holds ``W`` segments of
``capacity`` rows, segment ``d`` for peer ``d`` (:func:`capacity`).

Invariants (``r`` = an expanded row of the home's routing, ``e(r)`` its expert,
``counts[e] = offsets[e+1] - offsets[e]``)::

    send order      rows to one owner are its experts ascending, each expert's rows in
                    expanded (ascending token) order: expert-major and stable
    slot[r]         = owner(e) * capacity + base[e] + (r - offsets[e]), base[e] = sum of counts
                    of the owner's experts below e; injective; slot % capacity < send_counts[d]
    send_counts[d]  = sum of counts[e] over the experts of d; <= capacity
    expert counts   the home tells owner d counts[experts_of(d)] (E_d ints); the owner's
                    recv_counts[s, j] is what home s sent for its local expert j
    owner order     local expert j's rows are source 0's, then source 1's, ... each in the
                    source's order: with the tokens of the world concatenated in rank order
                    (rank 0's first), exactly expert e's rows of one GPU, in the same order
    return path     the owner writes each result at the position its input arrived in, and
                    sends segment s back to s; the home reads row r at slot[r], so finalize
                    sums its k results in the fixed slot order of the one-GPU finalize

With these, expert ``e`` multiplies the same matrix of rows as on one GPU, and finalize adds the
same numbers in the same order: the results are bitwise those of one GPU wherever the expert
kernels give a row the same result for the same rows of its expert (always for the float64
reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._runtime.validate import check_int
from ..routing import Routing
from .placement import ExpertPlacement

__all__ = ["ReceivePlan", "SendPlan", "capacity", "receive_plan", "send_plan"]


def capacity(n_tokens: int, top_k: int, experts_per_rank: int) -> int:
    """Rows of one segment: ``n_tokens * min(top_k, experts_per_rank)``.

    A token's ``top_k`` experts are distinct (top-k of a ranking), so it sends at most
    ``min(top_k, E_d)`` rows to rank ``d`` and a home of ``n_tokens`` tokens at most this many:
    the exact worst case, never exceeded, known on the host without reading the routing. That
    is what lets the exchange run at a fixed size inside a CUDA graph.
    """
    named = (("n_tokens", n_tokens), ("top_k", top_k), ("experts_per_rank", experts_per_rank))
    for name, v in named:
        check_int(name, v)
        if v < 0:
            raise ValueError(f"{name}: expected >= 0, got {v}")
    return int(n_tokens) * min(int(top_k), int(experts_per_rank))


@dataclass(frozen=True)
class SendPlan:
    """The home's side of the exchange (see the module invariants)."""

    capacity: int  # rows per segment
    expert_counts: np.ndarray  # int32 [E]: rows per expert of this home's tokens
    send_counts: np.ndarray  # int32 [W]: valid rows of segment d
    slot: np.ndarray  # int32 [M * k]: expanded row r -> row of the [W * capacity] send buffer

    def counts_for(self, placement: ExpertPlacement, rank: int) -> np.ndarray:
        """The expert counts this home tells ``rank``: ``expert_counts[experts_of(rank)]``."""
        return self.expert_counts[placement.experts_of(rank)]


def send_plan(routing: Routing, placement: ExpertPlacement, cap: int) -> SendPlan:
    """The home's plan from its (NumPy) routing; ``cap`` rows per segment (:func:`capacity`)."""
    if not isinstance(routing, Routing):
        raise TypeError(f"routing: expected a Routing, got {type(routing).__name__}")
    if not isinstance(placement, ExpertPlacement):
        raise TypeError(f"placement: expected an ExpertPlacement, got {type(placement).__name__}")
    if routing.n_experts != placement.n_experts:
        raise ValueError(
            f"routing: has {routing.n_experts} experts, the placement {placement.n_experts}"
        )
    offsets = np.asarray(routing.expert_offsets, np.int64)
    counts = np.diff(offsets)
    owner = placement.owner.astype(np.int64)
    send_counts = np.bincount(owner, weights=counts, minlength=placement.world_size).astype(
        np.int64
    )
    if send_counts.size and send_counts.max(initial=0) > cap:
        d = int(np.argmax(send_counts))
        raise ValueError(
            f"capacity: {cap} rows per segment, but {int(send_counts[d])} rows go to rank {d} "
            "(capacity must be n_tokens * min(top_k, experts per rank))"
        )
    base = np.zeros_like(counts)
    for d in range(placement.world_size):  # exclusive scan of counts over each owner's experts
        mine = placement.experts_of(d)
        base[mine] = np.cumsum(counts[mine]) - counts[mine]
    ids = np.asarray(routing.topk_ids).reshape(-1).astype(np.int64)
    expert = ids[np.asarray(routing.sorted_rows, np.int64)]  # e(r)
    r = np.arange(expert.size, dtype=np.int64)
    slot = owner[expert] * cap + base[expert] + (r - offsets[expert])
    return SendPlan(
        int(cap), counts.astype(np.int32), send_counts.astype(np.int32), slot.astype(np.int32)
    )


@dataclass(frozen=True)
class ReceivePlan:
    """The owner's side: its rows in local expert-major order (see the module invariants)."""

    capacity: int
    recv_counts: np.ndarray  # int32 [W, E_local]: rows from source s for local expert j
    expert_offsets: np.ndarray  # int32 [E_local + 1]: local expert j's rows
    sorted_rows: np.ndarray  # int32 [R]: local row -> row of the [W * capacity] receive buffer

    @property
    def n_rows(self) -> int:
        """Valid rows ``R`` the owner's experts run."""
        return int(self.expert_offsets[-1])


def receive_plan(recv_counts: np.ndarray, cap: int) -> ReceivePlan:
    """The owner's plan from the expert counts it received, ``recv_counts [W, E_local]``."""
    counts = np.asarray(recv_counts)
    if counts.ndim != 2 or counts.dtype.kind not in "iu":
        raise TypeError(
            f"recv_counts: expected an integer array [world_size, local experts], got "
            f"{counts.dtype} {counts.shape}"
        )
    counts = counts.astype(np.int64)
    if np.any(counts < 0) or np.any(counts.sum(axis=1) > cap):
        raise ValueError(
            f"recv_counts: expected >= 0 counts summing to <= capacity {cap} per source, got "
            f"row sums {counts.sum(axis=1).tolist()}"
        )
    w, e_local = counts.shape
    per_expert = counts.sum(axis=0)
    offsets = np.concatenate([[0], np.cumsum(per_expert)])
    src_prefix = np.cumsum(counts, axis=1) - counts  # first row of (s, j) within segment s
    rows = np.empty(int(offsets[-1]), np.int64)
    for j in range(e_local):
        at = int(offsets[j])
        for s in range(w):
            n = int(counts[s, j])
            rows[at : at + n] = s * cap + src_prefix[s, j] + np.arange(n)
            at += n
    return ReceivePlan(
        int(cap), counts.astype(np.int32), offsets.astype(np.int32), rows.astype(np.int32)
    )
