# SPDX-License-Identifier: Apache-2.0
"""Whole-layer benchmark: CUDA-graph replay over a stack of layers with distinct weights.

Also the timing tools the benchmarks in ``benchmarks/`` build on: :func:`median_event_us` (CUDA
events around launches), :func:`capture` (a CUDA graph of a call) and :func:`device_name`.

A decode step runs many layers, each reading its own experts from HBM. One layer replayed
alone would find its experts in the 60 MB L2 and look faster than it is, so the benchmark builds
a stack of ``L`` layers whose experts touched at one token exceed 4x the L2, records the stack
into one CUDA graph and reports the median replay time divided by ``L``.

The floor of a call is the larger of two times: the bytes of the DISTINCT experts it must read
(packed codes, block scales and global scales of gate, up and down) over the HBM read bandwidth
(4.5 TB/s measured on the H200), and its tensor-core FLOPs (``2 * M * k * 3 * H * I``) over the
bf16 dense peak (790 TFLOP/s measured). Activations and routing metadata are not counted.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._runtime.backend import require_cupy
from ._runtime.device import device_name
from ._runtime.timing import capture, median_event_us
from .layer import MoELayer, record_graph
from .layer.device import STAGES
from .presets import LayerShape, random_layer_gpu
from .routing import route_ref

__all__ = [
    "HBM_READ_TBPS",
    "L2_BYTES",
    "PEAK_BF16_TFLOPS",
    "STAGES",
    "BenchResult",
    "bench_preset",
    "capture",
    "device_name",
    "expert_bytes",
    "floor_time_us",
    "format_table",
    "layer_flops",
    "median_event_us",
    "stack_depth",
    "write_csv",
    "write_json",
]

#: Measured HBM read bandwidth of the H200 (TB/s): the denominator of every floor.
HBM_READ_TBPS = 4.5
#: Measured bf16 dense tensor-core rate of the H200 (TFLOP/s): the FLOP floor's denominator.
PEAK_BF16_TFLOPS = 790.0
#: L2 of the H200; the stack touches at least 4x this per replay.
L2_BYTES = 60 << 20


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """One row of ``cupymoe bench``: a preset at one token count."""

    preset: str
    format: str
    dtype: str
    tokens: int
    layers: int
    mode: str  # "graph" (CUDA-graph replay) or "eager" (batched fallback: not capturable)
    us_per_layer: float
    floor_us: float  # the larger of the byte floor and the FLOP floor
    distinct_bytes: int
    stages_us: dict[str, float]
    eager_us: float  # wall time per eager call of one layer, back to back (host-bound at decode)
    flops: float = 0.0  # tensor-core FLOPs of one layer call

    @property
    def effective_tbps(self) -> float:
        return self.distinct_bytes / (self.us_per_layer * 1e-6) / 1e12

    @property
    def tflops(self) -> float:
        """Achieved tensor-core TFLOP/s."""
        return self.flops / (self.us_per_layer * 1e-6) / 1e12

    @property
    def bound(self) -> str:
        """Which floor binds: ``"bytes"`` (HBM) or ``"flops"`` (tensor cores)."""
        return "flops" if self.flops / PEAK_BF16_TFLOPS / 1e6 > self.byte_floor_us else "bytes"

    @property
    def byte_floor_us(self) -> float:
        return self.distinct_bytes / (HBM_READ_TBPS * 1e12) * 1e6

    @property
    def pct_of_floor(self) -> float:
        """Floor over measured time, in percent (100 = at the floor)."""
        return 100.0 * self.floor_us / self.us_per_layer

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(
            effective_tbps=self.effective_tbps,
            pct_of_floor=self.pct_of_floor,
            tflops=self.tflops,
            bound=self.bound,
        )
        return d


def layer_flops(shape: LayerShape, tokens: int) -> float:
    """Tensor-core FLOPs of one layer call: gate, up and down for every expanded row."""
    return 2.0 * tokens * shape.top_k * 3 * shape.hidden * shape.intermediate


def floor_time_us(distinct: float, flops: float) -> float:
    """The larger of the byte floor (HBM read) and the FLOP floor (bf16 dense peak), in µs."""
    return max(distinct / (HBM_READ_TBPS * 1e12), flops / (PEAK_BF16_TFLOPS * 1e12)) * 1e6


def expert_bytes(shape: LayerShape) -> int:
    """Bytes of one expert's gate + up + down weights, block scales and global scales."""
    block = 16 if shape.format == "nvfp4" else 32
    h, i = shape.hidden, shape.intermediate
    per_matrix = i * h // 2 + i * h // block + 4  # codes + scales + global scale
    return 3 * per_matrix


def distinct_bytes(shape: LayerShape, logits: np.ndarray, layer: MoELayer) -> int:
    """Bytes a call must read: the experts chosen by at least one token."""
    ids = route_ref(logits, layer.router).topk_ids
    return int(np.unique(ids).size) * expert_bytes(shape)


