# SPDX-License-Identifier: Apache-2.0
"""Where the wgmma kernel's consumers spend each work item: a timeline per block (probe).

Run on an H100 / H200 from the repository root::

    python3 benchmarks/item_timeline.py --case qwen3.6-35b-a3b:4096 --case gpt-oss-20b:1024 \\
        [--json timeline.json]

Writes a copy of this checkout's ``cupymoe`` into a temporary folder whose ``cuda/gemm_sm90.cu``
records, for the first consumer thread of groups 0 and 1 of every block (threads 128 and 256),
five ``clock64`` stamps per item: before the item's first ``full`` wait, after it, after the K
loop (its last ``wgmma`` group drained), after the pre-epilogue barrier (bn 144) and after the
epilogue; and the item's rows and ``wgmma`` width. The stamps go to a ``__device__`` array of
each specialisation's module, which the run reads back after one eager layer call (the third:
two calls compile and warm up). Each case runs in its own process with the copy first on
``sys.path``.

What it prints per launch, in cycles of the block's SM clock: each block's span from its first
item's start to its last epilogue, the shares of it spent waiting for an item's first stage, in
K loops, at the barrier, in epilogues and between items; then per item position (the first
item is the launch's start: its wait is the ring's first fill, its epilogue runs cold) and per
``wgmma`` width of the later items, the mean cycles of each part. docs/kernels.md, twenty-second
round, reads a run. The stamps cost a few instructions per item; the instrumented kernels
compiled with no spills for every tiling at session 36.

``--back-to-back`` times, instead of the eager call, each of FC1 and FC2 alone in a CUDA graph
after the L2 has been flushed, once (``fc1 x1``: code, maps and weights cold) and twice back to
back (``fc1 x2``: the stamps are the second launch's, which finds its code and its maps in the L2
the first left, its first items' weights still cold). The first item's excess over the later
items in ``x1`` and not in ``x2`` is what a cold start costs a launch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KERNEL = Path("cupymoe") / "cuda" / "gemm_sm90.cu"

BLOCKS = 132  # blocks recorded (an H100 / H200 has 132 SMs: the persistent grid's size)
ITEMS = 40  # items recorded per block
VALUES = 8  # per (block, item, group): five stamps, rows, width, a written flag
GROUPS = 2
POSITIONS = 6  # item positions summarised one by one (the first is the launch's start)
L2_FLUSH_BYTES = 60 << 20  # the H100's / H200's L2 (50 / 60 MB), rounded up

_EDITS: tuple[tuple[str, str], ...] = (
    (
        '#include "gemm_items.cuh"\n',
        '#include "gemm_items.cuh"\n'
        'extern "C" __device__ unsigned long long '
        f"cm_probe[{BLOCKS} * {ITEMS} * {GROUPS} * {VALUES}];\n",
    ),
    (
        "        for (int index = blockIdx.x; index < n_items(); index = next_item<kBN>(index)) {\n"
        "            mbar_wait(full + 8 * slot, phase);  // the item's first stage, and with it its"
        " record\n"
        "            const Item it = record(slot);\n",
        "        int nitem = 0;\n"
        "        for (int index = blockIdx.x; index < n_items(); index = next_item<kBN>(index)) {\n"
        "            const unsigned long long t_s = clock64();\n"
        "            mbar_wait(full + 8 * slot, phase);  // the item's first stage, and with it its"
        " record\n"
        "            const unsigned long long t_r = clock64();\n"
        "            const Item it = record(slot);\n",
    ),
    (
        "            if constexpr (kEpiInSlot) {\n",
        "            const unsigned long long t_k = clock64();\n"
        "            unsigned long long t_b = t_k;\n"
        "            if constexpr (kEpiInSlot) {\n",
    ),
    (
        '                asm volatile("bar.sync 1, %0;" ::"n"(kCons) : "memory");\n'
        "                store_tile(it, group * 4 + warp, acc, ep, smem + last * kStageBytes);\n",
        '                asm volatile("bar.sync 1, %0;" ::"n"(kCons) : "memory");\n'
        "                t_b = clock64();\n"
        "                store_tile(it, group * 4 + warp, acc, ep, smem + last * kStageBytes);\n",
    ),
    (
        "                store_tile(it, group * 4 + warp, acc, ep, epi);\n"
        "            }\n        }\n",
        "                store_tile(it, group * 4 + warp, acc, ep, epi);\n"
        "            }\n"
        "            const unsigned long long t_e = clock64();\n"
        f"            if ((threadIdx.x == 128 || threadIdx.x == 256) && nitem < {ITEMS} && "
        f"blockIdx.x < {BLOCKS}) {{\n"
        "                unsigned long long* const o = cm_probe + "
        f"((blockIdx.x * {ITEMS} + nitem) * {GROUPS} + (threadIdx.x == 256)) * {VALUES};\n"
        "                o[0] = t_s; o[1] = t_r; o[2] = t_k; o[3] = t_b; o[4] = t_e;\n"
        "                o[5] = (unsigned long long)it.rows;\n"
        "                o[6] = (unsigned long long)width; o[7] = 1;\n"
        "            }\n"
        "            ++nitem;\n"
        "        }\n",
    ),
)


def instrument(source: str) -> str:
    """gemm_sm90.cu's text with the stamps; ``ValueError`` when an anchor is not found exactly
    once (the kernel moved on: update the edits)."""
    for i, (anchor, new) in enumerate(_EDITS):
        times = source.count(anchor)
        if times != 1:
            raise ValueError(f"item timeline edit {i}: its anchor is in gemm_sm90.cu {times} times")
        source = source.replace(anchor, new)
    return source


def write_tree(root: Path, into: Path) -> Path:
    """A copy of ``root``'s ``cupymoe`` under ``into`` with the kernel instrumented."""
    shutil.copytree(
        root / "cupymoe", into / "cupymoe", ignore=shutil.ignore_patterns("__pycache__")
    )
    kernel = into / KERNEL
    kernel.write_text(instrument(kernel.read_text()))
    return into


