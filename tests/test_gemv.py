# SPDX-License-Identifier: Apache-2.0
"""FP4 GEMV: references on hand-computed cases (CPU), the kernel's decode identity (CPU), and
the fc1 / fc2 kernels against fc1_ref / gemv_ref (GPU)."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

from cupymoe import gemv
from cupymoe.formats import E2M1_VALUES, Fp4Experts, pack_fp4, to_pair_interleaved
from cupymoe.gemv import Activation, ActivationSpec, activation_ref, fc1_ref, gemv_ref
from cupymoe.testing import assert_close, tolerance_for

BF16 = np.dtype(ml_dtypes.bfloat16)
SWIGLU = ActivationSpec(Activation.SWIGLU)


# ---- activations (CPU) -------------------------------------------------------------------------
def test_activation_parse() -> None:
    assert Activation.parse("SwiGLU") is Activation.SWIGLU
    assert ActivationSpec("geglu").kind is Activation.GEGLU
    with pytest.raises(ValueError, match="swiglu_oai"):
        Activation.parse("relu")
    with pytest.raises(ValueError, match="limit"):
        ActivationSpec("swiglu_oai", limit=0.0)
    with pytest.raises(TypeError, match="alpha"):
        ActivationSpec("swiglu", alpha="1")  # type: ignore[arg-type]


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


def test_gemv_ref_hand_computed() -> None:
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
    out = gemv_ref(x, w, offsets)
    assert out.tolist() == [[1 + 3 + 18 - 4, 4.0], [0.0, -36.0], [0.0, 72.0]]
    bias = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert gemv_ref(x, w, offsets, bias=bias).tolist() == [[19.0, 6.0], [3.0, -32.0], [3.0, 76.0]]


def test_fc1_ref_is_activation_of_two_gemvs(rng: np.random.Generator) -> None:
    gate = Fp4Experts.quantize(rng.standard_normal((3, 8, 32)), "mxfp4")
    up = Fp4Experts.quantize(rng.standard_normal((3, 8, 32)), "mxfp4")
    x = rng.standard_normal((5, 32))
    off = np.array([0, 2, 2, 5])
    bg, bu = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
    act = ActivationSpec("swiglu_oai", limit=1.5)
    ref = activation_ref(gemv_ref(x, gate, off, bias=bg), gemv_ref(x, up, off, bias=bu), act)
    np.testing.assert_array_equal(fc1_ref(x, gate, up, off, act=act, gate_bias=bg, up_bias=bu), ref)
    # dense check of one row against the dequantized weights
    dense = gate.dequantize(np.float64)
    np.testing.assert_allclose(gemv_ref(x, gate, off)[3], dense[2] @ x[3], rtol=1e-12)


def test_reference_input_errors(rng: np.random.Generator) -> None:
    w = Fp4Experts.quantize(rng.standard_normal((2, 4, 32)), "nvfp4")
    x = np.zeros((3, 32))
    with pytest.raises(ValueError, match="expert_offsets"):
        gemv_ref(x, w, np.array([0, 1, 2]))  # ends at 2, not 3
    with pytest.raises(ValueError, match="expert_offsets"):
        gemv_ref(x, w, np.array([0, 1]))
    with pytest.raises(ValueError, match="x_sorted"):
        gemv_ref(np.zeros((3, 16)), w, np.array([0, 1, 3]))
    with pytest.raises(ValueError, match="bias"):
        gemv_ref(x, w, np.array([0, 1, 3]), bias=np.zeros((2, 5)))


# ---- the kernel's decode identity (CPU transcription of decode_word in gemv_fp4.cu) ---------
def _decode_word(w: np.ndarray) -> np.ndarray:
    """[..] uint32 words -> [.., 8] values (times 2^14), slot order, as the kernel computes them."""
    w = w.astype(np.uint32)
    keep = np.uint32(0x8E008E00)
    even, odd = w & np.uint32(0x0F0F0F0F), w & np.uint32(0xF0F0F0F0)
    pairs = [
        ((even << 9) | (even << 12)) & keep,
        ((odd << 5) | (odd << 8)) & keep,
        ((even << 1) | (even << 4)) & keep,
        ((odd >> 3) | odd) & keep,
    ]
    out = np.empty((*w.shape, 8))
    for j, h in enumerate(pairs):
        out[..., j] = (h & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
        out[..., j + 4] = (h >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return out * 2.0**14


def test_decode_word_identity(rng: np.random.Generator) -> None:
    codes = np.concatenate(
        [
            np.repeat(np.arange(16, dtype=np.uint32), 8).reshape(16, 8),  # every code in every slot
            rng.integers(0, 16, size=(4096, 8), dtype=np.uint32),
        ]
    )
    words = np.zeros(codes.shape[0], np.uint32)
    for s in range(8):
        words |= codes[:, s] << np.uint32(4 * s)
    got = _decode_word(words)
    want = E2M1_VALUES[codes].astype(np.float64)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))  # -0 for code 0x8


def _slot_of(i: int, pair: bool) -> int:  # slot_of<kPairInterleaved> in gemv_fp4.cu
    return (i >> 1) + ((i & 1) << 2) if pair else i


def _emulate_kernel(
    x: np.ndarray, mats: list[Fp4Experts], offsets: np.ndarray, rows_per_mat: int, pair: bool
) -> list[np.ndarray]:
    """The kernel's index math in NumPy: padded packed rows, tiled scales (byte g * S + b of the
    tile's vector), slot order per nibble order, per-block scaling, global scale at the end."""
    w0 = mats[0]
    block, k, n = w0.block_size, w0.k, w0.n
    per_chunk = 32 // block
    packed = [gemv.pad_packed(to_pair_interleaved(m.packed) if pair else m.packed, k) for m in mats]
    tiled = gemv.tile_scales([m.scales for m in mats], k, block, rows_per_mat)
    table = w0.format.decode_scales(np.arange(256, dtype=np.uint8)).astype(np.float64)
    chunks = packed[0].shape[2] // 16
    x_pad = np.zeros((x.shape[0], chunks * 32))
    x_pad[:, :k] = x
    order = [_slot_of(i, pair) for i in range(8)]
    outs = [np.zeros((x.shape[0], n)) for _ in mats]
    for e in np.flatnonzero(np.diff(offsets)):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        for col in range(n):
            tile, j = divmod(col, rows_per_mat)
            for m, mat in enumerate(mats):
                words = np.ascontiguousarray(packed[m][e, col]).view("<u4")
                values = _decode_word(words)[:, order].reshape(-1)  # logical k order
                g = m * rows_per_mat + j
                scale_bytes = tiled[e, tile, :, g * per_chunk : (g + 1) * per_chunk]
                scales = np.repeat(table[scale_bytes.reshape(-1)], block)
                dot = x_pad[lo:hi] @ (values * scales)
                outs[m][lo:hi, col] = dot * float(mat.global_scale[e])
    return outs


