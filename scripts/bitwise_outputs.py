# SPDX-License-Identifier: Apache-2.0
"""Dump the raw output bits of the existing routing kinds and gated activations on the GPU, or
compare two dumps: proof that a change left the existing specialisations bitwise unchanged.

    python scripts/bitwise_outputs.py dump before.npz     # on the old tree
    python scripts/bitwise_outputs.py dump after.npz      # on the new tree, same GPU
    python scripts/bitwise_outputs.py compare before.npz after.npz

Inputs are drawn from fixed seeds, so both trees see the same bytes. Covered: every routing
method (one-launch decode routing, warp and block launches: M 1 .. 1024, E 256 and 1024),
and the whole layer with swiglu / geglu / swiglu_oai, NVFP4 and MXFP4, with and without
biases, GEMV and grouped-GEMM sizes, the three weight layouts.
"""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np


def _routes(out: dict[str, np.ndarray]) -> None:
    import cupy

    from cupymoe.routing import Router, RoutingMethod, route

    for e, k in ((256, 8), (1024, 16)):
        bias = (np.random.default_rng(1).standard_normal(e) * 0.05).astype(np.float32)
        routers = {
            "softmax_topk": Router(e, k),
            "softmax_topk_plain": Router(e, k, renormalize=False),
            "topk_softmax": Router(e, k, RoutingMethod.TOPK_SOFTMAX),
            "sigmoid_grouped": Router(
                e, k, RoutingMethod.SIGMOID_GROUPED, n_group=8, topk_group=4,
                correction_bias=bias, routed_scaling_factor=2.5,
            ),
        }  # fmt: skip
        for m in (1, 4, 8, 65, 1024):
            for dtype in (np.float32, ml_dtypes.bfloat16):
                x = np.random.default_rng(m + e).standard_normal((m, e)) * 3
                x[0, :3] = np.nan
                xd = cupy.asarray(x.astype(dtype))
                for name, router in routers.items():
                    r = route(xd, router)
                    key = f"route/{name}/E{e}/M{m}/{np.dtype(dtype).name}"
                    out[key + "/ids"] = r.topk_ids.get()
                    out[key + "/weights"] = r.topk_weights.get().view(np.int32)
                    out[key + "/rows"] = r.sorted_rows.get()


def _layers(out: dict[str, np.ndarray]) -> None:
    import cupy

    import cupymoe as cm
    from cupymoe.presets import random_fp4_experts

    e, h, i = 32, 512, 256
    for fmt in ("nvfp4", "mxfp4"):
        for act in ("swiglu", "geglu", "swiglu_oai"):
            for bias in (False, True):
                for layout in ("split", "pair", "plain"):
                    rng = np.random.default_rng(7)
                    fc1 = tuple(random_fp4_experts(rng, e, i, h, fmt) for _ in "gu")
                    down = random_fp4_experts(rng, e, h, i, fmt)
                    kw = {}
                    if bias:
                        kw = dict(
                            fc1_bias=rng.standard_normal((e, 2 * i)).astype(np.float32),
                            fc2_bias=rng.standard_normal((e, h)).astype(np.float32),
                        )
                    layer = cm.MoELayer(fc1, down, top_k=4, activation=act, max_tokens=1024,
                                        weight_layout=layout, **kw)  # fmt: skip
                    for m in (1, 8, 65, 1024) if layout == "split" else (8,):
                        x = rng.standard_normal((m, h)).astype(ml_dtypes.bfloat16)
                        logits = rng.standard_normal((m, e)).astype(np.float32)
                        y = layer(cupy.asarray(x), cupy.asarray(logits))
                        out[f"layer/{fmt}/{act}/bias{bias}/{layout}/M{m}"] = y.view(np.int16).get()


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "dump":
        out: dict[str, np.ndarray] = {}
        _routes(out)
        _layers(out)
        np.savez_compressed(argv[1], **out)
        print(f"{len(out)} arrays -> {argv[1]}")
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        a, b = np.load(argv[1]), np.load(argv[2])
        missing = sorted(set(a.files) ^ set(b.files))
        differ = [n for n in sorted(set(a.files) & set(b.files)) if not np.array_equal(a[n], b[n])]
        for name in missing:
            print(f"only in one dump: {name}")
        for name in differ:
            print(f"differs: {name}")
        print(
            f"{len(a.files)} / {len(b.files)} arrays; {len(differ)} differ, "
            f"{len(missing)} unmatched"
        )
        return 1 if differ or missing else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