def summarize(stamps: np.ndarray) -> dict[str, Any] | None:
    """The timeline of one launch from its ``[BLOCKS, ITEMS, GROUPS, VALUES]`` record (None when
    nothing was recorded): shares of the blocks' spans, and mean cycles per item position and per
    width of the later items (``wait``, ``kloop``, ``bar``, ``epi``, and how many items)."""
    a = stamps.astype(np.int64)
    spans, parts = [], []
    by_pos: dict[int, list[np.ndarray]] = {}
    by_width: dict[int, list[np.ndarray]] = {}
    for block in range(a.shape[0]):
        for group in range(a.shape[2]):
            v = a[block, :, group]
            n = int(v[:, 7].sum())
            if n == 0:
                continue
            v = v[:n]
            wait, kloop = v[:, 1] - v[:, 0], v[:, 2] - v[:, 1]
            bar, epi = v[:, 3] - v[:, 2], v[:, 4] - v[:, 3]
            span = int(v[-1, 4] - v[0, 0])
            gap = span - int(wait.sum() + kloop.sum() + bar.sum() + epi.sum())
            spans.append(span)
            parts.append([wait.sum(), kloop.sum(), bar.sum(), epi.sum(), gap])
            for i in range(n):
                row = np.array([wait[i], kloop[i], bar[i], epi[i]])
                by_pos.setdefault(i, []).append(row)
                if i > 0:
                    by_width.setdefault(int(v[i, 6]), []).append(row)
    if not spans:
        return None
    shares = np.asarray(parts, dtype=float) / np.asarray(spans, dtype=float)[:, None]

    def means(rows: list[np.ndarray]) -> dict[str, float]:
        m = np.mean(rows, axis=0)
        return dict(
            wait=float(m[0]), kloop=float(m[1]), bar=float(m[2]), epi=float(m[3]), items=len(rows)
        )

    return dict(
        records=len(spans),
        span_median=float(np.median(spans)),
        span_max=int(max(spans)),
        shares=dict(
            zip(
                ("wait", "kloop", "bar", "epi", "gap"), map(float, shares.mean(axis=0)), strict=True
            )
        ),
        by_position={i: means(rows) for i, rows in sorted(by_pos.items()) if i < POSITIONS},
        by_width_after_first={w: means(rows) for w, rows in sorted(by_width.items())},
    )


