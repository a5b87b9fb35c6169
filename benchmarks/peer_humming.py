# SPDX-License-Identifier: Apache-2.0
"""humming-kernels' MoE layer as vLLM's ``HummingIndexedExperts`` runs it, in torch, for
``bench_peers.py``: random weights in humming's layout, the routing and block alignment in torch,
the two indexed GEMMs, the activation and the combine, a stack of layers timed as a CUDA graph,
and a check of one layer against an FP32 reference. ``bench_peers.py``'s docstring has the method.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from cupymoe.bench import expert_bytes, floor_time_us, layer_flops
from cupymoe.presets import LayerShape

DEVICE = "cuda"
#: vLLM pads humming layers to these multiples of N and K.
PAD_N, PAD_K = 256, 128
WARMUP = 3
#: humming weight schemas (``HummingWeightSchema`` keywords) of cupymoe's formats, W4A16.
HUMMING_FORMATS = {
    "nvfp4": dict(
        b_dtype="float4e2m1",
        bs_dtype="float8e4m3",
        weight_scale_group_size=16,
        weight_scale_2_type="tensor",
    ),
    "mxfp4": dict(b_dtype="float4e2m1", bs_dtype="float8e8m0", weight_scale_group_size=32),
}
FORMAT_NAMES = {
    "nvfp4": "NVFP4 W4A16 (E2M1, E4M3 per 16, FP32 per expert)",
    "mxfp4": "MXFP4 W4A16 (E2M1, E8M0 per 32)",
}
#: The gated activations as humming ``process_input`` expressions of (gate ``a``, up ``b``).
ACTIVATION_IMPL = {
    "swiglu": "a / (1.0f + __expf(-a)) * b",
    "swiglu_oai": "fminf(a, 7.0f) / (1.0f + __expf(-1.702f * fminf(a, 7.0f)))"
    " * (fminf(fmaxf(b, -7.0f), 7.0f) + 1.0f)",
}
#: Scale bytes drawn uniformly: E4M3 0x28..0x37 is 0.25..0.94, E8M0 118..121 is 2^-9..2^-6.
SCALE_BYTES = {"float8_e4m3fn": (0x28, 0x38), "float8_e8m0fnu": (118, 122)}

_T0 = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {message}", flush=True)


def report_error(what: str, exc: BaseException) -> str:
    log(f"ERROR {what}: {type(exc).__name__}: {exc}")
    traceback.print_exc(limit=4, file=sys.stdout)
    sys.stdout.flush()
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------------------
# torch routing and alignment (graph-capturable: static shapes, no host synchronisation)


def route(torch: Any, shape: LayerShape, logits: Any, bias: Any) -> tuple[Any, Any]:
    """``(topk_ids int64 [M, k], topk_weights fp32 [M, k])`` of ``shape.routing``."""
    k = shape.top_k
    if shape.routing == "softmax_topk" and not shape.renormalize:
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        return ids, weights
    if shape.routing in ("softmax_topk", "topk_softmax"):  # renormalised softmax = softmax of top k
        values, ids = torch.topk(logits, k, dim=-1)
        return ids, torch.softmax(values, dim=-1)
    if shape.routing == "sigmoid_grouped":
        m, e = logits.shape
        group = e // shape.n_group
        scores = torch.sigmoid(logits)
        biased = scores + bias
        group_scores = biased.view(m, shape.n_group, group).topk(2, dim=-1).values.sum(-1)
        groups = group_scores.topk(shape.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        masked = biased.masked_fill(~keep.repeat_interleave(group, dim=1), float("-inf"))
        ids = masked.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * shape.routed_scaling_factor
        return ids, weights
    raise ValueError(f"routing {shape.routing!r}: no torch version")


class Aligner:
    """``moe_align_block_size`` in torch: the indexed-GEMM layout, written into static buffers.

    ``sorted_ids[p]`` is a flat route ``t * top_k + j`` (or ``n_rows`` for padding); expert
    ``e``'s routes, in route order, fill ``padded_start[e] : padded_start[e] + counts[e]`` with
    ``padded_start`` the exclusive sum of ``counts`` rounded up to ``block``;
    ``expert_ids[b]`` owns positions ``b * block : (b + 1) * block``; ``num_padded[0]`` is the
    padded total (the GEMM's ``num_tokens_padded``, read on the device).
    """

    def __init__(self, torch: Any, n_rows: int, n_experts: int, block: int) -> None:
        self.torch, self.n_rows, self.n_experts, self.block = torch, n_rows, n_experts, block
        capacity = -(-(n_rows + min(n_rows, n_experts) * (block - 1)) // block) * block
        dev = DEVICE
        self.ones = torch.ones(n_rows, dtype=torch.int32, device=dev)
        self.arange = torch.arange(n_rows, dtype=torch.int64, device=dev)
        self.block_starts = torch.arange(0, capacity, block, dtype=torch.int64, device=dev)
        self.sorted_ids = torch.full((capacity,), n_rows, dtype=torch.int32, device=dev)
        self.expert_ids = torch.zeros(capacity // block, dtype=torch.int32, device=dev)
        self.num_padded = torch.zeros(1, dtype=torch.int32, device=dev)

    def __call__(self, topk_ids: Any) -> None:
        torch, block = self.torch, self.block
        flat = topk_ids.reshape(-1)
        counts = torch.zeros(self.n_experts, dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat, self.ones)
        padded = (counts + (block - 1)) // block * block
        padded_end = torch.cumsum(padded, 0)
        padded_start = padded_end - padded
        start = torch.cumsum(counts, 0) - counts
        order = torch.argsort(flat, stable=True)
        expert = flat.index_select(0, order)
        rank = self.arange - start.index_select(0, expert)
        dest = padded_start.index_select(0, expert) + rank
        self.sorted_ids.fill_(self.n_rows)
        self.sorted_ids.scatter_(0, dest, order.to(torch.int32))
        owner = torch.searchsorted(padded_end, self.block_starts, right=True)
        self.expert_ids.copy_(owner.clamp_(max=self.n_experts - 1))
        self.num_padded.copy_(padded_end[-1:])


# ---------------------------------------------------------------------------------------------
# humming: plan (configurations, JIT), weights, one layer


@dataclasses.dataclass
class HummingPlan:
    """Per preset: the two GEMMs' layer configurations and the kernel of each token count."""

    shape: LayerShape
    tokens: tuple[int, ...]
    schema: Any  # humming HummingWeightSchema
    fc1: Any  # humming LayerConfig of w13 [E, (2)I, H]
    fc2: Any  # humming LayerConfig of w2 [E, H, I]
    fc1_n: int
    compute: str  # ComputeConfig JSON
    fc1_tuning: str  # JSON [[lo, hi, config], ...]: one kernel per token count
    fc2_tuning: str
    configs: dict[int, tuple[dict, dict]]  # M -> (fc1 config, fc2 config)
    activation: str = "humming"  # or "torch" (process_input failed)

    def blocks(self, m: int) -> tuple[int, int]:
        c1, c2 = self.configs[m]
        return int(c1["block_shape"][0]), int(c2["block_shape"][0])


def humming_plan(torch: Any, shape: LayerShape, tokens: Sequence[int]) -> HummingPlan:
    from humming.schema import HummingWeightSchema
    from humming.transform import prepare_layer_config
    from humming.tune import get_heuristics_config

    from cupymoe.experts.activation import Activation

    if shape.format not in HUMMING_FORMATS:
        raise ValueError(f"format {shape.format!r}: no humming equivalent")
    schema = HummingWeightSchema(**HUMMING_FORMATS[shape.format])
    fc1_n = (2 if Activation.parse(shape.activation).gated else 1) * shape.intermediate
    device = torch.cuda.current_device()

    def layer_config(n: int, k: int) -> Any:
        return prepare_layer_config(
            shape_n=n,
            shape_k=k,
            weight_schema=schema,
            num_experts=shape.n_experts,
            pad_n_to_multiple=PAD_N,
            pad_k_to_multiple=PAD_K,
            has_bias=shape.biases,
            torch_dtype=torch.bfloat16,
            device=device,
        )

    fc1, fc2 = layer_config(fc1_n, shape.hidden), layer_config(shape.hidden, shape.intermediate)
    # The launcher looks every call up by its rows in these intervals, (lo, hi], and first its
    # base kernel at 1 row: they tile (0, inf) (hi 0 means unbounded), one per token count.
    configs, t1, t2 = {}, [], []
    ordered = sorted(set(tokens))
    lo = 0
    for i, m in enumerate(ordered):
        rows = m * shape.top_k  # vLLM's valid_shape_m without expert parallelism
        c1, c2 = (
            get_heuristics_config(c, shape_m=rows, gemm_type="indexed", device=device)
            for c in (fc1, fc2)
        )
        configs[m] = (c1, c2)
        hi = 0 if i == len(ordered) - 1 else rows
        t1.append([lo, hi, c1])
        t2.append([lo, hi, c2])
        lo = rows
    compute = json.dumps(
        {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": "indexed"}
    )
    return HummingPlan(
        shape=shape,
        tokens=tuple(sorted(set(tokens))),
        schema=schema,
        fc1=fc1,
        fc2=fc2,
        fc1_n=fc1_n,
        compute=compute,
        fc1_tuning=json.dumps(t1),
        fc2_tuning=json.dumps(t2),
        configs=configs,
    )


def compile_plans(torch: Any, plans: Sequence[HummingPlan]) -> dict[str, str]:
    """Compile every kernel of ``plans`` concurrently (the GEMMs of every token count, the
    activation); ``{preset: error}`` for presets whose GEMMs fail."""
    from humming.kernel.humming import HummingKernel
    from humming.ops.utils import init_humming_launcher

    init_humming_launcher()  # once, before the threads
    device = torch.cuda.current_device()
    errors: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=3 * max(1, len(plans))) as pool:
        futures = {
            pool.submit(HummingKernel.prepare_kernels, c.to_str(), p.compute, t, device): p
            for p in plans
            for c, t in ((p.fc1, p.fc1_tuning), (p.fc2, p.fc2_tuning))
        }
        for p in plans:
            pool.submit(choose_activation, torch, p)
        for future in concurrent.futures.as_completed(futures):
            plan = futures[future]
            try:
                future.result()
            except Exception as exc:  # noqa: BLE001 - report and go on with the other presets
                errors[plan.shape.name] = report_error(f"humming JIT {plan.shape.name}", exc)
    return errors


def _torch_activation(torch: Any, name: str, gate_up: Any, out: Any) -> None:
    half = gate_up.shape[1] // 2
    gate, up = gate_up[:, :half], gate_up[:, half:]
    if name == "swiglu":
        torch.mul(torch.nn.functional.silu(gate), up, out=out)
        return
    g = gate.float().clamp(max=7.0)
    out.copy_(g * torch.sigmoid(1.702 * g) * (up.float().clamp(-7.0, 7.0) + 1.0))


def activate(torch: Any, plan: HummingPlan, gate_up: Any, out: Any) -> None:
    """``out [R, I] = act(gate_up[:, :I], gate_up[:, I:])``."""
    if plan.activation == "humming":
        from humming import ops

        impl = ACTIVATION_IMPL[plan.shape.activation]
        ops.process_input(
            gate_up, outputs=out, activation_type="binary_split", activation_impl=impl
        )
    else:
        _torch_activation(torch, plan.shape.activation, gate_up, out)


def choose_activation(torch: Any, plan: HummingPlan) -> str:
    """Compile humming's activation kernel and check it against torch; ``"torch"`` if it fails."""
    try:
        if plan.shape.activation not in ACTIVATION_IMPL:
            raise ValueError(f"activation {plan.shape.activation!r}: no humming expression")
        i = plan.shape.intermediate
        gate_up = torch.randn(64, 2 * i, dtype=torch.bfloat16, device=DEVICE)
        out, ref = (torch.empty(64, i, dtype=torch.bfloat16, device=DEVICE) for _ in "ab")
        plan.activation = "humming"
        activate(torch, plan, gate_up, out)
        _torch_activation(torch, plan.shape.activation, gate_up, ref)
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        if not err < 0.02:  # bf16 outputs: about 2^-8 of the largest value
            raise ValueError(f"process_input differs from torch by {err:.3g} of the maximum")
        return "humming"
    except Exception as exc:  # noqa: BLE001
        report_error(f"humming activation {plan.shape.name} (torch used instead)", exc)
        plan.activation = "torch"
        return "torch"


@dataclasses.dataclass
class Gemm:
    """One transformed humming GEMM of a layer (``w13`` or ``w2``)."""

    config: Any  # humming LayerConfig
    tensors: dict[str, Any]  # weight, weight_scale[, weight_scale_2][, bias]
    locks: Any

    def __call__(self, torch: Any, inputs: Any, outputs: Any, aligner: Aligner, **kw: Any) -> None:
        from humming.forward import humming_forward

        humming_forward(
            self.config,
            inputs=inputs,
            weight=self.tensors["weight"],
            weight_scale=self.tensors["weight_scale"],
            weight_scale_2=self.tensors.get("weight_scale_2"),
            bias=self.tensors.get("bias"),
            outputs=outputs,
            sorted_ids=aligner.sorted_ids,
            expert_ids=aligner.expert_ids,
            num_tokens_padded=aligner.num_padded,
            locks=self.locks,
            **kw,
        )


def random_gemm(
    torch: Any, plan: HummingPlan, config: Any, n: int, k: int, *, keep: int = 0
) -> tuple[Gemm, dict[str, Any]]:
    """Random weights of one GEMM in humming's input layout, transformed; with ``keep``, also the
    untransformed tensors of experts ``[0, keep)`` (for the reference check)."""
    from humming.transform import transform_humming_tensors

    attrs = plan.schema.get_tensors_attrs(
        shape_n=n,
        shape_k=k,
        param_dtype=torch.bfloat16,
        num_experts=plan.shape.n_experts,
        has_bias=plan.shape.biases,
    )
    raw = {}
    for name, attr in attrs.items():
        t = torch.empty(attr["shape"], dtype=attr["dtype"], device=DEVICE)
        if name == "weight":  # packed E2M1 codes: any bits are valid
            t.random_(-(2**31), 2**31 - 1)
        elif name == "weight_scale":
            lo, hi = SCALE_BYTES[str(t.dtype).removeprefix("torch.")]
            t.view(torch.uint8).random_(lo, hi)
        elif name == "weight_scale_2":
            t.fill_(1.0 / (2.0 * math.sqrt(k)))
        elif name == "bias":
            t.normal_(0.0, 0.1)
        else:
            t.zero_()
        raw[name] = t
    kept = {name: t[:keep].clone() for name, t in raw.items()} if keep else {}
    tensors = transform_humming_tensors(config, raw)
    del raw
    locks = torch.zeros(8192, dtype=torch.int32, device=DEVICE)  # stream-K; zero between calls
    return Gemm(config, tensors, locks), kept


@dataclasses.dataclass
class HummingLayer:
    fc1: Gemm
    fc2: Gemm
    correction_bias: Any  # fp32 [E] (sigmoid_grouped) or None


@dataclasses.dataclass
class LayerInputs:
    """One layer's router logits and routing buffers at one token count."""

    logits: Any
    weights: Any  # bf16 [M, 1, k]: the combine's top-k weights
    aligners: dict[int, Aligner]  # block_m -> buffers


class HummingStack:
    """``L`` humming layers and the shared activations of one token count."""

    def __init__(self, torch: Any, plan: HummingPlan, layers: Sequence[HummingLayer], m: int):
        self.torch, self.plan, self.layers, self.m = torch, plan, layers, m
        s, dev = plan.shape, DEVICE
        rows = m * s.top_k
        self.x = torch.randn(m, s.hidden, dtype=torch.bfloat16, device=dev)
        self.gate_up = torch.empty(rows, plan.fc1_n, dtype=torch.bfloat16, device=dev)
        self.act = torch.empty(rows, s.intermediate, dtype=torch.bfloat16, device=dev)
        self.down = torch.empty(rows, s.hidden, dtype=torch.bfloat16, device=dev)
        self.out = torch.empty(m, s.hidden, dtype=torch.bfloat16, device=dev)
        blocks = set(plan.blocks(m))
        self.inputs = [
            LayerInputs(
                logits=torch.randn(m, s.n_experts, dtype=torch.float32, device=dev),
                weights=torch.empty(m, 1, s.top_k, dtype=torch.bfloat16, device=dev),
                aligners={b: Aligner(torch, rows, s.n_experts, b) for b in blocks},
            )
            for _ in layers
        ]

    def route(self, layer: HummingLayer, li: LayerInputs) -> Any:
        ids, weights = route(self.torch, self.plan.shape, li.logits, layer.correction_bias)
        li.weights.copy_(weights.view(li.weights.shape))
        for aligner in li.aligners.values():
            aligner(ids)
        return ids

    def experts(self, layer: HummingLayer, li: LayerInputs, x: Any, out: Any) -> None:
        torch, plan, m = self.torch, self.plan, x.shape[0]
        k = plan.shape.top_k
        b1, b2 = plan.blocks(m)
        common = dict(valid_shape_m=m * k, compute_config=plan.compute)
        fc1_kw = dict(top_k=k, tuning_config=plan.fc1_tuning, **common)
        layer.fc1(torch, x, self.gate_up, li.aligners[b1], **fc1_kw)
        activate(torch, plan, self.gate_up, self.act)
        fc2_kw = dict(top_k=1, tuning_config=plan.fc2_tuning, **common)
        layer.fc2(torch, self.act, self.down, li.aligners[b2], **fc2_kw)
        torch.bmm(li.weights, self.down.view(m, k, -1), out=out.view(m, 1, -1))

    def run(self, *, with_routing: bool) -> None:
        for layer, li in zip(self.layers, self.inputs, strict=True):
            if with_routing:
                self.route(layer, li)
            self.experts(layer, li, self.x, self.out)

    def distinct_bytes(self) -> float:
        """Mean bytes of the distinct experts a layer's tokens select (the floor's numerator)."""
        torch, s = self.torch, self.plan.shape
        counts = []
        for layer, li in zip(self.layers, self.inputs, strict=True):
            ids, _ = route(torch, s, li.logits, layer.correction_bias)
            counts.append(int(torch.unique(ids).numel()))
        return statistics.mean(counts) * expert_bytes(s)


def graph_us(torch: Any, fn: Callable[[], None], repeats: int) -> float:
    """Median µs of one replay of ``fn`` recorded as a CUDA graph (two eager runs first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    stream = torch.cuda.current_stream()
    for _ in range(WARMUP):
        graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record(stream)
        graph.replay()
        stop.record(stream)
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3)
    del graph
    return statistics.median(samples)


@dataclasses.dataclass
class Reference:
    """FP32 weights of experts ``[0, C)`` of layer 0, from humming's ``dequantize_weight``."""

    w1: Any  # [C, (2)I, H]
    w2: Any  # [C, H, I]
    b1: Any  # [C, (2)I] or None
    b2: Any  # [C, H] or None

    @classmethod
    def from_raw(cls, raw1: dict, raw2: dict) -> Reference:
        from humming import dtypes
        from humming.utils.weight import dequantize_weight

        def dequant(raw: dict) -> Any:
            return dequantize_weight(
                raw["weight"],
                raw["weight_scale"],
                None,
                raw.get("weight_scale_2"),
                dtypes.float4e2m1,
                packed=True,
            ).float()

        b1, b2 = (r["bias"].float() if "bias" in r else None for r in (raw1, raw2))
        return cls(dequant(raw1), dequant(raw2), b1, b2)


def check_layer(torch: Any, plan: HummingPlan, stack: HummingStack, ref: Reference) -> float:
    """Relative L2 error of layer 0's output against ``ref`` with every token routed to experts
    ``[0, C)``; the layer's routing buffers are restored afterwards."""
    s, layer, li = plan.shape, stack.layers[0], stack.inputs[0]
    c = ref.w1.shape[0]
    saved = li.logits.clone()
    li.logits.fill_(-1e4)
    li.logits[:, :c] = torch.randn(stack.m, c, device=DEVICE) + 5.0
    ids = stack.route(layer, li)
    out = torch.empty_like(stack.out)
    stack.experts(layer, li, stack.x, out)
    _, weights = route(torch, s, li.logits, layer.correction_bias)
    li.logits.copy_(saved)
    stack.route(layer, li)
    if int(ids.max()) >= c:
        raise RuntimeError(f"check routing left experts [0, {c})")
    x = stack.x.float()
    expected = torch.zeros(stack.m, s.hidden, device=DEVICE)
    for e in range(c):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token] @ ref.w1[e].T
        if ref.b1 is not None:
            h = h + ref.b1[e]
        a = torch.empty(h.shape[0], s.intermediate, device=DEVICE)
        _torch_activation(torch, s.activation, h, a)
        y = a @ ref.w2[e].T
        if ref.b2 is not None:
            y = y + ref.b2[e]
        expected.index_add_(0, token, y * weights[token, slot, None])
    return float((out.float() - expected).norm() / expected.norm())


