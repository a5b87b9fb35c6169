# SPDX-License-Identifier: Apache-2.0
"""Programmatic dependent launches and cluster launches (cupymoe/_launch.py).

CPU: the ctypes mirrors of ``CUlaunchConfig`` / ``CUlaunchAttribute`` have cuda.h's layout (the
cluster-dimension attribute too), the kernel-parameter array points at values of the kernel's C
types, the support rule and the ``CUPYMOE_PDL`` and ``CUPYMOE_CLUSTERS`` switches. GPU: a layer
gives bitwise the same output with and without PDL, eager and in a chained CUDA graph replayed
with new inputs (a stage that read data of the previous call before its wait would differ), and
PDL is really in use on sm_90+.
"""

from __future__ import annotations

import ctypes
import types
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import cupymoe as cm
import cupymoe._runtime.launch as launch_mod
from cupymoe import record_graph
from cupymoe.presets import random_fp4_experts
from cupymoe.testing import assert_close, tolerance_for

BF16 = ml_dtypes.bfloat16


def test_struct_layouts_match_cuda_h() -> None:
    # CUlaunchConfig: 7 unsigned ints, CUstream at 32, attrs at 40, numAttrs at 48; 56 bytes.
    cfg = launch_mod._LaunchConfig
    assert ctypes.sizeof(cfg) == 56
    assert (cfg.stream.offset, cfg.attrs.offset, cfg.num_attrs.offset) == (32, 40, 48)
    # CUlaunchAttribute: id, padding to 8, a 64-byte value union.
    attr = launch_mod._LaunchAttribute
    assert ctypes.sizeof(attr) == 72 and attr.value.offset == 8


def test_launch_config_fields() -> None:
    config, attrs = launch_mod.launch_config((3, 2, 1), (128, 1, 1), 512, 0xABC0)
    assert (config.grid_x, config.grid_y, config.grid_z) == (3, 2, 1)
    assert (config.block_x, config.block_y, config.block_z) == (128, 1, 1)
    assert config.shared_mem == 512 and config.stream == 0xABC0 and config.num_attrs == 1
    assert ctypes.addressof(config.attrs.contents) == ctypes.addressof(attrs)
    assert attrs[0].id == 6 and attrs[0].value.flag == 1  # PROGRAMMATIC_STREAM_SERIALIZATION


@pytest.mark.parametrize("pdl", [False, True])
def test_launch_config_cluster(pdl: bool) -> None:
    config, attrs = launch_mod.launch_config((8, 1, 1), (64, 1, 1), 0, 0, pdl=pdl, cluster=4)
    assert config.num_attrs == 1 + pdl
    cluster = attrs[int(pdl)]
    assert cluster.id == 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    # CUlaunchAttributeValue.clusterDim: three unsigned ints at the start of the union.
    raw = (ctypes.c_uint * 3).from_address(ctypes.addressof(cluster.value))
    assert tuple(raw) == (4, 1, 1)
    plain, _ = launch_mod.launch_config((8, 1, 1), (64, 1, 1), 0, 0, pdl=False)
    assert plain.num_attrs == 0


def test_cluster_must_divide_the_grid() -> None:
    pytest.importorskip("cupy")
    spec = launch_mod.KernelSpec("route_fused", "route_fused", ("float", 1, 8))
    with pytest.raises(ValueError, match="whole number of 2-block clusters"):
        launch_mod.launch(spec, 3, 64, (np.int32(1),), cluster=2)  # before any compile


def test_kernel_params_point_at_c_values() -> None:
    device_array = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0x7F00_1234_5600))
    args = [
        np.int32(-3),
        np.uint32(4_000_000_000),
        np.int64(-(2**40)),
        np.uint64(2**63 + 5),
        np.float32(1.5),
        np.float64(-2.25),
        np.bool_(True),
        None,
        device_array,
    ]
    params, values = launch_mod.kernel_params(args)
    expect = [
        (ctypes.c_int32, -3),
        (ctypes.c_uint32, 4_000_000_000),
        (ctypes.c_int64, -(2**40)),
        (ctypes.c_uint64, 2**63 + 5),
        (ctypes.c_float, 1.5),
        (ctypes.c_double, -2.25),
        (ctypes.c_bool, True),
        (ctypes.c_void_p, None),  # a null pointer
        (ctypes.c_void_p, 0x7F00_1234_5600),
    ]
    assert len(values) == len(args)
    for i, (ctype, value) in enumerate(expect):
        got = ctypes.cast(params[i], ctypes.POINTER(ctype)).contents.value
        assert got == value, f"argument {i}: {got!r} != {value!r}"


