# SPDX-License-Identifier: Apache-2.0
"""FP4 GEMV: references on hand-computed cases (CPU), the kernel's decode identity (CPU), and
the fc1 / fc2 kernels against fc1_ref / fc2_ref (GPU)."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

from cupymoe.experts import dispatch, gemv, layouts
from cupymoe.experts.activation import Activation, ActivationSpec, activation_ref
from cupymoe.experts.config import TILINGS
from cupymoe.experts.layouts import WeightLayout
from cupymoe.experts.reference import fc1_ref, fc2_ref
from cupymoe.formats import E2M1_VALUES, Fp4Experts, pack_fp4, to_pair_interleaved
from cupymoe.testing import assert_close, tolerance_for

BF16 = np.dtype(ml_dtypes.bfloat16)
SWIGLU = ActivationSpec(Activation.SWIGLU)


# ---- activations (CPU) -------------------------------------------------------------------------
def test_activation_parse() -> None:
    assert Activation.parse("SwiGLU") is Activation.SWIGLU
    assert ActivationSpec("geglu").kind is Activation.GEGLU
    with pytest.raises(ValueError, match="swiglu_oai"):
        Activation.parse("tanh")
    with pytest.raises(ValueError, match="limit"):
        ActivationSpec("swiglu_oai", limit=0.0)
    with pytest.raises(TypeError, match="alpha"):
        ActivationSpec("swiglu", alpha="1")


def test_activation_known_points() -> None:
    g = np.array([0.0, 1.0, -1.0, 40.0, -800.0])
    u = np.array([5.0, 2.0, 3.0, 0.5, 1.0])
    sig = 1.0 / (1.0 + np.exp(-g[:3]))
    np.testing.assert_allclose(activation_ref(g, u, SWIGLU)[:3], g[:3] * sig * u[:3], rtol=1e-15)
    assert activation_ref(g, u, SWIGLU)[3] == pytest.approx(20.0)  # silu(40) = 40
    assert activation_ref(g, u, SWIGLU)[4] == 0.0  # no overflow warning / NaN
    geglu = activation_ref(g, u, ActivationSpec("geglu"))
    phi1 = 0.5 * (1.0 + math.erf(1.0 / math.sqrt(2.0)))  # 0.841344746...
    np.testing.assert_allclose(geglu[:3], [0.0, 2.0 * phi1, -3.0 * (1.0 - phi1)], rtol=1e-15)


def test_swiglu_oai_clamps() -> None:
    act = ActivationSpec("swiglu_oai", alpha=1.702, limit=7.0)
    g = np.array([10.0, 10.0, -3.0, 2.0])
    u = np.array([10.0, -10.0, 100.0, 0.5])
    out = activation_ref(g, u, act)
    s = lambda z: 1.0 / (1.0 + math.exp(-1.702 * z))  # noqa: E731
    expected = [7 * s(7) * 8, 7 * s(7) * -6, -3 * s(-3) * 8, 2 * s(2) * 1.5]
    np.testing.assert_allclose(out, expected, rtol=1e-15)
    # limit = inf: no clamping, still gate * sigmoid(alpha * gate) * (up + 1)
    free = activation_ref(g, u, ActivationSpec("swiglu_oai", limit=math.inf))
    np.testing.assert_allclose(free[0], 10 * s(10) * 11, rtol=1e-15)


# ---- references (CPU) --------------------------------------------------------------------------
def _tiny_experts(codes: np.ndarray, scale_byte: int, global_scale: list[float]) -> Fp4Experts:
    e, n, k = codes.shape
    scales = np.full((e, n, k // 16), scale_byte, np.uint8)
    return Fp4Experts.from_packed(
        pack_fp4(codes.astype(np.uint8)), scales, np.array(global_scale, np.float32), format="nvfp4"
    )


def test_fc2_ref_hand_computed() -> None:
    # 2 experts, N = 2, K = 16; E4M3 0x38 = 1.0, 0x40 = 2.0.
    codes = np.zeros((2, 2, 16), np.uint8)
    codes[0, 0, :4] = [2, 3, 7, 0xA]  # 1, 1.5, 6, -1
    codes[0, 1, 15] = 1  # 0.5
    codes[1, 1, 0] = 0xF  # -6
    w = _tiny_experts(codes, 0x40, [0.5, 3.0])  # scale 2: expert 0 x1.0, expert 1 x6.0
    x = np.zeros((3, 16))
    x[0, :4] = [1, 2, 3, 4]
    x[0, 15] = 8
    x[1:, 0] = [1.0, -2.0]
    offsets = np.array([0, 1, 3])  # row 0 -> expert 0, rows 1, 2 -> expert 1
    out = fc2_ref(x, w, offsets)
    assert out.tolist() == [[1 + 3 + 18 - 4, 4.0], [0.0, -36.0], [0.0, 72.0]]
    bias = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert fc2_ref(x, w, offsets, bias=bias).tolist() == [[19.0, 6.0], [3.0, -32.0], [3.0, 76.0]]


def test_fc1_ref_is_activation_of_two_gemvs(rng: np.random.Generator) -> None:
    gate = Fp4Experts.quantize(rng.standard_normal((3, 8, 32)), "mxfp4")
    up = Fp4Experts.quantize(rng.standard_normal((3, 8, 32)), "mxfp4")
    x = rng.standard_normal((5, 32))
    off = np.array([0, 2, 2, 5])
    bg, bu = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
    act = ActivationSpec("swiglu_oai", limit=1.5)
    ref = activation_ref(fc2_ref(x, gate, off, bias=bg), fc2_ref(x, up, off, bias=bu), act)
    np.testing.assert_array_equal(fc1_ref(x, gate, up, off, act=act, gate_bias=bg, up_bias=bu), ref)
    # dense check of one row against the dequantized weights
    dense = gate.dequantize(np.float64)
    np.testing.assert_allclose(fc2_ref(x, gate, off)[3], dense[2] @ x[3], rtol=1e-12)


def test_reference_input_errors(rng: np.random.Generator) -> None:
    w = Fp4Experts.quantize(rng.standard_normal((2, 4, 32)), "nvfp4")
    x = np.zeros((3, 32))
    with pytest.raises(ValueError, match="expert_offsets"):
        fc2_ref(x, w, np.array([0, 1, 2]))  # ends at 2, not 3
    with pytest.raises(ValueError, match="expert_offsets"):
        fc2_ref(x, w, np.array([0, 1]))
    with pytest.raises(ValueError, match="x_sorted"):
        fc2_ref(np.zeros((3, 16)), w, np.array([0, 1, 3]))
    with pytest.raises(ValueError, match="bias"):
        fc2_ref(x, w, np.array([0, 1, 3]), bias=np.zeros((2, 5)))


# ---- the kernel's decoders and layouts (CPU transcription of gemv_fp4.cu) ----------------------
U32 = np.uint32


def _prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """PTX prmt.b32 (default mode) on uint32 arrays."""
    a, b, sel = np.broadcast_arrays(np.asarray(a, U32), np.asarray(b, U32), np.asarray(sel, U32))
    src = np.stack([(v >> U32(8 * i)) & U32(0xFF) for v in (a, b) for i in range(4)])
    out = np.zeros(a.shape, U32)
    for i in range(4):
        nib = (sel >> U32(4 * i)) & U32(0xF)
        byte = np.take_along_axis(src, (nib & U32(7)).astype(np.intp)[None], 0)[0]
        byte = np.where(nib & U32(8), np.where(byte & U32(0x80), U32(0xFF), U32(0)), byte)
        out |= byte << U32(8 * i)
    return out


ORDERS = ["plain", "pair", "split"]  # the GEMV's kOrder 0, 1, 2


def _decode(w: np.ndarray, dtype: np.dtype, order: str) -> tuple[np.ndarray, int]:
    """Decoder<T, kOrder>::run: uint32 words [n] -> 16-bit patterns [n, 8] (logical order), kExp."""
    w = np.asarray(w, U32)
    h = []
    if order == "split" and dtype == np.float16:
        mag, sign, w8 = U32(0x0E000E00), U32(0x80008000), w << U32(3)
        h = [
            (w8 & mag) | (w & sign),
            ((w << U32(6)) & mag) | (w8 & sign),
            ((w & U32(0x40074007)) * U32(512 + 2)) & U32(0x8E008E00),
            (w & mag) | ((w << U32(2)) & sign),
        ]
        exp = -14
    elif order == "split":
        keep, mag, sign = U32(0x81C081C0), U32(0x01C001C0), U32(0x80008000)
        h = [
            w & keep,
            (w << U32(3)) & keep,
            ((w & U32(0x40074007)) * U32(64 + 2)) & keep,
            ((w >> U32(3)) & mag) | ((w << U32(2)) & sign),
        ]
        exp = -126
    elif order == "plain":
        mag, sgn = w & U32(0x77777777), (w >> U32(3)) & U32(0x11111111)
        for j in range(2):
            sel, sg = mag >> U32(16 * j), sgn >> U32(16 * j)
            signs = _prmt(U32(0x8000), U32(0), sg)
            if dtype == np.float16:
                hb = _prmt(U32(0x3E3C3800), U32(0x46444240), sel) | signs
                h += [_prmt(hb, U32(0), U32(0x1404)), _prmt(hb, U32(0), U32(0x3424))]
            else:
                hb = _prmt(U32(0x3F3F3F00), U32(0x40404040), sel) | signs
                lb = _prmt(U32(0xC0800000), U32(0xC0804000), sel)
                h += [_prmt(lb, hb, U32(0x5140)), _prmt(lb, hb, U32(0x7362))]
        exp = 0
    elif dtype == np.float16:
        keep = U32(0x8E008E00)
        even, odd = w & U32(0x0F0F0F0F), w & U32(0xF0F0F0F0)
        h = [
            ((even << U32(9)) | (even << U32(12))) & keep,
            ((odd << U32(5)) | (odd << U32(8))) & keep,
            ((even << U32(1)) | (even << U32(4))) & keep,
            ((odd >> U32(3)) | odd) & keep,
        ]
        exp = -14
    else:
        keep = U32(0x81C081C0)
        s = [w & U32(0x000F000F << (4 * j)) for j in range(4)]
        h = [
            (s[0] * U32(64 + 4096)) & keep,  # the kernel's sums (equal to the ORs of the shifts)
            (s[1] * U32(4 + 256)) & keep,
            ((s[2] >> U32(2)) | (s[2] << U32(4))) & keep,
            ((s[3] >> U32(6)) | s[3]) & keep,
        ]
        exp = -126
    out = np.empty((w.shape[0], 8), np.uint16)
    for j, reg in enumerate(h):
        out[:, 2 * j] = (reg & U32(0xFFFF)).astype(np.uint16)
        out[:, 2 * j + 1] = (reg >> U32(16)).astype(np.uint16)
    return out, exp


def _as_f64(bits: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return bits.astype(np.uint16).view(dtype).astype(np.float64)


def _exact_in(values: np.ndarray, dtype: np.dtype, *, normal: bool) -> np.ndarray:
    """Whether each float64 value is exactly a finite ``dtype`` number (normal or zero if asked)."""
    with np.errstate(over="ignore"):
        back = values.astype(dtype).astype(np.float64)
    ok = (back == values) & np.isfinite(back)
    if normal:
        tiny = float(ml_dtypes.finfo(dtype).smallest_normal)
        ok &= (values == 0) | (np.abs(values) >= tiny)
    return ok


def _words_of(codes: np.ndarray, order: str) -> np.ndarray:
    """codes [n, 8] (logical order) -> uint32 words in the plain, pair-interleaved or split order
    (the split words through layouts.split_words, from either source order)."""
    if order == "split":
        return layouts.split_words(_words_of(codes, "pair"), True)
    slots = [0, 4, 1, 5, 2, 6, 3, 7] if order == "pair" else list(range(8))  # slot of element i
    words = np.zeros(codes.shape[0], U32)
    for i in range(8):
        words |= codes[:, i].astype(U32) << U32(4 * slots[i])
    return words


def test_split_words_from_either_order(rng: np.random.Generator) -> None:
    """split_words places element 2p's magnitude at _SPLIT_MAG[p] and sign at _SPLIT_SIGN[p] of
    the low half (2p + 1: high half), whichever order the source words are in."""
    codes = rng.integers(0, 16, size=(512, 8), dtype=np.uint32)
    split = layouts.split_words(_words_of(codes, "plain"), False)
    assert split.tobytes() == layouts.split_words(_words_of(codes, "pair"), True).tobytes()
    for i in range(8):
        p, half = divmod(i, 2)
        mag = (split >> U32(16 * half + layouts._SPLIT_MAG[p])) & U32(7)
        sign = (split >> U32(16 * half + layouts._SPLIT_SIGN[p])) & U32(1)
        np.testing.assert_array_equal(mag | (sign << U32(3)), codes[:, i])
    hand = layouts.split_words(np.array([0x8], U32), False)  # element 0 = -0: sign bit 15 only
    assert hand.tolist() == [0x8000]
    with pytest.raises(TypeError, match="words: expected uint32"):
        layouts.split_words(np.zeros(3, np.int64), False)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_decoders_are_exact(dtype: np.dtype, order: str, rng: np.random.Generator) -> None:
    codes = np.concatenate(
        [
            np.repeat(np.arange(16, dtype=np.uint32), 8).reshape(16, 8),  # every code in every slot
            rng.integers(0, 16, size=(4096, 8), dtype=np.uint32),
        ]
    )
    bits, exp = _decode(_words_of(codes, order), dtype, order)
    got = _as_f64(bits, dtype) * 2.0**-exp
    want = E2M1_VALUES[codes].astype(np.float64)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0 for code 0x8


def _table_value(fmt: str, dtype: np.dtype, byte: np.ndarray, shift: int) -> np.ndarray:
    """scale_bits<kFormat, T>: the table entry of each scale byte as float64 (T-rounded)."""
    from cupymoe.formats import Fp4Format

    v = Fp4Format.parse(fmt).decode_scales(byte.astype(np.uint8)).astype(np.float64) * 2.0**shift
    with np.errstate(over="ignore"):
        return v.astype(dtype).astype(np.float64)


def _e4m3_table_bits(b: int, dtype: np.dtype, shift: int) -> int:
    """Transcription of scale_bits<0, T> (gemv_fp4.cu): E4M3 byte b times 2^shift as T's bits,
    built from integers."""
    bias, mant = (127, 7) if dtype == BF16 else (15, 10)
    if b & 0x7F == 0x7F:
        return -1  # NaN: the kernel converts a NaN (checked below as a NaN pattern)
    sign = (b & 0x80) << 8
    e, m = (b >> 3) & 15, b & 7
    if e == 0 and m == 0:
        return sign
    p = m.bit_length() - 1  # 31 - clz(m)
    x = e - 7 if e else p - 9
    f = m if e else (m << (3 - p)) & 7
    return sign | ((x + shift + bias) << mant) | (f << (mant - 3))


@pytest.mark.parametrize(
    ("dtype", "shift"), [(np.dtype(np.float16), 0), (BF16, 0), (BF16, 116)], ids=str
)
def test_e4m3_table_bits_from_integers(dtype: np.dtype, shift: int) -> None:
    # The NVFP4 scale table is built with integer operations; every byte's bits must be those of
    # the exact value scale * 2^shift rounded to T (exact: all of them are normal numbers of T).
    from cupymoe.formats import Fp4Format

    values = Fp4Format.NVFP4.decode_scales(np.arange(256, dtype=np.uint8)).astype(np.float64)
    want = (values * 2.0**shift).astype(dtype).view(np.uint16)
    for b in range(256):
        got = _e4m3_table_bits(b, dtype, shift)
        if got < 0:
            assert np.isnan(values[b])
        else:
            assert got == int(want[b]), (b, hex(got), hex(int(want[b])))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_block_scale_fold_is_exact(fmt: str, dtype: np.dtype, order: str) -> None:
    """code * scale in 16 bits (mul2 of a decoded pair with the table) is exact for every code and
    every scale byte in use: all 256 E4M3 bytes; for MXFP4 the widest byte range the shift of
    mx_scale_shift accepts, at both ends of the exponent range."""
    codes = np.repeat(np.arange(16, dtype=np.uint32)[:, None], 8, axis=1)
    bits, exp = _decode(_words_of(codes, order), dtype, order)
    decoded = _as_f64(bits[:, 0], dtype)  # code * 2^exp
    pair = order != "plain"  # the split decoders place the code bits like the pair decoders
    table_shift = 116 if exp == -126 else 0
    is_bf16 = dtype == BF16
    if fmt == "nvfp4":
        cases = [(np.array([b for b in range(256) if b & 0x7F != 0x7F]), 0)]
    else:
        first, last = layouts._MX_INTERVALS[(dtype, pair)]
        width = last - first
        cases = []
        for lo in (0, 127 - width // 2, 254 - width):
            shift = layouts.mx_scale_shift((lo, lo + width), dtype, pair)
            assert shift is not None
            cases.append((np.arange(lo, lo + width + 1), shift))
        assert layouts.mx_scale_shift((0, width + 1), dtype, pair) is None  # one wider: batched
    for scale_bytes, shift in cases:
        table = _table_value(fmt, dtype, scale_bytes, table_shift + shift)
        product = decoded[:, None] * table[None, :]  # exact in float64
        assert _exact_in(table, dtype, normal=False).all()
        assert _exact_in(product, dtype, normal=is_bf16).all()
        from cupymoe.formats import Fp4Format

        scales = Fp4Format.parse(fmt).decode_scales(scale_bytes.astype(np.uint8)).astype(np.float64)
        want = E2M1_VALUES[np.arange(16)].astype(np.float64)[:, None] * scales[None, :]
        post = -(exp + table_shift + shift)
        np.testing.assert_array_equal(product * 2.0**post, want)


def _emulate_kernel(
    x: np.ndarray, mats: list[Fp4Experts], offsets: np.ndarray, order: str, dtype: np.dtype
) -> list[np.ndarray]:
    """The kernel's index math in NumPy: padded packed rows (plain, pair) or the split layout's
    bytes at [e, tile, chunk, row in tile], scales from tile_scales at the byte a lane (g, t)
    reads for its rows g / g + 8, the decoders, the scale table and the epilogue's power of two.
    Returns the weight rows' dot products with x, per matrix."""
    w0 = mats[0]
    block, k, n = w0.block_size, w0.k, w0.n
    per_chunk = 32 // block
    pair = order != "plain"
    packed = [
        layouts.pad_packed(to_pair_interleaved(m.packed) if pair else m.packed, k) for m in mats
    ]
    tiled = layouts.tile_scales([m.scales for m in mats], k, block)
    shift = layouts.mx_scale_shift(
        layouts._scale_range_host([m.scales for m in mats], w0.format), dtype, pair
    )
    assert shift is not None
    chunks = packed[0].shape[2] // 16
    x_pad = np.zeros((x.shape[0], chunks * 32))
    x_pad[:, :k] = x
    rows_per_tile = 16 // len(mats)
    split = [
        layouts.gemv_layout(to_pair_interleaved(m.packed), k, True, rows_per_tile) for m in mats
    ]
    outs = [np.zeros((x.shape[0], n)) for _ in mats]
    for e in np.flatnonzero(np.diff(offsets)):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        for col in range(n):
            tile, r = divmod(col, rows_per_tile)
            for m, mat in enumerate(mats):
                half, g = (m, r) if len(mats) == 2 else divmod(r, 8)
                if order == "split":  # [E, tiles, chunks, slots, 16]: row r at its slot
                    at = layouts.split_slot(r, np.arange(chunks))
                    words = np.ascontiguousarray(split[m][e, tile, np.arange(chunks), at])
                    words = words.view("<u4").reshape(-1)
                else:
                    words = np.ascontiguousarray(packed[m][e, col]).view("<u4")
                bits, exp = _decode(words, dtype, order)
                table_shift = 116 if exp == -126 else 0
                row_bytes = tiled[
                    e, tile, :, (g * 2 + half) * per_chunk : (g * 2 + half + 1) * per_chunk
                ]
                table = _table_value(
                    w0.format.value, dtype, row_bytes.reshape(-1), table_shift + shift
                )
                a = _as_f64(bits.reshape(-1), dtype) * np.repeat(table, block)
                post = 2.0 ** -(exp + table_shift + shift)
                outs[m][lo:hi, col] = (x_pad[lo:hi] @ a) * post * float(mat.global_scale[e])
    return outs


