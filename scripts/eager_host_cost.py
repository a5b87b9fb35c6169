# SPDX-License-Identifier: Apache-2.0
"""The Python side of an eager call, on any machine: ``MoELayer.__call__`` with a recorded graph
whose CUDA calls do nothing.

Runs without a GPU: the layer's ``EagerGraphs`` gets no-op CUDA entry points
(:class:`~cupymoe.layer.eager.CudaCalls`), a fake recorded graph of Qwen3.6-35B-A3B's shapes and
CuPy arrays on a null allocation (``cupy.cuda.using_allocator``: a result costs its ``ndarray``
but no memory). What it prints is the host time a call spends outside CUDA: the hit path (in
place and with copies, with and without ``out=``) and the checked path (``MoELayer``'s full
checks, as a call that misses the hit takes). Usage::

    PYTHONPATH=. python3 scripts/eager_host_cost.py [--tokens 1,4] [--calls 20000]
"""

from __future__ import annotations

import argparse
import time
import types
from collections.abc import Callable
from typing import Any

import cupy
import ml_dtypes
import numpy as np

import cupymoe as cm
from cupymoe.layer import eager
from cupymoe.layer.graph import LayerGraph
from cupymoe.presets import PRESETS, random_fp4_experts

BF16 = ml_dtypes.bfloat16
_NULL = cupy.cuda.memory.MemoryPointer(cupy.cuda.memory.BaseMemory(), 0)


def _array(shape: tuple[int, ...], dtype: Any) -> Any:
    return cupy.ndarray(shape, dtype, memptr=_NULL)


def _none(*args: Any) -> None:
    return None


def _calls() -> eager.CudaCalls:
    stream = types.SimpleNamespace(ptr=0x50, is_capturing=lambda: False)
    return eager.CudaCalls(
        ndarray=cupy.ndarray,
        current_stream=lambda: stream,
        memcpy=_none,
        memcpy2d=_none,
        graph_launch=_none,
        is_capturing=lambda s: False,
        synchronize=_none,
    )


def _best_us(call: Callable[[], Any], calls: int, rounds: int = 15) -> float:
    for _ in range(calls // 10):
        call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def measure(m: int, calls: int) -> dict[str, float]:
    shape = PRESETS["qwen3.6-35b-a3b"]
    h, e = shape.hidden, shape.n_experts
    rng = np.random.default_rng(0)
    gate, up = (random_fp4_experts(rng, e, 32, h, "nvfp4", experts=[0]) for _ in range(2))
    layer = cm.MoELayer(
        (gate, up), random_fp4_experts(rng, e, h, 32, "nvfp4", experts=[0]), top_k=8
    )
    x, logits, out = _array((m, h), BF16), _array((m, e), np.float32), _array((m, h), BF16)
    graph = LayerGraph(
        types.SimpleNamespace(graphExec=0),
        None,
        _array((m, h), BF16),
        [_array((m, e), np.float32)],
        _array((m, h), BF16),
        keep=None,
        workspaces=[None],
    )
    graphs = layer._graphs = eager.EagerGraphs(layer, cuda=_calls())
    key = eager.plan_key(m, x.dtype, logits.dtype, 0x50)
    replay = eager.Replay(key, graph, eager._environment())
    replay.binds_left = 0  # every address is 0 here: no in-place graph but the one put below
    graphs.graphs.put(key, replay)
    graphs.last[(0x50, x.size)] = replay

    def checked() -> Any:
        graphs.last.clear()  # the hit misses; the checked path puts the Replay back
        return layer(x, logits, out=out)

    result: dict[str, float] = {}
    with cupy.cuda.using_allocator(lambda size: _NULL):
        result["hit, out="] = _best_us(lambda: layer(x, logits, out=out), calls)
        result["hit, new result"] = _best_us(lambda: layer(x, logits), calls)
        result["checked path, out="] = _best_us(checked, calls)
        result["new ndarray alone"] = _best_us(lambda: cupy.ndarray((m, h), BF16), calls)
        replay.bound[(0, 0, 0)] = types.SimpleNamespace(graphExec=0)
        result["hit in place, out="] = _best_us(lambda: layer(x, logits, out=out), calls)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    for m in (int(t) for t in args.tokens.split(",")):
        cells = "  ".join(f"{k} {v:.2f}" for k, v in measure(m, args.calls).items())
        print(f"M={m}: µs per call  {cells}")


if __name__ == "__main__":
    main()
