# SPDX-License-Identifier: Apache-2.0
"""Which rank owns which expert: :class:`ExpertPlacement`, and the expert subset of a rank.

``owner[e]`` is the rank that holds expert ``e``'s weights and runs its rows. The default is
contiguous blocks: rank ``r`` of ``W`` owns experts ``[r * E / W, (r + 1) * E / W)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._runtime.backend import is_cupy_array
from .._runtime.validate import check_int
from ..formats import Fp4Experts

__all__ = ["ExpertPlacement", "select_experts"]


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    """The owner rank of every expert of a layer spread over ``world_size`` ranks.

    Invariants::

        owner           int32 [E]     owner[e] in [0, world_size): the rank that runs expert e
        experts_of(r)   int32 [E_r]   the experts of rank r, ascending; every expert once
        local_index     int32 [E]     e -> its position in experts_of(owner[e])

    Every rank owns at least one expert. Build one with :meth:`contiguous` (the default of
    expert parallelism; needs ``E % W == 0``) or :meth:`from_owners` (any assignment).
    """

    world_size: int
    owner: np.ndarray

    def __post_init__(self) -> None:
        w = check_int("world_size", self.world_size)
        assert w is not None
        if w < 1:
            raise ValueError(f"world_size: expected >= 1, got {w}")
        if is_cupy_array(self.owner):
            raise TypeError("owner: expected a NumPy array or a sequence of ints (host data)")
        owner = np.asarray(self.owner)
        if owner.ndim != 1 or owner.size == 0 or (owner.dtype.kind not in "iu"):
            raise TypeError(
                f"owner: expected a non-empty 1-D integer array [n_experts], got "
                f"{owner.dtype} {owner.shape}"
            )
        bad = np.flatnonzero((owner < 0) | (owner >= w))
        if bad.size:
            raise ValueError(
                f"owner: expected ranks in [0, {w}), got owner[{int(bad[0])}] = "
                f"{int(owner[bad[0]])} (world_size = {w})"
            )
        counts = np.bincount(owner.astype(np.int64), minlength=w)
        if np.any(counts == 0):
            idle = np.flatnonzero(counts == 0).tolist()
            raise ValueError(f"owner: every rank must own >= 1 expert; ranks {idle} own none")
        owner = owner.astype(np.int32)
        owner.setflags(write=False)
        object.__setattr__(self, "world_size", w)
        object.__setattr__(self, "owner", owner)

    @classmethod
    def contiguous(cls, n_experts: int, world_size: int) -> ExpertPlacement:
        """Rank ``r`` owns experts ``[r * E / W, (r + 1) * E / W)``; ``E`` must divide by ``W``."""
        e = check_int("n_experts", n_experts)
        w = check_int("world_size", world_size)
        assert e is not None and w is not None
        if e < 1:
            raise ValueError(f"n_experts: expected >= 1, got {e}")
        if w < 1:
            raise ValueError(f"world_size: expected >= 1, got {w}")
        if e % w:
            raise ValueError(
                f"world_size: the contiguous placement needs n_experts divisible by "
                f"world_size, got n_experts = {e} and world_size = {w} (give an explicit "
                "placement with ExpertPlacement.from_owners)"
            )
        return cls(w, np.repeat(np.arange(w, dtype=np.int32), e // w))

    @classmethod
    def from_owners(cls, owner: Any, world_size: int) -> ExpertPlacement:
        """An explicit placement: ``owner[e]`` is the rank of expert ``e``."""
        if isinstance(owner, np.ndarray) or is_cupy_array(owner):
            return cls(world_size, owner)
        return cls(world_size, np.asarray(list(owner)))

    @classmethod
    def resolve(cls, placement: Any, n_experts: int, world_size: int) -> ExpertPlacement:
        """``placement`` checked against the layer and the world (``None``: contiguous)."""
        if placement is None:
            return cls.contiguous(n_experts, world_size)
        if not isinstance(placement, ExpertPlacement):
            raise TypeError(
                f"placement: expected an ExpertPlacement or None, got {type(placement).__name__}"
            )
        if placement.n_experts != n_experts:
            raise ValueError(
                f"placement: places {placement.n_experts} experts, the layer has {n_experts}"
            )
        if placement.world_size != world_size:
            raise ValueError(
                f"placement: made for world_size = {placement.world_size}, got {world_size}"
            )
        return placement

    @property
    def n_experts(self) -> int:
        return int(self.owner.shape[0])

    def check_rank(self, rank: Any) -> int:
        """``rank`` as an int in ``[0, world_size)``; ``ValueError`` otherwise."""
        r = check_int("rank", rank)
        assert r is not None
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size = {self.world_size}, got {r}")
        return r

    def experts_of(self, rank: int) -> np.ndarray:
        """The experts of ``rank``, ascending (int32)."""
        return np.flatnonzero(self.owner == self.check_rank(rank)).astype(np.int32)

    @property
    def local_index(self) -> np.ndarray:
        """``e -> position of e in experts_of(owner[e])`` (int32 [E])."""
        out = np.empty(self.n_experts, np.int32)
        for r in range(self.world_size):
            mine = self.experts_of(r)
            out[mine] = np.arange(mine.size, dtype=np.int32)
        return out

    @property
    def max_local_experts(self) -> int:
        """The most experts any rank owns."""
        return int(np.bincount(self.owner, minlength=self.world_size).max())

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ExpertPlacement)
            and other.world_size == self.world_size
            and np.array_equal(other.owner, self.owner)
        )

    def __hash__(self) -> int:
        return hash((self.world_size, self.owner.tobytes()))

    def __repr__(self) -> str:
        return f"ExpertPlacement(world_size={self.world_size}, n_experts={self.n_experts})"


def select_experts(w: Fp4Experts, experts: np.ndarray) -> Fp4Experts:
    """The experts ``experts`` (ascending ids) of ``w``: a new ``Fp4Experts`` of ``len(experts)``
    experts with their codes, block scales and global scales (host copies of only those)."""
    if not isinstance(w, Fp4Experts):
        raise TypeError(f"w: expected Fp4Experts, got {type(w).__name__}")
    idx = np.asarray(experts, np.int64)
    return Fp4Experts(w.format, w.packed[idx], w.scales[idx], w.global_scale[idx])