@pytest.mark.parametrize("fmt, k", [("nvfp4", 48), ("nvfp4", 64), ("nvfp4", 112), ("mxfp4", 96)])
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
def test_kernel_layouts_emulated(
    fmt: str, k: int, order: str, dtype: np.dtype, rng: np.random.Generator
) -> None:
    from cupymoe.presets import random_fp4_experts

    n, e = 19, 3  # N not a multiple of the 8- or 16-row tiles
    mats = [random_fp4_experts(rng, e, n, k, fmt) for _ in range(2)]
    x = rng.standard_normal((5, k))
    offsets = np.array([0, 2, 2, 5])
    for used in (mats, mats[:1]):  # FC1 (gate, up) and FC2 tilings
        got = _emulate_kernel(x, used, offsets, order, dtype)
        for m, out in zip(used, got, strict=True):
            np.testing.assert_allclose(out, fc2_ref(x, m, offsets), rtol=1e-12, atol=1e-12)


def test_gemv_layout_shape_and_padding(rng: np.random.Generator) -> None:
    """[E, tiles, chunks, rows, 16]: zero rows past N in the last tile, zero codes past K."""
    from cupymoe.presets import random_fp4_experts

    w = random_fp4_experts(rng, 2, 19, 48, "nvfp4")  # 19 rows: 2 tiles of 16; K 48: 2 chunks
    lay = layouts.gemv_layout(w.packed, 48, False, 16)
    assert lay.shape == (2, 2, 2, 16, 16) and lay.dtype == np.uint8
    for c in range(2):  # rows 19..31 (tile 1, rows 3..15) are zero, wherever they sit
        assert not lay[:, 1, c, layouts.split_slot(np.arange(3, 16), c)].any()
        assert lay[:, 1, c, layouts.split_slot(np.arange(3), c)].any()
    assert not lay[:, :, 1, :, 8:].any()  # codes 48..63
    padded = layouts.pad_packed(w.packed, 48)
    for c, row in ((0, 5), (1, 13)):  # expert 1: codes 32c .. 32c + 31 of the row, split order
        got = np.ascontiguousarray(lay[1, 0, c, layouts.split_slot(row, c)]).view("<u4")
        want = np.ascontiguousarray(padded[1, row, 16 * c : 16 * c + 16]).view("<u4")
        assert got.tolist() == layouts.split_words(want, False).tolist()


