# SPDX-License-Identifier: Apache-2.0
"""Optional autotuning: profile every tiling, keep the fastest in the tuning cache.

:func:`tune_gemv` times the GEMV tilings per expanded-row bucket; :func:`tune_gemm` times, per
bucket of rows per active expert, the GEMV against every grouped-GEMM tiling that runs on the
device, which places the GEMV/GEMM hand-over and the GEMM's tiling by measurement. The top of
the ``experts`` layer: nothing in the package imports it but the CLI. The cache it writes
(:mod:`.cache`) is read by ``GemvConfig.for_problem`` (:func:`.config.lookup_tuned`) and by
:func:`.handover.choose` (:func:`.handover.tuned_choice`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from .._runtime.backend import require_cupy
from .._runtime.device import device_name, max_shared_per_block
from .._runtime.timing import capture, median_event_us
from ..formats import Fp4Format, random_fp4_gpu
from ..routing import random_routing
from . import dispatch, handover
from .activation import Activation, ActivationSpec
from .cache import (
    BUCKETS,
    ROWS_PER_EXPERT_BUCKETS,
    cache_key,
    dtype_name,
    gemm_cache_key,
    row_bucket,
    rows_per_expert_bucket,
    store_results,
)
from .config import GemvConfig
from .gemm import GEMM_TILINGS, WGMMA_TILINGS, GemmConfig, WgmmaConfig, wgmma_enabled
from .gemv import default_config as gemv_default_config
from .gemv import prepare_fc1, prepare_fc2
from .layouts import WeightLayout

__all__ = [
    "GEMM_TUNE_BUCKETS",
    "candidate_label",
    "count_gemm_trials",
    "count_trials",
    "gemm_candidates",
    "gemm_table",
    "tune_gemm",
    "tune_gemv",
]

#: Rows per active expert :func:`tune_gemm` times by default: 1 to 512, both hand-overs of the
#: analytic rule (8 and 64) with two buckets either side, up to a 4,096-token prefill of gpt-oss
#: (32 experts, top-4) and 16,384 tokens of Qwen3.6 / DeepSeek-V3 (256 experts, top-8).
GEMM_TUNE_BUCKETS: tuple[int, ...] = ROWS_PER_EXPERT_BUCKETS[:10]

#: ``progress(done, total, label)``: called with ``done = 0`` first, then after each trial.
ProgressFn = Callable[[int, int, str], None]


# ---- profiling ---------------------------------------------------------------------------------
def count_trials(shapes: Sequence[tuple[int, int]], *, rows_list: Iterable[int]) -> int:
    """Number of (shape, bucket, candidate) timings :func:`tune_gemv` will run."""
    buckets = sorted({row_bucket(r) for r in rows_list})
    return len(GemvConfig.candidates()) * len(buckets) * len(shapes)


def _time_graph(calls: Callable[[], None], n_calls: int, *, warmup: int, repeats: int) -> float:
    """Median µs per call of ``calls`` (``n_calls`` GEMVs) captured into one CUDA graph."""
    stream = require_cupy().cuda.Stream(non_blocking=True)
    graph = capture(calls, stream)
    launch = functools.partial(graph.launch, stream)
    return median_event_us(launch, stream, repeats=repeats, warmup=warmup) / n_calls


def _weight_sets(
    op: str,
    n: int,
    k: int,
    fmt: Fp4Format,
    n_experts: int,
    layout: WeightLayout,
    l2_defeat_bytes: int,
    seed: int,
) -> tuple[list[Any], int]:
    """Random prepared weight sets (FC1: gate and up ``[E, n, k]``; FC2: one ``[E, n, k]``),
    enough of them to hold ``l2_defeat_bytes`` (at most 64), and the bytes of one expert."""
    mats = 2 if op == "fc1" else 1
    expert_bytes = mats * n * (k // 2 + k // fmt.block_size)
    n_sets = max(1, min(64, -(-l2_defeat_bytes // (n_experts * expert_bytes))))
    sets = []
    for s in range(n_sets):
        weights = [
            random_fp4_gpu(n_experts, n, k, fmt, seed=seed + 7919 * s + m) for m in range(mats)
        ]
        sets.append(
            prepare_fc1(*weights, layout=layout)
            if op == "fc1"
            else prepare_fc2(*weights, layout=layout)
        )
    return sets, expert_bytes


def _call_count(n_sets: int, active_bytes: int, l2_defeat_bytes: int) -> int:
    """Calls one graph makes (cycling over the sets) until they read ``l2_defeat_bytes``: with
    many experts one set holds the whole budget, and a single routing of it would re-read the
    same few active experts from the L2 (Qwen FC1 at 32 rows: 256 experts, 1 set)."""
    return max(n_sets, min(64, -(-l2_defeat_bytes // active_bytes)))


def _run_sets(
    op: str, x: Any, sets: list[Any], routings: list[Any], out: Any, act: Any, config: Any
) -> None:
    """One GEMV per weight set (FC1 with ``act`` or FC2), all into ``out``."""
    for weights, routing in zip(sets, routings, strict=True):
        if op == "fc1":
            dispatch.fc1(x, weights, routing, act=act, out=out, config=config)
        else:
            dispatch.fc2(x, weights, routing, out=out, config=config)


def tune_gemv(
    shapes: Sequence[tuple[int, int]],
    *,
    fmt: Any,
    dtype: Any = ml_dtypes.bfloat16,
    rows_list: Iterable[int] = BUCKETS,
    op: str = "fc2",
    layout: WeightLayout | str = WeightLayout.SPLIT,
    n_experts: int = 32,
    warmup: int = 3,
    repeats: int = 20,
    l2_defeat_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
    path: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Profile every ``GemvConfig.candidates`` tiling per shape and row bucket; store the winners.

    Parameters
    ----------
    shapes : list of (n, k)
        GEMV shapes: output rows N and reduction length K (``op="fc2"``: the down projection
        ``[E, N, K]``; ``op="fc1"``: gate and up, each ``[E, N, K]``, with SwiGLU).
    fmt : Fp4Format or str
    dtype : dtype
        Activation dtype (bfloat16 or float16).
    rows_list : iterable of int
        Expanded-row counts; each maps to its :func:`row_bucket` and is profiled at the bucket.
    op : {"fc2", "fc1"}
        Which GEMV runs the candidates.
    layout : WeightLayout or str
        The weight layout timed: SPLIT (the GEMV's own copy, the default of ``prepare_fc1`` /
        ``prepare_fc2``), or the uploaded bytes in the PAIR or PLAIN nibble order.
    n_experts : int
        Experts per weight set (rows are routed to random distinct experts, top-k <= 8).
    warmup, repeats : int
        Graph replays before timing, and timed replays (the median is kept).
    l2_defeat_bytes : int
        Weight bytes one graph reads, so that the weights come from HBM rather than the 60 MB
        L2: enough weight sets to hold them, and enough calls, each routed to its own random
        experts, to read them (a call reads only its active experts).
    progress : callable, optional
        ``progress(done, total, label)``; ``done = 0`` first (the total for a progress bar).
    path : path, optional
        Cache file (default :func:`.cache.cache_path`).
    seed : int
        Seed of the random weights, activations and routing.

    Returns
    -------
    dict
        ``key -> {"config": {...}, "us": float, "op": str, "candidates": {label: us}}`` for every
        (shape, bucket); also merged into the cache file.

    Notes
    -----
    Each candidate is timed as a CUDA graph of GEMV calls rotating over the weight sets and
    routings (graph replay, no host launch cost), with CUDA events; µs per call is the median
    over ``repeats``.
    """
    cupy = require_cupy()
    fmt = Fp4Format.parse(fmt, "fmt")
    act_dtype = np.dtype(dtype_name(dtype))
    if op not in ("fc1", "fc2"):
        raise ValueError(f"op: expected 'fc1' or 'fc2', got {op!r}")
    layout = WeightLayout.parse(layout)
    buckets = sorted({row_bucket(r) for r in rows_list})
    total = count_trials(shapes, rows_list=buckets)
    done = 0
    if progress is not None:
        progress(0, total, "starting")
    name = device_name()
    rng = np.random.default_rng(seed)
    results: dict[str, dict[str, Any]] = {}
    for n, k in shapes:
        sets, expert_bytes = _weight_sets(op, n, k, fmt, n_experts, layout, l2_defeat_bytes, seed)
        n_sets = len(sets)
        for bucket in buckets:
            top_k = min(8, bucket, n_experts)
            while bucket % top_k:
                top_k -= 1
            n_tokens = bucket // top_k
            n_calls = _call_count(n_sets, min(bucket, n_experts) * expert_bytes, l2_defeat_bytes)
            call_sets = [sets[i % n_sets] for i in range(n_calls)]
            routings = [random_routing(rng, n_tokens, top_k, n_experts) for _ in range(n_calls)]
            shape_in = (n_tokens, k) if op == "fc1" else (bucket, k)
            x = cupy.asarray(rng.standard_normal(shape_in).astype(act_dtype))
            out = cupy.empty((bucket, n), dtype=act_dtype)
            act = ActivationSpec(Activation.SWIGLU)
            timings: dict[str, float] = {}
            best: tuple[float, Any] | None = None
            for config in GemvConfig.candidates():
                calls = functools.partial(_run_sets, op, x, call_sets, routings, out, act, config)
                us = _time_graph(calls, n_calls, warmup=warmup, repeats=repeats)
                timings[repr(config)] = us
                if best is None or us < best[0]:
                    best = (us, config)
                done += 1
                if progress is not None:
                    progress(done, total, f"N={n} K={k} rows={bucket}")
            if best is None:
                continue
            key = cache_key(
                device_name=name,
                fmt=fmt,
                dtype=act_dtype,
                n=n,
                k=k,
                rows=bucket,
                op=op,
                layout=layout,
            )
            results[key] = {
                "config": dataclasses.asdict(best[1]),
                "us": round(best[0], 3),
                "op": op,
                "layout": layout.key,
                "candidates": {label: round(t, 3) for label, t in timings.items()},
            }
    store_results(results, path)
    return results


