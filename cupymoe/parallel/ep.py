# SPDX-License-Identifier: Apache-2.0
"""``ExpertParallelMoE``: one MoE layer spread over the GPUs of a world, one process per GPU,
the exchanges on NCCL (``cupy.cuda.nccl``).

Rank ``r`` holds only its experts (:class:`~.shard.ExpertShard`, uploaded once), routes its own
tokens and finalizes them. One call, on the current stream::

    route (home)          the full router on this rank's tokens
    home tables, pack     send buffer [W * cap, H]: segment d = the rows for d's experts,
                          expert-major and stable (:mod:`.plan`)
    exchange              one NCCL group: every peer gets its expert counts (E_max int32) and
                          its row segment (cap rows, padded: a fixed size, capturable)
    local maps            the owner's expert offsets and row order from the received counts
    fc1, fc2              this rank's experts on the received rows (top_k = 1 routing over
                          W * cap positions; padding is never read)
    return, exchange back each result to the position its input came from, segments back
    gather, finalize      the home reads its k results per token at their slots; finalize in
                          the fixed slot order

``cap = capacity(m, top_k, E_max)`` with ``m`` the tokens per rank the world agreed on (eager
calls: an NCCL max-reduction of the ranks' token counts, one host read; graphs: the recorded
``n_tokens``, the same on every rank). The expert kernels get the backend and tiling the one-GPU
layer picks for ``W * m`` tokens, so each expert's rows meet the same kernel as on one GPU.

.. warning::
   Written carefully but **not run on two or more GPUs**: no multi-GPU machine was available.
   The world of one (no NCCL) is the only GPU path with a test that one H200 can run
   (``tests/test_parallel_gpu.py``); the NCCL exchange, the bitwise claim for W >= 2 and the
   CUDA graph of the whole EP layer await a multi-GPU run (``docs/parallel.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._runtime.backend import is_cupy_array, require_cupy
from ..experts.dispatch import fc1, fc2
from ..experts.gemv import prepare_fc1, prepare_fc2, scale_shift
from ..experts.handover import choose
from ..layer import MoELayer
from ..layer.finalize import finalize
from ..routing import Routing, route, route_workspace_words
from . import kernels
from .placement import ExpertPlacement
from .plan import capacity
from .shard import ExpertShard, layer_options, options_digest

__all__ = ["ExpertParallelMoE"]


@dataclasses.dataclass
class _Buffers:
    """Workspaces for ``max_tokens`` per rank (allocated once per activation dtype)."""

    home: Routing  # the home routing, max_tokens
    route_work: Any  # int32 [route_workspace_words(max_tokens, E)]
    slot: Any  # int32 [max_tokens * k]
    base: Any  # int32 [E]
    run: Any  # int32 [W]
    counts_to: Any  # int32 [W * E_max] (send) ...
    counts_from: Any  # int32 [W * E_max] (receive)
    send: Any  # [W * cap_max, H]; also the return segments arrive here (back)
    recv: Any  # [W * cap_max, H]; also the owner's returned results (ret)
    h: Any  # [W * cap_max, I]
    y: Any  # [W * cap_max, H]
    y_home: Any  # [max_tokens * k, H]
    offsets: Any  # int32 [E_local + 1]
    prefix: Any  # int32 [W * (E_local + 1)]
    before: Any  # int32 [W * E_local]
    active: Any  # int32 [min(W * cap_max, E_local)]
    local_rows: Any  # int32 [W * cap_max]
    local_inverse: Any  # int32 [W * cap_max]
    local_ids: Any  # int32 [W * cap_max, 1]
    local_weights: Any  # float32 [W * cap_max, 1] (not read by the expert kernels)


class ExpertParallelMoE:
    """Rank ``rank`` of a :class:`~cupymoe.MoELayer` spread over ``world_size`` GPUs.

    Parameters
    ----------
    layer : MoELayer
        The whole layer (host weights); only this rank's experts are uploaded. Every rank must
        build it with the same options (:func:`~.shard.layer_options`; checked at construction
        through the communicator).
    rank, world_size : int
    comm : cupy.cuda.nccl.NcclCommunicator, optional
        Needed when ``world_size > 1`` (:func:`.launch.nccl_communicator` builds it); a world of
        one runs without NCCL.
    placement : ExpertPlacement, optional
        Default: contiguous blocks of ``E / W`` experts.

    Notes
    -----
    Call with this rank's ``x [M, H]`` and ``router_logits [M, E]`` (CuPy arrays on this rank's
    GPU, ``M <= max_tokens``); every rank must call, even with ``M = 0``. Unverified on more than
    one GPU (module docstring).
    """

    def __init__(
        self,
        layer: MoELayer,
        *,
        rank: int,
        world_size: int,
        comm: Any = None,
        placement: ExpertPlacement | None = None,
    ) -> None:
        if not isinstance(layer, MoELayer):
            raise TypeError(f"layer: expected a MoELayer, got {type(layer).__name__}")
        self.placement = ExpertPlacement.resolve(placement, layer.n_experts, world_size)
        self.rank = self.placement.check_rank(rank)
        self.world_size = self.placement.world_size
        if self.world_size > 1 and comm is None:
            raise ValueError(f"comm: a world of {self.world_size} ranks needs an NCCL communicator")
        if comm is not None:
            for name, want in (("rank", self.rank), ("size", self.world_size)):
                got = int(getattr(comm, f"{name}_id" if name == "rank" else name)())
                if got != want:
                    raise ValueError(f"comm: its {name} is {got}, expected {want}")
        self.layer, self.comm = layer, comm
        self.options = layer_options(layer)
        self.shard = ExpertShard.of(layer, self.placement, self.rank)
        self.e_max = self.placement.max_local_experts
        cupy = require_cupy()
        self.fc1_weights = prepare_fc1(
            self.shard.gate,
            self.shard.up,
            gate_bias=self.shard.gate_bias,
            up_bias=self.shard.up_bias,
            layout=layer.weight_layout,
        )
        self.fc2_weights = prepare_fc2(
            self.shard.down, bias=self.shard.fc2_bias, layout=layer.weight_layout
        )
        self._owner = cupy.asarray(self.placement.owner)
        self._local = cupy.asarray(self.placement.local_index)
        self._buffers: dict[np.dtype, _Buffers] = {}
        if comm is not None:
            self._check_peers()

    # ---- agreement across ranks ----------------------------------------------------------------
    def _check_peers(self) -> None:
        """Every rank built the same layer options: an all-gather of 32-byte digests."""
        from cupy.cuda import nccl

        cupy = require_cupy()
        mine = cupy.asarray(np.frombuffer(options_digest(self.layer), np.uint8))
        every = cupy.empty(32 * self.world_size, np.uint8)
        stream = cupy.cuda.get_current_stream()
        self.comm.allGather(mine.data.ptr, every.data.ptr, 32, nccl.NCCL_UINT8, stream.ptr)
        digests = every.get().reshape(self.world_size, 32)
        bad = [r for r in range(self.world_size) if not np.array_equal(digests[r], digests[0])]
        if bad:
            raise ValueError(
                f"layer: ranks {bad} built the layer with options other than rank 0's "
                "(every rank must pass the same layer options; see layer_options)"
            )

    def agreed_tokens(self, n_tokens: int) -> int:
        """The largest ``n_tokens`` of the world (an NCCL max-reduction; reads the host)."""
        if self.comm is None:
            return int(n_tokens)
        from cupy.cuda import nccl

        cupy = require_cupy()
        buf = cupy.asarray(np.array([n_tokens], np.int32))
        stream = cupy.cuda.get_current_stream()
        self.comm.allReduce(
            buf.data.ptr, buf.data.ptr, 1, nccl.NCCL_INT32, nccl.NCCL_MAX, stream.ptr
        )
        return int(buf.get()[0])

    # ---- buffers --------------------------------------------------------------------------------
    def buffers(self, dtype: Any) -> _Buffers:
        dtype = np.dtype(dtype)
        ws = self._buffers.get(dtype)
        if ws is None:
            cupy = require_cupy()
            lay, w, n_local = self.layer, self.world_size, self.shard.n_local
            k, e = lay.top_k, lay.n_experts
            positions = w * capacity(lay.max_tokens, k, self.e_max)
            ws = _Buffers(
                home=Routing.empty(lay.max_tokens, e, k, xp=cupy),
                route_work=cupy.empty(route_workspace_words(lay.max_tokens, e), np.int32),
                slot=cupy.zeros(lay.max_tokens * k, np.int32),
                base=cupy.zeros(e, np.int32),
                run=cupy.zeros(w, np.int32),
                counts_to=cupy.zeros(w * self.e_max, np.int32),
                counts_from=cupy.zeros(w * self.e_max, np.int32),
                send=cupy.zeros((positions, lay.hidden), dtype),
                recv=cupy.zeros((positions, lay.hidden), dtype),
                h=cupy.zeros((positions, lay.intermediate), dtype),
                y=cupy.zeros((positions, lay.hidden), dtype),
                y_home=cupy.zeros((lay.max_tokens * k, lay.hidden), dtype),
                offsets=cupy.zeros(n_local + 1, np.int32),
                prefix=cupy.zeros(w * (n_local + 1), np.int32),
                before=cupy.zeros(w * n_local, np.int32),
                active=cupy.full(min(positions, n_local), -1, np.int32),
                local_rows=cupy.zeros(positions, np.int32),  # stale entries stay valid rows
                local_inverse=cupy.full(positions, -1, np.int32),
                local_ids=cupy.zeros((positions, 1), np.int32),
                local_weights=cupy.zeros((positions, 1), np.float32),
            )
            self._buffers[dtype] = ws
        return ws

    # ---- the exchange ---------------------------------------------------------------------------
    def _exchange(self, send: Any, recv: Any, seg_bytes: int, counts: bool) -> None:
        """Segment ``d`` of ``send`` to rank ``d``, segment ``s`` of ``recv`` from rank ``s``
        (with the expert counts when ``counts``): one NCCL group; this rank's own segment is
        a device copy (no NCCL self-send)."""
        cupy = require_cupy()
        stream = cupy.cuda.get_current_stream()
        ws = self.buffers(send.dtype)
        cbytes = 4 * self.e_max
        me = self.rank

        def copy(dst: Any, src: Any, nbytes: int) -> None:
            if nbytes:
                cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, 3, stream.ptr)  # device->device

        copy(recv.data.ptr + me * seg_bytes, send.data.ptr + me * seg_bytes, seg_bytes)
        if counts:
            copy(ws.counts_from.data.ptr + me * cbytes, ws.counts_to.data.ptr + me * cbytes, cbytes)
        if self.world_size == 1:
            return
        from cupy.cuda import nccl

        nccl.groupStart()
        try:
            for peer in range(self.world_size):
                if peer == me:
                    continue
                if counts:
                    self.comm.send(
                        ws.counts_to.data.ptr + peer * cbytes,
                        cbytes,
                        nccl.NCCL_UINT8,
                        peer,
                        stream.ptr,
                    )
                    self.comm.recv(
                        ws.counts_from.data.ptr + peer * cbytes,
                        cbytes,
                        nccl.NCCL_UINT8,
                        peer,
                        stream.ptr,
                    )
                if seg_bytes:
                    self.comm.send(
                        send.data.ptr + peer * seg_bytes,
                        seg_bytes,
                        nccl.NCCL_UINT8,
                        peer,
                        stream.ptr,
                    )
                    self.comm.recv(
                        recv.data.ptr + peer * seg_bytes,
                        seg_bytes,
                        nccl.NCCL_UINT8,
                        peer,
                        stream.ptr,
                    )
        finally:
            nccl.groupEnd()

    def _expert_choice(self, weights: Any, rows: int, dtype: Any) -> tuple[Any, Any]:
        """The backend and tiling the one-GPU layer uses for ``rows`` expanded rows of the world
        (so each expert's rows meet the same kernel as on one GPU): :func:`.handover.choose`
        with the whole layer's expert count (the tuning cache's key and the hand-over)."""
        shift = scale_shift(weights, dtype)
        return choose(weights, rows, dtype, shift, n_experts=self.layer.n_experts)

    def stage_calls(self, x: Any, logits: Any, out: Any, tokens_per_rank: int) -> list[Any]:
        """The plan of one call as ``(name, call)`` (as ``DeviceLayer.stage_calls``, with the
        exchanges inserted), for ``tokens_per_rank`` agreed by every rank."""
        lay, w = self.layer, self.world_size
        k, hidden = lay.top_k, lay.hidden
        m = int(x.shape[0])
        if m > tokens_per_rank:
            raise ValueError(f"x: {m} tokens, more than the agreed {tokens_per_rank} per rank")
        ws = self.buffers(x.dtype)
        cap = capacity(tokens_per_rank, k, self.e_max)
        positions = w * cap
        n_local = self.shard.n_local
        home = ws.home.prefix(m)
        slot = ws.slot[: m * k]
        send, recv = ws.send[:positions], ws.recv[:positions]
        seg_bytes = cap * hidden * x.dtype.itemsize
        local = Routing(
            ws.local_ids[:positions],
            ws.local_weights[:positions],
            ws.offsets,
            ws.local_rows[:positions],
            ws.local_inverse[:positions],
            ws.active[: min(positions, n_local)],
        )
        h, y = ws.h[:positions], ws.y[:positions]
        rows_world = w * tokens_per_rank * k
        choice1 = self._expert_choice(self.fc1_weights, rows_world, x.dtype)
        choice2 = self._expert_choice(self.fc2_weights, rows_world, x.dtype)
        y_home = ws.y_home[: m * k]

        def pack() -> None:
            if not m:  # a home with no tokens still tells every owner: zero rows
                ws.counts_to.fill(0)
                return
            route(logits, lay.router, out=home, workspace=ws.route_work)
            kernels.home_tables(
                home.expert_offsets,
                self._owner,
                self._local,
                self.e_max,
                ws.base,
                ws.run,
                ws.counts_to,
            )
            kernels.pack_rows(
                x,
                home.sorted_rows,
                home.topk_ids.reshape(-1),
                home.expert_offsets,
                self._owner,
                ws.base,
                k,
                cap,
                send,
                slot,
            )

        def local_maps() -> None:
            kernels.local_tables(
                ws.counts_from,
                n_local,
                self.e_max,
                ws.offsets,
                ws.prefix,
                ws.before,
                local.active_experts,
            )
            kernels.local_rows(
                ws.offsets,
                ws.prefix,
                ws.before,
                n_local,
                cap,
                positions,
                local.sorted_rows,
                local.inverse,
                local.topk_ids.reshape(-1),
            )

        def back() -> None:
            kernels.return_rows(y, local.inverse, recv)  # recv now holds the results (ret)
            self._exchange(recv, send, seg_bytes, counts=False)  # send now holds them (back)

        def fin() -> None:
            if m:
                kernels.gather_rows(send, slot, y_home)
                finalize(y_home, home, out=out)

        return [
            ("route", pack),
            ("exchange", lambda: self._exchange(send, recv, seg_bytes, counts=True)),
            ("maps", local_maps),
            (
                "fc1",
                lambda: fc1(
                    recv,
                    self.fc1_weights,
                    local,
                    act=lay.activation,
                    out=h,
                    backend=choice1[0],
                    config=choice1[1],
                ),
            ),
            (
                "fc2",
                lambda: fc2(
                    h, self.fc2_weights, local, out=y, backend=choice2[0], config=choice2[1]
                ),
            ),
            ("exchange_back", back),
            ("finalize", fin),
        ]

    def __call__(self, x: Any, router_logits: Any, *, out: Any = None) -> Any:
        """This rank's ``[M, H]`` output for its ``x [M, H]`` and ``router_logits [M, E]`` (CuPy
        arrays; every rank calls). Eager: one host read (the token-count agreement)."""
        cupy = require_cupy()
        if not (is_cupy_array(x) and is_cupy_array(router_logits)):
            raise TypeError("x and router_logits: expected cupy.ndarray on this rank's GPU")
        m = self.layer.check_inputs(x, router_logits)
        if router_logits.dtype == np.float64:
            router_logits = router_logits.astype(np.float32)
        if out is None:
            out = cupy.empty((m, self.layer.hidden), x.dtype)
        agreed = self.agreed_tokens(m)
        if agreed == 0:
            return out
        for _, call in self.stage_calls(x, router_logits, out, agreed):
            call()
        return out

    def graph(self, n_tokens: int, *, dtype: Any) -> Any:
        """Record the whole EP layer for ``n_tokens`` tokens on every rank (call on all ranks
        with the same ``n_tokens``): returns ``(graph, stream, x, logits, out)``; fill ``x`` and
        ``logits`` on ``stream``, ``graph.launch(stream)``, read ``out``. NCCL calls are
        captured in the graph (NCCL >= 2.9). Unverified on hardware."""
        from .._runtime.timing import capture

        cupy = require_cupy()
        lay = self.layer
        if not 1 <= n_tokens <= lay.max_tokens:
            raise ValueError(f"n_tokens: expected 1..{lay.max_tokens}, got {n_tokens}")
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            x = cupy.zeros((n_tokens, lay.hidden), dtype)
            logits = cupy.zeros((n_tokens, lay.n_experts), np.float32)
            out = cupy.empty((n_tokens, lay.hidden), dtype)
        calls = self.stage_calls(x, logits, out, n_tokens)

        def run() -> None:
            for _, call in calls:
                call()

        return capture(run, stream), stream, x, logits, out
