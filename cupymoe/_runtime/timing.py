# SPDX-License-Identifier: Apache-2.0
"""GPU timing used by ``bench``, ``tune`` and ``MoELayer.stage_times``: CUDA events around
launches on one stream, warm-up first, the median of the samples."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from .backend import require_cupy

__all__ = ["capture", "median_event_us"]


def median_event_us(
    launch: Callable[[], Any], stream: Any, *, repeats: int, warmup: int = 3
) -> float:
    """Median microseconds of ``launch()`` on ``stream``, timed by CUDA events."""
    cupy = require_cupy()
    with stream:
        for _ in range(warmup):
            launch()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        samples = []
        for _ in range(repeats):
            start.record(stream)
            launch()
            stop.record(stream)
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    return statistics.median(samples)


def capture(fn: Callable[[], Any], stream: Any) -> Any:
    """Run ``fn`` once eagerly on ``stream`` (compiles and loads its kernels), then record it
    into a CUDA graph; returns the graph (replay with ``graph.launch(stream)``)."""
    cupy = require_cupy()
    cupy.cuda.Device().synchronize()  # inputs made on other streams are ready
    with stream:
        fn()
        stream.synchronize()
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph
