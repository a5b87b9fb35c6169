# SPDX-License-Identifier: Apache-2.0
"""Dequantize: the NumPy reference by hand (CPU) and the kernel bit for bit against it (GPU)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from cupymoe.experts.dequant import dequantize, dequantize_ref, kernel_specs
from cupymoe.formats import DeviceFp4, Fp4Experts, Fp4Format, pack_fp4

_OUT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


def _random_experts(rng: np.random.Generator, fmt: str, e: int, n: int, k: int) -> Fp4Experts:
    """Every code, and scale bytes over a wide exact range (no NaN byte).

    NVFP4: every non-NaN E4M3 byte, negative and subnormal ones included. MXFP4: E8M0 bytes
    20..254 -- the products stay fp32-normal (the kernel flushes subnormals) and 254 overflows
    6 * 2^127 to inf, exactly as the reference does.
    """
    fmt_ = Fp4Format.parse(fmt)
    packed = rng.integers(0, 256, size=(e, n, k // 2), dtype=np.uint8)
    shape = (e, n, k // fmt_.block_size)
    if fmt_ is Fp4Format.NVFP4:
        scales = rng.integers(0, 256, size=shape, dtype=np.uint8)
        scales[(scales & 0x7F) == 0x7F] = 0x38  # NaN bytes -> 1.0
        global_scale = rng.uniform(0.01, 3.0, size=e).astype(np.float32)
    else:
        scales = rng.integers(20, 255, size=shape, dtype=np.uint8)
        global_scale = None
    return Fp4Experts.from_packed(packed, scales, global_scale, format=fmt_)


# ---- CPU: the reference -----------------------------------------------------------------------
def test_ref_by_hand() -> None:
    # codes 0..15 in one row of K = 16: values E2M1 * 2 (E4M3 0x40) * 0.5 (global) = E2M1
    codes = np.arange(16, dtype=np.uint8)
    w = Fp4Experts.from_packed(
        pack_fp4(codes)[None, None, :],
        np.array([[[0x40]]], np.uint8),
        np.array([0.5], np.float32),
        format="nvfp4",
    )
    expected = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    out = dequantize_ref(w)
    assert out.dtype == np.float32 and out.shape == (1, 1, 16)
    assert np.array_equal(out[0, 0], np.array(expected, np.float32))
    assert np.signbit(out[0, 0, 8])  # code 0x8 is -0


def test_ref_mxfp4_by_hand() -> None:
    # E8M0 byte 125 = 2^-2 on the first 32 codes; 130 = 2^3 on the next 32
    codes = np.tile(np.arange(16, dtype=np.uint8), 4)
    w = Fp4Experts.from_packed(
        pack_fp4(codes)[None, None, :], np.array([[[125, 130]]], np.uint8), format="mxfp4"
    )
    values = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
    expected = np.concatenate([np.tile(values, 2) / 4, np.tile(values, 2) * 8])
    assert np.array_equal(dequantize_ref(w, out_dtype=np.float64)[0, 0], expected)


@pytest.mark.parametrize("out_dtype", _OUT_DTYPES)
def test_ref_selects_and_rounds_from_float32(rng: np.random.Generator, out_dtype) -> None:
    w = _random_experts(rng, "nvfp4", 4, 3, 32)
    full32 = w.dequantize(np.float32)
    experts = [3, 0, 3]  # any order, repeats allowed
    out = dequantize_ref(w, experts=experts, out_dtype=out_dtype)
    assert out.dtype == np.dtype(out_dtype) and out.shape == (3, 3, 32)
    assert np.array_equal(out, full32[experts].astype(out_dtype))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"experts": [0, 4]}, ValueError, r"experts: expected ids in \[0, 4\), got 4"),
        ({"experts": [-1]}, ValueError, "experts"),
        ({"experts": [[0]]}, TypeError, "1-D integer"),
        ({"experts": [0.5]}, TypeError, "1-D integer"),
        ({"out_dtype": np.int8}, TypeError, "out_dtype"),
    ],
)
def test_ref_rejects(rng: np.random.Generator, kwargs, error, match) -> None:
    w = _random_experts(rng, "mxfp4", 4, 2, 32)
    with pytest.raises(error, match=match):
        dequantize_ref(w, **kwargs)


def test_kernel_specs_cover_the_dispatch() -> None:
    specs = kernel_specs()
    assert len(specs) == len(set(specs)) == 2 * 3 * 2
    assert {s.stage for s in specs} == {"dequant"}


# ---- GPU: the kernel --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    fmt: str
    n: int
    k: int
    pair_interleaved: bool


def _cases() -> list[Case]:
    # K = 32: one 16-byte step per row; K = 48 (NVFP4 only): the 8-byte step (K % 32 != 0);
    # K = 2048 with N = 5: many steps per row and a grid that does not divide evenly.
    shapes = [
        ("nvfp4", 3, 32),
        ("nvfp4", 7, 48),
        ("nvfp4", 5, 2048),
        ("mxfp4", 3, 32),
        ("mxfp4", 5, 2048),
        ("mxfp4", 2, 96),
    ]
    return [Case(f, n, k, p) for f, n, k in shapes for p in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", _cases(), ids=repr)
@pytest.mark.parametrize("out_dtype", _OUT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("experts", [None, [2, 0, 2]], ids=["all", "subset"])
def test_kernel_is_exact(rng: np.random.Generator, case: Case, out_dtype, experts) -> None:
    import cupy

    w = _random_experts(rng, case.fmt, 3, case.n, case.k)
    device = DeviceFp4.from_experts(w, pair_interleaved=case.pair_interleaved)
    ref = dequantize_ref(w, experts=experts, out_dtype=out_dtype)
    out = cupy.full(ref.shape, np.nan, dtype=out_dtype)  # poison: every element must be written
    got = dequantize(device, experts=experts, out_dtype=out_dtype, out=out)
    assert got is out
    host = got.get()
    assert host.dtype == ref.dtype
    bits = np.uint32 if host.itemsize == 4 else np.uint16
    mismatch = host.view(bits) != ref.view(bits)  # bitwise: signed zeros and infs included
    assert not mismatch.any(), np.argwhere(mismatch)[:5]


@pytest.mark.gpu
def test_kernel_allocates_and_takes_device_ids(rng: np.random.Generator) -> None:
    import cupy

    w = _random_experts(rng, "mxfp4", 4, 3, 64)
    device = DeviceFp4.from_experts(w)
    ids = cupy.asarray([3, 1], dtype=cupy.int32)
    ref = dequantize_ref(w, experts=[3, 1], out_dtype=ml_dtypes.bfloat16)
    for check in (True, False):
        out = dequantize(device, experts=ids, out_dtype=ml_dtypes.bfloat16, check_experts=check)
        assert np.array_equal(out.get().view(np.uint16), ref.view(np.uint16))
    empty = dequantize(device, experts=np.zeros(0, np.int32))
    assert empty.shape == (0, 3, 64)


@pytest.mark.gpu
def test_unchecked_bad_id_writes_nan(rng: np.random.Generator) -> None:
    import cupy

    device = DeviceFp4.from_experts(_random_experts(rng, "nvfp4", 2, 3, 32))
    ids = cupy.asarray([1, 7], dtype=cupy.int32)
    with pytest.raises(ValueError, match="experts"):
        dequantize(device, experts=ids)
    out = dequantize(device, experts=ids, check_experts=False).get()
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1]))


@pytest.mark.gpu
def test_kernel_rejects_before_launch(rng: np.random.Generator) -> None:
    import cupy

    w = _random_experts(rng, "nvfp4", 2, 3, 32)
    device = DeviceFp4.from_experts(w)
    with pytest.raises(ValueError, match="out: expected float32"):
        dequantize(device, out=cupy.empty((2, 3, 16), cupy.float32))
    with pytest.raises(ValueError, match="out: expected bfloat16"):
        dequantize(device, out_dtype=ml_dtypes.bfloat16, out=cupy.empty((2, 3, 32), cupy.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        dequantize(device, out=cupy.empty((2, 3, 64), cupy.float32)[:, :, ::2])
    with pytest.raises(TypeError, match="out_dtype"):
        dequantize(device, out_dtype=np.float64)
    with pytest.raises(TypeError, match="DeviceFp4"):
        dequantize(w)  # host weights
    with pytest.raises(ValueError, match="scales: expected shape"):
        dataclasses.replace(device, scales=device.scales[:, :, :1].copy())
    with pytest.raises(TypeError, match="packed: expected a cupy"):
        DeviceFp4(Fp4Format.NVFP4, w.packed, device.scales, device.global_scale)


@pytest.mark.gpu
def test_pair_interleaved_layout_differs_but_decodes_equal(rng: np.random.Generator) -> None:
    w = _random_experts(rng, "nvfp4", 2, 4, 64)
    plain = DeviceFp4.from_experts(w)
    inter = DeviceFp4.from_experts(w, pair_interleaved=True)
    assert not np.array_equal(plain.packed.get(), inter.packed.get())
    assert np.array_equal(dequantize(plain).get(), dequantize(inter).get())
