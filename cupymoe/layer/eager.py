# SPDX-License-Identifier: Apache-2.0
"""Eager calls as CUDA-graph replays: one recorded graph per token count, dtypes and stream.

Launching the four stages from Python costs far more host time than the GPU spends on them at
decode sizes: each launch goes through argument marshalling and ``cuLaunchKernelEx`` by
``ctypes``, and each stage re-derives its tiling and re-checks its arguments (434 µs of host time
per call against 12 µs of GPU time, Qwen3.6-35B-A3B M = 1 on the H200). None of that depends on
the data, so :class:`EagerGraphs` records the layer once per plan key into a CUDA graph with its
own static buffers and replays it: a call is two input copies (``cudaMemcpyAsync`` on the
current stream), one graph launch on that stream and one output copy.

Plan key: ``(n_tokens, x dtype, logits dtype, stream handle)``. The stream: the static buffers
of a graph are written by every call that replays it; a graph per stream keeps calls on
different streams from racing (calls on one stream are ordered by it), and each graph has its
intermediate buffers to itself (``record_graph(own_workspace=True)``).

Read once, when a graph is recorded (:data:`RECORDED_ONCE`): the GEMV tiling override
``CUPYMOE_GEMV_CONFIG``, ``CUPYMOE_PDL``, ``CUPYMOE_CLUSTERS`` and the tuning cache. A graph keeps
the tilings and launch kinds it was recorded with until :meth:`EagerGraphs.clear`
(``MoELayer.clear_cache``); the next call then records with the values of that moment. Reading
three environment variables on every call would cost 2-7 µs of host time, a quarter of the budget
of a call.

At most :data:`MAX_GRAPHS` graphs per layer are kept (least recently used first out); evicting
one synchronises the device first, because its buffers go back to CuPy's pool, which may hand
them out again while a replay could still be reading them.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .._runtime.backend import require_cupy
from .._runtime.launch import ENV_CLUSTERS, ENV_PDL
from ..experts.config import ENV_GEMV_CONFIG
from .graph import LayerGraph, record_graph

__all__ = ["MAX_GRAPHS", "RECORDED_ONCE", "EagerGraphs", "GraphCache", "plan_key"]

#: Graphs kept per layer. A decode loop uses one; a server that pads to a few token counts,
#: with one stream per request queue, a handful. Each holds its static inputs, output and
#: intermediate buffers for its token count (Qwen3.6 M = 1: 50 kB; DeepSeek-V3 M = 64: 11 MB).
MAX_GRAPHS = 8

#: What a graph reads when it is recorded and keeps until ``MoELayer.clear_cache``: environment
#: variables, and the tuning cache (``"tune-cache"``, memoised per process anyway).
RECORDED_ONCE = (ENV_GEMV_CONFIG, ENV_PDL, ENV_CLUSTERS, "tune-cache")

# cudaMemcpyKind (cuda_runtime_api.h)
_HOST_TO_DEVICE, _DEVICE_TO_HOST, _DEVICE_TO_DEVICE = 1, 2, 3
_PER_THREAD_STREAM = 2  # cudaStreamPerThread


def plan_key(n_tokens: int, dtype: Any, logits_dtype: Any, stream_handle: int) -> Hashable:
    """The key of a call's graph: its token count, dtypes and stream (see the module docstring).
    The per-thread default stream is one handle for a stream per thread: the thread joins it."""
    if stream_handle == _PER_THREAD_STREAM:
        return (n_tokens, dtype, logits_dtype, stream_handle, threading.get_ident())
    return (n_tokens, dtype, logits_dtype, stream_handle)


class GraphCache:
    """A mapping of at most ``capacity`` entries that forgets the least recently used first.

    ``on_evict(value)`` runs before an evicted value is dropped.
    """

    def __init__(self, capacity: int, on_evict: Callable[[Any], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: expected >= 1, got {capacity}")
        self.capacity = capacity
        self._on_evict = on_evict
        self._items: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

    def get(self, key: Hashable) -> Any:
        """The value of ``key`` (now the most recently used), or ``None``."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            _, old = self._items.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(old)

    def clear(self) -> None:
        """Forget every entry (each passed to ``on_evict``)."""
        while self._items:
            _, old = self._items.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(old)

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _synchronize_device(_: Any) -> None:
    require_cupy().cuda.runtime.deviceSynchronize()


