# SPDX-License-Identifier: Apache-2.0
"""FC1 / FC2 expert GEMV benchmark: CUDA-graph replay over a stack of layers, µs and TB/s.

Run on a GPU from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_gemv.py [--presets qwen3.6-35b-a3b,...]
        [--tokens 1,4,8,64] [--repeats 20] [--json results.json]

For every preset and token count M it builds a stack of L layers with distinct random weights
(drawn on the GPU: uniform E2M1 bytes, E4M3 scale bytes 0x30..0x40 or E8M0 bytes 120..124), so
that the weights one pass over the stack reads at M = 1 are over 4x the 60 MB L2 and every layer
comes from HBM, as in a real decode step. Each layer gets its own random routing. FC1 over the L
layers is captured into one CUDA graph and replayed (warm-up, then the median of the timed
replays, CUDA events); FC2 likewise. Each call runs the backend ``cupymoe.experts.fc1`` / ``fc2``
choose (the GEMV at few rows per expert, the grouped GEMM above), always as graph replays.

Effective bandwidth counts the DISTINCT bytes a call must read: packed codes and block scales of
the active experts (those with rows) plus their global scales; activations are not counted.
The floor is 4.5 TB/s (H200 HBM3e read); the measured device-to-device copy bandwidth
(read + write bytes over time) is printed as the practical ceiling.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from cupymoe import experts
from cupymoe.bench import capture, device_name, median_event_us
from cupymoe.formats import Fp4Format, random_fp4_gpu
from cupymoe.presets import PRESETS, LayerShape

L2_BYTES = 60 << 20
FLOOR_TBPS = 4.5
DEFAULT_PRESETS = ("qwen3.6-35b-a3b", "gpt-oss-20b", "deepseek-v3")
DEFAULT_TOKENS = (1, 4, 8, 64)


def _cupy() -> Any:
    import cupy

    return cupy


def time_fn(fn: Callable[[], None], *, graph: bool, warmup: int, repeats: int) -> float:
    """Median µs of one ``fn()`` (as a replayed CUDA graph when ``graph``), by CUDA events."""
    stream = _cupy().cuda.Stream(non_blocking=True)
    run = functools.partial(capture(fn, stream).launch, stream) if graph else fn
    return median_event_us(run, stream, repeats=repeats, warmup=warmup)


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in TB/s, counting the bytes read plus the bytes written."""
    cupy = _cupy()
    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    us = time_fn(lambda: cupy.copyto(dst, src), graph=False, warmup=3, repeats=repeats)
    return 2 * nbytes / (us * 1e-6) / 1e12


def expert_bytes(n: int, k: int, fmt: Fp4Format) -> int:
    """Bytes one expert matrix [n, k] occupies: packed codes, block scales, global scale."""
    return n * k // 2 + n * k // fmt.block_size + 4


def n_layers_for(shape: LayerShape, min_layers: int = 2, max_layers: int = 64) -> int:
    """Layers whose M = 1 working set (top_k experts of FC1 + FC2 each) is >= 4x the L2."""
    fmt = Fp4Format.parse(shape.format)
    h, i = shape.hidden, shape.intermediate
    active = shape.top_k * (2 * expert_bytes(i, h, fmt) + expert_bytes(h, i, fmt))
    return max(min_layers, min(max_layers, math.ceil(4 * L2_BYTES / active)))


