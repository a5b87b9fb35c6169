# SPDX-License-Identifier: Apache-2.0
"""FP4 expert GEMV for decode: FC1 with the gated activation fused, and FC2.

``gemv_fc2(h)[r] = h[r] @ W[e]^T + b[e]`` and
``gemv_fc1(x)[r] = act(x[t] @ Wg[e]^T + bg[e], x[t] @ Wu[e]^T + bu[e])`` for every expanded row
``r`` of expert ``e`` (``expert_offsets[e] <= r < expert_offsets[e + 1]``) with
``t = sorted_rows[r] // top_k``; the references are :mod:`.reference`.

The kernels (``cuda/gemv_fp4.cu``) run on tensor cores (``mma.sync`` m16n8k16, weights decoded
and block-scaled exactly in 16 bits, fp32 accumulation) and are expert-major: one block per
(column tile, active expert) applies each decoded weight tile to all rows of its expert, so an
expert's weights are read once per call. FC1 reads ``x`` in token order through ``sorted_rows``
(no expand launch). Which backend serves a call (this GEMV up to the row window, the batched
fallback above it) is :mod:`.dispatch`'s choice; the launches here take validated arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._runtime.backend import require_cupy, to_numpy
from .._runtime.compile import CTYPE, KernelSpec
from .._runtime.device import device_name
from .._runtime.launch import launch, pdl_enabled
from .._runtime.validate import ACTIVATION_DTYPES, check_bias, device_output
from ..formats import DeviceFp4, Fp4Experts, Fp4Format
from ..routing import Routing
from .activation import Activation, ActivationSpec
from .config import TILINGS, GemvConfig
from .layouts import (
    DEFAULT_LAYOUT,
    WeightLayout,
    check_expert_bytes,
    chunk_count,
    gemv_layout,
    mx_scale_shift,
    packed_from_layout,
    pad_packed,
    scale_range,
    scales_from_tiles,
    tile_scales,
)

__all__ = [
    "PreparedFc1",
    "PreparedFc2",
    "ResidentExperts",
    "default_config",
    "fc1_arrays",
    "fc2_arrays",
    "gemv_fc1",
    "gemv_fc1_single",
    "gemv_fc2",
    "kernel_specs",
    "prepare_fc1",
    "prepare_fc2",
    "scale_shift",
]


@dataclasses.dataclass(frozen=True)
class ResidentExperts:
    """One weight matrix as the kernels know it besides the bytes they read: format, shape and
    global scales. Its codes and block scales live once, in the kernel layout of the
    :class:`PreparedFc1` / :class:`PreparedFc2` that holds it."""

    format: Fp4Format
    n_experts: int
    n: int
    k: int
    global_scale: Any  # cupy float32 [E]; all ones for MXFP4

    @property
    def block_size(self) -> int:
        """Elements per block scale (16 for NVFP4, 32 for MXFP4)."""
        return self.format.block_size

    @classmethod
    def of(cls, w: DeviceFp4) -> ResidentExperts:
        return cls(w.format, w.n_experts, w.n, w.k, w.global_scale)


def _plain(info: ResidentExperts, kernel: Any, scales: Any, layout: WeightLayout) -> DeviceFp4:
    """``info``'s weights as a :class:`DeviceFp4` rebuilt from the resident kernel bytes (new
    arrays: for the fallback that reads row-major bytes, never in the decode path)."""
    cupy = require_cupy()
    if layout is WeightLayout.SPLIT:
        packed = packed_from_layout(kernel, info.n, info.k)
    else:
        packed = cupy.ascontiguousarray(kernel[:, :, : info.k // 2])
    return DeviceFp4(
        format=info.format,
        packed=packed,
        scales=scales,
        global_scale=info.global_scale,
        pair_interleaved=layout is not WeightLayout.SPLIT and layout.pair_interleaved,
    )


def _nbytes(*arrays: Any) -> int:
    return sum(int(a.nbytes) for a in arrays)


@dataclasses.dataclass(frozen=True)
class PreparedFc1:
    """FC1 weights on the GPU, once: the kernels' layout of gate and up and their scale tiles.

    ``kernel_gate`` / ``kernel_up`` are the weights every kernel reads, in ``layout``: for PLAIN
    and PAIR ``[E, I, chunks * 16]`` uint8 (the uploaded packed arrays themselves when
    ``H % 32 == 0``, else zero-padded along K to a multiple of 32 codes); for SPLIT the
    :func:`.layouts.gemv_layout` tiles of 8 rows, which the GEMV and the grouped GEMM read.
    ``kernel_scales`` (uint8 ``[E, ceil(I / 8), chunks, 8 * 2 * 32 / block]``, see
    :func:`.layouts.tile_scales`) puts the scale bytes one lane needs per chunk (gate and up of
    one column) side by side: one 4- or 2-byte load. ``scale_range`` is the (min, max) MXFP4
    scale exponent byte of gate and up (NaN bytes left out), ``None`` for NVFP4: it picks the
    kernels' power-of-two scale shift (:func:`.layouts.mx_scale_shift`).
    """

    gate: ResidentExperts
    up: ResidentExperts
    kernel_gate: Any
    kernel_up: Any
    kernel_scales: Any
    layout: WeightLayout
    gate_bias: Any = None  # cupy float32 [E, I] or None (set together with up_bias)
    up_bias: Any = None
    scale_range: tuple[int, int] | None = None

    @property
    def resident_bytes(self) -> int:
        """GPU bytes of the weights: codes, block scales and global scales (biases excluded)."""
        return _nbytes(
            self.kernel_gate,
            self.kernel_up,
            self.kernel_scales,
            self.gate.global_scale,
            self.up.global_scale,
        )

    def device_fp4(self) -> tuple[DeviceFp4, DeviceFp4]:
        """Gate and up as row-major :class:`DeviceFp4` copies, rebuilt from the resident bytes
        (the batched fallback's input)."""
        g = self.gate
        scales = scales_from_tiles(self.kernel_scales, g.n, g.k, g.block_size, 2)
        return (
            _plain(g, self.kernel_gate, scales[0], self.layout),
            _plain(self.up, self.kernel_up, scales[1], self.layout),
        )


@dataclasses.dataclass(frozen=True)
class PreparedFc2:
    """FC2 weights on the GPU, once: ``kernel_packed`` (SPLIT: tiles of 16 rows) and
    ``kernel_scales`` uint8 ``[E, ceil(H / 16), chunks, 8 * 2 * 32 / block]`` (rows ``g`` and
    ``g + 8`` of each 16-row tile side by side); ``layout`` as in :class:`PreparedFc1`; see
    :func:`.layouts.tile_scales`.
    """

    down: ResidentExperts
    kernel_packed: Any
    kernel_scales: Any
    layout: WeightLayout
    bias: Any = None  # cupy float32 [E, H] or None
    scale_range: tuple[int, int] | None = None

    @property
    def resident_bytes(self) -> int:
        """GPU bytes of the weights: codes, block scales and global scales (bias excluded)."""
        return _nbytes(self.kernel_packed, self.kernel_scales, self.down.global_scale)

    def device_fp4(self) -> DeviceFp4:
        """Down as a row-major :class:`DeviceFp4` copy rebuilt from the resident bytes."""
        d = self.down
        (scales,) = scales_from_tiles(self.kernel_scales, d.n, d.k, d.block_size, 1)
        return _plain(d, self.kernel_packed, scales, self.layout)


def scale_shift(weights: PreparedFc1 | PreparedFc2, dtype: Any) -> int | None:
    """The GEMV's MXFP4 scale shift for activations of ``dtype``; ``None`` when the scales span
    more than the GEMV can fold exactly (:func:`.layouts.mx_scale_shift`): another backend runs."""
    return mx_scale_shift(weights.scale_range, dtype, weights.layout is not WeightLayout.PLAIN)


def _device(w: Fp4Experts | DeviceFp4, name: str, layout: WeightLayout) -> DeviceFp4:
    """``w`` on the GPU in the nibble order ``layout`` reads (SPLIT converts from either order:
    a :class:`DeviceFp4` keeps its own, host weights are uploaded pair-interleaved)."""
    if isinstance(w, DeviceFp4):
        if layout is not WeightLayout.SPLIT and w.pair_interleaved != layout.pair_interleaved:
            raise ValueError(
                f"{name}: layout {layout.key} reads pair_interleaved={layout.pair_interleaved} "
                f"bytes, got a DeviceFp4 with pair_interleaved={w.pair_interleaved}"
            )
    elif not isinstance(w, Fp4Experts):
        raise TypeError(f"{name}: expected Fp4Experts or DeviceFp4, got {type(w).__name__}")
    else:
        w = DeviceFp4.from_experts(w, pair_interleaved=layout.pair_interleaved)
    if w.packed.data.ptr % 16:  # the kernels load 16 bytes at a time
        raise ValueError(f"{name}.packed: expected a 16-byte aligned array")
    check_expert_bytes(w.n, w.k, name)
    return w


def _kernel_weights(w: DeviceFp4, layout: WeightLayout, rows_per_tile: int) -> Any:
    """The bytes the GEMV reads: the split copy or the uploaded (K-padded) array."""
    if layout is WeightLayout.SPLIT:
        return gemv_layout(w.packed, w.k, w.pair_interleaved, rows_per_tile)
    return pad_packed(w.packed, w.k)


def _device_bias(bias: Any, name: str, n_experts: int, n: int) -> Any:
    cupy = require_cupy()
    b = check_bias(to_numpy(bias), name, (n_experts, n))
    return cupy.ascontiguousarray(cupy.asarray(b, dtype=np.float32))


def prepare_fc1(
    gate: Fp4Experts | DeviceFp4,
    up: Fp4Experts | DeviceFp4,
    *,
    gate_bias: Any = None,
    up_bias: Any = None,
    layout: WeightLayout | str = DEFAULT_LAYOUT,
) -> PreparedFc1:
    """Upload FC1 (gate ``[E, I, H]`` and up ``[E, I, H]``) and build the GEMV's layout once.

    A bias given for only one of gate / up gets a zero bias for the other. ``layout``: the
    :class:`~.layouts.WeightLayout` the GEMV reads (SPLIT keeps a second copy of the weights);
    host weights are uploaded in its nibble order, and a :class:`DeviceFp4` must be in it (any
    order for SPLIT).
    """
    layout = WeightLayout.parse(layout)
    g = _device(gate, "gate", layout)
    u = _device(up, "up", layout)
    if (u.format, u.n_experts, u.n, u.k) != (g.format, g.n_experts, g.n, g.k):
        raise ValueError(
            f"up: expected the format and shape of gate {(g.format.value, g.n_experts, g.n, g.k)}, "
            f"got {(u.format.value, u.n_experts, u.n, u.k)}"
        )
    biases = [gate_bias, up_bias]
    if any(b is not None for b in biases):
        biases = [np.zeros((g.n_experts, g.n), np.float32) if b is None else b for b in biases]
        biases = [
            _device_bias(b, name, g.n_experts, g.n)
            for b, name in zip(biases, ("gate_bias", "up_bias"), strict=True)
        ]
    scales = tile_scales([g.scales, u.scales], g.k, g.block_size)
    return PreparedFc1(
        ResidentExperts.of(g),
        ResidentExperts.of(u),
        _kernel_weights(g, layout, 8),
        _kernel_weights(u, layout, 8),
        scales,
        layout,
        gate_bias=biases[0],
        up_bias=biases[1],
        scale_range=scale_range(g, u),
    )


def prepare_fc2(
    down: Fp4Experts | DeviceFp4,
    *,
    bias: Any = None,
    layout: WeightLayout | str = DEFAULT_LAYOUT,
) -> PreparedFc2:
    """Upload FC2 (down ``[E, H, I]``) and build the GEMV's layout once (``layout`` as in
    :func:`prepare_fc1`)."""
    layout = WeightLayout.parse(layout)
    d = _device(down, "down", layout)
    b = None if bias is None else _device_bias(bias, "bias", d.n_experts, d.n)
    scales = tile_scales([d.scales], d.k, d.block_size)
    packed = _kernel_weights(d, layout, 16)
    return PreparedFc2(ResidentExperts.of(d), packed, scales, layout, b, scale_range=scale_range(d))


# ---- GPU launches (validated arguments; see dispatch.fc1 / dispatch.fc2) ------------------------
def fc1_arrays(x: Any, weights: PreparedFc1, routing: Routing, out: Any) -> tuple[Any, ...]:
    """The array arguments the FC1 kernels (GEMV and grouped GEMM) take first, in their order."""
    return (
        x,
        routing.sorted_rows,
        weights.kernel_gate,
        weights.kernel_up,
        weights.kernel_scales,
        weights.gate.global_scale,
        weights.up.global_scale,
        weights.gate_bias,
        weights.up_bias,
        routing.expert_offsets,
        routing.active_experts,
        out,
    )


def fc2_arrays(h: Any, weights: PreparedFc2, routing: Routing, out: Any) -> tuple[Any, ...]:
    """The array arguments the FC2 kernels (GEMV and grouped GEMM) take first, in their order."""
    return (
        h,
        weights.kernel_packed,
        weights.kernel_scales,
        weights.down.global_scale,
        weights.bias,
        routing.expert_offsets,
        routing.active_experts,
        out,
    )


def default_config(
    w: ResidentExperts,
    rows: int,
    dtype: Any,
    *,
    gated: bool,
    layout: WeightLayout,
    n_experts: int | None = None,
) -> GemvConfig:
    """The GEMV tiling a call of ``rows`` expanded rows gets when none is given
    (:meth:`GemvConfig.for_problem`: environment, tuning cache, table); ``n_experts`` defaults to
    ``w``'s (an expert-parallel shard passes the whole layer's, to pick what one GPU picks)."""
    return GemvConfig.for_problem(
        n=w.n,
        k=w.k,
        rows=rows,
        fmt=w.format,
        device_name=device_name(),
        dtype=np.dtype(dtype),
        gated=gated,
        n_experts=w.n_experts if n_experts is None else n_experts,
        layout=layout,
    )


def _config(
    config: GemvConfig | None,
    w: ResidentExperts,
    rows: int,
    dtype: np.dtype,
    *,
    gated: bool,
    layout: WeightLayout,
) -> GemvConfig:
    if config is None:
        return default_config(w, rows, dtype, gated=gated, layout=layout)
    if not isinstance(config, GemvConfig):
        raise TypeError(f"config: expected a GemvConfig, got {type(config).__name__}")
    return config


def _blocks(n: int, cols_per_tile: int, cfg: GemvConfig) -> int:
    """Column blocks of a launch: tiles of ``cols_per_tile`` columns, ``cfg.cta_n / 16`` each."""
    tiles = -(-n // cols_per_tile)
    return -(-tiles // (cfg.cta_n // 16))


def gemv_fc1(
    x: Any,
    weights: PreparedFc1,
    routing: Routing,
    *,
    act: ActivationSpec,
    top_k: int,
    shift: int,
    out: Any = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
) -> Any:
    """The FC1 GEMV launch (arguments checked by :func:`.dispatch.fc1`); ``shift`` from
    :func:`scale_shift`."""
    g = weights.gate
    dtype = np.dtype(x.dtype)
    rows = int(x.shape[0]) * top_k
    out = device_output(out, (rows, g.n), dtype)
    if rows == 0 or g.n == 0:
        return out
    cfg = _config(config, g, rows, dtype, gated=True, layout=weights.layout)
    has_bias = weights.gate_bias is not None
    spec = KernelSpec(
        "gemv_fp4",
        "gemv_fc1",
        (
            g.format.code,
            CTYPE[dtype],
            weights.layout.value,
            cfg.cta_n,
            cfg.threads,
            act.kind.code,
            has_bias,
        ),
    )
    active = routing.active_experts
    grid = (_blocks(g.n, 8, cfg), int(active.shape[0]))
    launch(
        spec,
        grid,
        cfg.threads,
        (
            *fc1_arrays(x, weights, routing, out),
            np.int32(g.n_experts),
            np.int32(g.n),
            np.int32(g.k),
            np.int32(chunk_count(g.k)),
            np.int32(top_k),
            np.int32(shift),
            np.float32(act.alpha),
            np.float32(act.beta),
            np.float32(act.limit),
        ),
        pdl=pdl,
    )
    return out


def gemv_fc2(
    h: Any,
    weights: PreparedFc2,
    routing: Routing,
    *,
    shift: int,
    out: Any = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
) -> Any:
    """The FC2 GEMV launch (arguments checked by :func:`.dispatch.fc2`)."""
    w = weights.down
    dtype = np.dtype(h.dtype)
    rows = int(h.shape[0])
    out = device_output(out, (rows, w.n), dtype)
    if rows == 0 or w.n == 0:
        return out
    cfg = _config(config, w, rows, dtype, gated=False, layout=weights.layout)
    head = (w.format.code, CTYPE[dtype], weights.layout.value, cfg.cta_n, cfg.threads)
    spec = KernelSpec("gemv_fp4", "gemv_fc2", (*head, weights.bias is not None))
    active = routing.active_experts
    dependent = pdl and pdl_enabled()  # the pre-wait prefetch only in a programmatic launch
    launch(
        spec,
        (_blocks(w.n, 16, cfg), int(active.shape[0])),
        cfg.threads,
        (
            *fc2_arrays(h, weights, routing, out),
            np.int32(w.n_experts),
            np.int32(w.n),
            np.int32(w.k),
            np.int32(chunk_count(w.k)),
            np.int32(shift),
            np.int32(dependent),
        ),
        pdl=dependent,
    )
    return out


def gemv_fc1_single(
    x: Any,
    weights: PreparedFc2,
    routing: Routing,
    *,
    act: ActivationSpec,
    top_k: int,
    shift: int,
    out: Any = None,
    config: GemvConfig | None = None,
    pdl: bool = False,
) -> Any:
    """The GEMV launch of FC1 with a non-gated activation, ``h[r] = act(x[t] W[e]^T + b[e])``:
    ``weights`` the one ``[E, I, H]`` matrix, prepared like FC2 (:func:`prepare_fc2`); ``x`` in
    token order (arguments checked by :func:`.dispatch.fc1`)."""
    w = weights.down
    dtype = np.dtype(x.dtype)
    rows = int(x.shape[0]) * top_k
    out = device_output(out, (rows, w.n), dtype)
    if rows == 0 or w.n == 0:
        return out
    cfg = _config(config, w, rows, dtype, gated=False, layout=weights.layout)
    head = (w.format.code, CTYPE[dtype], weights.layout.value, cfg.cta_n, cfg.threads)
    spec = KernelSpec(
        "gemv_fp4", "gemv_fc1_single", (*head, act.kind.code, weights.bias is not None)
    )
    active = routing.active_experts
    launch(
        spec,
        (_blocks(w.n, 16, cfg), int(active.shape[0])),
        cfg.threads,
        (
            x,
            routing.sorted_rows,
            *fc2_arrays(x, weights, routing, out)[1:],
            np.int32(w.n_experts),
            np.int32(w.n),
            np.int32(w.k),
            np.int32(chunk_count(w.k)),
            np.int32(top_k),
            np.int32(shift),
        ),
        pdl=pdl,
    )
    return out


def kernel_specs() -> list[KernelSpec]:
    """Every specialisation :func:`gemv_fc1` / :func:`gemv_fc1_single` / :func:`gemv_fc2` can
    select.

    2 formats x 2 dtypes x 3 weight layouts x len(TILINGS) tilings x 2 (bias) x (FC2 + 3 gated
    and 4 non-gated FC1 activations).
    """
    specs = []
    for fmt in Fp4Format:
        for ctype in (CTYPE[dtype] for dtype in ACTIVATION_DTYPES):
            for layout in WeightLayout:
                for cta_n, threads in TILINGS:
                    for bias in (False, True):
                        head = (fmt.code, ctype, layout.value, cta_n, threads)
                        specs.append(KernelSpec("gemv_fp4", "gemv_fc2", (*head, bias)))
                        specs += [
                            KernelSpec(
                                "gemv_fp4",
                                "gemv_fc1" if act.gated else "gemv_fc1_single",
                                (*head, act.code, bias),
                            )
                            for act in Activation
                        ]
    return specs
