# SPDX-License-Identifier: Apache-2.0
"""Host time of eager ``MoELayer`` calls: back to back, one call + sync, NumPy in/out, profile.

Run on a GPU from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_eager.py [--preset NAME ...] [--tokens 1,4,8]
        [--calls 2000] [--profile] [--json results.json]

Per preset (one layer, random weights drawn on the GPU) and token count M, µs per call of:

* ``b2b``: ``out = layer(x, logits)`` with CuPy arrays, ``--calls`` calls back to back, then one
  device sync: the issue's figure, the host time per call when the host is the bottleneck (as
  at decode sizes), else the GPU's. Each result is dropped before the next call, so the pool
  usually hands out the same block and the calls run in place (``in_place`` says whether);
* ``b2b_out``: the same with ``out=`` (no allocation; in place after a few calls);
* ``host_out``: the host side of ``b2b_out`` alone (the loop without its final sync);
* ``copies``: back to back with ``out=`` and ``x`` taken in turn from 16 buffers, so that no
  call runs in place: two input copies, the graph, one output copy (a caller whose buffers
  change every call);
* ``latency``: one call, then a sync; the median over ``--calls // 10`` calls;
* ``numpy``: NumPy in and NumPy out (two host-to-device copies, the replay, one copy back);
* ``direct``: back to back with ``replay=False`` (the four stages launched one by one);
* ``gpu``: the layer's CUDA graph alone (``MoELayer.graph``), 200 replays between two CUDA
  events, per replay; one layer, so its weights stay in the L2: ``cupymoe bench`` has the
  HBM-bound time;
* ``gpu_call`` / ``gpu_call_copies``: the GPU time of an eager call (``b2b_out``'s calls, in
  place; ``copies``' calls, copies included): 64 calls queued behind a spinning kernel, then
  timed between events, so the host's pace does not enter (``gpu_call_valid``: the host had
  queued them all before the spin ended).

``--profile`` runs cProfile over ``--calls`` back-to-back calls of each preset's first token
count, in place (``out=``) and with copies (``x`` in turn), and prints the share of host time in
Python functions against the C calls (CuPy's Cython runtime wrappers, the CUDA driver), with the
entries that take most of each. cProfile inflates the Python side (a hook per Python call), so
it also gives the wall time without the profiler and the Python time that leaves (wall minus the
profiled C time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import cupy
import ml_dtypes
import numpy as np

from cupymoe import MoELayer
from cupymoe.bench import device_name
from cupymoe.presets import PRESETS, random_layer_gpu

BF16 = ml_dtypes.bfloat16
COLUMNS = (
    "b2b",
    "b2b_out",
    "host_out",
    "copies",
    "latency",
    "numpy",
    "direct",
    "gpu",
    "gpu_call",
    "gpu_call_copies",
)
HEADER = (
    "b2b",
    "b2b out=",
    "host out=",
    "copies",
    "call+sync",
    "NumPy in/out",
    "replay=False",
    "GPU graph",
    "GPU call",
    "GPU call copies",
)
_ROTATE = 16  # x buffers taken in turn by the copies column: more than an in-place graph follows

# Benchmark-only: holds the stream while the host queues calls behind it (gpu_call)
_SPIN = cupy.RawKernel(
    r"""extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}""",
    "spin",
)
_SPIN_CYCLES = np.int64(60_000_000)  # 30-60 ms at 1-2 GHz: 64 calls at 100 µs of host time fit


def _sync() -> None:
    cupy.cuda.Device().synchronize()


def _back_to_back_us(call: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(µs per call back to back with one sync at the end, µs per call of the host alone)."""
    for _ in range(20):  # records the graph, binds the buffers, fills the pool
        call()
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    queued = time.perf_counter()
    _sync()
    end = time.perf_counter()
    return (end - start) / calls * 1e6, (queued - start) / calls * 1e6


def _latency_us(call: Callable[[], Any], calls: int) -> float:
    call()
    _sync()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        _sync()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def _numpy_us(call: Callable[[], Any], calls: int) -> float:
    for _ in range(5):
        call()
    start = time.perf_counter()
    for _ in range(calls):
        call()  # returns with the result on the host: synchronised
    return (time.perf_counter() - start) / calls * 1e6