def build_layers(
    torch: Any, plan: HummingPlan, n_layers: int, *, keep: int
) -> tuple[list[HummingLayer], dict[str, Any], dict[str, Any]]:
    """``n_layers`` random layers and layer 0's untransformed experts ``[0, keep)``."""
    s = plan.shape
    layers: list[HummingLayer] = []
    kept: list[dict[str, Any]] = []
    for n in range(n_layers):
        torch.manual_seed(1000 + n)
        kn = keep if n == 0 else 0
        fc1, r1 = random_gemm(torch, plan, plan.fc1, plan.fc1_n, s.hidden, keep=kn)
        fc2, r2 = random_gemm(torch, plan, plan.fc2, s.hidden, s.intermediate, keep=kn)
        kept = kept or [r1, r2]
        bias = None
        if s.routing == "sigmoid_grouped":
            bias = torch.randn(s.n_experts, device=DEVICE) * 0.01
        layers.append(HummingLayer(fc1, fc2, bias))
    return layers, kept[0], kept[1]


def bench_humming(
    torch: Any, plan: HummingPlan, n_layers: int, repeats: int, *, check: bool
) -> tuple[dict[int, dict], dict]:
    """``({M: row}, preset notes)``; rows carry ``us_per_layer`` or ``error``."""
    s = plan.shape
    notes: dict[str, Any] = {"format": FORMAT_NAMES[s.format], "activation": plan.activation}
    keep = min(s.n_experts, 2 * s.top_k) if check else 0
    log(f"humming {s.name}: building {n_layers} layers")
    layers, raw1, raw2 = build_layers(torch, plan, n_layers, keep=keep)
    ref = None
    if keep:
        try:
            ref = Reference.from_raw(raw1, raw2)
        except Exception as exc:  # noqa: BLE001
            notes["check_error"] = report_error(f"humming reference {s.name}", exc)
    del raw1, raw2
    torch.cuda.synchronize()
    rows: dict[int, dict] = {}
    for m in plan.tokens:
        row: dict[str, Any] = {
            "fc1_config": plan.configs[m][0],
            "fc2_config": plan.configs[m][1],
            "block_m": list(plan.blocks(m)),
        }
        rows[m] = row
        try:
            stack = HummingStack(torch, plan, layers, m)
            for layer, li in zip(stack.layers, stack.inputs, strict=True):
                stack.route(layer, li)
            if ref is not None:
                try:
                    row["check_rel_err"] = check_layer(torch, plan, stack, ref)
                    log(f"humming {s.name} M={m} check: rel err {row['check_rel_err']:.2e}")
                except Exception as exc:  # noqa: BLE001
                    row["check_error"] = report_error(f"humming check {s.name} M={m}", exc)
            row["distinct_bytes"] = stack.distinct_bytes()
            row["floor_us"] = floor_time_us(row["distinct_bytes"], layer_flops(s, m))
        except Exception as exc:  # noqa: BLE001
            row["error"] = report_error(f"humming {s.name} M={m} setup", exc)
            continue
        for key, with_routing in (("experts_us_per_layer", False), ("us_per_layer", True)):
            run = functools.partial(stack.run, with_routing=with_routing)
            label = "with torch routing" if with_routing else "experts"
            for attempt in range(2):  # the second with torch's activation, if humming's failed
                try:
                    log(f"humming {s.name} M={m} {label} ({plan.activation} activation)")
                    row[key] = graph_us(torch, run, repeats) / n_layers
                    row["finite"] = bool(torch.isfinite(stack.out).all())
                    row.pop(f"{key}_error", None)
                    break
                except Exception as exc:  # noqa: BLE001
                    row[f"{key}_error"] = report_error(f"humming {s.name} M={m} {key}", exc)
                    if attempt or plan.activation != "humming":
                        break
                    notes["humming_activation_error"] = row[f"{key}_error"]
                    plan.activation = notes["activation"] = "torch"
            row["activation"] = plan.activation
        del stack
        torch.cuda.synchronize()
    return rows, notes