@pytest.mark.parametrize("fmt, k", [("nvfp4", 48), ("nvfp4", 64), ("mxfp4", 96)])
@pytest.mark.parametrize("pair", [False, True])
def test_kernel_layouts_emulated(fmt: str, k: int, pair: bool, rng: np.random.Generator) -> None:
    from cupymoe.presets import random_fp4_experts

    n, e = 7, 3  # N not a multiple of the 2- or 4-row tiles
    mats = [random_fp4_experts(rng, e, n, k, fmt) for _ in range(2)]
    x = rng.standard_normal((5, k))
    offsets = np.array([0, 2, 2, 5])
    for rows_per_mat, used in ((2, mats), (4, mats[:1])):  # FC1 (gate, up) and FC2 tilings
        got = _emulate_kernel(x, used, offsets, rows_per_mat, pair)
        for m, out in zip(used, got, strict=True):
            np.testing.assert_allclose(out, gemv_ref(x, m, offsets), rtol=1e-12, atol=1e-12)


# ---- GPU ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    fmt: str
    dtype: np.dtype
    pair: bool
    bias: bool
    n: int  # output columns (I for fc1, H for fc2)
    k: int
    n_experts: int
    n_tokens: int
    top_k: int
    act: str = "swiglu"

    def __str__(self) -> str:
        return (
            f"{self.fmt}-{self.dtype.name}-{'pair' if self.pair else 'plain'}-"
            f"{'bias' if self.bias else 'nobias'}-{self.act}-N{self.n}K{self.k}E{self.n_experts}"
            f"-M{self.n_tokens}x{self.top_k}"
        )


