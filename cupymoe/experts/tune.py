# SPDX-License-Identifier: Apache-2.0
"""Optional GEMV autotuning: profile every tiling, keep the fastest in the tuning cache.

The top of the ``experts`` layer: nothing in the package imports it but the CLI. The cache it
writes (:mod:`.cache`) is read by ``GemvConfig.for_problem`` through :func:`.config.lookup_tuned`.
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
from .._runtime.device import device_name
from .._runtime.timing import capture, median_event_us
from ..formats import Fp4Format, random_fp4_gpu
from ..routing import random_routing
from . import dispatch
from .activation import Activation, ActivationSpec
from .cache import BUCKETS, cache_key, dtype_name, row_bucket, store_results
from .config import GemvConfig
from .gemv import prepare_fc1, prepare_fc2
from .layouts import WeightLayout

__all__ = ["count_trials", "tune_gemv"]

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
        for bucket in buckets:
            top_k = min(8, bucket, n_experts)
            while bucket % top_k:
                top_k -= 1
            n_tokens = bucket // top_k
            # Calls (cycling over the sets) until they read l2_defeat_bytes: with many experts
            # one set holds the whole budget, and a single routing of it would re-read the same
            # few active experts from the L2 (Qwen FC1 at 32 rows: 256 experts, 1 set).
            active_bytes = min(bucket, n_experts) * expert_bytes
            n_calls = max(n_sets, min(64, -(-l2_defeat_bytes // active_bytes)))
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
