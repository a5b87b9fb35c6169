# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the exact FP4 formats: E2M1 / E4M3 / E8M0 codes against ``ml_dtypes`` and the
FORMATS.md tables, nibble packing, the reference quantizers and ``Fp4Experts`` validation."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from cupymoe.formats import (
    E2M1_VALUES,
    Fp4Experts,
    Fp4Format,
    MxScaleRule,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    encode_e2m1,
    encode_e4m3,
    encode_e8m0_exponent,
    from_pair_interleaved,
    pack_fp4,
    to_pair_interleaved,
    unpack_fp4,
)

ALL_BYTES = np.arange(256, dtype=np.uint8)
FORMATS = ["nvfp4", "mxfp4"]

# ---- E2M1 --------------------------------------------------------------------------------------
# The FORMATS.md table, code -> value.
FORMATS_TABLE = {0x0: 0.0, 0x1: 0.5, 0x2: 1.0, 0x3: 1.5, 0x4: 2.0, 0x5: 3.0, 0x6: 4.0, 0x7: 6.0,
                 0x8: -0.0, 0x9: -0.5, 0xA: -1.0, 0xB: -1.5, 0xC: -2.0, 0xD: -3.0, 0xE: -4.0,
                 0xF: -6.0}  # fmt: skip


@pytest.mark.parametrize("code", range(16))
def test_e2m1_decode_matches_table_and_ml_dtypes(code: int) -> None:
    out = decode_e2m1(np.array([code], dtype=np.uint8))
    oracle = np.array([code], dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert out.dtype == np.float32
    assert out[0] == FORMATS_TABLE[code] and np.signbit(out[0]) == (code >= 8)
    assert out.tobytes() == oracle.tobytes()  # bitwise, so -0 is checked too
    assert E2M1_VALUES[code].tobytes() == out.tobytes()
    assert encode_e2m1(out)[0] == code  # every code round-trips, including -0


def test_e2m1_table_is_read_only() -> None:
    with pytest.raises(ValueError):
        E2M1_VALUES[1] = 0.0


# FORMATS.md: "ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4".
@pytest.mark.parametrize(
    ("tie", "value"),
    [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)],
)
def test_e2m1_ties_as_listed(tie: float, value: float) -> None:
    for sign in (1.0, -1.0):
        code = encode_e2m1(np.array([sign * tie]))[0]
        assert decode_e2m1([code])[0] == sign * value
        assert code % 2 == 0  # the even code (even mantissa)
        assert (code >= 8) == (sign < 0)  # the sign is kept, even for -0.25 -> -0


@pytest.mark.parametrize("lower", range(7))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_e2m1_decision_points(lower: int, dtype: type) -> None:
    """Just below a decision point -> the lower code, just above -> the upper one."""
    mid = (float(E2M1_VALUES[lower]) + float(E2M1_VALUES[lower + 1])) / 2
    below = np.nextafter(np.array(mid, dtype=dtype), np.array(-np.inf, dtype=dtype))
    above = np.nextafter(np.array(mid, dtype=dtype), np.array(np.inf, dtype=dtype))
    assert encode_e2m1(np.array([below, mid, above], dtype=dtype)).tolist() == [
        lower,
        lower + lower % 2,  # a tie goes to the even code
        lower + 1,
    ]


@pytest.mark.parametrize("value", [6.0, 6.5, 7.0, 1e6, np.inf, np.finfo(np.float64).max])
def test_e2m1_saturates(value: float) -> None:
    assert encode_e2m1(np.array([value, -value])).tolist() == [0x7, 0xF]


def test_e2m1_signed_zero() -> None:
    codes = encode_e2m1(np.array([0.0, -0.0, -1e-30, -0.25, 1e-30, 0.25]))
    assert codes.tolist() == [0x0, 0x8, 0x8, 0x8, 0x0, 0x0]


