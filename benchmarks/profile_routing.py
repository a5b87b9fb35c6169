# SPDX-License-Identifier: Apache-2.0
"""Launch the fused decode routing (softmax top-k and DeepSeek's grouped sigmoid, E 256, top-8)
and finalize once each at M tokens, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        -k regex:"route_|finalize" python3 benchmarks/profile_routing.py 4
"""

from __future__ import annotations

import sys

import cupy
import ml_dtypes
import numpy as np

from cupymoe.layer.finalize import finalize
from cupymoe.routing import Router, route


def main() -> None:
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    rng = np.random.default_rng(0)
    logits = cupy.asarray(rng.standard_normal((m, 256)).astype(np.float32))
    plain = route(logits, Router(n_experts=256, top_k=8))
    grouped = Router(
        n_experts=256,
        top_k=8,
        method="sigmoid_grouped",
        n_group=8,
        topk_group=4,
        correction_bias=np.zeros(256, np.float32),
        routed_scaling_factor=2.5,
    )
    route(logits, grouped)
    y = cupy.asarray(rng.standard_normal((m * 8, 2048)).astype(ml_dtypes.bfloat16))
    finalize(y, plain)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    main()
