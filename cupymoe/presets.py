# SPDX-License-Identifier: Apache-2.0
"""Layer shapes of real MoE models and random FP4 weights of the same statistics.

Random weights are drawn directly as E2M1 codes and block-scale bytes (no float quantization),
so that a full-size layer (DeepSeek-V3: 256 experts x 3 matrices of 7168 x 2048) is made in
seconds, and for the NumPy backend only the experts the tokens select are drawn. Scales are
chosen so that ``W_e · x`` has unit variance for unit-variance ``x``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from .experts.activation import Activation
from .formats import Fp4Experts, Fp4Format, decode_e4m3, random_fp4_gpu
from .routing import Router, RoutingMethod, route_ref

__all__ = ["PRESETS", "LayerShape", "random_fp4_experts", "random_layer", "random_layer_gpu"]

#: RMS of a uniformly random E2M1 code: sqrt(mean(v^2 over the 16 codes)) = sqrt(68.5 / 8).
_E2M1_RMS = float(np.sqrt(68.5 / 8))


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """Shape and options of one MoE layer (the ``MoELayer`` keyword arguments)."""

    name: str
    hidden: int
    intermediate: int
    n_experts: int
    top_k: int
    format: str
    routing: str = "softmax_topk"
    renormalize: bool = True
    activation: str = "swiglu"
    biases: bool = False
    fc1_layout: str | None = None  # None: (gate, up) pair with separate global scales
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    def layer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``MoELayer`` other than the weights and biases."""
        kw: dict[str, Any] = dict(
            top_k=self.top_k,
            routing=self.routing,
            activation=self.activation,
            fc1_layout=self.fc1_layout,
        )
        if self.routing == "softmax_topk":
            kw["renormalize"] = self.renormalize
        if self.routing == "sigmoid_grouped":
            kw.update(
                n_group=self.n_group,
                topk_group=self.topk_group,
                routed_scaling_factor=self.routed_scaling_factor,
            )
        return kw


PRESETS: dict[str, LayerShape] = {
    s.name: s
    for s in (
        LayerShape("qwen3.6-35b-a3b", 2048, 512, 256, 8, "nvfp4"),
        LayerShape(
            "gpt-oss-20b",
            2880,
            2880,
            32,
            4,
            "mxfp4",
            routing="topk_softmax",
            activation="swiglu_oai",
            biases=True,
            fc1_layout="interleaved",
        ),
        LayerShape(
            "deepseek-v3",
            7168,
            2048,
            256,
            8,
            "nvfp4",
            routing="sigmoid_grouped",
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
        ),
    )
}


#: Block-scale bytes drawn per format: ``(first, count)``. E4M3 0x60..0x70 is 32..128 (two
#: octaves, 8 bytes per octave, far from the subnormals and from 448); E8M0 takes three powers of
#: two around the target.
_NVFP4_FIRST, _NVFP4_COUNT, _MXFP4_COUNT = 0x60, 17, 3


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(values.astype(np.float64) ** 2)))


