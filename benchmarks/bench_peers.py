# SPDX-License-Identifier: Apache-2.0
"""cupymoe against humming-kernels (vLLM's Hopper W4A16 MoE backend): µs per layer, same GPU run.

Run on a GPU from the repository root, humming-kernels installed (its wheel travels in ``.whl/``)::

    PYTHONPATH=. python3 benchmarks/bench_peers.py [--preset NAME ...] [--tokens 16,64]
        [--layers L] [--repeats 20] [--skip-cupymoe] [--skip-humming] [--no-check]
        [--out peers.json]

Default token counts: Qwen3.6 and gpt-oss 16, 64, 256, 1,024, 4,096; DeepSeek-V3 16, 64, 512.

**Method** (both libraries alike, in one process on one GPU). Per preset, a stack of ``L`` layers
with distinct random weights, ``L = cupymoe.bench.stack_depth(shape)`` capped at 40 GB of weights
(one token's experts over the stack read 4x the 60 MB L2; Qwen3.6 18, gpt-oss 5, DeepSeek-V3 4),
recorded into one CUDA graph; every layer reads the same ``x [M, hidden]`` (bf16) and its own
router logits ``[M, n_experts]`` (fp32, standard normal). CUDA events around ``--repeats``
replays after 3 warm-up replays; the median replay over ``L`` is the µs per layer. The two
libraries take turns (cupymoe's phase, then humming's), each preceded by a device
synchronisation and followed by freeing its memory pool.

**cupymoe**: ``cupymoe.bench.bench_preset`` (what ``cupymoe bench`` prints): the whole
``MoELayer`` call: GPU routing, FC1 (+ activation), FC2, weighted top-k combine. Its "experts"
column is the sum of its fc1, fc2 and finalize stage graphs (routing left out).

**humming** (``humming-kernels``, driven by ``peer_humming.py``) as vLLM's
``HummingIndexedExperts`` runs it, which is humming's MoE: weights in vLLM's layout
(``w13 [E, 2I, H]``, ``w2 [E, H, I]``, padded to multiples of 256 in N and 128 in K as vLLM
pads them) and two indexed grouped GEMMs (``humming.forward.humming_forward``,
``gemm_type="indexed"``, ``sorted_ids`` / ``expert_ids`` / ``num_tokens_padded`` in the
``moe_align_block_size`` layout, each GEMM's kernel from ``humming.tune.get_heuristics_config``
for ``M * top_k`` rows, as vLLM's tuning table picks it), the gated activation between them as
humming's fused ``ops.process_input`` kernel (``binary_split``; plain torch if that kernel
fails) and the weighted top-k sum as one ``torch.bmm``. Humming has no routing of its own (vLLM
runs its fused ``topk_softmax`` and ``moe_align_block_size`` CUDA kernels, which humming does
not ship), so the "humming" column adds the routing in torch inside the graph: ``torch.topk`` +
``softmax`` (Qwen3.6, gpt-oss) or DeepSeek-V3's sigmoid and group-limited top-k, and the block
alignment as ~12 torch kernels (a stable sort, cumulative sums, a scatter; twice where the two
GEMMs' kernels tile M differently, as each needs its own). That is more kernels than vLLM
launches, so the "humming experts" column also times the graph without them (routing and
alignment computed once, outside the graph): the two humming columns bracket what vLLM's
backend would take. Weight formats, W4A16 (bf16 activations, FP4 codes decoded in the kernel,
as cupymoe does): the NVFP4 presets as E2M1 codes, E4M3 scales per 16 and an FP32 scale per
expert (humming's ModelOpt NVFP4 path), gpt-oss as MXFP4 (E2M1, E8M0 scales per 32) with its
fused biases. Codes and scale bytes are random (uniform codes, scales over two octaves).

Unless ``--no-check``, layer 0 is checked at every token count before it is timed: all tokens
routed to its first ``2 * top_k`` experts, the output against an FP32 reference from humming's
own ``dequantize_weight`` (the ``check`` column, a relative L2 error; bf16 intermediates give
about 1e-2, a wrong index layout about 1), so that the timed pipeline is known to compute the
layer.

**JIT.** humming compiles its kernels on first use (NVRTC from ``cuda-bindings``, else nvcc;
cubins cached under ``HUMMING_CACHE_DIR``, default ``~/.humming/cache``). Every preset's GEMM
kernels (one per GEMM and token count) are compiled up front, all in parallel, before any timing.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from peer_humming import HummingPlan, bench_humming, compile_plans, humming_plan, log, report_error

from cupymoe.bench import HBM_READ_TBPS, stack_depth
from cupymoe.presets import PRESETS, LayerShape

DEFAULT_TOKENS = {
    "qwen3.6-35b-a3b": (16, 64, 256, 1024, 4096),
    "gpt-oss-20b": (16, 64, 256, 1024, 4096),
    "deepseek-v3": (16, 64, 512),
}
#: Weights of one library's stack at most (DeepSeek-V3: ~6.3 GB a layer, so 4 layers).
MAX_STACK_BYTES = 40e9

# ---------------------------------------------------------------------------------------------
# the run


def bench_cupymoe(shape: LayerShape, tokens: Sequence[int], n_layers: int, repeats: int) -> dict:
    import ml_dtypes

    from cupymoe.bench import bench_preset

    results = bench_preset(
        shape,
        tokens,
        dtype=ml_dtypes.bfloat16,
        n_layers=n_layers,
        repeats=repeats,
        progress=lambda label: log(f"cupymoe {label}"),
    )
    rows = {}
    for r in results:
        d = r.as_dict()
        parts = [r.stages_us.get(stage) for stage in ("fc1", "fc2", "finalize")]
        d["experts_us_per_layer"] = sum(parts) if all(p is not None for p in parts) else None
        rows[r.tokens] = d
    return rows


def _sync_all(torch: Any, cupy: Any) -> None:
    """Both libraries' work done (they share the device, not their streams)."""
    try:
        if torch is not None:
            torch.cuda.synchronize()
        if cupy is not None:
            cupy.cuda.Device().synchronize()
    except Exception as exc:  # noqa: BLE001
        report_error("device synchronisation", exc)


def _free(torch: Any, cupy: Any) -> None:
    """Give one library's cached memory back before the other allocates its stack."""
    gc.collect()
    _sync_all(torch, cupy)
    try:
        if cupy is not None:
            cupy.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001
        report_error("freeing memory", exc)


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None


def _fmt(value: Any, digits: int = 1) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, float) else "—"


def format_table(rows: Sequence[dict]) -> str:
    head = (
        "| preset | M | L | cupymoe µs | humming µs | ratio | cupymoe experts µs "
        "| humming experts µs | experts ratio | floor µs | check |\n" + "|---" * 11 + "|"
    )
    lines = [head]
    for r in rows:
        c, h = r.get("cupymoe") or {}, r.get("humming") or {}
        lines.append(
            f"| {r['preset']} | {r['tokens']} | {r['layers']} | {_fmt(c.get('us_per_layer'))} "
            f"| {_fmt(h.get('us_per_layer'))} | {_fmt(r.get('ratio'), 2)} "
            f"| {_fmt(c.get('experts_us_per_layer'))} | {_fmt(h.get('experts_us_per_layer'))} "
            f"| {_fmt(r.get('experts_ratio'), 2)} | {_fmt(r.get('floor_us'))} "
            f"| {_fmt(h.get('check_rel_err'), 4)} |"
        )
    return "\n".join(lines)


def _preflight(skip_cupymoe: bool, skip_humming: bool) -> tuple[Any, Any, dict]:
    info: dict[str, Any] = {}
    torch = cupy = None
    if not skip_humming:
        try:
            import torch as torch_module

            torch = torch_module
            info["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
            missing = [
                name
                for name in ("jinja2", "cuda.bindings", "filelock", "triton", "packaging")
                if importlib.util.find_spec(name) is None
            ]
            info["humming_missing_deps"] = missing
            import humming

            info["humming"] = humming.__version__
        except Exception as exc:  # noqa: BLE001
            info["humming_error"] = report_error("import torch / humming", exc)
    if not skip_cupymoe:
        try:
            import cupy as cupy_module

            cupy = cupy_module
            info["cupy"] = cupy.__version__
        except Exception as exc:  # noqa: BLE001
            info["cupy_error"] = report_error("import cupy", exc)
    try:
        if torch is not None:
            info["gpu"] = torch.cuda.get_device_name()
        elif cupy is not None:
            from cupymoe.bench import device_name

            info["gpu"] = device_name()
    except Exception as exc:  # noqa: BLE001
        info["gpu_error"] = report_error("device name", exc)
    log(f"preflight: {json.dumps(info)}")
    return torch, cupy, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable")
    parser.add_argument("--tokens", help="comma-separated token counts (default: per preset)")
    parser.add_argument("--layers", type=int, help="layers in each stack (default: stack_depth)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--skip-cupymoe", action="store_true")
    parser.add_argument("--skip-humming", action="store_true")
    parser.add_argument("--no-check", action="store_true", help="skip humming's reference check")
    parser.add_argument("--out", help="write results as JSON")
    args = parser.parse_args(argv)
    names = args.preset or list(DEFAULT_TOKENS)
    tokens_arg = None
    if args.tokens:
        tokens_arg = sorted({int(t) for t in args.tokens.split(",") if t.strip()})
        if not tokens_arg or min(tokens_arg) < 1:
            parser.error(f"--tokens: expected positive integers, got {args.tokens!r}")

    torch, cupy, info = _preflight(args.skip_cupymoe, args.skip_humming)
    info.update(command=" ".join(["bench_peers.py", *sys.argv[1:]]), hbm_read_tbps=HBM_READ_TBPS)
    tokens = {n: tuple(tokens_arg or DEFAULT_TOKENS[n]) for n in names}
    depth = {
        n: args.layers or stack_depth(PRESETS[n], max_weight_bytes=MAX_STACK_BYTES) for n in names
    }

    plans: dict[str, HummingPlan] = {}
    preset_notes: dict[str, dict] = {n: {} for n in names}
    if torch is not None and "humming" in info:
        for n in names:
            try:
                plans[n] = humming_plan(torch, PRESETS[n], tokens[n])
            except Exception as exc:  # noqa: BLE001
                preset_notes[n]["humming_error"] = report_error(f"humming plan {n}", exc)
        log(f"humming JIT: compiling the kernels of {', '.join(plans)}")
        jit_start = time.perf_counter()
        for n, err in compile_plans(torch, list(plans.values())).items():
            preset_notes[n]["humming_error"] = err
            plans.pop(n)
        info["humming_jit_s"] = time.perf_counter() - jit_start
        log(f"humming JIT done in {info['humming_jit_s']:.0f} s")

    rows: list[dict] = []
    for n in names:
        shape = PRESETS[n]
        log(f"=== {n}: tokens {list(tokens[n])}, {depth[n]} layers per stack")
        cup: dict[int, dict] = {}
        if cupy is not None:
            _sync_all(torch, cupy)
            try:
                cup = bench_cupymoe(shape, tokens[n], depth[n], args.repeats)
            except Exception as exc:  # noqa: BLE001
                preset_notes[n]["cupymoe_error"] = report_error(f"cupymoe {n}", exc)
            _free(torch, cupy)
        hum: dict[int, dict] = {}
        if n in plans:
            _sync_all(torch, cupy)
            try:
                hum, notes = bench_humming(
                    torch, plans[n], depth[n], args.repeats, check=not args.no_check
                )
                preset_notes[n].update(notes)
            except Exception as exc:  # noqa: BLE001
                preset_notes[n]["humming_error"] = report_error(f"humming {n}", exc)
            _free(torch, cupy)
        for m in tokens[n]:
            c, h = cup.get(m), hum.get(m)
            floor = (c or {}).get("floor_us", (h or {}).get("floor_us"))
            rows.append(
                {
                    "preset": n,
                    "format": shape.format,
                    "tokens": m,
                    "layers": depth[n],
                    "cupymoe": c,
                    "humming": h,
                    "floor_us": floor,
                    "ratio": _ratio((h or {}).get("us_per_layer"), (c or {}).get("us_per_layer")),
                    "experts_ratio": _ratio(
                        (h or {}).get("experts_us_per_layer"),
                        (c or {}).get("experts_us_per_layer"),
                    ),
                }
            )
        print(format_table([r for r in rows if r["preset"] == n]), flush=True)
        if args.out:  # after every preset, so that a run cut short keeps what it measured
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump({**info, "presets": preset_notes, "results": rows}, f, indent=1)
    print("\n" + format_table(rows))
    for n, notes in preset_notes.items():
        print(f"{n}: {json.dumps(notes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
