# SPDX-License-Identifier: Apache-2.0
"""Every kernel family once, at tail shapes and at the largest supported E, top_k and M, each
result checked against its reference. Run under compute-sanitizer by ``scripts/sanitize.sh``.

Exit status 1 when any result differs from its reference (the sanitizer reports memory errors,
races, uninitialised reads and bad barriers itself).
"""

from __future__ import annotations

import dataclasses
import sys

import cupy
import ml_dtypes
import numpy as np

import cupymoe as cm
from cupymoe.experts.dequant import dequantize, dequantize_ref
from cupymoe.formats import DeviceFp4
from cupymoe.layer.expand import expand, expand_ref
from cupymoe.layer.finalize import finalize, finalize_ref
from cupymoe.presets import PRESETS, random_fp4_experts, random_layer
from cupymoe.routing import GPU_MAX_EXPERTS, Router, Routing, route, route_ref
from cupymoe.testing import assert_close, assert_equal

BF16 = ml_dtypes.bfloat16
failures: list[str] = []
#: ``--only WORD``: run only the checks whose name contains WORD (e.g. ``gemm``).
ONLY = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else ""


def check(name: str, fn) -> None:  # type: ignore[no-untyped-def]
    if ONLY not in name:
        return
    try:
        fn()
        print(f"ok    {name}", flush=True)
    except AssertionError as error:
        failures.append(name)
        print(f"FAIL  {name}: {str(error).splitlines()[0]}", flush=True)


def routing_case(  # type: ignore[no-untyped-def]
    m: int, e: int, k: int, method: str, offset: int = 0, workspace: bool = True, **kw
) -> None:
    """``offset``: rows start that many elements into a wider buffer (unaligned lane runs);
    ``workspace=False``: preallocated outputs and no workspace (above 512 rows the routing
    launch and the maps' launches instead of route_tiles and maps_tiles_place)."""
    rng = np.random.default_rng(m * 1000 + e + k)
    buf = rng.standard_normal((m, e + offset)).astype(np.float32)
    logits = np.ascontiguousarray(buf[:, offset:])
    router = Router(n_experts=e, top_k=k, method=cm.RoutingMethod(method), **kw)
    out = None if workspace else Routing.empty(m, e, k)
    ref, out = route_ref(logits, router), route(cupy.asarray(buf)[:, offset:], router, out=out)
    for field in ("topk_ids", "expert_offsets", "sorted_rows", "inverse", "active_experts"):
        assert_equal(getattr(ref, field), getattr(out, field), name=field)
    assert_close(ref.topk_weights, out.topk_weights, max_rel=2e-6, rms_rel=2e-6)


def stages_case(m: int, h: int, k: int, dtype) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(h)
    e = 32
    logits = rng.standard_normal((m, e)).astype(np.float32)
    router = Router(n_experts=e, top_k=k)
    ref_r, r = route_ref(logits, router), route(cupy.asarray(logits), router)
    x = rng.standard_normal((m, h)).astype(dtype)
    assert_equal(expand_ref(x, ref_r).view(np.uint8), expand(cupy.asarray(x), r).view(cupy.uint8))
    y = rng.standard_normal((m * k, h)).astype(dtype)
    assert_close(finalize_ref(y, ref_r), finalize(cupy.asarray(y), r), max_rel=1e-2, rms_rel=5e-3)


def _layout(pair: bool) -> str:
    """The GEMV layouts the sanitizer runs: the split copy (from pair-interleaved uploads) and the
    plain uploaded bytes."""
    return "split" if pair else "plain"


def dequant_case(fmt: str, pair: bool, k: int) -> None:
    w = random_fp4_experts(np.random.default_rng(k), 3, 24, k, fmt)
    d = DeviceFp4.from_experts(w, pair_interleaved=pair)
    out = dequantize(d, out_dtype=np.float32)
    assert_equal(dequantize_ref(w, out_dtype=np.float32).view(np.uint32), out.view(cupy.uint32))


