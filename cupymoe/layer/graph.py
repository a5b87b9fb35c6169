# SPDX-License-Identifier: Apache-2.0
"""CUDA graphs of whole layers (``record_graph``, ``LayerGraph``) and per-stage timing."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._runtime.backend import require_cupy
from .._runtime.timing import capture, median_event_us
from .._runtime.validate import ACTIVATION_DTYPES
from .device import STAGES, DeviceLayer

__all__ = ["LayerGraph", "record_graph", "record_in_place", "time_stages"]


class LayerGraph:
    """A CUDA graph of one or more layers with static input and output buffers.

    Write the inputs into :attr:`x` (first layer) and :attr:`logits` (one per layer), call
    :meth:`replay`, read :attr:`out` (the last layer's output). Replays run on :attr:`stream`:
    write the inputs on that stream (``with g.stream: g.x[...] = x``) or synchronise first.
    Layer ``i + 1`` reads layer ``i``'s output, like consecutive layers of a decode step.
    """

    def __init__(
        self,
        graph: Any,
        stream: Any,
        x: Any,
        logits: list[Any],
        out: Any,
        keep: Any,
        workspaces: Sequence[Any] = (),
    ) -> None:
        self._graph = graph
        self._keep = keep  # every buffer the graph's kernels address must outlive it
        #: Per layer, the graph's own intermediate buffers (``own_workspace``) or ``None``.
        self.workspaces = list(workspaces)
        self.stream = stream
        self.x = x
        self.logits = logits
        self.out = out

    def replay(self) -> Any:
        """Launch the recorded graph on its stream (asynchronous); returns :attr:`out`."""
        self._graph.launch(self.stream)
        return self.out

    def launch(self, stream: Any) -> None:
        """Launch the recorded graph on ``stream`` (asynchronous), ordered after what that stream
        already holds: the caller writes the inputs and reads :attr:`out` on the same stream."""
        self._graph.launch(stream)

    @property
    def exec_handle(self) -> int:
        """The ``cudaGraphExec_t`` handle, for ``cupy.cuda.runtime.graphLaunch(handle, stream)``
        (what :meth:`launch` calls, without looking up the stream's handle)."""
        return int(self._graph.graphExec)


def record_graph(
    layers: Sequence[Any],
    n_tokens: int,
    dtype: Any,
    *,
    logits_dtype: Any = np.float32,
    chain: bool = True,
    stages: Sequence[str] = STAGES,
    inputs: tuple[Any, Sequence[Any]] | None = None,
    own_workspace: bool = False,
) -> LayerGraph:
    """Record ``layers`` (``MoELayer`` objects, applied in sequence) into one CUDA graph.

    Inputs and outputs are static buffers of ``n_tokens`` tokens; all layers must share
    ``hidden``. With ``chain`` layer ``i + 1`` reads layer ``i``'s output (a decode step);
    without it every layer reads :attr:`LayerGraph.x`. ``stages`` restricts the recording to
    some stages (all run once, eagerly, before capture), for per-stage timing; ``inputs``
    ``(x, [logits per layer])`` fills the static buffers before that warm-up. ``own_workspace``:
    each layer's intermediate buffers (routing maps, FC1 and FC2 outputs) are the graph's own,
    sized for ``n_tokens``, instead of the layer's shared ones, so that replays never race with
    eager calls or with other graphs of the same layer on other streams. Every token count
    up to ``max_tokens`` can be recorded; ``ValueError`` for MXFP4 layers whose block scales need
    the batched fallback with ``dtype`` (it reads expert counts on the host).
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
    dtype = np.dtype(dtype)
    if dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"dtype: expected bfloat16 or float16, got {dtype}")
    logits_dtype = np.dtype(logits_dtype)
    if logits_dtype not in (np.dtype(np.float32), *ACTIVATION_DTYPES):  # what routing reads
        raise TypeError(f"logits_dtype: expected float32, bfloat16 or float16, got {logits_dtype}")
    devices = [layer.device_layer() for layer in layers]
    for i, dev in enumerate(devices):
        if not dev.capturable(dtype):
            raise ValueError(
                f"layers[{i}]: its MXFP4 block scales span more than the tensor cores fold "
                f"exactly with {dtype} activations; the batched fallback they need reads the "
                "host and cannot be recorded (use bfloat16 activations)"
            )
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:  # every buffer is written on the graph's stream: no race with other streams
        x = cupy.zeros((n_tokens, hidden), dtype)
        logits = [cupy.zeros((n_tokens, layer.n_experts), logits_dtype) for layer in layers]
        outs = [cupy.zeros((n_tokens, hidden), dtype) for _ in layers]
        workspaces = [dev.workspace(dtype, n_tokens) if own_workspace else None for dev in devices]
        if inputs is not None:
            x[...] = inputs[0]
            for buf, value in zip(logits, inputs[1], strict=True):
                buf[...] = value
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise ValueError(f"stages: expected names from {STAGES}, got {sorted(unknown)}")
    calls = []
    inp = x
    for dev, lg, out, ws in zip(devices, logits, outs, workspaces, strict=True):
        calls += dev.stage_calls(inp, lg, out, workspace=ws)
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
    return LayerGraph(
        graph, stream, x, logits, outs[-1], keep=(outs, devices), workspaces=workspaces
    )


def record_in_place(layer: Any, graph: LayerGraph, x: Any, logits: Any, out: Any) -> Any:
    """Record ``layer`` reading ``x`` and ``logits`` and writing ``out`` where they are, on the
    intermediate buffers of ``graph`` (one layer's graph recorded with ``own_workspace`` for the
    same token count, dtypes and layouts); returns the ``cupy.cuda.Graph``.

    Nothing runs: ``graph``'s recording has compiled the kernels, copied the router biases and
    filled the caches, and a capture reads and writes no memory, so the streams that write ``x``
    and ``logits`` or read ``out`` need not be synchronised. Launch it only on the one stream
    that launches ``graph`` (they share the intermediate buffers), and only with these arrays
    (or others at the same addresses with the same shapes, dtypes and strides).
    """
    cupy = require_cupy()
    workspace = graph.workspaces[0]
    if len(graph.workspaces) != 1 or workspace is None:
        raise ValueError("graph: expected one layer's graph recorded with own_workspace=True")
    calls = layer.device_layer().stage_calls(x, logits, out, workspace=workspace)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            for _, call in calls:
                call()
        finally:
            captured = stream.end_capture()
    return captured


def time_stages(device: DeviceLayer, x: Any, logits: Any, *, repeats: int) -> dict[str, float]:
    """Median microseconds per stage: each stage recorded into a graph, replayed between events."""
    cupy = require_cupy()
    out = cupy.empty((x.shape[0], device.layer.hidden), x.dtype)
    calls = device.stage_calls(x, logits, out)
    stream = cupy.cuda.Stream(non_blocking=True)
    if not device.capturable(x.dtype):  # batched fallback: time the eager calls
        return {name: median_event_us(call, stream, repeats=repeats) for name, call in calls}
    with stream:
        for _, call in calls:  # every stage once, in order: later stages read earlier outputs
            call()
    graphs = [(name, capture(call, stream)) for name, call in calls]
    return {
        name: median_event_us(functools.partial(graph.launch, stream), stream, repeats=repeats)
        for name, graph in graphs
    }
