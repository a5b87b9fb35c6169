# SPDX-License-Identifier: Apache-2.0
"""Routing, expand and finalize benchmark: CUDA-graph replay, µs per call.

Run on a GPU from the repository root::

    PYTHONPATH=. python3 benchmarks/bench_routing.py [--tokens 1,4,8,64,1024] [--experts 256]
        [--top-k 8] [--hidden 2048] [--logits fp32|bf16] [--calls 64] [--repeats 30]
        [--pdl] [--json results.json]

Each stage is recorded ``--calls`` times back to back into one CUDA graph, every call on its own
inputs and outputs (distinct logits, rows and routing buffers, as the layers of a decode step
have), and the graph is replayed: the median replay time over ``--calls`` is the time of one
graph node, launch gap included. The same graph of an empty kernel gives that gap alone (the
floor of any one-launch stage). Stages: ``route`` softmax top-k and DeepSeek-V3's grouped
sigmoid (8 groups, 4 kept, correction bias, renormalised, scale 2.5) -- one launch when
M * k <= 64, else routing + maps launches --, ``expand`` (bf16 rows, H) and ``finalize``
(bf16 y -> bf16 out, H). ``--pdl`` makes route and finalize programmatic dependent launches
(``cupymoe/_launch.py``), as ``MoELayer`` does: each call's launch overlaps the previous call's
end, and waits for it before touching memory.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import cupy
import ml_dtypes
import numpy as np

from cupymoe.bench import capture, device_name, median_event_us
from cupymoe.layer.expand import expand
from cupymoe.layer.finalize import finalize
from cupymoe.routing import Router, Routing, RoutingMethod, route, route_workspace_words

BF16 = ml_dtypes.bfloat16
_EMPTY = cupy.RawKernel('extern "C" __global__ void empty_node() {}', "empty_node")


def _per_call_us(fn: Callable[..., Any], args: list[tuple[Any, ...]], repeats: int) -> float:
    """Median replay time of a graph of ``fn(*a) for a in args``, over ``len(args)``."""
    stream = cupy.cuda.Stream(non_blocking=True)
    graph = capture(lambda: [fn(*a) for a in args], stream)
    return median_event_us(lambda: graph.launch(stream), stream, repeats=repeats) / len(args)


def _routers(e: int, k: int) -> dict[str, Router]:
    bias = (np.random.default_rng(7).standard_normal(e) * 0.01).astype(np.float32)
    return {
        "softmax_topk": Router(e, k, RoutingMethod.SOFTMAX_TOPK, renormalize=True),
        "sigmoid_grouped": Router(
            e,
            k,
            RoutingMethod.SIGMOID_GROUPED,
            renormalize=True,
            n_group=8,
            topk_group=4,
            correction_bias=bias,
            routed_scaling_factor=2.5,
        ),
    }


def bench(
    tokens: list[int],
    e: int,
    k: int,
    h: int,
    calls: int,
    repeats: int,
    logits_dtype: Any,
    pdl: bool = False,
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    empty = _per_call_us(lambda: _EMPTY((1,), (32,), ()), [()] * calls, repeats)
    rows.append({"stage": "empty kernel (graph node floor)", "tokens": 0, "us": empty})
    for m in tokens:
        logits = [
            cupy.asarray(rng.standard_normal((m, e)).astype(logits_dtype)) for _ in range(calls)
        ]
        outs = [Routing.empty(m, e, k, xp=cupy) for _ in range(calls)]
        works = [cupy.empty(route_workspace_words(m, e), np.int32) for _ in range(calls)]
        for name, router in _routers(e, k).items():
            us = _per_call_us(
                lambda lg, o, w, r=router: route(lg, r, out=o, workspace=w, pdl=pdl),
                list(zip(logits, outs, works, strict=True)),
                repeats,
            )
            rows.append({"stage": f"route {name}", "tokens": m, "us": us})
            us = _per_call_us(  # without a workspace: the routing launch, then the maps'
                lambda lg, o, r=router: route(lg, r, out=o, pdl=pdl),
                list(zip(logits, outs, strict=True)),
                repeats,
            )
            rows.append({"stage": f"route {name} (no workspace)", "tokens": m, "us": us})
        x = [cupy.asarray(rng.standard_normal((m, h)).astype(BF16)) for _ in range(calls)]
        xe = [cupy.empty((m * k, h), BF16) for _ in range(calls)]
        us = _per_call_us(
            lambda a, o, b: expand(a, o, out=b), list(zip(x, outs, xe, strict=True)), repeats
        )
        rows.append({"stage": f"expand (H {h})", "tokens": m, "us": us})
        y = [cupy.asarray(rng.standard_normal((m * k, h)).astype(BF16)) for _ in range(calls)]
        out = [cupy.empty((m, h), BF16) for _ in range(calls)]
        us = _per_call_us(
            lambda a, o, b: finalize(a, o, out=b, pdl=pdl),
            list(zip(y, outs, out, strict=True)),
            repeats,
        )
        rows.append({"stage": f"finalize (H {h})", "tokens": m, "us": us})
        print(f"M={m} done", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,4,8,64,1024")
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--logits", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launches")
    parser.add_argument("--json", dest="json_path")
    a = parser.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    dtype = np.float32 if a.logits == "fp32" else BF16
    rows = bench(tokens, a.experts, a.top_k, a.hidden, a.calls, a.repeats, dtype, a.pdl)
    name = device_name()
    print(
        f"{name}, E {a.experts}, top-{a.top_k}, {a.logits} logits, graph of {a.calls} calls, "
        f"median of {a.repeats}, PDL {'on' if a.pdl else 'off'}"
    )
    print(
        "(route: one launch while M * k <= 512; above, route_tiles + maps_tiles_place with a "
        "workspace, else the routing launch + the maps' launches)"
    )
    stages = list(dict.fromkeys(r["stage"] for r in rows if r["tokens"]))
    print("| stage | " + " | ".join(f"M = {m}" for m in tokens) + " |")
    print("|---|" + "---|" * len(tokens))
    print(f"| {rows[0]['stage']} | {rows[0]['us']:.2f} µs (any M) |" + " |" * (len(tokens) - 1))
    for s in stages:
        cells = [
            next(f"{r['us']:.2f}" for r in rows if r["stage"] == s and r["tokens"] == m)
            for m in tokens
        ]
        print(f"| {s} | " + " | ".join(cells) + " |")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(
                {
                    "device": name,
                    "experts": a.experts,
                    "top_k": a.top_k,
                    "pdl": a.pdl,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