class EagerGraphs:
    """The recorded graphs of one ``MoELayer``'s eager calls (see the module docstring).

    :meth:`call_device` and :meth:`call_host` take inputs already checked by
    ``MoELayer.check_inputs`` (and ``out`` by its ``_check_out``) and return ``None`` when the
    call cannot be a replay: the layer's weights need the uncapturable batched fallback with
    this dtype, or the current stream is capturing (a replay inside someone else's capture).
    """

    def __init__(self, layer: Any, capacity: int = MAX_GRAPHS) -> None:
        self.layer = layer
        self.graphs = GraphCache(capacity, on_evict=_synchronize_device)
        self._record_lock = threading.Lock()  # two threads missing at once record one graph

    def clear(self) -> None:
        """Drop every graph: the next call records again (after the tuning cache changed)."""
        self.graphs.clear()

    def graph_for(self, m: int, dtype: Any, logits_dtype: Any, stream: Any) -> LayerGraph | None:
        """The graph of ``m`` tokens for ``stream`` (recorded on the first call), or ``None``
        when the current stream is capturing or the layer cannot be recorded with ``dtype``."""
        if _capturing(stream):
            return None
        key = plan_key(m, dtype, logits_dtype, stream.ptr)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph
        if not self.layer.device_layer().capturable(dtype):
            return None
        with self._record_lock:
            graph = self.graphs.get(key)
            if graph is None:
                graph = record_graph(
                    [self.layer], m, dtype, logits_dtype=logits_dtype, own_workspace=True
                )
                self.graphs.put(key, graph)
        return graph

    def call_device(self, x: Any, logits: Any, out: Any) -> Any:
        """``layer(x, logits, out=out)`` for CuPy arrays as a replay on the current stream;
        ``None`` when it cannot be one. Allocates only the result when ``out`` is ``None``."""
        cupy = require_cupy()
        stream = cupy.cuda.get_current_stream()
        m = x.shape[0]
        graph = self.graph_for(m, x.dtype, logits.dtype, stream)
        if graph is None:
            return None
        memcpy = cupy.cuda.runtime.memcpyAsync
        s = stream.ptr
        memcpy(graph.x.data.ptr, x.data.ptr, x.nbytes, _DEVICE_TO_DEVICE, s)
        dst = graph.logits[0]
        if m == 1 or logits.flags.c_contiguous:
            memcpy(dst.data.ptr, logits.data.ptr, dst.nbytes, _DEVICE_TO_DEVICE, s)
        else:  # rows with a larger stride (check_inputs accepts them): one 2-D copy
            width = dst.strides[0]
            cupy.cuda.runtime.memcpy2DAsync(
                dst.data.ptr,
                width,
                logits.data.ptr,
                logits.strides[0],
                width,
                m,
                _DEVICE_TO_DEVICE,
                s,
            )
        graph.launch(stream)
        if out is None:
            out = cupy.empty(graph.out.shape, graph.out.dtype)
        memcpy(out.data.ptr, graph.out.data.ptr, graph.out.nbytes, _DEVICE_TO_DEVICE, s)
        return out

    def call_host(self, x: np.ndarray, logits: np.ndarray, out: Any) -> Any:
        """``layer(x, logits, out=out)`` for NumPy arrays as a replay: the inputs copied from the
        host into the graph's buffers, the output copied back; returns once it is on the host.
        ``None`` when it cannot be a replay."""
        cupy = require_cupy()
        stream = cupy.cuda.get_current_stream()
        x = np.ascontiguousarray(x)
        logits = np.ascontiguousarray(logits)
        graph = self.graph_for(x.shape[0], x.dtype, logits.dtype, stream)
        if graph is None:
            return None
        memcpy = cupy.cuda.runtime.memcpyAsync
        s = stream.ptr
        # From pageable memory the driver stages the bytes before returning: x may be reused.
        memcpy(graph.x.data.ptr, x.ctypes.data, x.nbytes, _HOST_TO_DEVICE, s)
        memcpy(graph.logits[0].data.ptr, logits.ctypes.data, logits.nbytes, _HOST_TO_DEVICE, s)
        graph.launch(stream)
        direct = out is not None and out.flags.c_contiguous
        result = out if direct else np.empty(graph.out.shape, graph.out.dtype)
        memcpy(result.ctypes.data, graph.out.data.ptr, graph.out.nbytes, _DEVICE_TO_HOST, s)
        stream.synchronize()  # a copy to pageable memory returns when done; this makes it explicit
        if out is not None and not direct:
            out[...] = result
            return out
        return result


def _capturing(stream: Any) -> bool:
    """Whether ``stream`` is being captured into someone else's graph (then no replay: a graph
    launch and a recording have no place in a capture). A stream the driver will not query
    counts as capturing."""
    try:
        return bool(stream.is_capturing())
    except Exception:  # cudaErrorStreamCaptureImplicit on the legacy stream during a capture
        return True