@pytest.mark.parametrize(
    ("driver", "cc", "has_ex", "want"),
    [
        (12030, 90, True, True),
        (13000, 100, True, True),
        (12020, 90, True, False),  # graphs record programmatic edges from 12.3
        (12080, 89, True, False),  # griddepcontrol needs sm_90
        (12080, 90, False, False),  # a libcuda without cuLaunchKernelEx
    ],
)
def test_support_rule(driver: int, cc: int, has_ex: bool, want: bool) -> None:
    assert launch_mod.pdl_supported(driver, cc, has_ex) is want


@pytest.mark.parametrize(
    ("env", "support", "enabled"),
    [
        (launch_mod.ENV_PDL, "_device_supports_pdl", launch_mod.pdl_enabled),
        (launch_mod.ENV_CLUSTERS, "_device_supports_clusters", launch_mod.cluster_supported),
    ],
)
def test_environment_switch(
    monkeypatch: pytest.MonkeyPatch, env: str, support: str, enabled: Any
) -> None:
    monkeypatch.setattr(launch_mod, "current_device", lambda: 0)
    monkeypatch.setattr(launch_mod, support, lambda device_id: True)
    monkeypatch.delenv(env, raising=False)
    assert enabled()
    monkeypatch.setenv(env, "0")
    assert not enabled()
    monkeypatch.setenv(env, "1")
    monkeypatch.setattr(launch_mod, support, lambda device_id: False)
    assert not enabled()


# ---- GPU -------------------------------------------------------------------------------------
def _layers(n: int, fmt: str, act: str) -> list[cm.MoELayer]:
    rng = np.random.default_rng(61)
    e, h, i = 16, 256, 128
    out = []
    for _ in range(n):
        gate, up = (random_fp4_experts(rng, e, i, h, fmt) for _ in range(2))
        down = random_fp4_experts(rng, e, h, i, fmt)
        out.append(cm.MoELayer((gate, up), down, top_k=4, max_tokens=16, activation=act))
    return out


def _inputs(seed: int, m: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, 256)).astype(BF16)
    return x, [rng.standard_normal((m, 16)).astype(np.float32) for _ in range(3)]


@pytest.mark.gpu
def test_pdl_is_used_on_sm90() -> None:
    cupy = pytest.importorskip("cupy")
    cc = int(cupy.cuda.Device().compute_capability)
    driver = int(cupy.cuda.runtime.driverGetVersion())
    assert launch_mod.pdl_enabled() is launch_mod.pdl_supported(driver, cc, True)


@pytest.mark.gpu
@pytest.mark.parametrize(("fmt", "act"), [("nvfp4", "swiglu"), ("mxfp4", "swiglu_oai")])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_pdl_bitwise_equal_to_ordinary_launches(
    fmt: str, act: str, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    cupy = pytest.importorskip("cupy")
    layers = _layers(3, fmt, act)

    def run(pdl: bool) -> list[Any]:
        monkeypatch.setenv(launch_mod.ENV_PDL, "1" if pdl else "0")
        got = []
        graph = record_graph(layers, m, BF16) if m * 4 <= 64 else None
        for seed in (1, 2):  # new inputs: nothing may leak from the previous call
            x, logits = _inputs(seed, m)
            h = cupy.asarray(x)
            for layer, lg in zip(layers, logits, strict=True):
                h = layer(h, cupy.asarray(lg))  # eager, stage after stage
            got.append(h.view(cupy.uint16).get())
            if graph is not None:
                with graph.stream:
                    graph.x[...] = cupy.asarray(x)
                    for buf, lg in zip(graph.logits, logits, strict=True):
                        buf[...] = cupy.asarray(lg)
                    out = graph.replay().copy()
                graph.stream.synchronize()
                got.append(out.view(cupy.uint16).get())
        return got

    plain, pdl = run(False), run(True)
    for a, b in zip(plain, pdl, strict=True):
        assert np.array_equal(a, b), "PDL output differs from ordinary launches"
    # ... and right: one layer under PDL against the float64 reference.
    x, logits = _inputs(3, m)
    got = layers[0](cupy.asarray(x), cupy.asarray(logits[0]))
    max_rel, rms_rel = tolerance_for(BF16)
    assert_close(
        cm.moe_reference(x, logits[0], layers[0]), got, max_rel=2 * max_rel, rms_rel=2 * rms_rel
    )


def test_tensor_map_params_are_the_128_bytes() -> None:
    """A TensorMap argument's kernelParams entry points at the map's own 64-byte aligned bytes
    (the driver copies them into the __grid_constant__ parameter)."""
    from cupymoe._runtime.tensormap import TensorMap

    m = TensorMap(("test",))
    ctypes.memmove(m.address, bytes(range(128)), 128)
    params, values = launch_mod.kernel_params([np.int32(7), m])
    assert m.address % 64 == 0
    assert ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int32)).contents.value == 7
    assert params[1] == m.address
    assert ctypes.string_at(params[1], 128) == bytes(range(128)) == m.raw