def _run_case(preset: str, tokens: int, back_to_back: bool = False) -> dict[str, Any]:
    """One eager layer call with the instrumented package (this process's ``cupymoe``), or
    with ``back_to_back`` each expert stage's graph of one and of two launches (module doc)."""
    import cupy
    import ml_dtypes

    import cupymoe as cm
    from cupymoe._runtime import compile as loader
    from cupymoe.presets import PRESETS, random_layer_gpu

    created: list[tuple[str, Any]] = []
    raw_module = cupy.RawModule

    def recording_module(*args: Any, **kwargs: Any) -> Any:  # the loader's cubin modules
        module = raw_module(*args, **kwargs)
        if "path" in kwargs:
            created.append((kwargs["path"], module))
        return module

    cupy.RawModule = recording_module
    shape = PRESETS[preset]
    rng = np.random.default_rng(0)
    layer = cm.MoELayer(**random_layer_gpu(shape, rng, seed=7, max_tokens=tokens))
    x = cupy.asarray(rng.standard_normal((tokens, shape.hidden)).astype(ml_dtypes.bfloat16))
    logits = cupy.asarray(rng.standard_normal((tokens, shape.n_experts)).astype(np.float32))
    layer(x, logits)
    cupy.cuda.Device().synchronize()
    names = {
        loader._target_cubin(key[1])[0]: key[1].expression
        for key in list(loader._kernels)
        if key[1].stage == "gemm_sm90" and key[1].target
    }
    shape4 = (BLOCKS, ITEMS, GROUPS, VALUES)
    arrays = {}
    for path, module in created:
        try:
            pointer = module.get_global("cm_probe")
        except Exception:  # noqa: BLE001  (a module of another stage: no stamps)
            continue
        arrays[names.get(path, path)] = cupy.ndarray(shape4, cupy.uint64, pointer)
    out = {}

    def collect(prefix: str) -> None:  # the recorded launches' summaries into out
        for name, array in arrays.items():
            summary = summarize(array.get())
            if summary is not None:
                out[prefix + name] = summary

    if back_to_back:
        from cupymoe.layer.graph import record_graph

        flush = cupy.empty(4 * L2_FLUSH_BYTES, cupy.uint8)  # 4x the L2: nothing stays
        for stage in ("fc1", "fc2"):
            for launches in (1, 2):
                graph = record_graph(
                    [layer] * launches,
                    tokens,
                    x.dtype,
                    chain=False,
                    stages=(stage,),
                    inputs=(x, [logits] * launches),
                )
                with graph.stream:
                    for array in arrays.values():
                        array.fill(0)
                    flush.fill(1)
                    graph.replay()
                graph.stream.synchronize()
                collect(f"{stage} x{launches} ")
        return out
    for _ in range(2):
        for array in arrays.values():
            array.fill(0)
        layer(x, logits)
    cupy.cuda.Device().synchronize()
    collect("")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--case", action="append", default=[], help="preset:M (one layer of M tokens)")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--back-to-back",
        action="store_true",
        help="each expert stage alone after an L2 flush, once and twice back to back",
    )
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)  # preset:M in the copy's process
    args = ap.parse_args(argv)
    if args.run:
        preset, tokens = args.run.split(":")
        print(json.dumps(_run_case(preset, int(tokens), args.back_to_back)))
        return 0
    if not args.case:
        ap.error("give at least one --case")
    report = {}
    with tempfile.TemporaryDirectory(prefix="item_timeline_") as tmp:
        tree = write_tree(ROOT, Path(tmp))
        env = dict(os.environ, PYTHONPATH=str(tree))  # the copy alone, as bench_ab.py's trees
        for case in args.case:
            done = subprocess.run(
                [sys.executable, __file__, "--run", case]
                + (["--back-to-back"] if args.back_to_back else []),
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            report[case] = json.loads(done.stdout.splitlines()[-1])
            for name, s in report[case].items():
                shares = " ".join(f"{k} {v:.2f}" for k, v in s["shares"].items())
                print(
                    f"{case} {name}: span {s['span_median']:.0f} cycles (median), shares {shares}"
                )
                for label, table in (
                    ("position", s["by_position"]),
                    ("width", s["by_width_after_first"]),
                ):
                    for key, m in table.items():
                        print(
                            f"  {label} {key}: wait {m['wait']:.0f} kloop {m['kloop']:.0f} "
                            f"bar {m['bar']:.0f} epi {m['epi']:.0f} ({m['items']} items)"
                        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