# ---- the expert backends: GEMV against the grouped-GEMM tilings ---------------------------------
def gemm_candidates(rows: int, n_experts: int, fmt_code: int) -> list[GemmConfig | WgmmaConfig]:
    """Every grouped-GEMM tiling that runs on the current device for ``rows`` expanded rows
    over ``n_experts`` experts: the mma.sync :data:`.gemm.GEMM_TILINGS`, and the
    :data:`.gemm.WGMMA_TILINGS` where :func:`.gemm.wgmma_enabled`, whose shared memory (static,
    and dynamic for ``min(rows, n_experts)`` slots) fits the device's opt-in limit."""
    configs: list[GemmConfig | WgmmaConfig] = [GemmConfig(*t) for t in GEMM_TILINGS]
    if wgmma_enabled():
        configs += [WgmmaConfig(*t) for t in WGMMA_TILINGS]
    slots, limit = min(rows, n_experts), max_shared_per_block()
    return [c for c in configs if c.shared_bytes(fmt_code, slots) + c.static_bytes <= limit]


def candidate_label(config: GemvConfig | GemmConfig | WgmmaConfig) -> str:
    """A candidate's name in an entry's ``candidates``: ``"gemv 16x128"`` (cta_n x threads),
    ``"mma 4x1x2x4x4"`` (warps_m x warps_n x mt x nt x stages), ``"wgmma 128x4x2"`` (bn x stages x
    groups)."""
    if isinstance(config, GemvConfig):
        return f"gemv {config.cta_n}x{config.threads}"
    return f"{_gemm_kind(config)} {'x'.join(map(str, config.key))}"