def _cases() -> list[Case]:
    cases = []
    for fmt in ("nvfp4", "mxfp4"):
        for dtype in (BF16, np.dtype(np.float16)):
            for pair in (False, True):
                for bias in (False, True):
                    for i, act in enumerate(("swiglu", "geglu", "swiglu_oai")):
                        # 3 chunks (odd for the two-chunk unroll); NVFP4 176 = 5.5 chunks (padded)
                        k = (96, 176, 64)[i] if fmt == "nvfp4" else (96, 160, 64)[i]
                        cases.append(Case(fmt, dtype, pair, bias, 40 + 8 * i, k, 6, 3, 2, act))
    block = 16
    cases += [
        Case("nvfp4", BF16, False, False, 1, block, 2, 1, 1),  # smallest N and K
        Case("mxfp4", BF16, True, True, 1, 32, 2, 1, 1),  # smallest MXFP4 K
        Case("nvfp4", BF16, True, True, 37, 48, 4, 2, 2),  # K % 32 = 16 (padded), odd N
        Case("nvfp4", np.dtype(np.float16), False, True, 5, 1040, 4, 2, 2),  # 33 chunks
        Case("mxfp4", BF16, False, False, 64, 64, 8, 8, 8),  # 64 rows: the window, 8 per expert
        Case("nvfp4", BF16, False, False, 128, 256, 3, 2, 1),  # 2 tokens on 3 experts
        Case("nvfp4", BF16, False, True, 512, 2048, 8, 4, 8, "swiglu"),  # Qwen, E=8
        Case("mxfp4", BF16, False, True, 2880, 2880, 8, 1, 4, "swiglu_oai"),  # gpt-oss
        Case("mxfp4", np.dtype(np.float16), True, True, 2880, 2880, 8, 2, 4, "swiglu_oai"),
        Case("nvfp4", BF16, False, False, 2048, 7168, 8, 1, 8),  # DeepSeek FC1 (N = I)
        Case("nvfp4", BF16, False, True, 2048, 512, 8, 4, 8),  # Qwen FC2 shape (N = H)
        Case("nvfp4", np.dtype(np.float16), False, False, 7168, 2048, 8, 2, 8),  # DeepSeek FC2
    ]
    return cases


CASES = _cases()


def _setup(case: Case, rng: np.random.Generator, *, n_mats: int, k: int, n: int):  # type: ignore[no-untyped-def]
    from cupymoe.presets import random_fp4_experts
    from cupymoe.tune import random_routing

    mats = [random_fp4_experts(rng, case.n_experts, n, k, case.fmt) for _ in range(n_mats)]
    routing = random_routing(rng, case.n_tokens, case.top_k, case.n_experts)
    biases = [
        rng.standard_normal((case.n_experts, n)).astype(np.float32) if case.bias else None
        for _ in range(n_mats)
    ]
    return mats, routing, biases


def _run_fc1(case: Case, rng: np.random.Generator, x_scale: float = 1.0):  # type: ignore[no-untyped-def]
    import cupy

    (gate, up), routing, (bg, bu) = _setup(case, rng, n_mats=2, k=case.k, n=case.n)
    act = ActivationSpec(case.act, alpha=1.702, limit=7.0)
    x = (rng.standard_normal((case.n_tokens, case.k)) * x_scale).astype(case.dtype)
    prepared = gemv.prepare_fc1(gate, up, gate_bias=bg, up_bias=bu, pair_interleaved=case.pair)
    rows = case.n_tokens * case.top_k
    out = cupy.full((rows, case.n), np.nan, dtype=case.dtype)
    got = gemv.fc1(cupy.asarray(x), prepared, routing, act=act, out=out)
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
    prepared = gemv.prepare_fc2(down, bias=bias, pair_interleaved=case.pair)
    out = cupy.full((rows, case.n), np.nan, dtype=case.dtype)
    gemv.fc2(cupy.asarray(h), prepared, routing, out=out)
    ref = gemv_ref(h.astype(np.float64), down, routing.expert_offsets.get(), bias=bias)
    max_rel, rms_rel = tolerance_for(case.dtype)
    assert_close(ref, out, max_rel=max_rel, rms_rel=rms_rel, name=f"fc2 {case}")
    again = gemv.fc2(cupy.asarray(h), prepared, routing)
    assert out.tobytes() == again.tobytes(), "fc2 is not bitwise deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=str)
