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
intermediate buffers to itself (``record_graph(own_workspace=True)``). The two default streams
(the legacy one, every thread's current stream unless it picks another, and the per-thread
one) are one handle for all threads, so on them the key also names the thread: two threads'
copies into one graph's buffers would interleave with their launches.

The hit path (:meth:`EagerGraphs.hit`). Once a stream has run a graph, the next call on that
stream with the same token count is matched by identity and integer comparisons against a
:class:`Replay`, which holds everything the call needs as plain ints (buffer addresses, byte
counts, the graph's executable handle): no plan key is built, no dtype is normalised, and the
copies and the launch are direct ``cupy.cuda.runtime`` calls. Anything unusual (another dtype,
strided logits, a subclass, bad input) falls through to the checked path, which raises for bad
input before any kernel runs.

In place (:data:`BIND_AFTER`): a decode loop that passes the same ``x``, ``router_logits`` and
``out`` buffers call after call (or drops each result before the next call, so that the pool
hands the same block out again) gets, after :data:`BIND_AFTER` such calls, a second graph of the
same stages recorded on those very buffers, and its calls are one graph launch without copies.
Such a graph shares the intermediate buffers of the graph it was derived from and is launched on
the same stream; it is only launched when all three addresses match, so it reads and writes the
caller's arrays and nothing else. At most :data:`MAX_BOUND` are kept per graph and at most
:data:`BIND_BUDGET` are ever recorded for it (a caller whose buffers never settle pays a bounded
number of captures, then always copies). ``MoELayer.in_place_graphs = False`` turns these
recordings off: a capture fails if another thread synchronises the device while it runs (an
in-place one is then dropped and the call goes on with the copies, the error kept on the
:class:`Replay`), so a server that synchronises from other threads may prefer that no capture
starts in the middle of its decode loop. The first call of each token count, dtypes and stream
still records the layer's graph (warm those up first, or call with ``replay=False``). Not
bound: addresses that are not 16-byte aligned (the kernels would take other specialisations),
arrays on another device than the layer's, an ``out`` that overlaps an input, and any recording
after an environment variable of :data:`RECORDED_ONCE` changed (the new graph would take other
tilings than the one it stands in for). A tuning cache read again in the same process
(``cupymoe tune``, ``cupymoe.experts.cache.clear_cache``) is not detected: an in-place graph
recorded after it takes the new tilings; call ``MoELayer.clear_cache`` after it, as for the
variables.

Read once, when a graph is recorded (:data:`RECORDED_ONCE`): the tuning cache, the GEMV tiling
override ``CUPYMOE_GEMV_CONFIG``, ``CUPYMOE_PDL``, ``CUPYMOE_CLUSTERS`` and ``CUPYMOE_WGMMA``. A
graph keeps the tilings, backends and launch kinds it was recorded with until
:meth:`EagerGraphs.clear` (``MoELayer.clear_cache``); the next call then records with the values
of that moment. Reading four environment variables on every call would cost 2-7 µs of host time,
a quarter of the budget of a call.

At most :data:`MAX_GRAPHS` graphs per layer are kept (least recently used first out); evicting
one synchronises the device first, because its buffers go back to CuPy's pool, which may hand
them out again while a replay could still be reading them.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .._runtime.backend import cupy_or_none
from .._runtime.launch import ENV_CLUSTERS, ENV_PDL
from ..experts.config import ENV_GEMV_CONFIG
from ..experts.gemm import ENV_WGMMA
from .graph import LayerGraph, record_graph, record_in_place

__all__ = [
    "BIND_AFTER",
    "BIND_BUDGET",
    "MAX_BOUND",
    "MAX_GRAPHS",
    "RECORDED_ONCE",
    "CudaCalls",
    "EagerGraphs",
    "GraphCache",
    "Replay",
    "plan_key",
]

#: Graphs kept per layer. A decode loop uses one; a server that pads to a few token counts,
#: with one stream per request queue, a handful. Each holds its static inputs, output and
#: intermediate buffers for its token count (Qwen3.6 M = 1: 50 kB; DeepSeek-V3 M = 64: 11 MB).
MAX_GRAPHS = 8

#: What a graph reads when it is recorded and keeps until ``MoELayer.clear_cache``: environment
#: variables, and the tuning cache (``"tune-cache"``, memoised per process anyway).
RECORDED_ONCE = (ENV_GEMV_CONFIG, ENV_PDL, ENV_CLUSTERS, ENV_WGMMA, "tune-cache")

#: Calls with the same ``(x, router_logits, out)`` addresses on one graph after which a graph is
#: recorded on those buffers (one capture of the four stages, without their warm-up run).
BIND_AFTER = 3
#: In-place graphs kept per recorded graph: two, because a loop that keeps each result alive
#: until the next call returns alternates between two output blocks of the pool.
MAX_BOUND = 2
#: In-place recordings per recorded graph, ever (until ``clear_cache``).
BIND_BUDGET = 8

# cudaMemcpyKind (cuda_runtime_api.h)
_HOST_TO_DEVICE, _DEVICE_TO_HOST, _DEVICE_TO_DEVICE = 1, 2, 3
_PER_THREAD_STREAM = 2  # cudaStreamPerThread
#: Handles shared by threads: the legacy default stream (every thread's current stream unless it
#: picks another) and the per-thread default stream. Their graphs are kept per thread, since two
#: threads' copies into one graph's buffers would interleave with the launches.
_SHARED_HANDLES = (0, _PER_THREAD_STREAM)
_ALIGN = 16  # the GEMV and finalize load 16 bytes at a time (other specialisations otherwise)


def plan_key(n_tokens: int, dtype: Any, logits_dtype: Any, stream_handle: int) -> Hashable:
    """The key of a call's graph: its token count, dtypes and stream (see the module docstring).
    The default streams are one handle for every thread: the thread joins the key."""
    if stream_handle in _SHARED_HANDLES:
        return (n_tokens, dtype, logits_dtype, stream_handle, threading.get_ident())
    return (n_tokens, dtype, logits_dtype, stream_handle)


def hit_key(stream_handle: int, x_size: int) -> Hashable:
    """The key of :attr:`EagerGraphs.last`: a stream (a thread's, for the default streams) and
    ``x.size``, which is ``n_tokens * hidden`` for every input of the layer."""
    if stream_handle in _SHARED_HANDLES:
        return (stream_handle, x_size, threading.get_ident())
    return (stream_handle, x_size)


def _environment() -> tuple[str | None, ...]:
    """The values of :data:`RECORDED_ONCE`'s environment variables."""
    return tuple(os.environ.get(name) for name in RECORDED_ONCE if name.startswith("CUPYMOE_"))


@dataclasses.dataclass(frozen=True)
class CudaCalls:
    """The CuPy entry points a replay calls, looked up once per layer (tests pass fakes)."""

    ndarray: Any  # cupy.ndarray: its constructor allocates a result (one pool allocation)
    current_stream: Callable[[], Any]  # cupy.cuda.get_current_stream
    memcpy: Callable[[int, int, int, int, int], Any]  # runtime.memcpyAsync(dst, src, n, kind, s)
    memcpy2d: Callable[..., Any]  # runtime.memcpy2DAsync
    graph_launch: Callable[[int, int], Any]  # runtime.graphLaunch(graph_exec, stream)
    is_capturing: Callable[[int], bool]  # runtime.streamIsCapturing(stream)
    synchronize: Callable[[], Any]  # runtime.deviceSynchronize

    @classmethod
    def from_cupy(cls) -> CudaCalls | None:
        """The real entry points, or ``None`` without CuPy."""
        cupy = cupy_or_none()
        if cupy is None:
            return None
        rt = cupy.cuda.runtime
        return cls(
            ndarray=cupy.ndarray,
            current_stream=cupy.cuda.get_current_stream,
            memcpy=rt.memcpyAsync,
            memcpy2d=rt.memcpy2DAsync,
            graph_launch=rt.graphLaunch,
            is_capturing=rt.streamIsCapturing,
            synchronize=rt.deviceSynchronize,
        )


class Replay:
    """One recorded graph and what a call that replays it needs, precomputed.

    A call matches when ``x.dtype is dtype``, ``x.strides == strides``, ``len(x) == n_tokens``,
    ``x`` is on the graph's device (``device_id``: every device's legacy stream is handle 0),
    the same for the logits (``logits_*``; their row count is ``n_tokens`` too) and, when given,
    for ``out`` (``x``'s). ``x.size`` and the stream are the key it was found under. Then the
    call copies ``x_nbytes`` to ``x_dst`` and ``logits_nbytes`` to ``logits_dst``, launches
    ``graph_exec`` and copies ``x_nbytes`` from ``out_src``; or, when ``(x, logits, out)``
    addresses are a key of :attr:`bound`, launches that graph alone.
    """

    __slots__ = (
        "bind_error",
        "binds_left",
        "bound",
        "device_id",
        "dtype",
        "environment",
        "graph",
        "graph_exec",
        "key",
        "logits_dst",
        "logits_dtype",
        "logits_nbytes",
        "logits_size",
        "logits_strides",
        "n_tokens",
        "out_shape",
        "out_src",
        "seen",
        "strides",
        "x_dst",
        "x_nbytes",
    )

    def __init__(self, key: Hashable, graph: LayerGraph, environment: tuple[Any, ...]) -> None:
        logits = graph.logits[0]
        self.key = key
        self.graph = graph  # holds the static and intermediate buffers the handles address
        self.graph_exec: int = graph.exec_handle
        self.n_tokens: int = int(graph.x.shape[0])
        self.dtype = graph.x.dtype
        self.device_id: int = graph.x.data.device_id
        self.strides: tuple[int, ...] = tuple(graph.x.strides)
        self.logits_dtype = logits.dtype
        self.logits_strides: tuple[int, ...] = tuple(logits.strides)
        self.logits_size: int = int(logits.size)
        self.x_dst: int = graph.x.data.ptr
        self.x_nbytes: int = int(graph.x.nbytes)
        self.logits_dst: int = logits.data.ptr
        self.logits_nbytes: int = int(logits.nbytes)
        self.out_src: int = graph.out.data.ptr
        self.out_shape: tuple[int, ...] = tuple(graph.out.shape)
        self.environment = environment  # RECORDED_ONCE's variables when it was recorded
        #: In-place graphs by ``(x, logits, out)`` address (oldest first), and how many calls on
        #: the copy path saw each recent address triple.
        self.bound: dict[tuple[int, int, int], Any] = {}
        self.seen: dict[tuple[int, int, int], int] = {}
        self.binds_left = BIND_BUDGET
        self.bind_error: Exception | None = None  # why recording an in-place graph failed


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
        #: ``touch(key)``: mark ``key`` the most recently used (``KeyError`` when absent); the
        #: dict's own method, without a Python frame around it (every replay calls it).
        self.touch: Callable[[Hashable], None] = self._items.move_to_end

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


class EagerGraphs:
    """The recorded graphs of one ``MoELayer``'s eager calls (see the module docstring).

    :meth:`hit` takes unchecked CuPy inputs and serves only calls it can match to a graph this
    stream ran; :meth:`call_device` and :meth:`call_host` take inputs already checked by
    ``MoELayer.check_inputs`` (and ``out`` by its ``_check_out``). All three return ``None``
    when the call is not a replay: for :meth:`hit` anything it does not match, for the others
    a layer whose weights need the uncapturable batched fallback with this dtype, or a current
    stream that is capturing (a replay inside someone else's capture).
    """

    def __init__(
        self,
        layer: Any,
        capacity: int = MAX_GRAPHS,
        *,
        cuda: CudaCalls | None = None,
        in_place: bool = True,
    ) -> None:
        self.layer = layer
        #: Whether graphs are recorded on callers' buffers (``MoELayer.in_place_graphs``); off,
        #: no such capture starts, and graphs recorded before keep serving their buffers.
        self.in_place = in_place
        self.graphs = GraphCache(capacity, on_evict=self._evict)
        #: The graph each stream (and ``x.size``) replayed last: what :meth:`hit` matches.
        self.last: dict[Hashable, Replay] = {}
        self._cuda = CudaCalls.from_cupy() if cuda is None else cuda
        self._record_lock = threading.Lock()  # two threads missing at once record one graph

    def clear(self) -> None:
        """Drop every graph: the next call records again (after the tuning cache changed)."""
        self.last.clear()
        self.graphs.clear()

    def _evict(self, replay: Replay) -> None:
        for key, r in list(self.last.items()):
            if r is replay:
                self.last.pop(key, None)
        # Its buffers go back to the pool: no replay may still read them.
        if self._cuda is not None:
            self._cuda.synchronize()

    def graph_for(self, m: int, dtype: Any, logits_dtype: Any, stream: Any) -> Replay | None:
        """The graph of ``m`` tokens for ``stream`` (recorded on the first call), or ``None``
        when the current stream is capturing or the layer cannot be recorded with ``dtype``."""
        if _capturing(stream):
            return None
        key = plan_key(m, dtype, logits_dtype, stream.ptr)
        replay = self.graphs.get(key)
        if replay is not None:
            return replay
        if not self.layer.device_layer().capturable(dtype):
            return None
        with self._record_lock:
            replay = self.graphs.get(key)
            if replay is None:
                graph = record_graph(
                    [self.layer], m, dtype, logits_dtype=logits_dtype, own_workspace=True
                )
                replay = Replay(key, graph, _environment())
                self.graphs.put(key, replay)
        return replay

    def hit(self, x: Any, logits: Any, out: Any) -> Any:
        """``layer(x, logits, out=out)`` when the current stream last replayed a graph of
        ``x.size`` elements and these arrays match it (:class:`Replay`), else ``None``.

        Unchecked inputs: anything that does not match exactly (another dtype or layout, a
        NumPy array, a subclass, a wrong shape) returns ``None`` before any CUDA call, and the
        caller's checked path takes it."""
        cuda = self._cuda
        if cuda is None:
            return None
        ndarray = cuda.ndarray
        if type(x) is not ndarray or type(logits) is not ndarray:
            return None
        stream = cuda.current_stream().ptr
        size = x.size
        # hit_key, inlined: a Python call costs a tenth of this method
        if stream not in _SHARED_HANDLES:
            r = self.last.get((stream, size))
        else:
            r = self.last.get((stream, size, threading.get_ident()))
        # strides first: a 2-tuple makes len() safe; len and size then fix the shape
        if (
            r is None
            or x.dtype is not r.dtype
            or x.strides != r.strides
            or x.data.device_id != r.device_id
            or len(x) != r.n_tokens
            or logits.dtype is not r.logits_dtype
            or logits.strides != r.logits_strides
            or len(logits) != r.n_tokens
            or logits.size != r.logits_size
        ):
            return None
        if out is not None and (
            type(out) is not ndarray
            or out.dtype is not r.dtype
            or out.strides != r.strides
            or len(out) != r.n_tokens
            or out.size != size
        ):
            return None
        try:
            if cuda.is_capturing(stream):
                return None
        except Exception:  # the legacy stream during a capture: the checked path decides
            return None
        if out is None:
            out = ndarray(r.out_shape, r.dtype)
        self._replay(r, x, logits, out, stream)
        try:
            self.graphs.touch(r.key)
        except KeyError:
            # Evicted by another thread between the lookup and this replay: its synchronisation
            # may have come before this launch, and the buffers go back to the pool with the
            # last reference to r, so the work queued here must finish first.
            cuda.synchronize()
        return out

    def _replay(self, r: Replay, x: Any, logits: Any, out: Any, stream: int) -> None:
        """Copies and launch of one call whose arrays match ``r``."""
        cuda = self._cuda
        assert cuda is not None  # every caller has checked
        addresses = (x.data.ptr, logits.data.ptr, out.data.ptr)
        if r.bound:
            bound = r.bound.get(addresses)
            if bound is not None:
                cuda.graph_launch(bound.graphExec, stream)
                return
        memcpy = cuda.memcpy
        memcpy(r.x_dst, addresses[0], r.x_nbytes, _DEVICE_TO_DEVICE, stream)
        memcpy(r.logits_dst, addresses[1], r.logits_nbytes, _DEVICE_TO_DEVICE, stream)
        cuda.graph_launch(r.graph_exec, stream)
        memcpy(addresses[2], r.out_src, r.x_nbytes, _DEVICE_TO_DEVICE, stream)
        if r.binds_left > 0 and self.in_place:
            self._count(r, addresses, x, logits, out)

    def _count(
        self, r: Replay, addresses: tuple[int, int, int], x: Any, logits: Any, out: Any
    ) -> None:
        """Count a copy-path call's addresses; record an in-place graph at :data:`BIND_AFTER`."""
        seen = r.seen
        n = seen.get(addresses, 0) + 1
        if n < BIND_AFTER:
            if len(seen) >= 4 * MAX_BOUND:  # addresses that never settle: keep the table small
                seen.clear()
            seen[addresses] = n
            return
        seen.pop(addresses, None)
        with self._record_lock:
            if r.binds_left <= 0 or addresses in r.bound:
                return
            graph = self._record_bound(r, x, logits, out)
            if graph is None:
                return
            if len(r.bound) >= MAX_BOUND:  # an in-flight graph is freed when it completes
                del r.bound[next(iter(r.bound))]
            r.bound[addresses] = graph

    def _record_bound(self, r: Replay, x: Any, logits: Any, out: Any) -> Any:
        """The in-place graph of ``r`` on these arrays, or ``None`` where one must not be made
        (see the module docstring)."""
        if _environment() != r.environment:
            r.binds_left = 0  # read once: a graph recorded now would take other tilings
            return None
        if x.data.ptr % _ALIGN or logits.data.ptr % _ALIGN or out.data.ptr % _ALIGN:
            return None
        device = self.layer.device_layer().device_id
        if any(a.data.device_id != device for a in (x, logits, out)):
            return None  # copies reach another device's memory; the layer's kernels do not
        o0, o1 = out.data.ptr, out.data.ptr + out.nbytes
        for a in (x, logits):
            if a.data.ptr < o1 and o0 < a.data.ptr + a.nbytes:
                return None  # safe with the copies; in place it would rest on the stage order
        r.binds_left -= 1  # the budget counts captures, not refusals
        try:
            return record_in_place(self.layer, r.graph, x, logits, out)
        except Exception as error:  # the copies keep working; the error is kept for a look
            r.binds_left = 0
            r.bind_error = error
            return None

    def call_device(self, x: Any, logits: Any, out: Any) -> Any:
        """``layer(x, logits, out=out)`` for CuPy arrays as a replay on the current stream;
        ``None`` when it cannot be one. Allocates only the result when ``out`` is ``None``."""
        cuda = self._cuda
        assert cuda is not None  # CuPy arrays came in
        stream = cuda.current_stream()
        m = x.shape[0]
        r = self.graph_for(m, x.dtype, logits.dtype, stream)
        if r is None:
            return None
        s = stream.ptr
        if out is None:
            out = cuda.ndarray(r.out_shape, r.dtype)
        if x.strides == r.strides and logits.strides == r.logits_strides:
            # the next call like this one is a hit; its dtypes are compared by identity (equal
            # dtypes are one object but for the rare copies, which then adopt this call's)
            r.dtype, r.logits_dtype = x.dtype, logits.dtype
            self.last[hit_key(s, x.size)] = r
            self._replay(r, x, logits, out, s)
            return out
        # C-contiguous x or logits with other strides (one row), or logits rows with a larger
        # stride (check_inputs accepts them): copied, never bound
        cuda.memcpy(r.x_dst, x.data.ptr, r.x_nbytes, _DEVICE_TO_DEVICE, s)
        if m == 1 or logits.flags.c_contiguous:
            cuda.memcpy(r.logits_dst, logits.data.ptr, r.logits_nbytes, _DEVICE_TO_DEVICE, s)
        else:  # one 2-D copy
            width = r.logits_strides[0]
            cuda.memcpy2d(
                r.logits_dst,
                width,
                logits.data.ptr,
                logits.strides[0],
                width,
                m,
                _DEVICE_TO_DEVICE,
                s,
            )
        cuda.graph_launch(r.graph_exec, s)
        cuda.memcpy(out.data.ptr, r.out_src, r.x_nbytes, _DEVICE_TO_DEVICE, s)
        return out

    def call_host(self, x: np.ndarray, logits: np.ndarray, out: Any) -> Any:
        """``layer(x, logits, out=out)`` for NumPy arrays as a replay: the inputs copied from the
        host into the graph's buffers, the output copied back; returns once it is on the host.
        ``None`` when it cannot be a replay."""
        cuda = self._cuda
        assert cuda is not None  # only called on a machine with a GPU
        stream = cuda.current_stream()
        x = np.ascontiguousarray(x)
        logits = np.ascontiguousarray(logits)
        r = self.graph_for(x.shape[0], x.dtype, logits.dtype, stream)
        if r is None:
            return None
        s = stream.ptr
        # From pageable memory the driver stages the bytes before returning: x may be reused.
        cuda.memcpy(r.x_dst, x.ctypes.data, r.x_nbytes, _HOST_TO_DEVICE, s)
        cuda.memcpy(r.logits_dst, logits.ctypes.data, r.logits_nbytes, _HOST_TO_DEVICE, s)
        cuda.graph_launch(r.graph_exec, s)
        direct = out is not None and out.flags.c_contiguous
        result = out if direct else np.empty(r.out_shape, r.dtype)
        cuda.memcpy(result.ctypes.data, r.out_src, r.x_nbytes, _DEVICE_TO_HOST, s)
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
