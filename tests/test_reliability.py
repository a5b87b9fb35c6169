# SPDX-License-Identifier: Apache-2.0
"""Reliability of the GPU layer (all tests need a GPU).

* Determinism: 1,000 eager calls give bitwise one result; a CUDA-graph replay gives the eager
  bits; two fresh processes give the same SHA-256 of the output.
* Concurrency: two threads, each with its own stream and layer, get their single-threaded bits;
  the kernel loader compiles once when 8 threads ask for a kernel at the same moment.
* Numerics guard rails: NaN in one token's activations turns exactly that token's output into
  NaN; fp16 activations up to 6e4 do not overflow inside the kernels when the true result fits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import cupymoe as cm
from cupymoe.presets import random_fp4_experts
from cupymoe.testing import assert_close, tolerance_for

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
REPO = Path(cm.__file__).resolve().parents[1]
E, H, I, TOP_K = 8, 128, 64, 2


def _cupy() -> Any:
    return pytest.importorskip("cupy")


def _layer(seed: int, *, fmt: str = "nvfp4", **kw: Any) -> cm.MoELayer:
    rng = np.random.default_rng(seed)
    gate, up = (random_fp4_experts(rng, E, I, H, fmt) for _ in range(2))
    down = random_fp4_experts(rng, E, H, I, fmt)
    args: dict[str, Any] = dict(top_k=TOP_K, max_tokens=64)
    args.update(kw)
    return cm.MoELayer((gate, up), down, **args)


def _inputs(seed: int, m: int, dtype: Any = BF16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + 1000)
    return rng.standard_normal((m, H)).astype(dtype), rng.standard_normal((m, E)).astype("f4")


def _assert_matches_reference(out: Any, x: np.ndarray, logits: np.ndarray, layer: Any) -> None:
    max_rel, rms_rel = tolerance_for(x.dtype)
    ref = cm.moe_reference(x, logits, layer)
    assert_close(ref, out, max_rel=2 * max_rel, rms_rel=2 * rms_rel)


# ---- determinism ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("m", "dtype"),
    [(1, BF16), (6, np.float16), (48, BF16)],
    ids=["M1-bf16-fused-routing", "M6-fp16", "M48-bf16-batched-path"],
)
def test_1000_eager_calls_are_bitwise_identical(m: int, dtype: Any) -> None:
    cupy = _cupy()
    layer = _layer(1)
    x, logits = _inputs(1, m, dtype)
    xd, ld = cupy.asarray(x), cupy.asarray(logits)
    first = layer(xd, ld).copy()
    _assert_matches_reference(first, x, logits, layer)  # the repeated bits are also right
    want = first.view(cupy.uint16)
    differing = cupy.zeros((), cupy.int64)  # accumulated on the device: one sync at the end
    for _ in range(1000):
        differing += (layer(xd, ld).view(cupy.uint16) != want).sum()
    assert int(differing) == 0, f"{int(differing)} output elements changed over 1,000 calls"


@pytest.mark.parametrize("m", [1, 4, 32])
def test_graph_replay_is_bitwise_eager(m: int) -> None:
    cupy = _cupy()
    layer = _layer(2)
    graph = layer.graph(m, dtype=BF16)  # 32 tokens x top-2 = 64 rows: the last GEMV window
    for seed in (10, 11):  # new inputs each time: the replay reads the static buffers
        x, logits = _inputs(seed, m)
        xd, ld = cupy.asarray(x), cupy.asarray(logits)
        eager = layer(xd, ld)
        cupy.cuda.Device().synchronize()  # eager and graph share the layer's workspaces
        with graph.stream:
            graph.x[...] = xd
            graph.logits[0][...] = ld
            first = graph.replay().copy()
            second = graph.replay().copy()
        graph.stream.synchronize()
        want = eager.view(cupy.uint16)
        assert bool((first.view(cupy.uint16) == want).all()), f"replay != eager (seed {seed})"
        assert bool((second.view(cupy.uint16) == want).all()), "replay != replay"


def output_digest() -> str:
    """SHA-256 of the outputs of a fixed layer and inputs (GEMV and batched paths, bf16/fp16).

    Run in fresh processes by :func:`test_two_processes_give_the_same_digest`.
    """
    import cupy

    digest = hashlib.sha256()
    for seed, m, dtype, fmt in ((3, 5, BF16, "nvfp4"), (4, 40, np.float16, "mxfp4")):
        layer = _layer(seed, fmt=fmt, activation="swiglu_oai", fc2_bias=np.full((E, H), 0.25))
        x, logits = _inputs(seed, m, dtype)
        out = layer(cupy.asarray(x), cupy.asarray(logits))
        digest.update(np.ascontiguousarray(out.get()).tobytes())
    return digest.hexdigest()


def test_two_processes_give_the_same_digest() -> None:
    _cupy()
    path = os.pathsep.join(
        p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")) if p
    )
    env = {**os.environ, "PYTHONPATH": path}
    code = "import test_reliability as t; print(t.output_digest())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            cwd=str(REPO),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    digests = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        digests.append(out.strip().splitlines()[-1])
    assert digests[0] == digests[1], digests
    assert digests[0] == output_digest(), "this process differs from the fresh ones"


# ---- concurrency ---------------------------------------------------------------------------------
def _run_threads(n: int, work: Any) -> None:
    """Run ``work(j)`` in ``n`` threads released together; re-raise the first error."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def body(j: int) -> None:
        try:
            barrier.wait(timeout=60)
            work(j)
        except BaseException as error:  # surfaced in the main thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(j,)) for j in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


