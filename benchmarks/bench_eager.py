# SPDX-License-Identifier: Apache-2.0
"""Host time of eager ``MoELayer`` calls: back to back, one call + sync, NumPy in/out, profile.

Run on a GPU from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_eager.py [--preset NAME ...] [--tokens 1,2,4,8]
        [--calls 2000] [--profile] [--json results.json]

Per preset (random weights drawn on the GPU) and token count M, wall-clock µs per call of:

* ``b2b``: ``out = layer(x, logits)`` with CuPy arrays, ``--calls`` calls back to back, then one
  device sync (the host time per call when the host is the bottleneck, as at decode sizes);
* ``b2b out=``: the same with ``out=`` (no allocation);
* ``latency``: one call, then a sync; the median over ``--calls // 10`` calls;
* ``direct``: back to back with ``replay=False`` (the four stages launched one by one: the
  eager path before graph replays);
* ``numpy``: NumPy in and NumPy out (two host-to-device copies, the replay, one copy back);
* ``gpu``: the layer's CUDA graph replayed between CUDA events (``MoELayer.graph``; one layer,
  so its weights stay in the L2: a lower bound of the GPU time, ``cupymoe bench`` has the
  HBM-bound one).

``--profile`` runs cProfile over ``--calls`` back-to-back calls of the first token count and
prints the share of the host time spent in Python-level functions (the rest is in C: CuPy's
Cython, the CUDA driver), with the functions that take most of it.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from typing import Any

import cupy
import ml_dtypes
import numpy as np

from cupymoe import MoELayer
from cupymoe.bench import device_name, median_event_us
from cupymoe.presets import PRESETS, random_layer_gpu

BF16 = ml_dtypes.bfloat16
COLUMNS = ("b2b", "b2b_out", "latency", "direct", "numpy", "gpu")


def _back_to_back_us(call: Any, calls: int) -> float:
    for _ in range(20):  # records the graph, fills the pool
        call()
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _latency_us(call: Any, calls: int) -> float:
    sync = cupy.cuda.Device().synchronize
    call()
    sync()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        sync()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _numpy_us(call: Any, calls: int) -> float:
    for _ in range(5):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()  # returns with the result on the host: synchronised
    return (time.perf_counter() - start) / calls * 1e6


def _gpu_us(layer: MoELayer, xd: Any, ld: Any) -> float:
    graph = layer.graph(int(xd.shape[0]), dtype=xd.dtype)
    with graph.stream:
        graph.x[...] = xd
        graph.logits[0][...] = ld
    return median_event_us(graph.replay, graph.stream, repeats=200, warmup=10)


def measure(layer: MoELayer, m: int, calls: int, seed: int) -> dict[str, float]:
    """Every column of the table for ``layer`` at ``m`` tokens (µs)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, layer.hidden)).astype(BF16)
    logits = rng.standard_normal((m, layer.n_experts)).astype(np.float32)
    xd, ld = cupy.asarray(x), cupy.asarray(logits)
    out = cupy.empty((m, layer.hidden), BF16)
    host_out = np.empty((m, layer.hidden), BF16)
    return {
        "b2b": _back_to_back_us(lambda: layer(xd, ld), calls),
        "b2b_out": _back_to_back_us(lambda: layer(xd, ld, out=out), calls),
        "latency": _latency_us(lambda: layer(xd, ld, out=out), max(10, calls // 10)),
        "direct": _back_to_back_us(
            lambda: layer(xd, ld, out=out, replay=False), max(50, calls // 10)
        ),
        "numpy": _numpy_us(lambda: layer(x, logits, out=host_out), max(50, calls // 4)),
        "gpu": _gpu_us(layer, xd, ld),
    }


def profile(layer: MoELayer, m: int, calls: int) -> dict[str, Any]:
    """cProfile of ``calls`` back-to-back CuPy calls: the share of time in Python functions."""
    xd = cupy.asarray(np.zeros((m, layer.hidden), BF16))
    ld = cupy.asarray(np.random.default_rng(0).standard_normal((m, layer.n_experts)), np.float32)
    for _ in range(20):
        layer(xd, ld)
    cupy.cuda.Device().synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        layer(xd, ld)
    prof.disable()
    cupy.cuda.Device().synchronize()
    stats = pstats.Stats(prof)
    rows = stats.stats  # type: ignore[attr-defined]
    total = sum(r[2] for r in rows.values())  # tottime over every function
    python = {
        f"{file.rsplit('/', 1)[-1]}:{line}({name})": r[2]
        for (file, line, name), r in rows.items()
        if file != "~"  # "~": built-ins and extension functions (C)
    }
    top = sorted(python.items(), key=lambda kv: -kv[1])[:12]
    return {
        "us_per_call": total / calls * 1e6,
        "python_share": sum(python.values()) / total if total else 0.0,
        "top_python_us_per_call": {k: v / calls * 1e6 for k, v in top},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS))
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    presets = args.preset or ["qwen3.6-35b-a3b", "gpt-oss-20b", "deepseek-v3"]
    results: list[dict[str, Any]] = []
    print(f"{device_name()}, bf16 activations, fp32 logits, µs per call", file=sys.stderr)
    print(
        "| preset | M | b2b | b2b out= | call+sync | direct (replay=False) | NumPy in/out "
        "| GPU (graph) |\n|---|---|---|---|---|---|---|---|"
    )
    for name in presets:
        print(f"... {name}: drawing weights on the GPU", file=sys.stderr)
        shape = PRESETS[name]
        kw = random_layer_gpu(shape, np.random.default_rng(1), seed=10, max_tokens=max(tokens))
        layer = MoELayer(**kw)
        for m in tokens:
            row = measure(layer, m, args.calls, seed=m)
            results.append({"preset": name, "tokens": m, **row})
            cells = " | ".join(f"{row[c]:.1f}" for c in COLUMNS)
            print(f"| {name} | {m} | {cells} |", flush=True)
        if args.profile:
            prof = profile(layer, tokens[0], args.calls)
            results.append({"preset": name, "tokens": tokens[0], "profile": prof})
            print(
                f"\nprofile {name} M={tokens[0]}: {prof['us_per_call']:.1f} µs per call under "
                f"cProfile, {100 * prof['python_share']:.0f} % in Python functions",
                file=sys.stderr,
            )
            for label, us in prof["top_python_us_per_call"].items():
                print(f"  {us:7.2f} µs  {label}", file=sys.stderr)
        del layer, kw
        gc.collect()  # the layer and its graphs refer to each other
        cupy.get_default_memory_pool().free_all_blocks()
    if args.json_path:
        document = {"gpu": device_name(), "command": " ".join(sys.argv), "results": results}
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)


if __name__ == "__main__":
    main()