def test_e2m1_nan_and_bad_input() -> None:
    with pytest.raises(ValueError, match="x: NaN"):
        encode_e2m1(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="codes"):
        decode_e2m1(np.array([16]))
    with pytest.raises(TypeError, match="codes"):
        decode_e2m1(np.array([1.0]))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_e2m1_random_vs_ml_dtypes(rng: np.random.Generator, dtype: type) -> None:
    x = (rng.uniform(-8, 8, 20000) * rng.choice([1.0, 0.1, 0.01], 20000)).astype(dtype)
    x[:8] = [0.25, -0.75, 1.25, -1.75, 2.5, -3.5, 5, -5]
    # ml_dtypes saturates out-of-range casts to +-6 as well, but clamp first so that the oracle
    # is used only inside its documented range.
    oracle = np.clip(x.astype(np.float32), -6, 6).astype(ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(encode_e2m1(x), oracle.view(np.uint8))


def test_e2m1_shapes() -> None:
    assert encode_e2m1(np.zeros((2, 0, 3))).shape == (2, 0, 3)
    assert encode_e2m1(1.0).shape == () and int(encode_e2m1(1.0)) == 2
    assert decode_e2m1(np.zeros((3, 4), dtype=np.uint8)).shape == (3, 4)


# ---- E4M3FN ------------------------------------------------------------------------------------
def test_e4m3_decode_all_codes_vs_ml_dtypes() -> None:
    out = decode_e4m3(ALL_BYTES)
    oracle = ALL_BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(out), np.isin(ALL_BYTES, [0x7F, 0xFF]))
    finite = ~np.isnan(out)
    assert out[finite].tobytes() == oracle[finite].tobytes()
    assert out[0x7E] == 448 and out[0x01] == 2.0**-9 and out[0x08] == 2.0**-6
    assert np.all(out[0x80:0xFF] == -out[0x00:0x7F])


def test_e4m3_encode_round_trips_every_finite_code() -> None:
    finite = ALL_BYTES[~np.isin(ALL_BYTES, [0x7F, 0xFF])]
    np.testing.assert_array_equal(encode_e4m3(decode_e4m3(finite)), finite)
    np.testing.assert_array_equal(encode_e4m3(decode_e4m3(finite).astype(np.float64)), finite)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e4m3_ties_between_adjacent_codes(sign: float) -> None:
    lower = np.arange(0x7E)  # pairs (c, c + 1) for all finite positive codes
    lo, hi = decode_e4m3(lower).astype(np.float64), decode_e4m3(lower + 1).astype(np.float64)
    mid = (lo + hi) / 2
    sign_bit = 0x80 if sign < 0 else 0
    tie = np.where(lower % 2 == 0, lower, lower + 1)  # the even code wins
    np.testing.assert_array_equal(encode_e4m3(sign * mid), tie | sign_bit)
    np.testing.assert_array_equal(encode_e4m3(sign * np.nextafter(mid, 0)), lower | sign_bit)
    np.testing.assert_array_equal(
        encode_e4m3(sign * np.nextafter(mid, 1e9)), (lower + 1) | sign_bit
    )
    # fp32 inputs at the same decision points agree with ml_dtypes' RNE cast.
    mid32 = (sign * mid).astype(np.float32)
    oracle = mid32.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(encode_e4m3(mid32), oracle)


@pytest.mark.parametrize(
    ("value", "byte"),
    [
        (2.0**-9, 0x01),  # smallest subnormal
        (2.0**-10, 0x00),  # tie between 0 and 2^-9 -> 0 (even)
        (1.5 * 2.0**-9, 0x02),  # tie between codes 1 and 2 -> 2
        (2.5 * 2.0**-9, 0x02),  # tie between codes 2 and 3 -> 2
        (7 * 2.0**-9, 0x07),  # largest subnormal
        (7.5 * 2.0**-9, 0x08),  # tie to the smallest normal 2^-6 (code 8, even)
        (1e-30, 0x00),
        (-1e-30, 0x80),  # keeps the sign
        (-0.0, 0x80),
        (448.0, 0x7E),
        (464.0, 0x7E),  # would be a tie to 480 without saturation
        (1e30, 0x7E),
        (-1e30, 0xFE),
        (np.nan, 0x7F),
        (np.inf, 0x7F),  # no infinity in e4m3fn: NaN
    ],
)
def test_e4m3_special_values(value: float, byte: int) -> None:
    assert encode_e4m3(np.array([value]))[0] == byte


