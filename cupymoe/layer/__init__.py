# SPDX-License-Identifier: Apache-2.0
"""The MoE layer: ``MoELayer`` and its float64 oracle ``moe_reference`` (:mod:`.moe`), the stage
plan on the GPU (:mod:`.device`), CUDA graphs of whole layers (:mod:`.graph`), and the two stages
that belong to the layer rather than to the experts: expand (:mod:`.expand`) and finalize
(:mod:`.finalize`)."""

from .graph import LayerGraph, record_graph
from .moe import Fc1Layout, MoELayer, moe_reference

__all__ = ["Fc1Layout", "LayerGraph", "MoELayer", "moe_reference", "record_graph"]
