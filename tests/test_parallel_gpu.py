# SPDX-License-Identifier: Apache-2.0
"""ExpertParallelMoE on GPUs. A world of one runs on any GPU and must equal MoELayer bitwise;
the worlds of two and four need that many GPUs and skip cleanly otherwise. None of these has
run yet in this repository (no GPU where it was written; see docs/parallel.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import cupymoe as cm
from cupymoe.presets import PRESETS, random_fp4_experts, random_layer

BF16 = ml_dtypes.bfloat16


def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver
        return 0


def _small(rng: np.random.Generator, top_k: int, max_tokens: int) -> cm.MoELayer:
    e, h, i = 24, 256, 128
    gate, up = (random_fp4_experts(rng, e, i, h, "nvfp4") for _ in range(2))
    down = random_fp4_experts(rng, e, h, i, "nvfp4")
    return cm.MoELayer((gate, up), down, top_k=top_k, max_tokens=max_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [0, 1, 4, 8, 64, 300])  # 64 and 300 cross into the grouped GEMM
@pytest.mark.parametrize("top_k", [2, 4])
def test_world_of_one_equals_moe_layer(rng: np.random.Generator, m: int, top_k: int) -> None:
    import cupy

    layer = _small(rng, top_k, max_tokens=512)
    ep = cm.ExpertParallelMoE(layer, rank=0, world_size=1)
    x = cupy.asarray(rng.standard_normal((m, layer.hidden)).astype(BF16))
    logits = cupy.asarray(rng.standard_normal((m, layer.n_experts)).astype(np.float32))
    out, one = ep(x, logits), layer(x, logits)
    assert out.shape == (m, layer.hidden)
    assert cupy.array_equal(out.view(cupy.uint16), one.view(cupy.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_world_of_one_presets(rng: np.random.Generator, name: str) -> None:
    # One layer per preset for every M: a DeepSeek-V3 layer holds 6.3 GB of weights, and one
    # test per M let parallel workers build several at once (out of memory on an 80 GB card).
    import cupy

    layer = cm.MoELayer(**random_layer(PRESETS[name], rng, max_tokens=64))
    ep = cm.ExpertParallelMoE(layer, rank=0, world_size=1)
    for m in (1, 8, 64):
        x = cupy.asarray(rng.standard_normal((m, layer.hidden)).astype(BF16))
        logits = cupy.asarray(rng.standard_normal((m, layer.n_experts)).astype(np.float32))
        out, one = ep(x, logits), layer(x, logits)
        assert cupy.array_equal(out.view(cupy.uint16), one.view(cupy.uint16)), f"M={m}"


@pytest.mark.gpu
def test_world_of_one_checks_its_arguments(rng: np.random.Generator) -> None:
    layer = _small(rng, 2, 16)
    with pytest.raises(ValueError, match="comm: a world of 2 ranks needs an NCCL communicator"):
        cm.ExpertParallelMoE(layer, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size = 1, got 1"):
        cm.ExpertParallelMoE(layer, rank=1, world_size=1)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("tokens", [1, 8, 64, 1024])
def test_world_equals_one_gpu(world: int, tokens: int, tmp_path: Path) -> None:
    """W processes through the launcher; each rank checks bitwise equality with one GPU."""
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, found {_gpus()}")
    from cupymoe.parallel.launch import spawn

    args = ["--tokens", str(tokens), "--timeout", "60", "--rendezvous", str(tmp_path)]
    spawn(
        world,
        lambda rank: [sys.executable, "-m", "cupymoe.parallel.launch", *args],
        timeout=300,
    )


@pytest.mark.gpu
def test_inputs_on_another_gpu_are_a_value_error() -> None:
    """A layer's weights live on the GPU of its first call: inputs on another GPU get a
    ValueError before any kernel runs (the eager copies would reach them, the kernels not)."""
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, found {_gpus()}")
    import cupy

    rng = np.random.default_rng(7)
    layer = _small(rng, top_k=2, max_tokens=8)
    x = rng.standard_normal((4, 256)).astype(BF16)
    logits = rng.standard_normal((4, 24)).astype(np.float32)
    with cupy.cuda.Device(0):
        expected = cupy.asnumpy(layer(cupy.asarray(x), cupy.asarray(logits)))
    with cupy.cuda.Device(1):
        xd, ld = cupy.asarray(x), cupy.asarray(logits)
        with pytest.raises(ValueError, match="x: on GPU 1, the layer's weights are on GPU 0"):
            layer(xd, ld)
    with cupy.cuda.Device(0):
        got = cupy.asnumpy(layer(cupy.asarray(x), cupy.asarray(logits)))
    assert np.array_equal(got.view(np.uint16), expected.view(np.uint16))
