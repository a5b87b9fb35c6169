# SPDX-License-Identifier: Apache-2.0
"""Layer shapes of real MoE models and random FP4 weights of the same statistics.

Random weights are drawn directly as E2M1 codes and block-scale bytes (no float quantization),
so that a full-size layer (DeepSeek-V3: 256 experts x 3 matrices of 7168 x 2048) is made in
seconds. Scales are chosen so that ``W_e · x`` has unit variance for unit-variance ``x``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .formats import Fp4Experts, Fp4Format, encode_e4m3

__all__ = ["PRESETS", "LayerShape", "random_fp4_experts", "random_layer"]

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


def random_fp4_experts(
    rng: np.random.Generator, n_experts: int, n: int, k: int, format: str | Fp4Format = "nvfp4"
) -> Fp4Experts:
    """Random ``[n_experts, n, k]`` FP4 weights with ``Var(W_e · x) ~ 1`` for unit ``x``.

    Codes are uniform over all 16 E2M1 values; block scales vary by a factor of up to 4 around
    their mean; NVFP4 global scales differ per expert (factor 2).
    """
    fmt = Fp4Format.parse(format)
    block = fmt.block_size
    packed = rng.integers(0, 256, size=(n_experts, n, k // 2), dtype=np.uint8)
    target = 1.0 / (_E2M1_RMS * np.sqrt(k))  # per-element scale for unit output variance
    jitter = np.exp2(rng.uniform(-1.0, 1.0, size=(n_experts, n, k // block)))
    if fmt is Fp4Format.NVFP4:
        global_scale = (target / 64.0) * np.exp2(rng.uniform(-0.5, 0.5, size=n_experts))
        block_scale = target * jitter / global_scale[:, None, None]
        scales = encode_e4m3(block_scale.astype(np.float32))
        return Fp4Experts.from_packed(packed, scales, global_scale.astype(np.float32), format=fmt)
    exponent = np.rint(np.log2(target * jitter)).astype(np.int64) + 127
    scales = np.clip(exponent, 0, 254).astype(np.uint8)
    return Fp4Experts.from_packed(packed, scales, None, format=fmt)


def random_layer(
    shape: LayerShape, rng: np.random.Generator, *, max_tokens: int = 64
) -> dict[str, Any]:
    """``MoELayer`` keyword arguments with random weights (biases, router bias) for ``shape``."""
    e, h, i = shape.n_experts, shape.hidden, shape.intermediate
    kw = shape.layer_kwargs()
    if shape.fc1_layout is None:
        kw["fc1"] = (
            random_fp4_experts(rng, e, i, h, shape.format),
            random_fp4_experts(rng, e, i, h, shape.format),
        )
    else:
        kw["fc1"] = random_fp4_experts(rng, e, 2 * i, h, shape.format)
    kw["fc2"] = random_fp4_experts(rng, e, h, i, shape.format)
    if shape.biases:
        kw["fc1_bias"] = rng.standard_normal((e, 2 * i)).astype(np.float32) * 0.1
        kw["fc2_bias"] = rng.standard_normal((e, h)).astype(np.float32) * 0.1
    if shape.routing == "sigmoid_grouped":
        kw["correction_bias"] = rng.standard_normal(e).astype(np.float32) * 0.01
    kw["max_tokens"] = max_tokens
    return kw
