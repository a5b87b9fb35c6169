# SPDX-License-Identifier: Apache-2.0
"""The automatic choice of an expert call: the GEMV or the grouped GEMM, and the GEMM's tiling.

:func:`choose` decides what :func:`.dispatch.fc1` / :func:`.dispatch.fc2` run when they are not
told (an explicit ``config=`` or ``backend=`` wins over everything below). First match wins:

1. **What the weights allow.** MXFP4 scales the tensor cores cannot fold exactly run the batched
   backend; weights in the PLAIN or PAIR layout run the GEMV (the grouped GEMM reads the SPLIT
   layout only). Neither asks the cache.
2. **The environment.** ``CUPYMOE_WGMMA=0``, or a device that is not compute capability 9.0,
   rules out the wgmma kernel, a tuned wgmma entry included: that call runs the grouped GEMM
   with the analytic mma.sync tiling (:meth:`.gemm.GemmConfig.for_rows`). ``CUPYMOE_GEMV_CONFIG``
   fixes the GEMV's tiling (:meth:`.config.GemvConfig.for_problem`), never the backend.
3. **The tuning cache.** The ``gemm`` entry of the problem (:func:`.cache.gemm_cache_key`:
   device, op, format, dtype, N, K, experts, bucket of rows per active expert), which
   ``cupymoe tune`` writes (:func:`.tune.tune_gemm`): the backend, and for the GEMM the tiling,
   that measured fastest on this GPU.
4. **The analytic rule.** The shape's :class:`HandOver` (:data:`HAND_OVERS`, else
   :data:`DEFAULT_HAND_OVER`): the GEMV up to ``gemv_max`` average rows per active expert; above
   it the grouped GEMM, on the wgmma kernel above ``wgmma_min`` where it runs, else the mma.sync
   table.

The GEMV's tiling always comes from :meth:`.config.GemvConfig.for_problem` (environment > GEMV
cache entry > table). "Rows per active expert" is ``rows / min(rows, n_experts)``: the host knows
it without reading the routing, so every choice is capturable; a graph keeps the choice it was
recorded with (``cupymoe.layer.eager.RECORDED_ONCE``).

A call costs two memoised dictionary lookups (the cache file is parsed once per process) and
nothing on the GPU; eager graphs pay it once, when they are recorded.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import warnings
from typing import Any

from .._runtime.device import device_name
from ..formats import Fp4Format
from . import cache
from .config import GemvConfig
from .gemm import WGMMA_MIN_ROWS_PER_EXPERT, GemmConfig, WgmmaConfig, default_config, wgmma_enabled
from .gemv import PreparedFc1, PreparedFc2
from .gemv import default_config as gemv_default_config
from .layouts import WeightLayout

__all__ = [
    "DEFAULT_HAND_OVER",
    "GEMV_MAX_ROWS_PER_EXPERT",
    "HAND_OVERS",
    "Backend",
    "HandOver",
    "analytic_choice",
    "choose",
    "hand_over_for",
    "rows_per_expert",
    "tuned_choice",
]

#: A tiling of either backend, or ``None`` for the batched one.
Config = GemvConfig | GemmConfig | WgmmaConfig | None


class Backend(enum.Enum):
    """An implementation of the expert GEMMs."""

    #: The tensor-core GEMV (:mod:`.gemv`): few rows per expert, capturable.
    GEMV = "gemv"
    #: The grouped tensor-core GEMM (:mod:`.gemm`): many rows per expert, capturable.
    GEMM = "gemm"
    #: Dequantize + cuBLAS (:mod:`.batched`): MXFP4 scales the tensor cores cannot fold.
    BATCHED = "batched"


#: Average expanded rows per active expert up to which the GEMV serves a call on the SPLIT
#: layout (the default of :class:`HandOver`): one pass of 8 rows per expert, each expert's
#: weights read once. Above it the grouped GEMM, which shares each decoded weight tile among up
#: to 128 rows. Measured on the H200 (FC1 + FC2 graph replays over HBM-resident weights, µs,
#: GEMV / GEMM): Qwen3.6 M = 16 (1 row per expert) 63 / 89, M = 64 (2) 122 / 171; gpt-oss M = 16
#: (2) 109 / 166, M = 64 (8) 182 / 199; DeepSeek-V3 M = 16 (1) 632 / 853, M = 64 (2) 1,331 /
#: 1,835.
GEMV_MAX_ROWS_PER_EXPERT = 8


@dataclasses.dataclass(frozen=True)
class HandOver:
    """Where one problem shape changes kernels, in average expanded rows per active expert: the
    GEMV serves up to ``gemv_max`` (the grouped GEMM above it); the GEMM runs the wgmma kernel
    above ``wgmma_min`` where it can (the mma.sync table up to it)."""

    gemv_max: float
    wgmma_min: float

    def __post_init__(self) -> None:
        for name in ("gemv_max", "wgmma_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"{name}: expected a number >= 0 (rows per expert), got {value!r}")


#: Today's thresholds, for every shape :data:`HAND_OVERS` does not list.
DEFAULT_HAND_OVER = HandOver(GEMV_MAX_ROWS_PER_EXPERT, WGMMA_MIN_ROWS_PER_EXPERT)

#: The analytic hand-over per problem shape ``(op, N, K, n_experts)`` (op as in the tuning cache:
#: ``"fc1"`` gate + up with N = intermediate, ``"fc2"`` one matrix per expert), H200, bf16. Each
#: row quotes the measurement behind it: ``cupymoe tune --preset P --kernel gemm`` (the table it
#: prints: GEMV and best GEMM µs per call, per bucket of rows per expert). ``gemv_max`` is the
#: largest bucket where the GEMV wins, ``wgmma_min`` the largest where mma.sync beats wgmma by
#: more than 2 % (closer results flip between runs).
#: Measured with ``cupymoe tune --kernel gemm --rows-per-expert 2,4,...,256 --repeats 5``
#: (scripts/tune_gemm_check.sh): ``gemv_max`` in session 14 (µs per call at 8 / 16 rows per
#: expert, GEMV | best mma.sync), ``wgmma_min`` in session 19 with the wgmma kernel's TMA weight
#: boxes and its bn 64 tiling (µs at 8 / 16 / 32 rows per expert, GEMV | best mma.sync | wgmma
#: bn 64: gpt-oss's GEMV and mma.sync from ``cupymoe tune``, benchmarks/h200_handover_s19.json,
#: Qwen3.6's from session 17's; the wgmma column, and Qwen3.6's GEMV at 8 rows, per-stage graphs
#: of whole layers, benchmarks/h200_wgmma_variants.json run ``run_s19_tilings``). From 16 rows
#: per expert wgmma beats mma.sync on every op (by 16-27 %, 26-45 % at 32), at 8 it ties the GEMV
#: (gpt-oss FC2: wgmma wins), so ``wgmma_min`` = ``gemv_max`` and mma.sync serves none of these
#: shapes on the H200. Session 21 (the wgmma kernel's bn 64 on four consumer groups) measured
#: the 8-rows bucket again as whole layers, per-stage graphs, GEMV | wgmma (``.dev`` harness,
#: benchmarks/h200_handover_s21.json): Qwen3.6 M = 256 FC1 120.8 | 118.8, FC2 70.9 | 70.2 (inside
#: the 2 %: unchanged); gpt-oss M = 64 FC1 122.3 | 122.3, and with FC1 on the wgmma kernel FC2
#: reads h in the split k order (``dispatch.permutes_h``): 71.2 | 58.3, layer 200.2 | 186.6;
#: DeepSeek-V3 M = 256 FC1 1,592 | 1,449, FC2 829 | 726. Those two take the wgmma kernel from
#: the bucket below 8. Session 23 (the wgmma kernel's width-16 K loop) again, layers µs (FC1 /
#: FC2), GEMV | wgmma, ``.dev`` harness, two rounds: Qwen3.6 M = 256 (8 rows) 207.5-208.4 (120.7
#: / 70.5) | 186.3-187.4 (111.7 / 60.4), so Qwen3.6 takes the wgmma kernel from the bucket below
#: 8 too; at 4 rows the GEMV keeps every preset: Qwen3.6 M = 128 151.7-152.0 | 184.2, gpt-oss
#: M = 32 137.2-137.9 | 170.2-170.9, DeepSeek-V3 M = 128 1,577-1,653 | 1,854-1,972.
HAND_OVERS: tuple[tuple[tuple[str, int, int, int], HandOver], ...] = (
    # Qwen3.6-35B-A3B (H 2048, I 512, E 256, top-8), NVFP4.
    # fc1: 8 rows GEMV 121.2 | mma 127.5 | wgmma 128.0; 16: 201.2 | 157.7 | 132.0;
    # 32: 347.9 | 230.9 | 159.4. Session 23 at 8 rows: GEMV 120.7 | wgmma 111.7.
    (("fc1", 512, 2048, 256), HandOver(4, 4)),
    # fc2: 8 rows GEMV 72.2 | mma 78.0 | wgmma 73.0; 16: 112.4 | 98.7 | 74.7;
    # 32: 189.2 | 144.6 | 85.5. Session 23 at 8 rows: GEMV 70.5 | wgmma on split h 60.4.
    (("fc2", 2048, 512, 256), HandOver(4, 4)),
    # gpt-oss-20b (H 2880, I 2880, E 32, top-4), MXFP4.
    # fc1: 8 rows GEMV 123.8 | mma 126.7 | wgmma 127.4; 16: 188.0 | 161.3 | 129.6;
    # 32: 340.4 | 213.6 | 157.0. Session 21 at 8 rows: 122.3 | wgmma 122.3, and FC2 on split h.
    (("fc1", 2880, 2880, 32), HandOver(4, 4)),
    # fc2: 8 rows GEMV 65.1 | mma 73.7 | wgmma 59.3; 16: 103.7 | 83.2 | 60.6;
    # 32: 178.2 | 126.2 | 69.5 (wgmma ahead from 8 rows: both thresholds at the bucket below).
    (("fc2", 2880, 2880, 32), HandOver(4, 4)),
    # DeepSeek-V3 routed experts (H 7168, I 2048, E 256, top-8), NVFP4. Session 21 at 8 rows
    # (M = 256), GEMV | wgmma: fc1 1,592 | 1,449, fc2 829 | 726.
    (("fc1", 2048, 7168, 256), HandOver(4, 4)),
    (("fc2", 7168, 2048, 256), HandOver(4, 4)),
)
_BY_SHAPE = dict(HAND_OVERS)


def rows_per_expert(rows: int, n_experts: int) -> float:
    """Average expanded rows per active expert: ``rows / min(rows, n_experts)`` (at most that
    many experts have rows), 0 for no rows.

    >>> rows_per_expert(64, 256), rows_per_expert(4096 * 8, 256), rows_per_expert(0, 8)
    (1.0, 128.0, 0.0)
    """
    return rows / max(1, min(rows, n_experts))


def hand_over_for(op: str, n: int, k: int, n_experts: int) -> HandOver:
    """The analytic thresholds of a shape: its row of :data:`HAND_OVERS`, else the default."""
    return _BY_SHAPE.get((op, n, k, n_experts), DEFAULT_HAND_OVER)


def analytic_choice(
    *,
    op: str,
    n: int,
    k: int,
    n_experts: int,
    rows: int,
    fmt_code: int,
    backend: Backend | None = None,
) -> tuple[Backend, GemmConfig | WgmmaConfig | None]:
    """The analytic rule for a call on the SPLIT layout: ``(GEMV, None)`` up to the shape's
    ``gemv_max`` rows per active expert (:func:`hand_over_for`), else ``(GEMM, tiling)``: the
    tiling of :func:`.gemm.default_config` with the shape's ``wgmma_min``. ``backend``: skip the
    hand-over and give that backend's tiling. ``None`` tiling: the GEMV's own table picks it."""
    hand = hand_over_for(op, n, k, n_experts)
    if backend is None:
        gemv = rows_per_expert(rows, n_experts) <= hand.gemv_max
        backend = Backend.GEMV if gemv else Backend.GEMM
    if backend is not Backend.GEMM:
        return backend, None
    return backend, default_config(rows, n_experts, fmt_code, wgmma_min=hand.wgmma_min)


@functools.lru_cache(maxsize=256)
def _decode(found: cache.GemmChoice) -> tuple[Backend, GemmConfig | WgmmaConfig | None] | str:
    """A stored choice as ``(backend, GemmConfig | WgmmaConfig | None)``, or the reason it no
    longer makes a valid one (an entry of other kernels' tilings); memoised by content."""
    backend, items = found
    fields = dict(items)
    try:
        if backend == Backend.GEMV.value:
            return Backend.GEMV, None
        if backend != Backend.GEMM.value:
            raise ValueError(f"backend {backend!r} is not 'gemv' or 'gemm'")
        kind = fields.pop("kind", None)
        if kind == "mma":
            return Backend.GEMM, GemmConfig(**fields)
        if kind == "wgmma":
            return Backend.GEMM, WgmmaConfig(**fields)
        raise ValueError(f"config kind {kind!r} is not 'mma' or 'wgmma'")
    except (TypeError, ValueError) as error:
        return str(error)


@functools.lru_cache(maxsize=64)
def _warn_unusable(where: str, found: cache.GemmChoice, reason: str) -> None:
    """One warning per stale entry and file (the lookups of every call come here)."""
    warnings.warn(
        f"cupymoe tune cache {where}: gemm entry {found} unusable ({reason}); ignoring it "
        "(run `cupymoe tune` again)",
        stacklevel=4,
    )


def tuned_choice(
    *,
    device_name: str,
    op: str,
    fmt: Any,
    dtype: Any,
    n: int,
    k: int,
    n_experts: int,
    rows: int,
    path: Any = None,
) -> tuple[Backend, GemmConfig | WgmmaConfig | None] | None:
    """The tuned choice of a call on the SPLIT layout, ``(backend, tiling)`` (``None`` tiling
    for the GEMV), or ``None`` when the cache has no usable ``gemm`` entry for it (a stale entry
    is ignored with a warning). The entry's wgmma tiling is only returned where
    :func:`.gemm.wgmma_enabled`; elsewhere the analytic mma.sync tiling replaces it.

    ``device_name`` ``""`` skips the cache; ``path``: the cache file (default
    :func:`.cache.cache_path`).
    """
    if not device_name or rows <= 0:
        return None
    found = cache.tuned_gemm(
        device_name=device_name,
        op=op,
        fmt=fmt,
        dtype=dtype,
        n=n,
        k=k,
        n_experts=n_experts,
        rows_per_expert=rows_per_expert(rows, n_experts),
        path=path,
    )
    if found is None:
        return None
    choice = _decode(found)
    if isinstance(choice, str):
        _warn_unusable(str(path or cache.cache_path()), found, choice)
        return None
    if isinstance(choice[1], WgmmaConfig) and not wgmma_enabled():
        # default_config gives the mma.sync table wherever the wgmma kernel does not run
        return Backend.GEMM, default_config(rows, n_experts, Fp4Format.parse(fmt, "fmt").code)
    return choice


def choose(
    weights: PreparedFc1 | PreparedFc2,
    rows: int,
    dtype: Any,
    shift: int | None,
    *,
    backend: Backend | None = None,
    n_experts: int | None = None,
) -> tuple[Backend, Config]:
    """The backend and tiling of a call of ``rows`` expanded rows (see the module docstring).

    Parameters
    ----------
    weights : PreparedFc1 or PreparedFc2
        Gate and up (op ``fc1``), or one matrix per expert (op ``fc2``: FC2, or FC1 with a
        non-gated activation).
    rows : int
        Expanded rows of the call (``n_tokens * top_k``).
    dtype : dtype
        Activation dtype.
    shift : int or None
        The MXFP4 scale shift (:func:`.gemv.scale_shift`); ``None``: only the batched backend
        folds these scales.
    backend : Backend, optional
        A backend the caller forces: then only its tiling is chosen (the tuned one when the
        cache's winner is that backend, else that backend's analytic table).
    n_experts : int, optional
        The layer's expert count (default: the weights'); an expert-parallel shard passes the
        whole layer's, so that it picks what one GPU picks.

    Returns
    -------
    (Backend, config)
        A :class:`.config.GemvConfig` for the GEMV, a :class:`.gemm.GemmConfig` or
        :class:`.gemm.WgmmaConfig` for the GEMM, ``None`` for the batched backend.
    """
    gated = isinstance(weights, PreparedFc1)
    w = weights.gate if isinstance(weights, PreparedFc1) else weights.down
    experts = w.n_experts if n_experts is None else n_experts
    if backend is Backend.BATCHED or (backend is None and shift is None):
        return Backend.BATCHED, None
    if rows <= 0 or w.n == 0:  # nothing to launch: the backends return at once
        return backend or Backend.GEMV, None
    chosen: Backend = backend or Backend.GEMV
    tiling: GemmConfig | WgmmaConfig | None = None
    if weights.layout is WeightLayout.SPLIT:  # the grouped GEMM reads no other layout
        op = "fc1" if gated else "fc2"
        tuned = tuned_choice(
            device_name=device_name(),
            op=op,
            fmt=w.format,
            dtype=dtype,
            n=w.n,
            k=w.k,
            n_experts=experts,
            rows=rows,
        )
        if tuned is not None and backend in (None, tuned[0]):
            chosen, tiling = tuned
        else:
            chosen, tiling = analytic_choice(
                op=op,
                n=w.n,
                k=w.k,
                n_experts=experts,
                rows=rows,
                fmt_code=w.format.code,
                backend=backend,
            )
    if chosen is Backend.GEMV:
        return chosen, gemv_default_config(
            w, rows, dtype, gated=gated, layout=weights.layout, n_experts=experts
        )
    return chosen, tiling