def _graph_us(layer: MoELayer, xd: Any, ld: Any, replays: int = 200) -> float:
    """GPU µs per replay of the layer's graph: ``replays`` launches between two events, the
    median of five such loops."""
    graph = layer.graph(int(xd.shape[0]), dtype=xd.dtype)
    stream = graph.stream
    with stream:
        graph.x[...] = xd
        graph.logits[0][...] = ld
        for _ in range(10):
            graph.replay()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        samples = []
        for _ in range(5):
            start.record(stream)
            for _ in range(replays):
                graph.replay()
            stop.record(stream)
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / replays)
    return statistics.median(samples)


def _gpu_call_us(call: Callable[[], Any], calls: int = 64) -> tuple[float, bool]:
    """GPU µs per call of ``calls`` calls queued behind a spinning kernel on the current stream,
    and whether the host had queued them all before the spin ended."""
    stream = cupy.cuda.get_current_stream()
    for _ in range(5):
        call()
    _sync()
    before, start, stop = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
    before.record(stream)
    _SPIN((1,), (1,), (_SPIN_CYCLES,))
    start.record(stream)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    queued_ms = (time.perf_counter() - t0) * 1e3
    stop.record(stream)
    stop.synchronize()
    spin_ms = cupy.cuda.get_elapsed_time(before, start)
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls, spin_ms > queued_ms


def _bound(layer: MoELayer, xd: Any) -> dict[tuple[int, int, int], Any]:
    """The in-place graphs the layer holds for ``xd``'s token count on the current stream, by
    ``(x, logits, out)`` address."""
    graphs = layer._graphs
    key = (cupy.cuda.get_current_stream().ptr, xd.size)
    replay = None if graphs is None else graphs.last.get(key)
    return {} if replay is None else dict(replay.bound)