def test_e4m3_random_vs_ml_dtypes(rng: np.random.Generator) -> None:
    x = rng.standard_normal(30000) * np.exp2(rng.integers(-16, 9, 30000))
    x = np.clip(x, -448, 448).astype(np.float32)  # ml_dtypes gives NaN past the range
    np.testing.assert_array_equal(encode_e4m3(x), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


# ---- E8M0 --------------------------------------------------------------------------------------
def test_e8m0_decode_all_codes_vs_ml_dtypes() -> None:
    out = decode_e8m0(ALL_BYTES)
    oracle = ALL_BYTES.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert out.dtype == np.float32
    assert np.isnan(out[255]) and not np.isnan(out[:255]).any()
    assert out[:255].tobytes() == oracle[:255].tobytes()
    exponent = np.arange(255) - 127
    np.testing.assert_array_equal(out[:255].astype(np.float64), np.ldexp(1.0, exponent))
    assert out[0] == 2.0**-127 and out[0] > 0  # the fp32 subnormal, not flushed to zero


@pytest.mark.parametrize(
    ("exponent", "byte"),
    [(-127, 0), (-1, 126), (0, 127), (1, 128), (127, 254), (-128, 0), (-1000, 0), (1000, 254)],
)
def test_e8m0_encode_exponent_clamps(exponent: int, byte: int) -> None:
    out = encode_e8m0_exponent(np.array([exponent]))
    assert out.dtype == np.uint8 and out[0] == byte


def test_e8m0_encode_rejects_floats() -> None:
    with pytest.raises(TypeError, match="exponent"):
        encode_e8m0_exponent(np.array([1.5]))


# ---- packing -----------------------------------------------------------------------------------
def test_pack_hand_built_byte() -> None:
    # element 0 = 0x3 (1.5) in the low nibble, element 1 = 0xA (-1.0) in the high nibble
    assert pack_fp4(np.array([0x3, 0xA], dtype=np.uint8)).tolist() == [0xA3]
    assert unpack_fp4(np.array([0xA3], dtype=np.uint8)).tolist() == [0x3, 0xA]
    assert decode_e2m1(unpack_fp4(np.array([0xA3], dtype=np.uint8))).tolist() == [1.5, -1.0]


@pytest.mark.parametrize("shape", [(2,), (3, 8), (2, 3, 64), (1, 0, 4)])
def test_pack_round_trip(rng: np.random.Generator, shape: tuple[int, ...]) -> None:
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and packed.dtype == np.uint8
    np.testing.assert_array_equal(packed & 0xF, codes[..., 0::2])
    np.testing.assert_array_equal(unpack_fp4(packed), codes)


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="codes"):
        pack_fp4(np.zeros(3, dtype=np.uint8))
    with pytest.raises(ValueError, match="codes"):
        pack_fp4(np.array([0, 16]))
    with pytest.raises(TypeError, match="packed"):
        unpack_fp4(np.zeros(4, dtype=np.int32))


def test_pair_interleaved_hand_checked_word() -> None:
    plain = pack_fp4(np.arange(1, 9, dtype=np.uint8))  # e_i = i + 1
    assert plain.tolist() == [0x21, 0x43, 0x65, 0x87]
    inter = to_pair_interleaved(plain)
    # slots 0..7 hold e0, e2, e4, e6, e1, e3, e5, e7 = 1, 3, 5, 7, 2, 4, 6, 8
    assert inter.tolist() == [0x31, 0x75, 0x42, 0x86]
    word = int(inter.view("<u4")[0])
    assert word == 0x86427531
    slot = [0, 4, 1, 5, 2, 6, 3, 7]
    assert [(word >> (4 * slot[i])) & 0xF for i in range(8)] == list(range(1, 9))
    np.testing.assert_array_equal(from_pair_interleaved(inter), plain)


