# SPDX-License-Identifier: Apache-2.0
"""Launch FC1 and FC2 once each for a preset at M tokens (for Nsight Compute to profile).

    ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section InstructionStats --section Occupancy -k regex:gemv_ \\
        python3 benchmarks/profile_gemv.py qwen3.6-35b-a3b 1
"""

from __future__ import annotations

import sys

import cupy
import ml_dtypes
import numpy as np

from cupymoe.experts import ActivationSpec, fc1, fc2, prepare_fc1, prepare_fc2
from cupymoe.formats import random_fp4_gpu
from cupymoe.presets import PRESETS
from cupymoe.routing import Router, route


def main() -> None:
    shape = PRESETS[sys.argv[1]]
    m = int(sys.argv[2])
    e, h, i = shape.n_experts, shape.hidden, shape.intermediate
    gate, up = (random_fp4_gpu(e, i, h, shape.format, seed=s) for s in (1, 2))
    down = random_fp4_gpu(e, h, i, shape.format, seed=3)
    w1, w2 = prepare_fc1(gate, up), prepare_fc2(down)
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((m, h)).astype(ml_dtypes.bfloat16))
    logits = cupy.asarray(rng.standard_normal((m, e)).astype(np.float32))
    routing = route(logits, Router(n_experts=e, top_k=shape.top_k))
    hid = fc1(x, w1, routing, act=ActivationSpec(shape.activation))
    fc2(hid, w2, routing)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
