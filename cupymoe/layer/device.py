# SPDX-License-Identifier: Apache-2.0
"""The GPU side of ``MoELayer``: prepared weights, workspaces, and the stage plan of one call.

Weights are uploaded and re-laid out once. Workspaces (routing maps, FC1 and FC2 outputs) are
allocated for ``max_tokens`` once per activation dtype, so an eager call allocates only its
output and a graph replay allocates nothing. A graph may instead get a workspace of its own,
sized for its token count (:meth:`DeviceLayer.workspace` with ``n_tokens``), so that it shares no
buffer with eager calls or with the graphs of other streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from .._runtime.backend import require_cupy
from ..experts.dispatch import capturable, fc1, fc2, permutes_h, permutes_x
from ..experts.gemm import permute_split
from ..experts.gemv import PreparedFc1, PreparedFc2, prepare_fc1, prepare_fc2, scale_shift
from ..routing import Routing, route, route_workspace_words
from .finalize import finalize

__all__ = ["STAGES", "DeviceLayer", "Stage"]

#: The stages of one call, in order (``stage_times`` reports them under these names).
STAGES = ("route", "fc1", "fc2", "finalize")

#: One step of the plan: its name (one of :data:`STAGES`) and the call that launches it.
Stage = tuple[str, Callable[[], Any]]


@dataclasses.dataclass
class _Workspace:
    routing: Routing  # buffers for max_tokens; .prefix(M) gives the views of one call
    route_work: Any  # the routing's tile table (routing.route_workspace_words)
    h: Any  # [max_tokens * k, I] FC1 output (expanded order)
    y: Any  # [max_tokens * k, H] FC2 output (expanded order)


class DeviceLayer:
    """Prepared device state of one :class:`~.moe.MoELayer` (built on first GPU use)."""

    def __init__(self, layer: Any) -> None:
        cupy = require_cupy()
        self.layer = layer
        self.device_id = cupy.cuda.Device().id
        self.fc1_weights: PreparedFc1 | PreparedFc2
        if layer.up is None:  # a non-gated FC1 is one matrix per expert, laid out like FC2
            self.fc1_weights = prepare_fc2(
                layer.gate, bias=layer.gate_bias, layout=layer.weight_layout
            )
        else:
            self.fc1_weights = prepare_fc1(
                layer.gate,
                layer.up,
                gate_bias=layer.gate_bias,
                up_bias=layer.up_bias,
                layout=layer.weight_layout,
            )
        self.fc2_weights = prepare_fc2(layer.down, bias=layer.fc2_bias, layout=layer.weight_layout)
        self._workspaces: dict[np.dtype, _Workspace] = {}
        self._capturable: dict[np.dtype, bool] = {}

    def workspace(self, dtype: Any, n_tokens: int | None = None) -> _Workspace:
        """Buffers for ``max_tokens`` tokens of activation ``dtype`` (allocated once, shared by
        every eager call), or with ``n_tokens`` new buffers for that many tokens (not kept)."""
        dtype = np.dtype(dtype)
        ws = self._workspaces.get(dtype) if n_tokens is None else None
        if ws is None:
            cupy = require_cupy()
            layer = self.layer
            tokens = layer.max_tokens if n_tokens is None else n_tokens
            rows = tokens * layer.top_k
            ws = _Workspace(
                routing=Routing.empty(tokens, layer.n_experts, layer.top_k, xp=cupy),
                route_work=cupy.empty(route_workspace_words(tokens, layer.n_experts), np.int32),
                h=cupy.empty((rows, layer.intermediate), dtype),
                y=cupy.empty((rows, layer.hidden), dtype),
            )
            if n_tokens is None:
                self._workspaces[dtype] = ws
        return ws

    def stage_calls(
        self,
        x: Any,
        logits: Any,
        out: Any,
        *,
        workspace: _Workspace | None = None,
        router_weights: Any = None,
    ) -> list[Stage]:
        """The plan of one call on fixed buffers: its stages in order, as ``(name, call)``;
        ``router_weights``: the call's mixing weights (``MoELayer.__call__``), or ``None``.

        Eager calls run the list, graphs record it and ``stage_times`` times each entry. The plan
        is a list so that stages can be inserted: expert parallelism adds its exchanges (tokens
        to the experts' devices after ``route``, results back before ``finalize``) here.
        ``workspace`` (from :meth:`workspace`, at least ``M`` tokens) replaces the shared one.
        """
        layer = self.layer
        m = int(x.shape[0])
        rows = m * layer.top_k
        ws = self.workspace(x.dtype) if workspace is None else workspace
        routing = ws.routing.prefix(m)
        h, y = ws.h[:rows], ws.y[:rows]
        # Programmatic dependent launches (cupymoe/_runtime/launch.py): each stage starts while the
        # one before it finishes; FC2 and finalize read the routing maps before their wait, which is
        # sound because the stage before each of them ran after routing had completed.
        # Where both expert stages run the wgmma kernel, h passes between them in the split k
        # order: FC2's producer then copies its tiles without staging them in registers.
        permuted = permutes_h(self.fc1_weights, self.fc2_weights, rows, x.dtype)
        # A wgmma FC1 reads x regrouped into the split k order likewise, from a copy in y's
        # buffer (free until FC2 writes it): FC1's producer then regroups nothing either.
        x_split = ws.y[:m] if permutes_x(self.fc1_weights, rows, x.dtype) else None

        def run_fc1() -> Any:
            source = x if x_split is None else permute_split(x, out=x_split, pdl=True)
            return fc1(
                source,
                self.fc1_weights,
                routing,
                act=layer.activation,
                out=h,
                pdl=True,
                permuted_h=permuted,
                permuted_x=x_split is not None,
            )

        return [
            (
                "route",
                lambda: route(
                    logits,
                    layer.router,
                    router_weights=router_weights,
                    out=routing,
                    workspace=ws.route_work,
                    pdl=True,
                ),
            ),
            ("fc1", run_fc1),
            (
                "fc2",
                lambda: fc2(h, self.fc2_weights, routing, out=y, pdl=True, permuted_h=permuted),
            ),
            ("finalize", lambda: finalize(y, routing, out=out, pdl=True)),
        ]

    def run(self, x: Any, logits: Any, *, out: Any = None, router_weights: Any = None) -> Any:
        """One eager call on the current stream; allocates only ``out`` when it is not given."""
        cupy = require_cupy()
        if out is None:
            out = cupy.empty((x.shape[0], self.layer.hidden), x.dtype)
        if x.shape[0] == 0:
            return out
        for _, call in self.stage_calls(x, logits, out, router_weights=router_weights):
            call()
        return out

    def capturable(self, dtype: Any) -> bool:
        """Whether calls with ``dtype`` activations can be recorded in a CUDA graph (at every
        token count): unless MXFP4 scales need the batched fallback."""
        dtype = np.dtype(dtype)
        known = self._capturable.get(dtype)
        if known is None:  # fixed by the weights: computed once per dtype
            weights = (self.fc1_weights, self.fc2_weights)
            known = all(capturable(scale_shift(w, dtype)) for w in weights)
            self._capturable[dtype] = known
        return known

    @property
    def resident_bytes(self) -> int:
        """GPU bytes of the layer's expert weights (codes, block scales, global scales), held
        once and read by every backend."""
        return self.fc1_weights.resident_bytes + self.fc2_weights.resident_bytes