def random_fp4_experts(
    rng: np.random.Generator,
    n_experts: int,
    n: int,
    k: int,
    format: str | Fp4Format = "nvfp4",
    *,
    experts: Iterable[int] | None = None,
) -> Fp4Experts:
    """Random ``[n_experts, n, k]`` FP4 weights with ``Var(W_e · x) ~ 1`` for unit ``x``.

    Codes are uniform bytes (all 16 E2M1 values); block-scale bytes are uniform over two
    octaves (a factor of 4); NVFP4 global scales differ per expert (by up to a factor of 2,
    the block-scale bytes shifting to compensate). Nothing is quantized: codes and scale bytes
    are drawn directly, expert by expert, each from its own stream seeded from ``rng``, so an
    expert's weights do not depend on which other experts are drawn.

    Parameters
    ----------
    experts : iterable of int, optional
        Draw only these experts; the others are all zero (zero pages that take no memory until
        written), for the NumPy backend, which reads only the experts the tokens select.
    """
    fmt = Fp4Format.parse(format)
    block = fmt.block_size
    seeds = rng.integers(0, 2**63, size=n_experts)
    drawn = range(n_experts) if experts is None else sorted({int(e) for e in experts})
    make = np.empty if experts is None else np.zeros
    packed = make((n_experts, n, k // 2), dtype=np.uint8)
    scales = make((n_experts, n, k // block), dtype=np.uint8)
    global_scale = np.ones(n_experts, dtype=np.float32)
    target = 1.0 / (_E2M1_RMS * np.sqrt(k))  # per-element scale for unit output variance
    if fmt is Fp4Format.MXFP4:  # E[4**d] = 5.25 / 3 for d in {-1, 0, 1}
        first = int(np.rint(np.log2(target / np.sqrt(5.25 / 3)))) - 1 + 127
        first, count = min(max(first, 0), 254 - _MXFP4_COUNT), _MXFP4_COUNT
    else:
        first, count = _NVFP4_FIRST, _NVFP4_COUNT
    for e in drawn:
        if not 0 <= e < n_experts:
            raise ValueError(f"experts: expected ids in [0, {n_experts}), got {e}")
        g = np.random.default_rng(seeds[e])
        low = first + (int(g.integers(0, 9)) if fmt is Fp4Format.NVFP4 else 0)  # up to 1 octave
        packed[e] = np.frombuffer(g.bytes(packed[e].size), np.uint8).reshape(packed.shape[1:])
        scales[e] = g.integers(low, low + count, scales.shape[1:], dtype=np.uint8)
        if fmt is Fp4Format.NVFP4:
            global_scale[e] = target / _rms(
                decode_e4m3(np.arange(low, low + count, dtype=np.uint8))
            )
    return Fp4Experts.from_packed(packed, scales, global_scale, format=fmt)


def random_layer(
    shape: LayerShape,
    rng: np.random.Generator,
    *,
    max_tokens: int = 64,
    only_for: np.ndarray | None = None,
) -> dict[str, Any]:
    """``MoELayer`` keyword arguments with random weights (biases, router bias) for ``shape``.

    With ``only_for`` (router logits ``[M, E]``), only the experts those logits select are
    drawn (the others are zero and take no memory): the NumPy backend reads no others, and the
    drawn experts are those of the full layer made from the same ``rng`` state.
    """
    e, h, i = shape.n_experts, shape.hidden, shape.intermediate
    kw = shape.layer_kwargs()
    if shape.routing == "sigmoid_grouped":
        kw["correction_bias"] = rng.standard_normal(e).astype(np.float32) * 0.01
    gated = Activation.parse(shape.activation).gated
    if shape.biases:
        kw["fc1_bias"] = rng.standard_normal((e, (2 if gated else 1) * i)).astype(np.float32) * 0.1
        kw["fc2_bias"] = rng.standard_normal((e, h)).astype(np.float32) * 0.1
    experts = None
    if only_for is not None:
        keys = ("renormalize", "n_group", "topk_group", "routed_scaling_factor", "correction_bias")
        router = Router(
            n_experts=e,
            top_k=shape.top_k,
            method=RoutingMethod.parse(shape.routing),
            **{k: v for k, v in kw.items() if k in keys},
        )
        experts = np.unique(route_ref(np.asarray(only_for), router).topk_ids).tolist()
    fmt = shape.format
    if not gated:  # one FC1 matrix [E, I, H]
        kw["fc1"] = random_fp4_experts(rng, e, i, h, fmt, experts=experts)
        kw["fc1_layout"] = None
    elif shape.fc1_layout is None:
        kw["fc1"] = tuple(random_fp4_experts(rng, e, i, h, fmt, experts=experts) for _ in "gu")
    else:
        kw["fc1"] = random_fp4_experts(rng, e, 2 * i, h, fmt, experts=experts)
    kw["fc2"] = random_fp4_experts(rng, e, h, i, fmt, experts=experts)
    kw["max_tokens"] = max_tokens
    return kw


def random_layer_gpu(
    shape: LayerShape, rng: np.random.Generator, *, seed: int = 0, max_tokens: int = 64
) -> dict[str, Any]:
    """``MoELayer`` keyword arguments with random FP4 weights drawn on the GPU
    (:func:`~cupymoe.formats.random_fp4_gpu`, seeds ``seed`` to ``seed + 2``: no host work per
    element, a DeepSeek-V3 layer in seconds); biases and the router bias come from ``rng``.

    A gated FC1 is a ``(gate, up)`` pair whatever ``shape.fc1_layout`` says: the kernels and the
    bytes they read are the same for every layout. The weights' statistics are those of
    ``random_fp4_gpu``, not the unit-variance ones of :func:`random_layer`.
    """
    e, h, i = shape.n_experts, shape.hidden, shape.intermediate
    kw = shape.layer_kwargs()
    kw["fc1_layout"] = None
    gated = Activation.parse(shape.activation).gated
    if shape.biases:
        kw["fc1_bias"] = rng.standard_normal((e, (2 if gated else 1) * i)).astype(np.float32) * 0.1
        kw["fc2_bias"] = rng.standard_normal((e, h)).astype(np.float32) * 0.1
    if shape.routing == "sigmoid_grouped":
        kw["correction_bias"] = rng.standard_normal(e).astype(np.float32) * 0.01
    gate = random_fp4_gpu(e, i, h, shape.format, seed=seed)
    if gated:
        kw["fc1"] = (gate, random_fp4_gpu(e, i, h, shape.format, seed=seed + 1))
    else:  # one FC1 matrix [E, I, H]
        kw["fc1"] = gate
    kw["fc2"] = random_fp4_gpu(e, h, i, shape.format, seed=seed + 2)
    kw["max_tokens"] = max_tokens
    return kw