def stack_depth(shape: LayerShape, *, max_weight_bytes: float = 48e9) -> int:
    """Layers needed so that one token's experts over the stack exceed 4x the L2.

    Capped so that the whole stack's weights stay under ``max_weight_bytes`` of GPU memory.
    """
    touched = shape.top_k * expert_bytes(shape)
    layer_bytes = shape.n_experts * expert_bytes(shape)
    wanted = max(4, math.ceil(4 * L2_BYTES / touched))
    return max(2, min(wanted, int(max_weight_bytes // layer_bytes)))


def _random_layers(shape: LayerShape, n_layers: int, seed: int, max_tokens: int) -> list[MoELayer]:
    """Layers with random FP4 weights drawn on the GPU (no host quantization)."""
    rng = np.random.default_rng(seed)
    return [
        MoELayer(**random_layer_gpu(shape, rng, seed=seed * 1000 + 10 * n, max_tokens=max_tokens))
        for n in range(n_layers)
    ]


def bench_preset(
    shape: LayerShape,
    tokens: Sequence[int],
    *,
    dtype: Any,
    n_layers: int | None = None,
    repeats: int = 30,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[BenchResult]:
    """Time ``shape`` at each token count: µs per layer (whole-layer graph) and per stage."""

    cupy = require_cupy()
    n_layers = n_layers or stack_depth(shape)
    layers = _random_layers(shape, n_layers, seed, max_tokens=max(tokens))
    rng = np.random.default_rng(seed + 1)
    dtype = np.dtype(dtype)
    results = []
    for m in tokens:
        if progress:
            progress(f"{shape.name} M={m}")
        x = rng.standard_normal((m, shape.hidden)).astype(dtype)
        logits = [rng.standard_normal((m, shape.n_experts)).astype(np.float32) for _ in layers]
        floor_bytes = float(
            np.mean([distinct_bytes(shape, lg, ly) for lg, ly in zip(logits, layers, strict=True)])
        )
        xd = cupy.asarray(x)
        ld = [cupy.asarray(lg) for lg in logits]
        if layers[0].device_layer().capturable(dtype):
            mode = "graph"
            whole = record_graph(layers, m, dtype, chain=False, inputs=(xd, ld))
            total = median_event_us(whole.replay, whole.stream, repeats=repeats)
            stages = {}
            for stage in STAGES:
                g = record_graph(layers, m, dtype, chain=False, stages=(stage,), inputs=(xd, ld))
                stages[stage] = median_event_us(g.replay, g.stream, repeats=repeats) / n_layers
                del g
            del whole
        else:
            mode = "eager"
            stream = cupy.cuda.get_current_stream()
            total = median_event_us(
                _eager_stack(layers, xd, ld), stream, repeats=max(3, repeats // 5), warmup=1
            )
            stages = {}
        results.append(
            BenchResult(
                preset=shape.name,
                format=shape.format,
                dtype=dtype.name,
                tokens=m,
                layers=n_layers,
                mode=mode,
                us_per_layer=total / n_layers,
                floor_us=floor_time_us(floor_bytes, layer_flops(shape, m)),
                distinct_bytes=int(floor_bytes),
                stages_us=stages,
                eager_us=_eager_call_us(layers[0], xd, ld[0]),
                flops=layer_flops(shape, m),
            )
        )
    return results


def _eager_call_us(layer: MoELayer, x: Any, logits: Any, calls: int = 200) -> float:
    """Wall microseconds per eager ``layer(x, logits)`` issued back to back, then one sync."""
    import time

    cupy = require_cupy()
    for _ in range(5):
        layer(x, logits)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        layer(x, logits)
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def _eager_stack(layers: Sequence[MoELayer], x: Any, logits: Sequence[Any]) -> Callable[[], None]:
    def run() -> None:
        for layer, lg in zip(layers, logits, strict=True):
            layer(x, lg)

    return run


def format_table(results: Sequence[BenchResult]) -> str:
    """Markdown table of ``results`` (the README and ``benchmarks/`` use this format)."""
    head = (
        "| preset | M | mode | µs/layer | floor µs | bound | % of floor | TB/s | TFLOP/s | route "
        "| fc1 | fc2 | finalize | eager µs/call |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    for r in results:
        st = [f"{r.stages_us[s]:.2f}" if s in r.stages_us else "—" for s in STAGES]
        rows.append(
            f"| {r.preset} {r.format} {r.dtype} | {r.tokens} | {r.mode} | {r.us_per_layer:.2f} "
            f"| {r.floor_us:.2f} | {r.bound} | {r.pct_of_floor:.0f} % | {r.effective_tbps:.2f} "
            f"| {r.tflops:.1f} | " + " | ".join(st) + f" | {r.eager_us:.1f} |"
        )
    return "\n".join([head, *rows])


def write_json(path: str, results: Sequence[BenchResult], *, gpu: str, command: str) -> None:
    """``results`` as one JSON document: the GPU, the HBM bandwidth of the floors, the command."""
    document = {
        "gpu": gpu,
        "hbm_read_tbps": HBM_READ_TBPS,
        "command": command,
        "results": [r.as_dict() for r in results],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1)


def write_csv(path: str, results: Sequence[BenchResult]) -> None:
    """``results`` as CSV: one row per result, the stage times as ``<stage>_us`` columns last."""
    flat = []
    for record in (r.as_dict() for r in results):
        stages = record.pop("stages_us")
        flat.append({**record, **{f"{s}_us": v for s, v in stages.items()}})
    fields = sorted({k for row in flat for k in row}, key=lambda k: (k.endswith("_us"), k))
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(flat)
