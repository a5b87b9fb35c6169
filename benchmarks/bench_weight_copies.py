# SPDX-License-Identifier: Apache-2.0
"""How fast the wgmma GEMM's weight pattern streams from HBM by each copy path, without consumers.

Run on an H100 / H200 with CuPy::

    python3 benchmarks/bench_weight_copies.py [--json results.json]

One block per SM, as the GEMM: 4 producer warps fill a ring of 16 KB stages, 4 more warps wait on
each stage's ``full`` mbarrier and release it unread. A stage is what a block tile of 16 m-tiles
(two matrices, FC1's gate and up) takes per 128 codes of K: in the resident split layout, 32
pieces of 512 contiguous bytes, one per m-tile and matrix, the m-tiles a whole K range apart.
The paths: 16-byte ``cp.async`` from every producer thread (``cp.async.mbarrier.arrive``), 32
``cp.async.bulk`` copies of 512 B from one thread, and, over a stage-contiguous layout of the
same bytes, two bulk copies of 8 KB or ``cp.async``. The weights are random bytes of the presets'
FC1 shapes (a reduced expert count for DeepSeek-V3), read once per launch, median of 15 launches.
The GEMM itself issues one TMA box per matrix (docs/kernels.md, tenth round, compares).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    with open(os.path.join(HERE, "bench_weight_copies.cu")) as f:
        source = f.read()
    k = cp.RawModule(code=source, options=("-std=c++17", "-arch=sm_90a")).get_function("probe")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    res = []
    for name, E, n, K in (
        ("qwen_fc1", 256, 512, 2048),
        ("gptoss_fc1", 32, 2880, 2880),
        ("dsv3_fc1", 64, 2048, 7168),
    ):
        mtiles = ((n + 7) // 8 + 15) // 16 * 16
        stages = (K + 127) // 128
        mat_bytes = E * mtiles * stages * 512
        total = 2 * mat_bytes
        w = cp.random.randint(0, 2**31, size=total // 4, dtype=cp.int32)
        cbl = mtiles // 16
        n_items = E * cbl
        for nst in (5, 8):
            k.max_dynamic_shared_size_bytes = nst * 16384
            for mode in (0, 1, 2, 3):
                kargs = (
                    w,
                    np.int32(mode),
                    np.int32(n_items),
                    np.int32(stages),
                    np.int32(mtiles),
                    np.int32(cbl),
                    np.int64(mat_bytes),
                    np.int32(nst),
                )
                for _ in range(3):
                    k((sms,), (256,), kargs, shared_mem=nst * 16384)
                ev = [cp.cuda.Event() for _ in range(2)]
                ts = []
                for _ in range(15):
                    ev[0].record()
                    k((sms,), (256,), kargs, shared_mem=nst * 16384)
                    ev[1].record()
                    ev[1].synchronize()
                    ts.append(cp.cuda.get_elapsed_time(ev[0], ev[1]) * 1e3)
                us = float(np.median(ts))
                r = dict(
                    case=name,
                    mode=[
                        "cp.async mtile_major",
                        "bulk 512 B mtile_major",
                        "bulk 8 KB stage_contig",
                        "cp.async stage_contig",
                    ][mode],
                    ring=nst,
                    mb=round(total / 1e6, 1),
                    us=round(us, 1),
                    tbps=round(total / us / 1e6, 2),
                )
                print(json.dumps(r), flush=True)
                res.append(r)
        del w
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
