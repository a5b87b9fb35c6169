# SPDX-License-Identifier: Apache-2.0
"""Routing: choose ``top_k`` experts per token and group the expanded rows by expert.

:mod:`.types` (``Router``, ``Routing``), :mod:`.reference` (``route_ref``, ``expert_maps_ref``:
the oracle, with the exact semantics of ties, NaN and infinities), :mod:`.route` (the GPU
routing) and :mod:`.maps` (the GPU expert maps).
"""

from .maps import GPU_MAX_EXPERTS, expert_maps
from .reference import expert_maps_ref, random_routing, route_ref, sigmoid_f32
from .topk import route, route_workspace_words
from .types import (
    SPARSE_MIXER_EPS,
    SPARSE_MIXER_EXPERTS,
    Router,
    Routing,
    RoutingMethod,
    check_device_routing,
    check_router_weights,
)

__all__ = [
    "GPU_MAX_EXPERTS",
    "SPARSE_MIXER_EPS",
    "SPARSE_MIXER_EXPERTS",
    "Router",
    "Routing",
    "RoutingMethod",
    "check_device_routing",
    "check_router_weights",
    "expert_maps",
    "expert_maps_ref",
    "random_routing",
    "route",
    "route_ref",
    "route_workspace_words",
    "sigmoid_f32",
]
