# SPDX-License-Identifier: Apache-2.0
"""Long run: many graph replays of a layer stack; memory must not grow, results must not change.

Usage (GPU machine, repository root)::

    PYTHONPATH=. python3 scripts/soak.py [--replays 100000] [--layers 8] [--tokens 4]

Prints GPU memory in use (device-wide, cudaMemGetInfo), CuPy pool bytes and host RSS before and
after, and the number of replays whose output differed bitwise from the first one (checked every
``--check-every`` replays). Exit status 1 on any change or growth.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import time

import cupy
import ml_dtypes
import numpy as np

import cupymoe as cm
from cupymoe.presets import PRESETS, random_layer


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _gpu_used() -> int:
    free, total = cupy.cuda.runtime.memGetInfo()
    return int(total - free)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replays", type=int, default=100_000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--check-every", type=int, default=1000)
    parser.add_argument(
        "--warmup",
        type=int,
        default=2000,
        help="replays (in the same launch pattern) before the 'before' snapshot: the driver grows "
        "its host-side launch queue once, the first time that many launches are in flight",
    )
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    shape = dataclasses.replace(PRESETS["qwen3.6-35b-a3b"], n_experts=args.experts)
    layers = [
        cm.MoELayer(**random_layer(shape, rng, max_tokens=args.tokens)) for _ in range(args.layers)
    ]
    x = cupy.asarray(rng.standard_normal((args.tokens, shape.hidden)).astype(ml_dtypes.bfloat16))
    logits = [
        cupy.asarray(rng.standard_normal((args.tokens, shape.n_experts)).astype(np.float32))
        for _ in layers
    ]
    graph = cm.record_graph(layers, args.tokens, x.dtype, inputs=(x, logits))
    graph.replay()
    graph.stream.synchronize()
    first = graph.out.copy()
    digest = hashlib.sha256(first.get().tobytes()).hexdigest()[:16]
    pool = cupy.get_default_memory_pool()

    def run(replays: int) -> int:
        differs = 0
        for i in range(1, replays + 1):
            graph.replay()
            if i % args.check_every == 0:
                graph.stream.synchronize()
                same = (graph.out.view(cupy.uint16) == first.view(cupy.uint16)).all()
                differs += int(not bool(same))
        graph.stream.synchronize()
        return differs

    warm_rss = _rss_bytes()
    differs = run(args.warmup)
    before = (_gpu_used(), pool.used_bytes(), pool.total_bytes(), _rss_bytes())
    t0 = time.perf_counter()
    half = args.replays // 2
    differs += run(half)
    mid_rss = _rss_bytes()
    differs += run(args.replays - half)
    seconds = time.perf_counter() - t0
    after = (_gpu_used(), pool.used_bytes(), pool.total_bytes(), _rss_bytes())
    names = ("GPU in use", "CuPy pool used", "CuPy pool held", "host RSS")
    print(
        f"{args.replays} replays of {args.layers} layers x {args.tokens} tokens in "
        f"{seconds:.1f} s ({seconds / args.replays * 1e6:.1f} us per replay); "
        f"output sha256 {digest}"
    )
    grew = False
    for name, b, a in zip(names, before, after, strict=True):
        # Host RSS may move by a page or two from the interpreter; allow 1 MiB there, 0 on the GPU.
        limit = (1 << 20) if name == "host RSS" else 0
        flag = "GREW" if a - b > limit else "ok"
        grew |= flag == "GREW"
        print(f"  {name:<15} before {b / 2**20:10.2f} MiB  after {a / 2**20:10.2f} MiB  {flag}")
    print(
        f"  host RSS over the {args.warmup} warm-up replays {warm_rss / 2**20:.2f} -> "
        f"{before[3] / 2**20:.2f} MiB; at the halfway point {mid_rss / 2**20:.2f} MiB"
    )
    checks = (args.warmup + args.replays) // args.check_every
    print(f"  outputs checked {checks} times, {differs} differed from the first replay")
    return 1 if grew or differs else 0


if __name__ == "__main__":
    sys.exit(main())