def build_stack(
    shape: LayerShape, n_layers: int, seed: int, *, order: str = "split"
) -> list[tuple[Any, Any]]:
    """``n_layers`` x (PreparedFc1, PreparedFc2) with distinct random weights; ``order``: the
    weights the GEMV reads, ``"split"`` (the library's default layout) or the uploaded bytes
    themselves in the ``"pair"``-interleaved or ``"plain"`` nibble order."""
    kw: dict[str, Any] = {"layout": experts.WeightLayout.parse(order)}
    e, h, i, fmt = shape.n_experts, shape.hidden, shape.intermediate, shape.format
    rng = np.random.default_rng(seed)
    stack = []
    for layer in range(n_layers):
        s = seed + 1000 * layer
        gate, up = random_fp4_gpu(e, i, h, fmt, seed=s), random_fp4_gpu(e, i, h, fmt, seed=s + 1)
        down = random_fp4_gpu(e, h, i, fmt, seed=s + 2)

        def bias(n: int) -> np.ndarray | None:
            return rng.standard_normal((e, n)).astype(np.float32) * 0.1 if shape.biases else None

        fc1 = experts.prepare_fc1(gate, up, gate_bias=bias(i), up_bias=bias(i), **kw)
        fc2 = experts.prepare_fc2(down, bias=bias(h), **kw)
        stack.append((fc1, fc2))
        del gate, up, down
    return stack


def make_routing(rng: np.random.Generator, n_tokens: int, shape: LayerShape) -> Any:
    """Routing of random logits by ``cupymoe.routing.topk`` (softmax top-k, on the GPU).

    Every preset is routed by softmax top-k here: which experts are picked matters to the GEMV,
    how their weights are computed does not.
    """
    from cupymoe.routing import Router, route

    cupy = _cupy()
    logits = cupy.asarray(rng.standard_normal((n_tokens, shape.n_experts)).astype(np.float32))
    return route(logits, Router(n_experts=shape.n_experts, top_k=shape.top_k))


