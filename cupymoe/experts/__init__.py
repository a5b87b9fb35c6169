# SPDX-License-Identifier: Apache-2.0
"""The expert GEMMs of a MoE layer, FC1 (gate and up with the gated activation) and FC2.

Bottom to top: :mod:`.activation` and :mod:`.layouts` (the ``WeightLayout`` the GEMV reads and
its transforms), :mod:`.reference` (``fc1_ref`` / ``fc2_ref``), :mod:`.cache` and
:mod:`.config` (the GEMV's tilings: pure tables, the tuned entries read from the cache),
the backends :mod:`.gemv` (tensor-core GEMV), :mod:`.gemm` (grouped tensor-core GEMM) and
:mod:`.batched` (dequantize :mod:`.dequant` + cuBLAS), :mod:`.handover` (which backend and
tiling a call gets unless told: environment, tuning cache, the per-shape hand-over table),
:mod:`.dispatch` (``fc1`` / ``fc2``: checks, then the chosen backend), and on top :mod:`.tune`
(imported by nothing in the package but the CLI).
"""

from .activation import Activation, ActivationSpec, activation_ref
from .config import GemvConfig
from .dispatch import fc1, fc2
from .gemv import PreparedFc1, PreparedFc2, prepare_fc1, prepare_fc2
from .layouts import WeightLayout
from .reference import fc1_ref, fc2_ref

__all__ = [
    "Activation",
    "ActivationSpec",
    "GemvConfig",
    "PreparedFc1",
    "PreparedFc2",
    "WeightLayout",
    "activation_ref",
    "fc1",
    "fc1_ref",
    "fc2",
    "fc2_ref",
    "prepare_fc1",
    "prepare_fc2",
]