def test_pair_interleaved_is_bitwise_plain(fmt: str, dtype: np.dtype) -> None:
    case = Case(fmt, dtype, False, True, 96, 256, 4, 3, 2, "geglu")
    ref_plain, plain, _ = _run_fc1(case, np.random.default_rng(5))
    _, pair, _ = _run_fc1(dataclasses.replace(case, pair=True), np.random.default_rng(5))
    assert plain.tobytes() == pair.tobytes()


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
    out = gemv.fc2(cupy.asarray(h), gemv.prepare_fc2(down), routing)
    ref = gemv_ref(h.astype(np.float64), down, routing.expert_offsets.get())
    assert np.abs(ref).max() < 6e4
    assert_close(ref, out, max_rel=4e-3, rms_rel=2e-3, name="fp16 large x")


@pytest.mark.gpu
def test_fc1_deterministic_and_config_override(rng: np.random.Generator) -> None:
    from cupymoe.config import TILINGS, GemvConfig

    case = Case("nvfp4", BF16, False, True, 96, 1024, 4, 4, 2)
    ref, out, (x, prepared, routing, act) = _run_fc1(case, rng)
    import cupy

    for cta_n, threads in TILINGS:
        cfg = GemvConfig(cta_n, threads)
        a = gemv.fc1(cupy.asarray(x), prepared, routing, act=act, config=cfg)
        b = gemv.fc1(cupy.asarray(x), prepared, routing, act=act, config=cfg)
        assert a.tobytes() == b.tobytes()
        assert_close(ref, a, max_rel=1.6e-2, rms_rel=8e-3, name=f"fc1 {cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens, top_k", [(65, 1), (64, 8)])  # 65 and 512 expanded rows
def test_above_window_uses_batched_path(
    n_tokens: int, top_k: int, rng: np.random.Generator
) -> None:
    pytest.importorskip("cupymoe.batched")
    case = Case("nvfp4", BF16, False, True, 64, 128, 8, n_tokens, top_k)
    ref, out, _ = _run_fc1(case, rng)
    assert_close(ref, out, max_rel=1.6e-2, rms_rel=8e-3, name="fc1 65 rows")


@pytest.mark.gpu
def test_gpu_input_errors(rng: np.random.Generator) -> None:
    import cupy

    case = Case("nvfp4", BF16, False, False, 32, 64, 4, 2, 2)
    _, _, (x, prepared, routing, act) = _run_fc1(case, rng)
    xg = cupy.asarray(x)
    with pytest.raises(TypeError, match="x: expected dtype"):
        gemv.fc1(xg.astype(cupy.float32), prepared, routing, act=act)
    with pytest.raises(ValueError, match="x: expected shape"):
        gemv.fc1(xg[:, :32], prepared, routing, act=act)
    with pytest.raises(ValueError, match="routing.topk_ids"):
        gemv.fc1(cupy.concatenate([xg, xg]), prepared, routing, act=act)
    with pytest.raises(ValueError, match="out"):
        gemv.fc1(xg, prepared, routing, act=act, out=cupy.empty((4, 31), dtype=xg.dtype))
    with pytest.raises(TypeError, match="act"):
        gemv.fc1(xg, prepared, routing, act="swiglu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config"):
        gemv.fc1(xg, prepared, routing, act=act, config=(16, 128))  # type: ignore[arg-type]
