# SPDX-License-Identifier: Apache-2.0
"""The GPU side of ``MoELayer``: prepared weights, workspaces, eager calls and CUDA graphs.

Weights are uploaded and re-laid out once. Workspaces (routing maps, FC1 and FC2 outputs) are
allocated for ``max_tokens`` once per activation dtype, so an eager call allocates only its
output and a graph replay allocates nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from ._backend import require_cupy
from ._timing import capture, median_event_us
from .finalize import finalize
from .gemv import ROW_WINDOW, fc1, fc2, prepare_fc1, prepare_fc2
from .routing import Routing, route

__all__ = ["DeviceLayer", "LayerGraph", "record_graph"]

#: The stages of one call, in order (``stage_times`` reports them under these names).
STAGES = ("route", "fc1", "fc2", "finalize")


@dataclasses.dataclass
class _Workspace:
    routing: Routing  # buffers for max_tokens; .prefix(M) gives the views of one call
    h: Any  # [max_tokens * k, I] FC1 output (expanded order)
    y: Any  # [max_tokens * k, H] FC2 output (expanded order)


class DeviceLayer:
    """Prepared device state of one :class:`~cupymoe.moe.MoELayer` (built on first GPU use)."""

    def __init__(self, layer: Any) -> None:
        cupy = require_cupy()
        self.layer = layer
        self.device_id = cupy.cuda.Device().id
        self.fc1_weights = prepare_fc1(
            layer.gate,
            layer.up,
            gate_bias=layer.gate_bias,
            up_bias=layer.up_bias,
            pair_interleaved=layer.pair_interleaved,
            gemv_order=layer.gemv_order,
        )
        self.fc2_weights = prepare_fc2(
            layer.down,
            bias=layer.fc2_bias,
            pair_interleaved=layer.pair_interleaved,
            gemv_order=layer.gemv_order,
        )
        self._workspaces: dict[np.dtype, _Workspace] = {}

    def workspace(self, dtype: Any) -> _Workspace:
        """Buffers for ``max_tokens`` tokens of activation ``dtype`` (allocated once)."""
        dtype = np.dtype(dtype)
        ws = self._workspaces.get(dtype)
        if ws is None:
            cupy = require_cupy()
            layer = self.layer
            rows = layer.max_tokens * layer.top_k
            ws = _Workspace(
                routing=Routing.empty(layer.max_tokens, layer.n_experts, layer.top_k, xp=cupy),
                h=cupy.empty((rows, layer.intermediate), dtype),
                y=cupy.empty((rows, layer.hidden), dtype),
            )
            self._workspaces[dtype] = ws
        return ws

    def stage_calls(self, x: Any, logits: Any, out: Any) -> list[tuple[str, Callable[[], Any]]]:
        """The four stage launches of one call on fixed buffers, as ``(name, call)`` pairs."""
        layer = self.layer
        m = int(x.shape[0])
        rows = m * layer.top_k
        ws = self.workspace(x.dtype)
        routing = ws.routing.prefix(m)
        h, y = ws.h[:rows], ws.y[:rows]
        # Programmatic dependent launches (cupymoe/_launch.py): each stage starts while the one
        # before it finishes; FC2 and finalize read the routing maps before their wait, which is
        # sound because the stage before each of them ran after routing had completed.
        return [
            ("route", lambda: route(logits, layer.router, out=routing, pdl=True)),
            (
                "fc1",
                lambda: fc1(x, self.fc1_weights, routing, act=layer.activation, out=h, pdl=True),
            ),
            ("fc2", lambda: fc2(h, self.fc2_weights, routing, out=y, pdl=True)),
            ("finalize", lambda: finalize(y, routing, out=out, pdl=True)),
        ]

    def run(self, x: Any, logits: Any, *, out: Any = None) -> Any:
        """One eager call on the current stream; allocates only ``out`` when it is not given."""
        cupy = require_cupy()
        if out is None:
            out = cupy.empty((x.shape[0], self.layer.hidden), x.dtype)
        if x.shape[0] == 0:
            return out
        for _, call in self.stage_calls(x, logits, out):
            call()
        return out

    def capturable(self, n_tokens: int) -> bool:
        """Whether a call with ``n_tokens`` stays on the GEMV path (which a graph can record)."""
        return n_tokens * self.layer.top_k <= ROW_WINDOW


class LayerGraph:
    """A CUDA graph of one or more layers with static input and output buffers.

    Write the inputs into :attr:`x` (first layer) and :attr:`logits` (one per layer), call
    :meth:`replay`, read :attr:`out` (the last layer's output). Replays run on :attr:`stream`:
    write the inputs on that stream (``with g.stream: g.x[...] = x``) or synchronise first.
    Layer ``i + 1`` reads layer ``i``'s output, like consecutive layers of a decode step.
    """

    def __init__(
        self, graph: Any, stream: Any, x: Any, logits: list[Any], out: Any, keep: Any
    ) -> None:
        self._graph = graph
        self._keep = keep  # every buffer the graph's kernels address must outlive it
        self.stream = stream
        self.x = x
        self.logits = logits
        self.out = out

    def replay(self) -> Any:
        """Launch the recorded graph on its stream (asynchronous); returns :attr:`out`."""
        self._graph.launch(self.stream)
        return self.out


def record_graph(
    layers: Sequence[Any],
    n_tokens: int,
    dtype: Any,
    *,
    logits_dtype: Any = np.float32,
    chain: bool = True,
    stages: Sequence[str] = STAGES,
    inputs: tuple[Any, Sequence[Any]] | None = None,
) -> LayerGraph:
    """Record ``layers`` (``MoELayer`` objects, applied in sequence) into one CUDA graph.

    Inputs and outputs are static buffers of ``n_tokens`` tokens; all layers must share
    ``hidden``. With ``chain`` layer ``i + 1`` reads layer ``i``'s output (a decode step);
    without it every layer reads :attr:`LayerGraph.x`. ``stages`` restricts the recording to
    some stages (all run once, eagerly, before capture), for per-stage timing; ``inputs``
    ``(x, [logits per layer])`` fills the static buffers before that warm-up. Raises
    ``ValueError`` when a layer's expanded rows exceed the GEMV row window
    (the batched path reads expert counts on the host and cannot be recorded).
    """
    cupy = require_cupy()
    if not layers:
        raise ValueError("layers: expected at least one MoELayer")
    hidden = layers[0].hidden
    for i, layer in enumerate(layers):
        if layer.hidden != hidden:
            raise ValueError(f"layers[{i}]: hidden {layer.hidden} differs from {hidden}")
        if n_tokens < 1 or n_tokens > layer.max_tokens:
            raise ValueError(f"n_tokens: expected 1..{layer.max_tokens}, got {n_tokens}")
        if n_tokens * layer.top_k > ROW_WINDOW:
            raise ValueError(
                f"n_tokens: {n_tokens} tokens x top_k {layer.top_k} exceed the GEMV row window "
                f"({ROW_WINDOW}); larger batches take the batched path, which cannot be recorded"
            )
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        raise TypeError(f"dtype: expected bfloat16 or float16, got {dtype}")
    logits_dtype = np.dtype(logits_dtype)
    if logits_dtype not in (np.dtype(np.float32), np.dtype(np.float16), dtype):
        raise TypeError(f"logits_dtype: expected float32, float16 or {dtype}, got {logits_dtype}")
    devices = [layer._device() for layer in layers]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # every buffer is written on the graph's stream: no race with other streams
        x = cupy.zeros((n_tokens, hidden), dtype)
        logits = [cupy.zeros((n_tokens, layer.n_experts), logits_dtype) for layer in layers]
        outs = [cupy.zeros((n_tokens, hidden), dtype) for _ in layers]
        if inputs is not None:
            x[...] = inputs[0]
            for buf, value in zip(logits, inputs[1], strict=True):
                buf[...] = value
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"stages: expected names from {STAGES}, got {sorted(unknown)}")
    calls = []
    inp = x
    for dev, lg, out in zip(devices, logits, outs, strict=True):
        calls += dev.stage_calls(inp, lg, out)
        inp = out if chain else x
    with stream:
        for _, call in calls:  # warm-up: compiles kernels, copies router biases, fills caches
            call()
        stream.synchronize()
        stream.begin_capture()
        try:
            for name, call in calls:
                if name in stages:
                    call()
        finally:
            graph = stream.end_capture()
    graph.upload(stream)
    stream.synchronize()
    return LayerGraph(graph, stream, x, logits, outs[-1], keep=(outs, devices))


def time_stages(device: DeviceLayer, x: Any, logits: Any, *, repeats: int) -> dict[str, float]:
    """Median microseconds per stage: each stage recorded into a graph, replayed between events."""
    cupy = require_cupy()
    out = cupy.empty((x.shape[0], device.layer.hidden), x.dtype)
    calls = device.stage_calls(x, logits, out)
    stream = cupy.cuda.Stream(non_blocking=True)
    if not device.capturable(int(x.shape[0])):  # batched path: time the eager calls
        return {name: median_event_us(call, stream, repeats=repeats) for name, call in calls}
    with stream:
        for _, call in calls:  # every stage once, in order: later stages read earlier outputs
            call()
    graphs = [(name, capture(call, stream)) for name, call in calls]
    return {
        name: median_event_us(functools.partial(graph.launch, stream), stream, repeats=repeats)
        for name, graph in graphs
    }
