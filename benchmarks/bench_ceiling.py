# SPDX-License-Identifier: Apache-2.0
"""The GEMV benchmark's read ceiling: a streaming read of the same bytes, launched the same way.

Run on a GPU from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_ceiling.py [--gemv-json benchmarks/h200_gemv.json]
        [--tokens 1,4] [--repeats 20] [--json results.json]

For every graph row of a ``bench_gemv.py`` JSON (preset, M) and each of FC1 and FC2, a plain
kernel reads that row's distinct bytes (``fc1_mb`` / ``fc2_mb``: codes, block scales and global
scales of the active experts) as 16-byte loads, ``U`` in flight per thread, and XORs them. L such
launches on distinct buffers (L x bytes over 4x the 60 MB L2, so every launch reads HBM) are
captured into one CUDA graph of ordinary launches, as ``bench_gemv.py`` captures its GEMVs; the
median replay over L is the time of one launch, launch gap included. Each size takes the best of
U in {2, 4}, 256 or 1024 threads and 1, 2, 4 or 8 blocks per SM.

A GEMV reads those bytes and more (the activations) and decodes them, so it cannot be faster than
this read: ``GEMV / ceiling`` is how close a row is, and ``80 % needs`` (the bytes over 80 % of
4.5 TB/s) against the ceiling tells whether that target is reachable at all for a kernel launched
this way.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from typing import Any

L2_BYTES = 60 << 20
FLOOR_TBPS = 4.5
TARGET_FRACTION = 0.8

_SOURCE = r"""
template <int U>
__global__ void read_stream(const uint4* __restrict__ p, long long n16, unsigned* out) {
    unsigned acc = 0;
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (; i + (U - 1) * stride < n16; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                         : "l"(p + i + u * stride));
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n16; i += stride) {
        const uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads; practically never true
}
"""
_UNROLLS = (2, 4)
_THREADS = (256, 1024)
_BLOCKS_PER_SM = (1, 2, 4, 8)


def read_sizes(results: list[dict[str, Any]], tokens: set[int]) -> list[dict[str, Any]]:
    """One entry per (row, GEMV) of ``bench_gemv.py`` results: the graph rows with M in
    ``tokens``, in order, FC1 before FC2."""
    sizes = []
    for r in results:
        if r.get("mode") != "graph" or int(r["tokens"]) not in tokens:
            continue
        for op in ("fc1", "fc2"):
            sizes.append(
                dict(
                    preset=r["preset"],
                    tokens=int(r["tokens"]),
                    op=op.upper(),
                    mb=float(r[f"{op}_mb"]),
                    gemv_us=float(r[f"{op}_us"]),
                )
            )
    return sizes


def launches_for(nbytes: int, pool_bytes: int) -> int:
    """Launches per graph: enough distinct buffers for 4x the L2 (at least 8), as the pool
    allows."""
    if nbytes <= 0 or nbytes > pool_bytes:
        raise ValueError(f"read of {nbytes} bytes: expected 1 .. {pool_bytes}")
    return max(1, min(max(8, math.ceil(4 * L2_BYTES / nbytes)), pool_bytes // nbytes))


def needs_us(mb: float) -> float:
    """µs within which ``mb`` megabytes must be read for 80 % of 4.5 TB/s."""
    return mb / (TARGET_FRACTION * FLOOR_TBPS)


@functools.cache
def _read_kernels() -> dict[int, Any]:
    """``read_stream<U>`` for each U of ``_UNROLLS``, built once per process."""
    import cupy

    module = cupy.RawModule(
        code=_SOURCE,
        options=("-std=c++17",),
        name_expressions=[f"read_stream<{u}>" for u in _UNROLLS],
    )
    return {u: module.get_function(f"read_stream<{u}>") for u in _UNROLLS}


def ceiling_us(nbytes: int, pool: Any, repeats: int) -> tuple[float, str]:
    """(µs per launch, the winning shape) of the best streaming read of ``nbytes``."""
    import cupy

    from cupymoe.bench import capture, median_event_us

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    n16 = nbytes // 16
    count = launches_for(n16 * 16, int(pool.nbytes))
    views = [pool[j * n16 * 4 : (j + 1) * n16 * 4] for j in range(count)]
    out = cupy.zeros(1, dtype=cupy.uint32)
    stream = cupy.cuda.Stream(non_blocking=True)
    best = (math.inf, "")
    for u, kernel in _read_kernels().items():
        for threads in _THREADS:
            for per_sm in _BLOCKS_PER_SM:
                if threads * per_sm > 2048:
                    continue
                blocks = sms * per_sm

                def run(kernel: Any = kernel, threads: int = threads, blocks: int = blocks) -> None:
                    for v in views:
                        kernel((blocks,), (threads,), (v, cupy.int64(n16), out), stream=stream)

                replay = functools.partial(capture(run, stream).launch, stream)
                us = median_event_us(replay, stream, repeats=repeats)
                if us / count < best[0]:
                    best = (us / count, f"U {u}, {threads} x {blocks}")
    return best


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as one markdown table."""
    lines = [
        "| preset | M | GEMV | MB | ceiling µs | ceiling % of 4.5 TB/s | GEMV µs "
        "| GEMV / ceiling | 80 % needs µs | reachable |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['tokens']} | {r['op']} | {r['mb']:.2f} | {r['ceiling_us']:.2f} "
            f"| {100 * r['mb'] / r['ceiling_us'] / FLOOR_TBPS:.0f} % | {r['gemv_us']:.2f} "
            f"| {100 * r['ceiling_us'] / r['gemv_us']:.0f} % | {r['needs_us']:.2f} "
            f"| {'yes' if r['needs_us'] >= r['ceiling_us'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gemv-json", default="benchmarks/h200_gemv.json")
    parser.add_argument("--tokens", default="1,4", help="the M of the rows to read")
    parser.add_argument("--repeats", type=int, default=20, help="timed replays (median)")
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    args = parser.parse_args(argv)
    with open(args.gemv_json, encoding="utf-8") as f:
        gemv = json.load(f)
    sizes = read_sizes(gemv["results"], {int(t) for t in args.tokens.split(",")})
    if not sizes:
        parser.error(f"{args.gemv_json}: no graph rows with M in {args.tokens}")

    import cupy

    pool = cupy.ones(int(1.2e9) // 4, dtype=cupy.uint32)
    cache: dict[int, tuple[float, str]] = {}
    rows = []
    for s in sizes:
        nbytes = int(s["mb"] * 1e6)
        if nbytes not in cache:
            cache[nbytes] = ceiling_us(nbytes, pool, args.repeats)
        us, shape = cache[nbytes]
        rows.append(dict(s, ceiling_us=us, shape=shape, needs_us=needs_us(s["mb"])))
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(markdown(rows))
    if args.json_path:
        from cupymoe.bench import device_name

        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "command": " ".join(["benchmarks/bench_ceiling.py", *(argv or sys.argv[1:])]),
                    "device": device_name(),
                    "gemv_json": args.gemv_json,
                    "floor_tbps": FLOOR_TBPS,
                    "results": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