def _stack_calls(
    stack: list[tuple[Any, Any]],
    routings: list[Any],
    x: Any,
    hs: list[Any],
    ys: list[Any],
    act: Any,
) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(fc1_all, fc2_all)``: FC1 (FC2) of every layer of the stack, into preallocated outputs."""

    def fc1_all() -> None:
        for (fc1, _), routing, out in zip(stack, routings, hs, strict=True):
            experts.fc1(x, fc1, routing, act=act, out=out)

    def fc2_all() -> None:
        for (_, fc2), routing, h, out in zip(stack, routings, hs, ys, strict=True):
            experts.fc2(h, fc2, routing, out=out)

    return fc1_all, fc2_all


def bench_preset(
    shape: LayerShape,
    tokens: list[int],
    *,
    layers: int | None,
    repeats: int,
    seed: int,
    order: str = "split",
) -> list[dict[str, Any]]:
    """Rows of results (one per token count) for one preset."""
    cupy = _cupy()
    fmt = Fp4Format.parse(shape.format)
    n_layers = layers or n_layers_for(shape)
    h, i, k = shape.hidden, shape.intermediate, shape.top_k
    print(f"[{shape.name}] building {n_layers} layers of random weights ...", file=sys.stderr)
    stack = build_stack(shape, n_layers, seed, order=order)
    act = experts.ActivationSpec(experts.Activation(shape.activation))
    rng = np.random.default_rng(seed + 1)
    rows_out = []
    for m in tokens:
        routings = [make_routing(rng, m, shape) for _ in range(n_layers)]
        active = [int(np.count_nonzero(np.diff(cupy.asnumpy(r.expert_offsets)))) for r in routings]
        x = cupy.asarray(rng.standard_normal((m, h)).astype(ml_dtypes.bfloat16))
        hs = [cupy.zeros((m * k, i), dtype=x.dtype) for _ in range(n_layers)]
        ys = [cupy.zeros((m * k, h), dtype=x.dtype) for _ in range(n_layers)]

        fc1_all, fc2_all = _stack_calls(stack, routings, x, hs, ys, act)
        graph = True  # every token count is capturable
        fc1_us = time_fn(fc1_all, graph=graph, warmup=5, repeats=repeats) / n_layers
        fc2_us = time_fn(fc2_all, graph=graph, warmup=5, repeats=repeats) / n_layers
        fc1_bytes = sum(a * 2 * expert_bytes(i, h, fmt) for a in active) / n_layers
        fc2_bytes = sum(a * expert_bytes(h, i, fmt) for a in active) / n_layers
        fc1_tbps, fc2_tbps = fc1_bytes / fc1_us / 1e6, fc2_bytes / fc2_us / 1e6
        total_tbps = (fc1_bytes + fc2_bytes) / (fc1_us + fc2_us) / 1e6
        row = dict(
            preset=shape.name,
            tokens=m,
            rows=m * k,
            layers=n_layers,
            mode="graph" if graph else "eager",
            active_experts=statistics.mean(active),
            fc1_us=fc1_us,
            fc2_us=fc2_us,
            fc1_fc2_us=fc1_us + fc2_us,
            fc1_mb=fc1_bytes / 1e6,
            fc2_mb=fc2_bytes / 1e6,
            fc1_tbps=fc1_tbps,
            fc2_tbps=fc2_tbps,
            fc1_fc2_tbps=total_tbps,
            fc1_floor_pct=100 * fc1_tbps / FLOOR_TBPS,
            fc2_floor_pct=100 * fc2_tbps / FLOOR_TBPS,
        )
        print(json.dumps(row), file=sys.stderr)
        rows_out.append(row)
    stack.clear()
    cupy.get_default_memory_pool().free_all_blocks()
    return rows_out


def markdown(rows: list[dict[str, Any]], copy_tbps: float) -> str:
    """The results as one markdown table."""
    head = (
        "| preset | M | rows | mode | experts | FC1 µs | FC1 TB/s | FC1 % | FC2 µs | FC2 TB/s "
        "| FC2 % | FC1+FC2 µs | FC1+FC2 % |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['tokens']} | {r['rows']} | {r['mode']} "
            f"| {r['active_experts']:.1f} | {r['fc1_us']:.2f} | {r['fc1_tbps']:.2f} "
            f"| {r['fc1_floor_pct']:.0f} | {r['fc2_us']:.2f} | {r['fc2_tbps']:.2f} "
            f"| {r['fc2_floor_pct']:.0f} | {r['fc1_fc2_us']:.2f} "
            f"| {100 * r['fc1_fc2_tbps'] / FLOOR_TBPS:.0f} |"
        )
    lines.append(
        f"\n% = effective TB/s over the distinct active-expert weight bytes / {FLOOR_TBPS} TB/s; "
        f"measured device-to-device copy ceiling {copy_tbps:.2f} TB/s "
        f"({100 * copy_tbps / FLOOR_TBPS:.0f} %)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default=",".join(DEFAULT_PRESETS))
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    parser.add_argument("--layers", type=int, default=None, help="override the stack depth")
    parser.add_argument("--repeats", type=int, default=20, help="timed replays (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    parser.add_argument(
        "--order",
        choices=("split", "pair", "plain"),
        default="split",
        help="weights the GEMV reads: the split layout or the uploaded nibble order",
    )
    args = parser.parse_args(argv)
    if args.repeats < 20:
        parser.error("--repeats: at least 20 replays")
    names = [p.strip() for p in args.presets.split(",") if p.strip()]
    unknown = [p for p in names if p not in PRESETS]
    if unknown:
        parser.error(f"--presets: unknown {unknown}; choose from {sorted(PRESETS)}")
    tokens = [int(t) for t in args.tokens.split(",")]

    copy_tbps = copy_bandwidth()
    print(f"device {device_name()}; device-to-device copy {copy_tbps:.2f} TB/s (ceiling)")
    rows = []
    for name in names:
        rows += bench_preset(
            PRESETS[name],
            tokens,
            layers=args.layers,
            repeats=args.repeats,
            seed=args.seed,
            order=args.order,
        )
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "device": device_name(),
                    "copy_tbps": copy_tbps,
                    "floor_tbps": FLOOR_TBPS,
                    "results": rows,
                },
                f,
                indent=1,
            )
    print(markdown(rows, copy_tbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