def _calls(layer: MoELayer, m: int, seed: int) -> dict[str, Any]:
    """The inputs and the calls every column times."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, layer.hidden)).astype(BF16)
    logits = rng.standard_normal((m, layer.n_experts)).astype(np.float32)
    xd, ld = cupy.asarray(x), cupy.asarray(logits)
    out = cupy.empty((m, layer.hidden), BF16)
    host_out = np.empty((m, layer.hidden), BF16)
    xs = itertools.cycle([xd.copy() for _ in range(_ROTATE)])
    return {
        "x": x,
        "logits": logits,
        "xd": xd,
        "addresses": (xd.data.ptr, ld.data.ptr, out.data.ptr),  # of b2b_out's calls
        "b2b": lambda: layer(xd, ld),
        "b2b_out": lambda: layer(xd, ld, out=out),
        "copies": lambda: layer(next(xs), ld, out=out),
        "numpy": lambda: layer(x, logits, out=host_out),
        "direct": lambda: layer(xd, ld, out=out, replay=False),
    }


def measure(layer: MoELayer, m: int, calls: int, seed: int) -> dict[str, Any]:
    """Every column of the table for ``layer`` at ``m`` tokens (µs)."""
    c = _calls(layer, m, seed)
    row: dict[str, Any] = {}
    row["b2b"], _ = _back_to_back_us(c["b2b"], calls)
    in_place_b2b = bool(_bound(layer, c["xd"]))  # the pool's block of the dropped results
    row["b2b_out"], row["host_out"] = _back_to_back_us(c["b2b_out"], calls)
    row["in_place"] = {"b2b": in_place_b2b, "b2b_out": c["addresses"] in _bound(layer, c["xd"])}
    row["copies"], _ = _back_to_back_us(c["copies"], calls)
    row["latency"] = _latency_us(c["b2b_out"], max(10, calls // 10))
    row["numpy"] = _numpy_us(c["numpy"], max(50, calls // 4))
    row["direct"], _ = _back_to_back_us(c["direct"], max(50, calls // 10))
    row["gpu"] = _graph_us(layer, c["xd"], cupy.asarray(c["logits"]))
    row["gpu_call"], valid = _gpu_call_us(c["b2b_out"])
    row["gpu_call_copies"], valid_copies = _gpu_call_us(c["copies"])
    row["gpu_call_valid"] = valid and valid_copies
    return row


# C entries that are CuPy / CUDA calls (the rest are builtins: dict.get, len, ...)
_RUNTIME_WORDS = ("cupy", "cuda", "memcpy", "graphLaunch", "Capturing", "stream", "ndarray")


def _split(stats: pstats.Stats, calls: int, top: int) -> dict[str, Any]:
    """µs per call in Python functions and in C entries (of which CuPy / CUDA calls), by
    tottime, with the ``top`` entries of each."""
    rows = stats.stats  # type: ignore[attr-defined]
    python: dict[str, float] = {}
    native: dict[str, float] = {}
    for (file, line, name), r in rows.items():
        if file == "~":  # built-ins and extension functions (C): CuPy's runtime calls among them
            native[name] = native.get(name, 0.0) + r[2]
        else:
            python[f"{file.rsplit('/', 1)[-1]}:{line}({name})"] = r[2]
    py, c = sum(python.values()), sum(native.values())
    runtime = sum(v for k, v in native.items() if any(w in k for w in _RUNTIME_WORDS))

    def per_call(d: dict[str, float]) -> dict[str, float]:
        return {k: v / calls * 1e6 for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]}

    return {
        "python_us": py / calls * 1e6,
        "c_us": c / calls * 1e6,
        "cupy_runtime_us": runtime / calls * 1e6,
        "python_share": py / (py + c) if py + c else 0.0,
        "top_python_us": per_call(python),
        "top_c_us": per_call(native),
    }


def profile(layer: MoELayer, m: int, calls: int, top: int = 10) -> dict[str, Any]:
    """cProfile of ``calls`` back-to-back CuPy calls, in place and with copies: µs per call in
    Python functions and in C calls (tottime), the entries that take most, and the wall time
    without the profiler."""
    c = _calls(layer, m, seed=0)
    result: dict[str, Any] = {}
    for label in ("b2b_out", "copies"):
        call = c[label]
        wall, host = _back_to_back_us(call, calls)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            call()
        prof.disable()
        _sync()
        split = _split(pstats.Stats(prof), calls, top)
        result[label] = {
            "wall_us": wall,
            "host_us": host,
            "python_us_estimate": max(0.0, host - split["c_us"]),
            **split,
        }
    return result


def _print_profile(name: str, m: int, prof: dict[str, Any]) -> None:
    for label, p in prof.items():
        print(
            f"\nprofile {name} M={m} {label}: {p['wall_us']:.1f} µs per call back to back "
            f"({p['host_us']:.1f} µs of host time); under cProfile {p['python_us']:.1f} µs in "
            f"Python functions, {p['c_us']:.1f} µs in C calls ({p['cupy_runtime_us']:.1f} in "
            f"CuPy / CUDA; {100 * p['python_share']:.0f} % Python); without the profiler Python "
            f"is about {p['python_us_estimate']:.1f} µs (host time minus the C calls)",
            file=sys.stderr,
        )
        for kind in ("top_python_us", "top_c_us"):
            for entry, us in p[kind].items():
                print(f"  {us:7.2f} µs  {entry}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS))
    parser.add_argument("--tokens", default="1,4,8")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    presets = args.preset or ["qwen3.6-35b-a3b", "gpt-oss-20b", "deepseek-v3"]
    results: list[dict[str, Any]] = []
    print(f"{device_name()}, bf16 activations, fp32 logits, µs per call", file=sys.stderr)
    print("| preset | M | " + " | ".join(HEADER) + " | in place |\n|" + "---|" * (len(HEADER) + 3))
    for name in presets:
        print(f"... {name}: drawing weights on the GPU", file=sys.stderr)
        shape = PRESETS[name]
        kw = random_layer_gpu(shape, np.random.default_rng(1), seed=10, max_tokens=max(tokens))
        layer = MoELayer(**kw)
        for m in tokens:
            row = measure(layer, m, args.calls, seed=m)
            results.append({"preset": name, "tokens": m, **row})
            cells = " | ".join(f"{row[c]:.1f}" for c in COLUMNS)
            flags = "/".join("y" if row["in_place"][k] else "n" for k in ("b2b", "b2b_out"))
            if not row["gpu_call_valid"]:
                flags += " (GPU call: host was late)"
            print(f"| {name} | {m} | {cells} | {flags} |", flush=True)
        if args.profile:
            prof = profile(layer, tokens[0], args.calls)
            results.append({"preset": name, "tokens": tokens[0], "profile": prof})
            _print_profile(name, tokens[0], prof)
        del layer, kw
        gc.collect()  # the layer and its graphs refer to each other
        cupy.get_default_memory_pool().free_all_blocks()
        if args.json_path:  # after each preset: a run stopped by a time limit keeps the others
            document = {"gpu": device_name(), "command": " ".join(sys.argv), "results": results}
            with open(args.json_path, "w", encoding="utf-8") as f:
                json.dump(document, f, indent=1)


if __name__ == "__main__":
    main()