def _gemm_kind(config: GemmConfig | WgmmaConfig) -> str:
    """The kernel a grouped-GEMM tiling runs: ``"wgmma"`` or ``"mma"`` (the cache's tag)."""
    return "wgmma" if isinstance(config, WgmmaConfig) else "mma"


def _problem_tokens(bucket: int, n_experts: int, top_k: int) -> int:
    """Tokens whose ``tokens * top_k`` expanded rows average ``bucket`` rows per active expert
    (at most ``bucket``, above half of it: the bucket's own entry)."""
    return max(1, bucket * n_experts // top_k)


def count_gemm_trials(
    shapes: Sequence[tuple[int, int]],
    *,
    fmt: Any,
    rows_per_expert: Iterable[float] = GEMM_TUNE_BUCKETS,
    n_experts: int = 32,
    top_k: int = 8,
) -> int:
    """Number of timings :func:`tune_gemm` will run on the current device (the GEMV and every
    fitting GEMM tiling per shape and bucket)."""
    code = Fp4Format.parse(fmt, "fmt").code
    per_shape = 0
    for bucket in sorted({rows_per_expert_bucket(r) for r in rows_per_expert}):
        rows = _problem_tokens(bucket, n_experts, top_k) * top_k
        per_shape += 1 + len(gemm_candidates(rows, n_experts, code))
    return per_shape * len(shapes)


def tune_gemm(
    shapes: Sequence[tuple[int, int]],
    *,
    fmt: Any,
    dtype: Any = ml_dtypes.bfloat16,
    rows_per_expert: Iterable[float] = GEMM_TUNE_BUCKETS,
    op: str = "fc2",
    n_experts: int = 32,
    top_k: int = 8,
    warmup: int = 3,
    repeats: int = 20,
    l2_defeat_bytes: int = 256 << 20,
    progress: ProgressFn | None = None,
    path: str | os.PathLike[str] | None = None,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """Time the GEMV against every grouped-GEMM tiling per shape and bucket of rows per active
    expert; store the winner (backend and tiling) as the ``gemm`` entry of each.

    Parameters
    ----------
    shapes : list of (n, k)
        Expert matrix shapes: N and K (``op="fc1"``: gate and up, each ``[E, N, K]``, with
        SwiGLU; ``op="fc2"``: one ``[E, N, K]``, which also serves FC1 of a non-gated
        activation: the same key, as in the GEMV cache).
    fmt : Fp4Format or str
    dtype : dtype
        Activation dtype (bfloat16 or float16).
    rows_per_expert : iterable of number
        Average expanded rows per active expert; each maps to its
        :func:`.cache.rows_per_expert_bucket` and is timed at the bucket's value, on
        ``bucket * n_experts // top_k`` tokens routed to ``top_k`` distinct random experts.
    op : {"fc2", "fc1"}
    n_experts, top_k : int
        The layer's experts and top-k (the key holds the experts; the routing density and the
        imbalance of random routing come from both).
    warmup, repeats, l2_defeat_bytes, progress, path, seed
        As in :func:`tune_gemv`: graph replays over weight sets and routings that read
        ``l2_defeat_bytes`` of weights per graph (the median of ``repeats``), a
        ``progress(done, total, label)`` callback, the cache file, the seed.

    Returns
    -------
    dict
        ``key -> {"backend": "gemv" | "gemm", "config": {"kind": "mma" | "wgmma", ...} | None,
        "us": float, "op", "n_experts", "top_k", "tokens", "rows_per_expert",
        "candidates": {label: us}}`` (labels: :func:`candidate_label`) for every (shape,
        bucket); also merged into the cache file.

    Notes
    -----
    Candidates: the GEMV with the tiling it gets for that call (:meth:`GemvConfig.for_problem`:
    environment, GEMV cache entry, table; so tune the GEMV first), and every tiling of
    :func:`gemm_candidates`, each run through :func:`.dispatch.fc1` / :func:`.dispatch.fc2`
    with an explicit ``config=``. Only the SPLIT layout is timed: the grouped GEMM reads no
    other. A tiling that cannot be launched here (``ValueError``: its shared memory) is left out.
    """
    cupy = require_cupy()
    fmt = Fp4Format.parse(fmt, "fmt")
    act_dtype = np.dtype(dtype_name(dtype))
    if op not in ("fc1", "fc2"):
        raise ValueError(f"op: expected 'fc1' or 'fc2', got {op!r}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k: expected 1..{n_experts} (n_experts), got {top_k}")
    buckets = sorted({rows_per_expert_bucket(r) for r in rows_per_expert})
    total = count_gemm_trials(
        shapes, fmt=fmt, rows_per_expert=buckets, n_experts=n_experts, top_k=top_k
    )
    done = 0
    if progress is not None:
        progress(0, total, "starting")
    name = device_name()
    rng = np.random.default_rng(seed)
    act = ActivationSpec(Activation.SWIGLU)
    results: dict[str, dict[str, Any]] = {}
    for n, k in shapes:
        sets, expert_bytes = _weight_sets(
            op, n, k, fmt, n_experts, WeightLayout.SPLIT, l2_defeat_bytes, seed
        )
        w = sets[0].gate if op == "fc1" else sets[0].down
        for bucket in buckets:
            n_tokens = _problem_tokens(bucket, n_experts, top_k)
            rows = n_tokens * top_k
            assert rows_per_expert_bucket(handover.rows_per_expert(rows, n_experts)) == bucket
            n_calls = _call_count(len(sets), min(rows, n_experts) * expert_bytes, l2_defeat_bytes)
            call_sets = [sets[i % len(sets)] for i in range(n_calls)]
            routings = [random_routing(rng, n_tokens, top_k, n_experts) for _ in range(n_calls)]
            shape_in = (n_tokens, k) if op == "fc1" else (rows, k)
            x = cupy.asarray(rng.standard_normal(shape_in).astype(act_dtype))
            out = cupy.empty((rows, n), dtype=act_dtype)
            gemv_cfg = gemv_default_config(
                w, rows, act_dtype, gated=op == "fc1", layout=WeightLayout.SPLIT
            )
            candidates: list[GemvConfig | GemmConfig | WgmmaConfig] = [gemv_cfg]
            candidates += gemm_candidates(rows, n_experts, fmt.code)
            timings: dict[str, float] = {}
            best: tuple[float, Any] | None = None
            for config in candidates:
                calls = functools.partial(_run_sets, op, x, call_sets, routings, out, act, config)
                label = f"{op} N={n} K={k} rows/expert={bucket} {candidate_label(config)}"
                try:
                    us = _time_graph(calls, n_calls, warmup=warmup, repeats=repeats)
                except ValueError as error:  # a tiling whose launch does not fit this device
                    if "shared memory" not in str(error):
                        raise
                    us = None
                done += 1
                if progress is not None:
                    progress(done, total, label)
                if us is None:
                    continue
                timings[candidate_label(config)] = us
                if best is None or us < best[0]:
                    best = (us, config)
            if best is None:
                continue
            key = gemm_cache_key(
                device_name=name,
                op=op,
                fmt=fmt,
                dtype=act_dtype,
                n=n,
                k=k,
                n_experts=n_experts,
                rows_per_expert=bucket,
            )
            results[key] = {
                **_stored_choice(best[1]),
                "us": round(best[0], 3),
                "op": op,
                "n_experts": n_experts,
                "top_k": top_k,
                "tokens": n_tokens,
                "rows_per_expert": bucket,
                "candidates": {label: round(t, 3) for label, t in timings.items()},
            }
            del x, out, routings, call_sets
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    store_results(results, path)
    return results


def _stored_choice(config: GemvConfig | GemmConfig | WgmmaConfig) -> dict[str, Any]:
    """The ``backend`` and ``config`` of an entry: no config for the GEMV (its tiling stays the
    GEMV cache's and table's), the fields tagged by kernel for the GEMM."""
    if isinstance(config, GemvConfig):
        return {"backend": "gemv", "config": None}
    return {"backend": "gemm", "config": {"kind": _gemm_kind(config), **dataclasses.asdict(config)}}


def gemm_table(results: dict[str, dict[str, Any]]) -> str:
    """The winners of :func:`tune_gemm` as a text table: one line per shape and bucket, with
    the GEMV's time, the best mma.sync and wgmma times and the winner."""
    head = ("op", "N", "K", "E", "rows/exp", "tokens", "gemv us", "mma us", "wgmma us", "winner")
    lines = [head]
    for key, entry in sorted(results.items(), key=lambda item: _table_order(item[0])):
        parts = key.split("|")
        best: dict[str, float] = {}
        for label, us in entry.get("candidates", {}).items():
            kind = label.split(" ")[0]
            best[kind] = min(us, best.get(kind, float("inf")))
        winner = min(entry.get("candidates", {}).items(), key=lambda item: item[1])[0]
        lines.append(
            (
                parts[2],
                parts[5],
                parts[6],
                parts[7],
                parts[8],
                str(entry.get("tokens", "")),
                *(
                    f"{best[kind]:.1f}" if kind in best else "-"
                    for kind in ("gemv", "mma", "wgmma")
                ),
                winner,
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.rjust(wd) for c, wd in zip(row, widths, strict=True)) for row in lines
    )


def _table_order(key: str) -> tuple[Any, ...]:
    parts = key.split("|")  # device|gemm|op|format|dtype|N|K|E|bucket
    return (
        parts[2],
        parts[3],
        parts[4],
        int(parts[5]),
        int(parts[6]),
        int(parts[7]),
        int(parts[8]),
    )