@pytest.mark.parametrize("shape", [(8,), (3, 16), (2, 5, 256), (2, 0, 8)])
def test_pair_interleaved_round_trip(rng: np.random.Generator, shape: tuple[int, ...]) -> None:
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    plain = pack_fp4(codes)
    inter = to_pair_interleaved(plain)
    assert inter.shape == plain.shape and inter.dtype == np.uint8
    np.testing.assert_array_equal(from_pair_interleaved(inter), plain)
    np.testing.assert_array_equal(to_pair_interleaved(from_pair_interleaved(plain)), plain)
    # every word decodes to the same logical codes through the slot rule
    nibbles = unpack_fp4(inter).reshape(*shape[:-1], shape[-1] // 8, 8)
    np.testing.assert_array_equal(
        nibbles[..., [0, 4, 1, 5, 2, 6, 3, 7]].reshape(codes.shape), codes
    )


@pytest.mark.parametrize("k", [2, 4, 6, 12])
def test_pair_interleaved_needs_k_multiple_of_8(k: int) -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        to_pair_interleaved(np.zeros(k // 2, dtype=np.uint8))
    with pytest.raises(ValueError, match="multiple of 8"):
        from_pair_interleaved(np.zeros(k // 2, dtype=np.uint8))


# ---- enums -------------------------------------------------------------------------------------
def test_format_enum() -> None:
    assert Fp4Format.parse("nvfp4") is Fp4Format.NVFP4
    assert Fp4Format.parse(" MXFP4 ") is Fp4Format.MXFP4
    assert Fp4Format.parse(Fp4Format.MXFP4) is Fp4Format.MXFP4
    assert (Fp4Format.NVFP4.block_size, Fp4Format.MXFP4.block_size) == (16, 32)
    assert Fp4Format.NVFP4.scale_dtype == np.dtype(ml_dtypes.float8_e4m3fn)
    assert Fp4Format.MXFP4.scale_name == "float8_e8m0fnu"
    with pytest.raises(ValueError, match="format: expected one of 'nvfp4', 'mxfp4'"):
        Fp4Format.parse("fp4")
    assert MxScaleRule.parse("round_up") is MxScaleRule.ROUND_UP
    with pytest.raises(ValueError, match="mx_scale_rule: expected one of 'ocp', 'round_up'"):
        MxScaleRule.parse("nearest")


# ---- quantizers --------------------------------------------------------------------------------
def _half_gap_bound(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Largest |dequantized - w| allowed: half the E2M1 gap at |w| / scale, plus the clip."""
    r = np.abs(w) / scale
    half_gap = np.where(r <= 2, 0.25, np.where(r <= 4, 0.5, 1.0))
    return half_gap * scale + np.maximum(np.abs(w) - 6 * scale, 0)


def _effective_scales(q: Fp4Experts) -> np.ndarray:
    """float64 ``scale * global_scale`` per element, [E, N, K]."""
    s = q.format.decode_scales(q.scales).astype(np.float64) * q.global_scale[:, None, None]
    return np.repeat(s, q.block_size, axis=2)


def _nvfp4_oracle(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """One expert [N, K] by ModelOpt's rule, with ml_dtypes doing every rounding to 8/4 bits."""
    w = w.astype(np.float32)
    amax = np.abs(w).max()
    gs = amax / np.float32(2688.0) if amax > 0 else np.float32(1.0)
    block_amax = np.abs(w.reshape(w.shape[0], -1, 16)).max(axis=-1)
    s = block_amax / (np.float32(6.0) * gs)
    s[s == 0] = 1.0
    s8 = np.maximum(s, np.float32(2.0**-9)).astype(ml_dtypes.float8_e4m3fn)
    eff = s8.astype(np.float32) * gs
    x = w.reshape(w.shape[0], -1, 16) / eff[..., None]
    codes = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    return codes.reshape(w.shape), s8.view(np.uint8), gs


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.float64])
def test_nvfp4_quantize_matches_modelopt_oracle(rng: np.random.Generator, dtype: type) -> None:
    w = (rng.standard_normal((3, 8, 64)) * [[[0.02]], [[1.0]], [[30.0]]]).astype(dtype)
    w[1, 2, :16] = 0  # a zero block
    w[2, 3, 16:32] *= 1e-5  # tiny blocks: subnormal E4M3 scales
    q = Fp4Experts.quantize(w, "nvfp4")
    assert (q.n_experts, q.n, q.k, q.block_size) == (3, 8, 64, 16)
    for e in range(3):
        codes, scale_bytes, gs = _nvfp4_oracle(w[e])
        np.testing.assert_array_equal(unpack_fp4(q.packed[e]), codes)
        np.testing.assert_array_equal(q.scales[e], scale_bytes)
        assert q.global_scale[e] == gs
    assert q.scales[1, 2, 0] == 0x38  # zero block -> scale 1.0
    assert np.all(unpack_fp4(q.packed[1, 2])[:16] == 0)
    tiny = q.scales[2, 3, 1]
    assert 0 < tiny < 0x08  # an E4M3 subnormal
    ref = w.astype(np.float32).astype(np.float64)
    err = np.abs(q.dequantize(np.float64) - ref)
    assert np.all(err <= _half_gap_bound(ref, _effective_scales(q)) * (1 + 2.0**-20))


def test_nvfp4_zero_expert_and_clamped_scale() -> None:
    w = np.zeros((2, 2, 32), dtype=np.float32)
    w[0, 1, :] = -0.0
    w[1, 0, 0] = 1.0
    w[1, 1, 0] = 1e-9  # block scale 1e-9 / (6 / 2688) < 2^-9: clamped to 2^-9 (byte 0x01)
    q = Fp4Experts.quantize(w, "nvfp4")
    assert q.global_scale[0] == 1.0 and np.all(q.scales[0] == 0x38)
    assert np.all(unpack_fp4(q.packed[0, 1]) == 0x8)  # -0.0 keeps its sign
    assert q.global_scale[1] == np.float32(1.0) / np.float32(2688.0)
    assert q.scales[1, 1, 0] == 0x01 and q.scales[1, 1, 1] == 0x38
    out = q.dequantize()
    assert out[0].tobytes() == w[0].tobytes() and out[1, 1, 0] == 0


@pytest.mark.parametrize(
    ("amax", "ocp_exponent", "round_up_exponent"),
    [
        (1.0, -2, -2),  # 6 * 2^-2 = 1.5 >= 1: no clipping either way
        (1.5, -2, -2),  # exactly 1.5 * 2^floor: the rules agree
        (1.75, -2, -1),
        (6.0, 0, 0),
        (6.5, 0, 1),
        (7.99, 0, 1),
        (8.0, 1, 1),
        (3.0, -1, -1),
        (0.01, -9, -9),
        (2.0**-130, -127, -127),  # clamped to the E8M0 range
        (1e300, 127, 127),
    ],
)
def test_mxfp4_exponent_rules(amax: float, ocp_exponent: int, round_up_exponent: int) -> None:
    w = np.zeros((1, 1, 32))
    w[0, 0, 5] = -amax
    for rule, exponent in (("ocp", ocp_exponent), ("round_up", round_up_exponent)):
        q = Fp4Experts.quantize(w, "mxfp4", mx_scale_rule=rule)
        assert q.scales[0, 0, 0] == 127 + exponent, rule
        assert q.global_scale.tolist() == [1.0]


def test_mxfp4_ocp_clips_round_up_does_not() -> None:
    w = np.full((1, 1, 32), 0.5, dtype=np.float32)
    w[0, 0, 0] = 7.5  # OCP: scale 2^0, 7.5 saturates to 6; round-up: scale 2^1, 3.75 -> 4 -> 8
    ocp = Fp4Experts.quantize(w, "mxfp4").dequantize()
    up = Fp4Experts.quantize(w, "mxfp4", mx_scale_rule=MxScaleRule.ROUND_UP).dequantize()
    assert ocp[0, 0, 0] == 6.0 and ocp[0, 0, 1] == 0.5
    assert up[0, 0, 0] == 8.0 and up[0, 0, 1] == 0.0  # 0.25 is a tie -> 0


@pytest.mark.parametrize("rule", ["ocp", "round_up"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64])
def test_mxfp4_error_bounds(rng: np.random.Generator, rule: str, dtype: type) -> None:
    w = rng.standard_t(3, (2, 16, 128)) * np.exp2(rng.integers(-20, 20, (2, 16, 1)))
    w = w.astype(dtype)
    q = Fp4Experts.quantize(w, "mxfp4", mx_scale_rule=rule)
    ref = w.astype(np.float64)
    scale = _effective_scales(q)
    out = q.dequantize(np.float64)
    clipped = np.abs(ref) > 6 * scale
    if rule == "round_up":
        assert not clipped.any()  # never clips
    else:
        np.testing.assert_array_equal(out[clipped], np.copysign(6 * scale, ref)[clipped])
    assert np.all(np.abs(out - ref) <= _half_gap_bound(ref, scale))
    # the result is the E2M1 rounding of w / 2^exponent, exactly
    oracle = np.clip(ref / scale, -6, 6).astype(np.float32).astype(ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(unpack_fp4(q.packed), oracle.view(np.uint8))


def test_mxfp4_zero_block() -> None:
    w = np.zeros((1, 2, 64), dtype=np.float32)
    w[0, 0, 32:] = -0.0
    w[0, 1, 40] = 3.0
    q = Fp4Experts.quantize(w, "mxfp4")
    assert q.scales.tolist() == [[[127, 127], [127, 127 - 1]]]  # zero blocks: 2^0
    codes = unpack_fp4(q.packed)
    assert np.all(codes[0, 0, :32] == 0) and np.all(codes[0, 0, 32:] == 0x8)
    assert q.dequantize().tobytes() == w.tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_exact_values_round_trip(rng: np.random.Generator, fmt: str) -> None:
    """Representable weights come back: exactly in MXFP4; NVFP4 recovers every code, and its
    fp32 global scale ``amax / 2688`` costs at most a few ulp."""
    block = Fp4Format.parse(fmt).block_size
    codes = rng.integers(0, 16, (2, 4, 64), dtype=np.uint8)
    codes[..., ::block] = 0x7  # every block reaches 6: the scale is recovered exactly
    exponent = rng.integers(-6, 6, (2, 4, 64 // block))
    w = decode_e2m1(codes) * np.repeat(np.ldexp(1.0, exponent), block, axis=2)
    q = Fp4Experts.quantize(w.astype(np.float32), fmt)
    np.testing.assert_array_equal(unpack_fp4(q.packed), codes)
    if fmt == "mxfp4":
        np.testing.assert_array_equal(q.dequantize(np.float64), w)
    else:
        np.testing.assert_allclose(q.dequantize(np.float64), w, rtol=2.0**-21, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(0, 4, 32), (2, 0, 32), (1, 3, 0)])
def test_quantize_zero_size(fmt: str, shape: tuple[int, int, int]) -> None:
    q = Fp4Experts.quantize(np.zeros(shape, dtype=np.float32), fmt)
    assert q.dequantize().shape == shape and q.global_scale.shape == (shape[0],)


def test_gate_and_up_keep_their_own_global_scales(rng: np.random.Generator) -> None:
    gate = rng.standard_normal((4, 8, 32)).astype(np.float32)
    up = 20 * rng.standard_normal((4, 8, 32)).astype(np.float32)
    qg, qu = Fp4Experts.quantize(gate), Fp4Experts.quantize(up)
    amax_g, amax_u = np.abs(gate).max(axis=(1, 2)), np.abs(up).max(axis=(1, 2))
    np.testing.assert_array_equal(qg.global_scale, amax_g / np.float32(2688))
    np.testing.assert_array_equal(qu.global_scale, amax_u / np.float32(2688))
    assert np.all(qu.global_scale > 5 * qg.global_scale)
    # select_rows of a concatenated [gate; up] keeps the one shared scale: not the same thing.
    both = Fp4Experts.quantize(np.concatenate([gate, up], axis=1)).select_rows(slice(0, 8))
    np.testing.assert_array_equal(both.global_scale, qu.global_scale)
    for q, w in ((qg, gate), (qu, up)):
        bound = _half_gap_bound(w.astype(np.float64), _effective_scales(q)) * (1 + 2.0**-20)
        assert np.all(np.abs(q.dequantize(np.float64) - w) <= bound)


@pytest.mark.parametrize(
    ("weights", "error", "match"),
    [
        (np.zeros((1, 2, 24), dtype=np.float32), ValueError, "weights: k = 24 must be a multiple"),
        (np.full((1, 2, 16), np.nan, dtype=np.float32), ValueError, "weights: 32 non-finite"),
        (np.full((1, 2, 16), np.inf, dtype=np.float16), ValueError, "weights: 32 non-finite"),
        (np.zeros((2, 16), dtype=np.float32), ValueError, r"weights: expected shape \(n_experts"),
        (np.zeros((1, 2, 16), dtype=np.int32), TypeError, "weights: expected dtype"),
    ],
)
def test_quantize_rejects_bad_weights(weights: np.ndarray, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Fp4Experts.quantize(weights, "nvfp4")


# ---- Fp4Experts: construction, validation, dequantize, select_rows ------------------------------
def _parts(fmt: str = "nvfp4", e: int = 2, n: int = 3, k: int = 64) -> dict[str, np.ndarray]:
    block = Fp4Format.parse(fmt).block_size
    return {
        "packed": np.zeros((e, n, k // 2), dtype=np.uint8),
        "scales": np.full((e, n, k // block), 0x38 if fmt == "nvfp4" else 127, dtype=np.uint8),
        "global_scale": np.ones(e, dtype=np.float32),
    }


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("packed", np.zeros((2, 3, 32), dtype=np.int8), TypeError, "packed: expected dtype uint8"),
        ("packed", [[[0] * 32] * 3] * 2, TypeError, "packed: expected a NumPy array"),
        ("packed", np.zeros((3, 32), dtype=np.uint8), ValueError, "packed: expected 3 dim"),
        ("packed", np.zeros((2, 3, 36), dtype=np.uint8), ValueError, "packed: K = 2 .* = 72"),
        ("scales", np.zeros((2, 3, 2), dtype=np.uint8), ValueError,
         r"scales: expected shape \(2, 3, 4\), got \(2, 3, 2\)"),
        ("scales", np.zeros((2, 3, 4), dtype=np.float32), TypeError, "scales: expected dtype"),
        ("global_scale", np.ones(3, dtype=np.float32), ValueError,
         r"global_scale: expected shape \(2,\)"),
        ("global_scale", np.ones(2), TypeError, "global_scale: expected dtype float32"),
        ("global_scale", np.array([1, 0], dtype=np.float32), ValueError, "global_scale: expected"),
        ("global_scale", np.array([1, -2], dtype=np.float32), ValueError, "finite values > 0"),
        ("global_scale", np.array([np.nan, 1], dtype=np.float32), ValueError, "global_scale"),
        ("global_scale", np.array([np.inf, 1], dtype=np.float32), ValueError, "global_scale"),
    ],
)  # fmt: skip
def test_fp4experts_validation(field: str, value: object, error: type, match: str) -> None:
    parts = _parts()
    parts[field] = value  # type: ignore[assignment]
    with pytest.raises(error, match=match):
        Fp4Experts("nvfp4", **parts)


def test_fp4experts_shape_message() -> None:
    parts = _parts(e=8, n=4, k=4096)
    parts["scales"] = np.zeros((8, 4, 128), dtype=np.uint8)
    with pytest.raises(
        ValueError, match=r"^scales: expected shape \(8, 4, 256\), got \(8, 4, 128\)$"
    ):
        Fp4Experts(Fp4Format.NVFP4, **parts)


@pytest.mark.parametrize(("fmt", "byte"), [("nvfp4", 0x7F), ("nvfp4", 0xFF), ("mxfp4", 0xFF)])
def test_fp4experts_rejects_nan_scale_bytes(fmt: str, byte: int) -> None:
    parts = _parts(fmt)
    parts["scales"][1, 2, 1] = byte
    with pytest.raises(ValueError, match=r"scales: 1 NaN .* at \(1, 2, 1\)"):
        Fp4Experts(fmt, **parts)  # type: ignore[arg-type]


def test_fp4experts_mxfp4_accepts_0x7f() -> None:
    parts = _parts("mxfp4")
    parts["scales"][:] = 0x7F  # 2^0 in E8M0: valid
    assert Fp4Experts("mxfp4", **parts).format is Fp4Format.MXFP4  # type: ignore[arg-type]


def test_fp4experts_bad_format() -> None:
    with pytest.raises(ValueError, match="format: expected one of"):
        Fp4Experts("int4", **_parts())  # type: ignore[arg-type]


def test_fp4experts_is_frozen_contiguous_and_read_only() -> None:
    parts = _parts()
    source = np.zeros((2, 3, 64), dtype=np.uint8)
    parts["packed"] = source[:, :, ::2]  # not contiguous: copied
    q = Fp4Experts("nvfp4", **parts)  # type: ignore[arg-type]
    for a in (q.packed, q.scales, q.global_scale):
        assert a.flags.c_contiguous and not a.flags.writeable
    assert parts["scales"].flags.writeable  # the caller's array is left alone
    with pytest.raises(ValueError):
        q.packed[0, 0, 0] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.packed = source  # type: ignore[misc]
    assert q.nbytes == 2 * 3 * 32 + 2 * 3 * 4 + 2 * 4
    assert repr(q) == "Fp4Experts(format=nvfp4, n_experts=2, n=3, k=64)"


def test_dequantize_hand_built() -> None:
    codes = np.arange(16, dtype=np.uint8)[None, None, :]
    for fmt, byte, scale in (("nvfp4", 0x40, 2.0), ("nvfp4", 0x03, 3 * 2.0**-9),
                             ("mxfp4", 130, 8.0), ("mxfp4", 0, 2.0**-127)):  # fmt: skip
        block = Fp4Format.parse(fmt).block_size
        packed = pack_fp4(np.tile(codes, (1, 1, block // 16)))
        scales = np.full((1, 1, 1), byte, dtype=np.uint8)
        q = Fp4Experts.from_packed(packed, scales, np.array([0.75], dtype=np.float32), fmt)
        expected = np.tile(E2M1_VALUES.astype(np.float64), block // 16) * scale * 0.75
        out64 = q.dequantize(np.float64)[0, 0]
        assert out64.tobytes() == expected.tobytes()
        assert q.dequantize()[0, 0].tobytes() == expected.astype(np.float32).tobytes()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, ml_dtypes.bfloat16])
def test_dequantize_is_one_rounding(rng: np.random.Generator, fmt: str, dtype: type) -> None:
    q = Fp4Experts.quantize(rng.standard_normal((2, 4, 64)), fmt)
    gs = np.array([0.3, 7.1], dtype=np.float32)  # arbitrary fp32 global scales
    q = Fp4Experts.from_packed(q.packed, q.scales, gs, fmt)
    exact = decode_e2m1(unpack_fp4(q.packed)).astype(np.float64) * _effective_scales(q)
    out = q.dequantize(dtype)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, exact.astype(dtype))
    if dtype is np.float32:  # = fp32 (e2m1 * scale) * global_scale
        product = decode_e2m1(unpack_fp4(q.packed)) * np.repeat(
            q.format.decode_scales(q.scales), q.block_size, axis=2
        )
        np.testing.assert_array_equal(out, product * gs[:, None, None])


def test_dequantize_rejects_dtype() -> None:
    with pytest.raises(TypeError, match="dtype"):
        Fp4Experts("nvfp4", **_parts()).dequantize(np.int32)  # type: ignore[arg-type]


class _FakeDeviceArray:
    """Stands in for a CuPy array: only ``.get()`` reaches the host."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def get(self) -> np.ndarray:
        return self._a


@pytest.mark.parametrize("fmt", FORMATS)
def test_from_packed_round_trips_quantize(rng: np.random.Generator, fmt: str) -> None:
    q = Fp4Experts.quantize(rng.standard_normal((3, 4, 64)).astype(np.float32), fmt)
    views = (
        (q.packed, q.scales, q.global_scale),
        (q.packed, q.scales.view(Fp4Format.parse(fmt).scale_dtype), q.global_scale),
        (_FakeDeviceArray(q.packed), _FakeDeviceArray(q.scales), list(q.global_scale)),
    )
    for packed, scales, gs in views:
        r = Fp4Experts.from_packed(packed, scales, gs, fmt)
        assert r.format is q.format
        for name in ("packed", "scales", "global_scale"):
            a, b = getattr(q, name), getattr(r, name)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        assert r.dequantize().tobytes() == q.dequantize().tobytes()


def test_from_packed_global_scale_rules() -> None:
    parts = _parts(e=1)
    assert Fp4Experts.from_packed(parts["packed"], parts["scales"]).global_scale.tolist() == [1.0]
    one = Fp4Experts.from_packed(parts["packed"], parts["scales"], 0.5)
    assert one.global_scale.dtype == np.float32 and one.global_scale.tolist() == [0.5]
    parts = _parts(e=2)
    none = Fp4Experts.from_packed(parts["packed"], parts["scales"], None, "nvfp4")
    assert none.global_scale.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"global_scale: a scalar .* expected shape \(2,\)"):
        Fp4Experts.from_packed(parts["packed"], parts["scales"], 0.5)
    with pytest.raises(ValueError, match="global_scale: expected finite values > 0"):
        Fp4Experts.from_packed(parts["packed"], parts["scales"], np.array([1.0, 0.0]))
    with pytest.raises(TypeError, match="global_scale: expected a floating dtype"):
        Fp4Experts.from_packed(parts["packed"], parts["scales"], np.array(["a", "b"]))


def test_from_packed_rejects_wrong_scale_type() -> None:
    parts = _parts("nvfp4")
    e8m0 = parts["scales"].view(ml_dtypes.float8_e8m0fnu)
    with pytest.raises(TypeError, match="scales: expected uint8 or float8_e4m3fn for nvfp4"):
        Fp4Experts.from_packed(parts["packed"], e8m0, format="nvfp4")
    with pytest.raises(ValueError, match="scales: expected shape"):
        Fp4Experts.from_packed(parts["packed"], parts["scales"], format="mxfp4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_select_rows(rng: np.random.Generator, fmt: str) -> None:
    q = Fp4Experts.quantize(rng.standard_normal((2, 6, 64)).astype(np.float32), fmt)
    full = q.dequantize()
    gate = q.select_rows(slice(0, None, 2))  # interleaved gate0, up0, gate1, ... (gpt-oss)
    up = q.select_rows(np.array([1, 3, 5]))
    for part, rows in ((gate, [0, 2, 4]), (up, [1, 3, 5])):
        assert (part.n_experts, part.n, part.k) == (2, 3, 64)
        assert part.global_scale.tobytes() == q.global_scale.tobytes()
        assert part.dequantize().tobytes() == full[:, rows].tobytes()
    assert q.select_rows(slice(3, 3)).n == 0
    with pytest.raises(ValueError, match=r"index: expected rows in \[0, 6\)"):
        q.select_rows([0, 6])
    with pytest.raises(TypeError, match="index"):
        q.select_rows(np.zeros((2, 2), dtype=np.int64))