def experts_case(fmt: str, dtype, cfg, layout: str, n: int, k: int, m: int, top_k: int) -> None:  # type: ignore[no-untyped-def]
    """fc1 (swiglu_oai, biases) and fc2 on 4 experts with a forced tiling (a GemvConfig runs the
    GEMV, a GemmConfig the grouped GEMM), against the references."""
    from cupymoe import experts
    from cupymoe.routing import random_routing

    rng = np.random.default_rng(n + k + m)
    e = 4
    gate, up = (random_fp4_experts(rng, e, n, k, fmt) for _ in range(2))
    down = random_fp4_experts(rng, e, n, k, fmt)
    bg, bu = (rng.standard_normal((e, n)).astype(np.float32) for _ in range(2))
    routing = random_routing(rng, m, top_k, e)
    act = experts.ActivationSpec("swiglu_oai")
    x = rng.standard_normal((m, k)).astype(dtype)
    w1 = experts.prepare_fc1(gate, up, gate_bias=bg, up_bias=bu, layout=layout)
    h = experts.fc1(cupy.asarray(x), w1, routing, act=act, config=cfg)
    xs = x.astype(np.float64)[routing.sorted_rows.get() // top_k]
    off = routing.expert_offsets.get()
    ref = experts.fc1_ref(xs, gate, up, off, act=act, gate_bias=bg, up_bias=bu)
    assert_close(ref, h, max_rel=2e-2, rms_rel=1e-2, name="fc1")
    hs = rng.standard_normal((m * top_k, k)).astype(dtype)
    y = experts.fc2(cupy.asarray(hs), experts.prepare_fc2(down, layout=layout), routing, config=cfg)
    assert_close(experts.fc2_ref(hs.astype(np.float64), down, off), y, max_rel=2e-2, rms_rel=1e-2)


def gemv_case(fmt: str, dtype, pair: bool, tiling: tuple[int, int], n: int, k: int, m: int) -> None:  # type: ignore[no-untyped-def]
    """The GEMV with a forced tiling: tail N and K, multi-pass rows (m tokens on 4 experts, top-4:
    m rows per expert)."""
    from cupymoe.experts import GemvConfig

    experts_case(fmt, dtype, GemvConfig(*tiling), _layout(pair), n, k, m, 4)


def gemm_case(fmt: str, dtype, tiling: tuple[int, ...], n: int, k: int, m: int) -> None:  # type: ignore[no-untyped-def]
    """The grouped GEMM with a forced tiling: tail N and K, more rows per expert than a tile."""
    from cupymoe.experts.gemm import GemmConfig, WgmmaConfig

    cfg = WgmmaConfig(*tiling[1:]) if tiling[0] == "wgmma" else GemmConfig(*tiling)
    experts_case(fmt, dtype, cfg, "split", n, k, m, 2)


def layer_case(name: str, m: int, dtype, pair: bool, experts: int, act: str = "") -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(m)
    shape = dataclasses.replace(PRESETS[name], n_experts=experts)
    if act:
        shape = dataclasses.replace(shape, activation=act)
    layer = cm.MoELayer(**random_layer(shape, rng, max_tokens=m), weight_layout=_layout(pair))
    x = rng.standard_normal((m, shape.hidden)).astype(dtype)
    logits = rng.standard_normal((m, experts)).astype(np.float32)
    out = layer(cupy.asarray(x), cupy.asarray(logits))
    assert_close(cm.moe_reference(x, logits, layer), out, max_rel=3e-2, rms_rel=1.6e-2)


def wgmma_layer_case(fmt: str, act: str, m: int) -> None:
    """A layer whose FC1 and FC2 both take the wgmma kernel (128 rows per expert at M = 512):
    x regrouped by permute_split, h passed in the split order, H = I = 320 (two whole stages
    and a partial one on both sides)."""
    from cupymoe.experts.dispatch import permutes_h, permutes_x

    rng = np.random.default_rng(m)
    e, h, i, k = 8, 320, 320, 2
    gate = random_fp4_experts(rng, e, i, h, fmt)
    fc1 = (gate, random_fp4_experts(rng, e, i, h, fmt)) if act != "relu" else gate
    layer = cm.MoELayer(
        fc1, random_fp4_experts(rng, e, h, i, fmt), top_k=k, max_tokens=m, activation=act
    )
    dl = layer.device_layer()
    assert permutes_h(dl.fc1_weights, dl.fc2_weights, m * k, BF16)
    assert permutes_x(dl.fc1_weights, m * k, BF16)
    x = rng.standard_normal((m, h)).astype(BF16)
    logits = rng.standard_normal((m, e)).astype(np.float32)
    out = layer(cupy.asarray(x), cupy.asarray(logits), replay=False)
    assert_close(cm.moe_reference(x, logits, layer), out, max_rel=3e-2, rms_rel=1.6e-2)


def main() -> int:
    # Routing: fused launch (one block, and clusters of 2 and 8 blocks on sm_90+; maps by one
    # warp up to 64 rows, by the first block up to 512), warp path, block path at the largest E
    # and top_k, large-M maps.
    check("route fused M=4 E=256 k=8", lambda: routing_case(4, 256, 8, "softmax_topk"))
    check("route fused M=8 E=256 k=8", lambda: routing_case(8, 256, 8, "softmax_topk"))
    check("route fused M=64 E=32 k=1", lambda: routing_case(64, 32, 1, "topk_softmax"))
    check("route fused, block maps M=33 E=60 k=6", lambda: routing_case(33, 60, 6, "topk_softmax"))
    check(
        "route fused, block maps M=64 E=256 k=8", lambda: routing_case(64, 256, 8, "softmax_topk")
    )
    check("route tiles M=100 E=60 k=6", lambda: routing_case(100, 60, 6, "topk_softmax"))
    check(
        "route warp M=100 E=60 k=6 (no workspace)",
        lambda: routing_case(100, 60, 6, "topk_softmax", workspace=False),
    )
    check(
        "route tiles grouped M=300 E=256 k=8",
        lambda: routing_case(
            300, 256, 8, "sigmoid_grouped", n_group=8, topk_group=4, correction_bias=None
        ),
    )
    check(
        "route grouped M=4 E=256 k=8",
        lambda: routing_case(
            4,
            256,
            8,
            "sigmoid_grouped",
            n_group=8,
            topk_group=4,
            correction_bias=np.linspace(-0.1, 0.1, 256, dtype=np.float32),
        ),
    )
    check(
        "route grouped M=5 E=250 k=8, rows 1 element off 16 bytes",
        lambda: routing_case(5, 250, 8, "sigmoid_grouped", offset=1, n_group=2, topk_group=1),
    )
    check(
        f"route block M=3 E={GPU_MAX_EXPERTS} k=64",
        lambda: routing_case(3, GPU_MAX_EXPERTS, 64, "softmax_topk"),
    )
    check("route tiles M=5000 E=256 k=8", lambda: routing_case(5000, 256, 8, "softmax_topk"))
    check(
        "route + tiled maps M=3000 E=256 k=8 (no workspace)",
        lambda: routing_case(3000, 256, 8, "softmax_topk", workspace=False),
    )
    # Expand / finalize at a tail width (no 16-byte vectors) and a vector width.
    check("expand+finalize M=5 H=2050 k=3 fp16", lambda: stages_case(5, 2050, 3, np.float16))
    check("expand+finalize M=64 H=2048 k=8 bf16", lambda: stages_case(64, 2048, 8, BF16))
    # Dequantize: both formats, both nibble orders, a K tail (NVFP4 K % 32 == 16).
    for fmt, k in (("nvfp4", 48), ("mxfp4", 96)):
        for pair in (False, True):
            check(
                f"dequant {fmt} K={k} pair={pair}",
                lambda f=fmt, kk=k, p=pair: dequant_case(f, p, kk),
            )
    # GEMV tilings with tails: N = 40 (not a multiple of the 16-row tile), K % 32 = 16, 12 rows
    # per expert (two passes of 8); MXFP4 with fp16 activations.
    # Every tiling; K = 2224 also runs unchecked iterations of the 8-warp blocks.
    from cupymoe.experts.config import TILINGS

    for tiling in TILINGS:
        for k in (176, 2224):
            check(
                f"gemv nvfp4 bf16 tiling={tiling} N=40 K={k} M=12",
                lambda t=tiling, kk=k: gemv_case("nvfp4", BF16, t[0] == 32, t, 40, kk, 12),
            )
    check(
        "gemv mxfp4 fp16 pair cta_n=32",
        lambda: gemv_case("mxfp4", np.float16, True, (32, 128), 24, 96, 3),
    )
    # Whole layers: FC1 (all three activations) and FC2 GEMVs, both formats and nibble orders,
    # biases, fp16 and bf16, the batched path above the row window.
    check("layer qwen M=8 bf16", lambda: layer_case("qwen3.6-35b-a3b", 8, BF16, False, 32))
    check("layer gpt-oss M=3 fp16 pair", lambda: layer_case("gpt-oss-20b", 3, np.float16, True, 8))
    check("layer deepseek M=2 bf16", lambda: layer_case("deepseek-v3", 2, BF16, False, 16))
    check(
        "layer qwen geglu M=4 fp16",
        lambda: layer_case("qwen3.6-35b-a3b", 4, np.float16, True, 16, act="geglu"),
    )
    check(
        "layer qwen M=9 plain fp16",
        lambda: layer_case("qwen3.6-35b-a3b", 9, np.float16, False, 16),
    )
    # The grouped GEMM: every tiling, N = 40 and K = 176 (tails), 3 and 37 rows per expert (one
    # partial tile, several tiles); MXFP4 with fp16; a whole layer above the hand-over.
    from cupymoe.experts.gemm import GEMM_TILINGS

    for tiling in GEMM_TILINGS:
        for m in (6, 74):
            check(
                f"gemm nvfp4 bf16 tiling={tiling} N=40 K=176 M={m}",
                lambda t=tiling, mm=m: gemm_case("nvfp4", BF16, t, 40, 176, mm),
            )
    check("gemm mxfp4 fp16", lambda: gemm_case("mxfp4", np.float16, GEMM_TILINGS[1], 48, 96, 30))
    # The sm_90a wgmma kernel (H100 / H200 only): tails, a partial and several tiles per expert
    # (m / 2 rows per expert, 3 / 25 / 37 / 64 + 11: K-loop widths 8, 32, 64 and 16; 128 in the
    # layer cases), MXFP4 with fp16.
    from cupymoe.experts.gemm import WGMMA_TILINGS, wgmma_enabled

    if wgmma_enabled():
        for m in (6, 50, 74, 150):
            check(
                f"gemm wgmma nvfp4 bf16 N=40 K=176 M={m}",
                lambda mm=m: gemm_case("nvfp4", BF16, ("wgmma", *WGMMA_TILINGS[0]), 40, 176, mm),
            )
        check(
            "gemm wgmma mxfp4 fp16",
            lambda: gemm_case("mxfp4", np.float16, ("wgmma", *WGMMA_TILINGS[0]), 48, 96, 90),
        )
        # bn 128 and bn 144 (138 rows per expert: one tile of 144 wide with the slack; 150: a
        # full tile and a narrow one), the epilogue of bn 144 staged in a stage slot.
        for tiling, m in (
            (WGMMA_TILINGS[1], 300),
            (WGMMA_TILINGS[2], 276),
            (WGMMA_TILINGS[2], 300),
        ):
            check(
                f"gemm wgmma nvfp4 bf16 bn={tiling[0]} N=40 K=176 M={m}",
                lambda t=tiling, mm=m: gemm_case("nvfp4", BF16, ("wgmma", *t), 40, 176, mm),
            )
        check("layer wgmma nvfp4 swiglu M=512", lambda: wgmma_layer_case("nvfp4", "swiglu", 512))
        check("layer wgmma mxfp4 relu M=512", lambda: wgmma_layer_case("mxfp4", "relu", 512))
    check("layer qwen M=40 bf16 (gemm)", lambda: layer_case("qwen3.6-35b-a3b", 40, BF16, True, 16))
    cupy.cuda.Device().synchronize()
    print(f"{len(failures)} failed checks" + (f": {failures}" if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
