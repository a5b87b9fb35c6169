# SPDX-License-Identifier: Apache-2.0
"""cupymoe: 4-bit (NVFP4 / MXFP4) Mixture-of-Experts layers on NVIDIA GPUs from plain Python.

One MoE layer is routing -> expert maps -> FC1 GEMV with the gated activation fused -> FC2 GEMV
-> finalize. Every GPU stage has a float64 NumPy reference beside it (``route`` / ``route_ref``).

Layers, each importing only those below it: ``_runtime`` (backend, validators, the kernel loader,
launches, timing) < ``formats`` < ``routing`` < ``experts`` < ``layer`` < ``parallel`` (expert
parallelism) < ``io``, then the top-level ``presets``, ``testing``, ``bench`` and ``cli``.

Dimension vocabulary, used in every docstring and error message:

``n_tokens`` (M)       tokens in the batch
``n_experts`` (E)      experts of the layer
``top_k`` (k)          experts chosen per token; ``M * k`` expanded rows
``hidden`` (H)         model width: FC1 input, FC2 output
``intermediate`` (I)   expert width: FC1 output (after the gated activation), FC2 input
``k``                  the reduction length of one GEMV (H for FC1, I for FC2)
"""

from __future__ import annotations

from ._version import __version__
from .experts import Activation, WeightLayout
from .formats import Fp4Experts, Fp4Format, MxScaleRule
from .io import Checkpoint, CheckpointNaming, load_experts, save_experts
from .layer import Fc1Layout, LayerGraph, MoELayer, moe_reference, record_graph
from .parallel import ExpertParallelMoE, ExpertPlacement, simulate_expert_parallel
from .presets import PRESETS, random_fp4_experts
from .routing import Router, Routing, RoutingMethod

__all__ = [
    "PRESETS",
    "Activation",
    "Checkpoint",
    "ExpertParallelMoE",
    "ExpertPlacement",
    "CheckpointNaming",
    "Fc1Layout",
    "Fp4Experts",
    "Fp4Format",
    "LayerGraph",
    "MoELayer",
    "MxScaleRule",
    "Router",
    "Routing",
    "RoutingMethod",
    "WeightLayout",
    "__version__",
    "load_experts",
    "moe_reference",
    "random_fp4_experts",
    "record_graph",
    "save_experts",
    "simulate_expert_parallel",
]