def test_split_slots_are_conflict_free() -> None:
    """The eight lanes of a quarter warp (g in {2p, 2p+1}, t in 0..3, chunk 4j + t) load eight
    different 16-byte bank groups (address / 16 mod 8), for 8- and 16-row tiles, and each chunk's
    slots are a permutation of its rows."""
    for rows in (8, 16):
        for c in range(4):
            assert sorted(layouts.split_slot(np.arange(rows), c).tolist()) == list(range(rows))
        for half in range(rows // 8):
            for p in range(4):
                groups = {
                    (t * rows + layouts.split_slot(8 * half + g, 4 + t)) % 8
                    for g in (2 * p, 2 * p + 1)
                    for t in range(4)
                }
                assert len(groups) == 8, (rows, half, p)


def test_expert_bytes_limit() -> None:
    """32-bit lane offsets: an expert of 4 GiB or more is refused before any kernel runs."""
    layouts.check_expert_bytes(131072, 65504, "w")  # 131072 x 2047 chunks x 16 bytes < 2^32
    with pytest.raises(ValueError, match="less than 4 GiB per expert"):
        layouts.check_expert_bytes(131072, 65536, "w")  # exactly 2^32 bytes
    with pytest.raises(ValueError, match="w: one expert"):
        layouts.check_expert_bytes(200000, 50000, "w")  # 5.0e9 bytes


def test_weight_order_dispatch(rng: np.random.Generator) -> None:
    """prepare's choice of kernel bytes and kOrder: the split copy (8 / 16-row tiles) or the
    native bytes (padded to whole chunks) in their own order; every order has its kernels."""
    from types import SimpleNamespace

    from cupymoe.presets import random_fp4_experts

    w = random_fp4_experts(rng, 2, 24, 48, "nvfp4")
    for pair in (False, True):
        packed = to_pair_interleaved(w.packed) if pair else w.packed
        dev = SimpleNamespace(packed=packed, k=48, pair_interleaved=pair)
        for rows in (8, 16):
            got = gemv._kernel_weights(dev, WeightLayout.SPLIT, rows)  # type: ignore[arg-type]
            assert WeightLayout.SPLIT.value == 2
            assert got.tobytes() == layouts.gemv_layout(packed, 48, pair, rows).tobytes()
        native = WeightLayout.PAIR if pair else WeightLayout.PLAIN
        got = gemv._kernel_weights(dev, native, 16)  # type: ignore[arg-type]
        assert native.value == (1 if pair else 0)
        assert got.tobytes() == layouts.pad_packed(packed, 48).tobytes()
    assert layouts.DEFAULT_LAYOUT is WeightLayout.SPLIT
    orders = {spec.args[2] for spec in gemv.kernel_specs()}
    assert orders == {0, 1, 2}
    # FC2 + 3 gated and 4 non-gated FC1 activations
    assert len(gemv.kernel_specs()) == 2 * 2 * 3 * len(TILINGS) * 2 * (1 + len(Activation))


def test_tile_scales_layout() -> None:
    # FC2: [E=1, N=16, 2 blocks] -> tile 0, chunk 0, lane row g: bytes (row g, row g + 8)
    s = np.arange(32, dtype=np.uint8).reshape(1, 16, 2)
    t = layouts.tile_scales([s], 32, 16)
    assert t.shape == (1, 1, 1, 32)
    assert t[0, 0, 0, :8].tolist() == [0, 1, 16, 17, 2, 3, 18, 19]
    # FC1: gate and up rows of the same column side by side; N = 9 -> 2 tiles, zero past N
    g, u = (
        np.arange(9, dtype=np.uint8)[None, :, None],
        100 + np.arange(9, dtype=np.uint8)[None, :, None],
    )
    t = layouts.tile_scales([g, u], 32, 32)
    assert t.shape == (1, 2, 1, 16)
    assert t[0, 0, 0, :6].tolist() == [0, 100, 1, 101, 2, 102]
    assert t[0, 1, 0, :4].tolist() == [8, 108, 0, 0]


# ---- GPU ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    fmt: str
    dtype: np.dtype
    order: str  # ORDERS: plain / pair = the DeviceFp4 bytes (layouts PLAIN, PAIR), split
    bias: bool
    n: int  # output columns (I for fc1, H for fc2)
    k: int
    n_experts: int
    n_tokens: int
    top_k: int
    act: str = "swiglu"

    def __str__(self) -> str:
        return (
            f"{self.fmt}-{self.dtype.name}-{self.order}-"
            f"{'bias' if self.bias else 'nobias'}-{self.act}-N{self.n}K{self.k}E{self.n_experts}"
            f"-M{self.n_tokens}x{self.top_k}"
        )


def _cases() -> list[Case]:
    cases = []
    for fmt in ("nvfp4", "mxfp4"):
        for dtype in (BF16, np.dtype(np.float16)):
            for order in ORDERS:
                for bias in (False, True):
                    for i, act in enumerate(("swiglu", "geglu", "swiglu_oai")):
                        # 3 chunks (odd for the two-chunk unroll); NVFP4 176 = 5.5 chunks (padded)
                        k = (96, 176, 64)[i] if fmt == "nvfp4" else (96, 160, 64)[i]
                        cases.append(Case(fmt, dtype, order, bias, 40 + 8 * i, k, 6, 3, 2, act))
    block = 16
    edge = [
        Case("nvfp4", BF16, "plain", False, 1, block, 2, 1, 1),  # smallest N and K
        Case("mxfp4", BF16, "pair", True, 1, 32, 2, 1, 1),  # smallest MXFP4 K
        Case("nvfp4", BF16, "pair", True, 37, 48, 4, 2, 2),  # K % 32 = 16 (padded), odd N
        Case("nvfp4", np.dtype(np.float16), "plain", True, 5, 1040, 4, 2, 2),  # 33 chunks
        Case("mxfp4", BF16, "plain", False, 64, 64, 8, 8, 8),  # 64 rows: the window, 8 per expert
        Case("nvfp4", BF16, "plain", False, 128, 256, 3, 2, 1),  # 2 tokens on 3 experts
        Case("nvfp4", BF16, "plain", True, 512, 2048, 8, 4, 8, "swiglu"),  # Qwen, E=8
        Case("mxfp4", BF16, "plain", True, 2880, 2880, 8, 1, 4, "swiglu_oai"),  # gpt-oss
        Case("mxfp4", np.dtype(np.float16), "pair", True, 2880, 2880, 8, 2, 4, "swiglu_oai"),
        Case("nvfp4", BF16, "plain", False, 2048, 7168, 8, 1, 8),  # DeepSeek FC1 (N = I)
        Case("nvfp4", BF16, "plain", True, 2048, 512, 8, 4, 8),  # Qwen FC2 shape (N = H)
        Case("nvfp4", np.dtype(np.float16), "plain", False, 7168, 2048, 8, 2, 8),  # DeepSeek FC2
    ]
    # ... and each again in the split layout (the default), whose tiles pad N to 8 / 16 rows
    cases += edge + [dataclasses.replace(c, order="split") for c in edge]
    return cases


CASES = _cases()


def _setup(case: Case, rng: np.random.Generator, *, n_mats: int, k: int, n: int):  # type: ignore[no-untyped-def]
    from cupymoe.presets import random_fp4_experts
    from cupymoe.routing import random_routing

    mats = [random_fp4_experts(rng, case.n_experts, n, k, case.fmt) for _ in range(n_mats)]
    routing = random_routing(rng, case.n_tokens, case.top_k, case.n_experts)
    biases = [
        rng.standard_normal((case.n_experts, n)).astype(np.float32) if case.bias else None
        for _ in range(n_mats)
    ]
    return mats, routing, biases


def _layout_kwargs(order: str) -> dict[str, object]:
    """prepare_fc1 / prepare_fc2 arguments of a test order."""
    return {"layout": WeightLayout.parse(order)}


def _run_fc1(case: Case, rng: np.random.Generator, x_scale: float = 1.0):  # type: ignore[no-untyped-def]
    import cupy

    (gate, up), routing, (bg, bu) = _setup(case, rng, n_mats=2, k=case.k, n=case.n)
    act = ActivationSpec(case.act, alpha=1.702, limit=7.0)
    x = (rng.standard_normal((case.n_tokens, case.k)) * x_scale).astype(case.dtype)
    prepared = gemv.prepare_fc1(gate, up, gate_bias=bg, up_bias=bu, **_layout_kwargs(case.order))
    rows = case.n_tokens * case.top_k
    out = cupy.full((rows, case.n), np.nan, dtype=case.dtype)
    got = dispatch.fc1(cupy.asarray(x), prepared, routing, act=act, out=out)
    assert got is out
    x_sorted = x.astype(np.float64)[routing.sorted_rows.get() // case.top_k]
    ref = fc1_ref(
        x_sorted, gate, up, routing.expert_offsets.get(), act=act, gate_bias=bg, up_bias=bu
    )
    return ref, out, (x, prepared, routing, act)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=str)
def test_fc1_matches_reference(case: Case, rng: np.random.Generator) -> None:
    ref, out, _ = _run_fc1(case, rng)
    max_rel, rms_rel = tolerance_for(case.dtype)
    assert_close(ref, out, max_rel=max_rel, rms_rel=rms_rel, name=f"fc1 {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.act == "swiglu"], ids=str)
def test_fc2_matches_reference(case: Case, rng: np.random.Generator) -> None:
    import cupy

    (down,), routing, (bias,) = _setup(case, rng, n_mats=1, k=case.k, n=case.n)
    rows = case.n_tokens * case.top_k
    h = rng.standard_normal((rows, case.k)).astype(case.dtype)
    prepared = gemv.prepare_fc2(down, bias=bias, **_layout_kwargs(case.order))
    out = cupy.full((rows, case.n), np.nan, dtype=case.dtype)
    dispatch.fc2(cupy.asarray(h), prepared, routing, out=out)
    ref = fc2_ref(h.astype(np.float64), down, routing.expert_offsets.get(), bias=bias)
    max_rel, rms_rel = tolerance_for(case.dtype)
    assert_close(ref, out, max_rel=max_rel, rms_rel=rms_rel, name=f"fc2 {case}")
    again = dispatch.fc2(cupy.asarray(h), prepared, routing)
    assert out.tobytes() == again.tobytes(), "fc2 is not bitwise deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=str)
def test_weight_orders_are_bitwise_equal(fmt: str, dtype: np.dtype) -> None:
    """Plain, pair-interleaved and split decode to the same values: same bits out."""
    case = Case(fmt, dtype, "plain", True, 96, 256, 4, 3, 2, "geglu")
    _, plain, _ = _run_fc1(case, np.random.default_rng(5))
    for order in ("pair", "split"):
        _, other, _ = _run_fc1(dataclasses.replace(case, order=order), np.random.default_rng(5))
        assert plain.tobytes() == other.tobytes(), order


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp16_large_activations_do_not_overflow(fmt: str, rng: np.random.Generator) -> None:
    # |x| ~ 2e4: an unscaled product code * x (up to 6 * 2e4 = 1.2e5) overflows fp16; the
    # scaled outputs stay in range because the weights are small.
    import cupy

    case = Case(fmt, np.dtype(np.float16), False, False, 64, 512, 4, 2, 2)
    (down,), routing, _ = _setup(case, rng, n_mats=1, k=case.k, n=case.n)
    if fmt == "nvfp4":
        down = dataclasses.replace(down, global_scale=down.global_scale * np.float32(2**-6))
    else:
        down = dataclasses.replace(down, scales=(down.scales - 6).astype(np.uint8))
    h = (rng.standard_normal((4, case.k)) * 1e4).astype(np.float16)
    assert np.abs(h).max() * 6 > 65504  # code * x alone would overflow fp16
    out = dispatch.fc2(cupy.asarray(h), gemv.prepare_fc2(down), routing)
    ref = fc2_ref(h.astype(np.float64), down, routing.expert_offsets.get())
    assert np.abs(ref).max() < 6e4
    assert_close(ref, out, max_rel=4e-3, rms_rel=2e-3, name="fp16 large x")


@pytest.mark.gpu
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("span", ["shifted", "too-wide"])
def test_mxfp4_fp16_scale_range(span: str, order: str, rng: np.random.Generator) -> None:
    """fp16 activations fold MXFP4 scales exactly only inside a window of exponents: scales near
    2^-32 need the kernel's scale shift; a range wider than the window takes the batched path.
    Both must match the reference (and the shift must really be used / the path really taken)."""
    import cupy

    fp16 = np.dtype(np.float16)
    pair = order != "plain"
    case = Case("mxfp4", fp16, order, False, 48, 256, 4, 3, 2)
    (down,), routing, _ = _setup(case, rng, n_mats=1, k=case.k, n=case.n)
    scales = down.scales.astype(np.int64)
    if span == "shifted":  # exponents ~ 2^-32: below the fp16 window, the shift moves them in
        scales = scales - 30
        down = dataclasses.replace(
            down,
            scales=scales.astype(np.uint8),
            global_scale=np.full(case.n_experts, 2.0**30, np.float32),
        )
    else:  # one block at 2^-67 next to ordinary ones: no shift folds both exactly in fp16
        scales[0, 0, 0] = 60
        down = dataclasses.replace(down, scales=scales.astype(np.uint8))
    prepared = gemv.prepare_fc2(down, **_layout_kwargs(order))
    shift = layouts.mx_scale_shift(prepared.scale_range, fp16, pair)
    if span == "shifted":
        assert shift is not None and shift > 0
    else:
        assert (
            shift is None and layouts.mx_scale_shift(prepared.scale_range, BF16, pair) is not None
        )
    rows = case.n_tokens * case.top_k
    h = rng.standard_normal((rows, case.k)).astype(fp16)
    out = cupy.full((rows, case.n), np.nan, dtype=fp16)
    dispatch.fc2(cupy.asarray(h), prepared, routing, out=out)
    ref = fc2_ref(h.astype(np.float64), down, routing.expert_offsets.get())
    max_rel, rms_rel = tolerance_for(fp16)
    assert_close(ref, out, max_rel=max_rel, rms_rel=rms_rel, name=f"fc2 {span}")


@pytest.mark.gpu
def test_fc1_deterministic_and_config_override(rng: np.random.Generator) -> None:
    from cupymoe.experts.config import GemvConfig

    case = Case("nvfp4", BF16, "split", True, 96, 1024, 4, 4, 2)
    ref, out, (x, prepared, routing, act) = _run_fc1(case, rng)
    import cupy

    for cta_n, threads in TILINGS:
        cfg = GemvConfig(cta_n, threads)
        a = dispatch.fc1(cupy.asarray(x), prepared, routing, act=act, config=cfg)
        b = dispatch.fc1(cupy.asarray(x), prepared, routing, act=act, config=cfg)
        assert a.tobytes() == b.tobytes()
        assert_close(ref, a, max_rel=1.6e-2, rms_rel=8e-3, name=f"fc1 {cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens, top_k", [(65, 1), (64, 8)])  # 65 and 512 expanded rows
def test_above_window_uses_batched_path(
    n_tokens: int, top_k: int, rng: np.random.Generator
) -> None:
    pytest.importorskip("cupymoe.experts.batched")
    case = Case("nvfp4", BF16, "split", True, 64, 128, 8, n_tokens, top_k)
    ref, out, _ = _run_fc1(case, rng)
    assert_close(ref, out, max_rel=1.6e-2, rms_rel=8e-3, name="fc1 65 rows")


@pytest.mark.gpu
def test_gpu_input_errors(rng: np.random.Generator) -> None:
    import cupy

    case = Case("nvfp4", BF16, "plain", False, 32, 64, 4, 2, 2)
    _, _, (x, prepared, routing, act) = _run_fc1(case, rng)
    xg = cupy.asarray(x)
    with pytest.raises(TypeError, match="x: expected dtype"):
        dispatch.fc1(xg.astype(cupy.float32), prepared, routing, act=act)
    with pytest.raises(ValueError, match="x: expected shape"):
        dispatch.fc1(xg[:, :32], prepared, routing, act=act)
    with pytest.raises(ValueError, match="routing.topk_ids"):
        dispatch.fc1(cupy.concatenate([xg, xg]), prepared, routing, act=act)
    with pytest.raises(ValueError, match="out"):
        dispatch.fc1(xg, prepared, routing, act=act, out=cupy.empty((4, 31), dtype=xg.dtype))
    with pytest.raises(TypeError, match="act"):
        dispatch.fc1(xg, prepared, routing, act="swiglu")
    with pytest.raises(TypeError, match="config"):
        dispatch.fc1(xg, prepared, routing, act=act, config=(16, 128))