def test_two_threads_with_own_streams_and_layers() -> None:
    cupy = _cupy()
    layers = [_layer(4), _layer(5, fmt="mxfp4", activation="geglu")]
    host = [_inputs(4, 4, BF16), _inputs(5, 8, np.float16)]
    dev = [(cupy.asarray(x), cupy.asarray(lg)) for x, lg in host]
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in layers]
    single = []
    for layer, (xd, ld), stream, (x, lg) in zip(layers, dev, streams, host, strict=True):
        with stream:
            out = layer(xd, ld)  # compiles every kernel before the threads start
        stream.synchronize()
        _assert_matches_reference(out, x, lg, layer)
        single.append(out.view(cupy.uint16))
    differing = [-1, -1]

    def work(j: int) -> None:
        xd, ld = dev[j]
        with streams[j]:
            count = cupy.zeros((), cupy.int64)
            for _ in range(200):
                count += (layers[j](xd, ld).view(cupy.uint16) != single[j]).sum()
            differing[j] = int(count)  # synchronises this thread's stream

    _run_threads(2, work)
    assert differing == [0, 0], f"elements that differ from the single-threaded run: {differing}"


def test_kernel_loader_compiles_once_under_8_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    cupy = _cupy()
    from cupymoe._runtime import compile as _compile
    from cupymoe.layer.finalize import finalize, finalize_ref
    from cupymoe.routing import Router, route

    # Inputs first (routing may compile its own kernels): float y with hidden % 4 != 0 makes
    # finalize select exactly `spec`.
    routing = route(cupy.asarray(np.array([[0.5, 0.0, 2.0, 1.0]], "f4")), Router(4, 2))
    y = np.arange(6, dtype="f4").reshape(2, 3)
    spec = _compile.KernelSpec("finalize", "finalize_rows", ("float", "float", "float", 1))
    with _compile._kernel_lock:  # forget this one specialisation: the next use compiles it
        _compile._kernels.pop((cupy.cuda.Device().id, spec), None)
    modules: list[Any] = []
    real = cupy.RawModule

    def counting_raw_module(*args: Any, **kwargs: Any) -> Any:
        modules.append(kwargs.get("name_expressions"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cupy, "RawModule", counting_raw_module)
    got: list[Any] = [None] * 8
    _run_threads(8, lambda j: got.__setitem__(j, _compile.get_kernel(spec)))
    assert modules == [(spec.expression,)], f"compiled {len(modules)} times: {modules}"
    assert all(k is got[0] for k in got), "threads got different kernel objects"
    out = finalize(cupy.asarray(y), routing)  # launches the kernel the threads compiled
    assert len(modules) == 1, "finalize compiled again"
    host = cm.Routing(
        **{f.name: getattr(routing, f.name).get() for f in dataclasses.fields(routing)}
    )
    assert_close(finalize_ref(y, host), out, max_rel=1e-6, rms_rel=1e-6)


# ---- numerics guard rails -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("activation", "m"),
    [
        ("swiglu", 4),
        ("geglu", 4),
        ("swiglu_oai", 4),
        ("swiglu", 40),  # 80 expanded rows: the batched (dequantize + cuBLAS) path
        ("swiglu_oai", 40),
    ],
)
def test_nan_in_one_token_stays_in_that_token(activation: str, m: int) -> None:
    cupy = _cupy()
    layer = _layer(6, activation=activation)
    x, logits = _inputs(6, m)
    bad = x.copy()
    bad[2, 7] = np.nan
    ref = cm.moe_reference(bad, logits, layer)
    assert np.isnan(ref[2]).all() and np.isfinite(np.delete(ref, 2, axis=0)).all()
    ld = cupy.asarray(logits)
    clean = layer(cupy.asarray(x), ld).get()
    dirty = layer(cupy.asarray(bad), ld).get()
    assert np.isnan(dirty[2].astype(np.float32)).all(), "token 2's output is not all NaN"
    others = np.arange(m) != 2
    np.testing.assert_array_equal(dirty[others].view(np.uint16), clean[others].view(np.uint16))


@pytest.mark.parametrize("x_scale", [2e3, 6e4])
@pytest.mark.parametrize("m", [2, 40])
def test_fp16_large_activations_do_not_overflow(x_scale: float, m: int) -> None:
    """x up to 6e4 (fp16 max 65504), all positive, positive weights: every partial sum has the
    sign of the total, so an fp16 accumulator or an unscaled ``x * code`` in fp16 overflows,
    while the true gate/up (~150), FC1 output (~2.2e4) and output (~100) fit in fp16."""
    cupy = _cupy()
    rng = np.random.default_rng(7)
    h, i = 256, 64
    mean_x = 0.75 * x_scale
    x = (x_scale * rng.uniform(0.5, 1.0, (m, h))).astype(np.float16)
    c1 = 150.0 / (h * mean_x * 0.75)  # gate = up ~ 150 -> silu(gate) * up ~ 2.2e4
    c2 = 100.0 / (i * 2.25e4 * 0.75)  # FC2 output ~ 100
    w1 = [cm.Fp4Experts.quantize(c1 * rng.uniform(0.5, 1.0, (E, i, h))) for _ in range(2)]
    w2 = cm.Fp4Experts.quantize(c2 * rng.uniform(0.5, 1.0, (E, h, i)))
    layer = cm.MoELayer(tuple(w1), w2, top_k=TOP_K, max_tokens=64)
    logits = rng.standard_normal((m, E)).astype("f4")
    ref = cm.moe_reference(x, logits, layer)
    assert np.abs(ref).max() < 1e3  # the true result fits comfortably
    out = layer(cupy.asarray(x), cupy.asarray(logits))
    assert bool(cupy.isfinite(out).all()), "fp16 overflow inside the layer"
    _assert_matches_reference(out, x, logits, layer)
