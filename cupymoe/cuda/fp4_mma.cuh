// SPDX-License-Identifier: Apache-2.0
// FP4 weight decode and tensor-core helpers shared by the GEMV (gemv_fp4.cu) and the grouped
// GEMM (gemm_fp4.cu): the E2M1 decoders of the three nibble orders into 16-bit pairs, the exact
// 16-bit block-scale multiply and its scale table, mma.sync m16n8k16 with fp32 accumulators, and
// the activations (gated and not). Every function is exact as described where it is defined; the
// numerics contract they implement is stated in gemv_fp4.cu's header. The loader inlines this file.
#pragma once

#include "common.cuh"

namespace {

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// Nibble orders (kOrder): plain and SM80 pair-interleaved words in row-major [E, N, chunks * 16]
// (the DeviceFp4 bytes themselves), or the split order of the tiled layout that the GEMV and the
// grouped GEMM read (experts/layouts.py: gemv_layout).
constexpr int kPlain = 0, kPair = 1, kSplit = 2;

// ---- decoders: one 32-bit word (8 codes) -> h[4] = 16-bit pairs (e0,e1) (e2,e3) (e4,e5) (e6,e7),
// element 2i in the low half. kExp: the decoded value is code * 2^kExp.
template <typename T, int kOrder> struct Decoder;

// Plain order (element i in nibble i). mag keeps 3 bits per nibble (bit 3 clear: prmt stays in
// byte-select mode), sgn is 0/1 per nibble; one prmt looks up four magnitude bytes, one more the
// four sign bytes.
template <> struct Decoder<__half, kPlain> {
    static constexpr int kExp = 0;
    __device__ __forceinline__ static void run(uint32_t w, uint32_t (&h)[4]) {
        const uint32_t mag = w & 0x77777777u;
        const uint32_t sgn = (w >> 3) & 0x11111111u;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            // fp16 high bytes of {0, .5, 1, 1.5, 2, 3, 4, 6}; the low bytes are all zero.
            const uint32_t hb = prmt(0x3E3C3800u, 0x46444240u, mag >> (16 * j)) |
                                prmt(0x00008000u, 0u, sgn >> (16 * j));
            h[2 * j] = prmt(hb, 0u, 0x1404u);      // {0, hb0, 0, hb1}
            h[2 * j + 1] = prmt(hb, 0u, 0x3424u);  // {0, hb2, 0, hb3}
        }
    }
};
template <> struct Decoder<__nv_bfloat16, kPlain> {
    static constexpr int kExp = 0;
    __device__ __forceinline__ static void run(uint32_t w, uint32_t (&h)[4]) {
        const uint32_t mag = w & 0x77777777u;
        const uint32_t sgn = (w >> 3) & 0x11111111u;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const uint32_t sel = mag >> (16 * j);
            const uint32_t hb = prmt(0x3F3F3F00u, 0x40404040u, sel) |  // bf16 high bytes
                                prmt(0x00008000u, 0u, sgn >> (16 * j));
            const uint32_t lb = prmt(0xC0800000u, 0xC0804000u, sel);  // bf16 low bytes
            h[2 * j] = prmt(lb, hb, 0x5140u);      // {lb0, hb0, lb1, hb1}
            h[2 * j + 1] = prmt(lb, hb, 0x7362u);  // {lb2, hb2, lb3, hb3}
        }
    }
};

// Pair-interleaved order: nibble slots hold e0 e2 e4 e6 e1 e3 e5 e7, so slots j and j + 4 are the
// pair (e2j, e2j+1) and one shift pair moves both to their half: sign -> bit 15, magnitude -> the
// exponent's low bits and the top mantissa bit. E2M1's subnormal 0.5 lands on a 16-bit subnormal.
// Left shifts are written as multiplications: ptxas may then issue them as IMAD on the FMA pipe,
// which is otherwise idle here, instead of the ALU pipe that the masks and LOP3s already load.
template <> struct Decoder<__half, kPair> {
    static constexpr int kExp = -14;  // fp16 bias 15 vs E2M1 bias 1
    __device__ __forceinline__ static void run(uint32_t w, uint32_t (&h)[4]) {
        constexpr uint32_t kKeep = 0x8E008E00u;  // bits 15, 9-11 of each half
        const uint32_t even = w & 0x0F0F0F0Fu;  // slots 0, 2, 4, 6
        const uint32_t odd = w & 0xF0F0F0F0u;   // slots 1, 3, 5, 7
        h[0] = ((even * 512u) | (even * 4096u)) & kKeep;  // << 9, << 12
        h[1] = ((odd * 32u) | (odd * 256u)) & kKeep;      // << 5, << 8
        h[2] = ((even * 2u) | (even * 16u)) & kKeep;      // << 1, << 4
        h[3] = ((odd >> 3) | odd) & kKeep;
    }
};
template <> struct Decoder<__nv_bfloat16, kPair> {
    static constexpr int kExp = -126;  // bf16 bias 127 vs E2M1 bias 1
    __device__ __forceinline__ static void run(uint32_t w, uint32_t (&h)[4]) {
        constexpr uint32_t kKeep = 0x81C081C0u;  // bits 15, 6-8 of each half
        // Slot j: magnitude shift 6 - 4j, sign shift 12 - 4j; one pair of slots at a time (a bf16
        // shift of 6 would carry a neighbouring nibble into the sign bit). For slots 0 and 1 both
        // shifts are left shifts whose copies of the masked nibbles share no bit (a copy 6 bits up
        // of a 4-bit nibble ends below the copy 12 bits up): the sum is the OR, one IMAD for two
        // shifts and the OR.
        const uint32_t s0 = w & 0x000F000Fu, s1 = w & 0x00F000F0u;
        const uint32_t s2 = w & 0x0F000F00u, s3 = w & 0xF000F000u;
        h[0] = (s0 * (64u + 4096u)) & kKeep;         // << 6 | << 12
        h[1] = (s1 * (4u + 256u)) & kKeep;           // << 2 | << 8
        h[2] = ((s2 >> 2) | (s2 * 16u)) & kKeep;     // >> 2, << 4
        h[3] = ((s3 >> 6) | s3) & kKeep;
    }
};

// Split order (built by gemv.split_words for this kernel): the bits of element 2p (low half) and
// 2p + 1 (high half) sit where the pair decode wants them with the fewest moves. Per 16-bit half,
// magnitude bits (low first) and sign:
//   pair 0: 6-8, 15    pair 1: 3-5, 12    pair 2: 0-2, 14    pair 3: 9-11, 13
// bf16 (magnitude to 6-8, sign to 15): pair 0 in place; pair 1 one shift (+3 both); pair 2 one
// multiply of disjoint copies (+6 and +1); pair 3 two pieces: 10 instructions per word, against
// 13 for the pair-interleaved order (the floor of an exhaustive search over bit layouts).
// fp16 (magnitude to 9-11): 12 instructions.
template <> struct Decoder<__half, kSplit> {
    static constexpr int kExp = -14;
    __device__ __forceinline__ static void run(uint32_t w, uint32_t (&h)[4]) {
        constexpr uint32_t kKeep = 0x8E008E00u, kMag = 0x0E000E00u, kSign = 0x80008000u;
        const uint32_t w8 = w * 8u;
        h[0] = (w8 & kMag) | (w & kSign);                 // +3, sign in place
        h[1] = ((w * 64u) & kMag) | (w8 & kSign);         // +6, +3
        h[2] = ((w & 0x40074007u) * (512u + 2u)) & kKeep;  // +9, +1 (disjoint copies)
        h[3] = (w & kMag) | ((w * 4u) & kSign);           // in place, +2
    }
};
template <> struct Decoder<__nv_bfloat16, kSplit> {
    static constexpr int kExp = -126;
    __device__ __forceinline__ static void run(uint32_t w, uint32_t (&h)[4]) {
        constexpr uint32_t kKeep = 0x81C081C0u, kMag = 0x01C001C0u, kSign = 0x80008000u;
        h[0] = w & kKeep;                                 // in place
        h[1] = (w * 8u) & kKeep;                          // +3
        h[2] = ((w & 0x40074007u) * (64u + 2u)) & kKeep;  // +6, +1 (disjoint copies)
        h[3] = ((w >> 3) & kMag) | ((w * 4u) & kSign);    // -3, +2
    }
};

// 16-bit pair multiply (exact for code * scale * 2^s: gemv_fp4.cu's header says why).
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b, __half) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b, __nv_bfloat16) {
    uint32_t d;  // fma with -0: mul.bf16x2 needs sm_90, this form works from sm_80
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                    __half) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                    __nv_bfloat16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t bits16(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

// 16-bit pattern of 2^x built from integers (no fp32 arithmetic: the loader compiles with
// -ftz=true, which would flush the fp32 subnormals 2^-127..2^-149). 0 below the smallest
// subnormal, infinity above the largest power.
__device__ __forceinline__ uint32_t pow2_bits(int x, __half) {
    return x > 15 ? 0x7C00u : x >= -14 ? (uint32_t)(x + 15) << 10 : x >= -24 ? 1u << (x + 24) : 0u;
}
__device__ __forceinline__ uint32_t pow2_bits(int x, __nv_bfloat16) {
    return x > 127 ? 0x7F80u : x >= -126 ? (uint32_t)(x + 127) << 7 : x >= -133 ? 1u << (x + 133) : 0u;
}

// Exponent bias and stored mantissa bits of the 16-bit types.
__device__ __forceinline__ constexpr int bias16(__half) { return 15; }
__device__ __forceinline__ constexpr int bias16(__nv_bfloat16) { return 127; }
__device__ __forceinline__ constexpr int mant16(__half) { return 10; }
__device__ __forceinline__ constexpr int mant16(__nv_bfloat16) { return 7; }

// Table entry of scale byte b: scale(b) * 2^shift as a 16-bit value (exact for the bytes in use).
template <int kFormat, typename T> __device__ __forceinline__ uint32_t scale_bits(int b, int shift) {
    if constexpr (kFormat == 0) {
        // E4M3 (subnormals included) times 2^shift, built from integers: the value 2^x (1 + f/8)
        // with x in [-9, 8] and shift 0 or 116 (NVFP4 has no scale shift, see gemv.py) is a normal
        // number of T, so the bits are sign | x + shift + bias | f. (ldexpf and a conversion
        // took ~200 instructions and branches per entry, ahead of every block's first barrier.)
        if ((b & 0x7F) == 0x7F) return bits16(cm::from_float<T>(__int_as_float(0x7FC00000)));
        const uint32_t sign = (uint32_t)(b & 0x80) << 8;
        const int e = (b >> 3) & 15, m = b & 7;
        if (e == 0 && m == 0) return sign;
        const int p = 31 - __clz(m);  // subnormal m * 2^-9 = 2^(p - 9) (m / 2^p)
        const int x = e ? e - 7 : p - 9;
        const int f = e ? m : (m << (3 - p)) & 7;
        return sign | ((uint32_t)(x + shift + bias16(T())) << mant16(T())) |
               ((uint32_t)f << (mant16(T()) - 3));
    } else {
        if (b == 0xFF) return bits16(cm::from_float<T>(__int_as_float(0x7FC00000)));  // NaN
        return pow2_bits(b - 127 + shift, T());
    }
}

// ---- activations in fp32 (kAct = experts/activation.py: Activation.code, the one table of codes:
// 0 none (FC2), gated 1 swiglu, 2 geglu, 3 swiglu_oai; non-gated 4 relu, 5 gelu, 6 silu, 7 identity)

// v sigmoid(a v) = v / (1 + e^(-a v)) by the fast intrinsics: __expf (ex2.approx of the argument
// times log2 e) and __fdividef (v times rcp.approx of the sum). __expf errs by up to 2 + 1.17 |x|
// ulp of fp32 (about 2^-16 relative at |x| = 87, a few ulp for the arguments an activation
// usually sees), far below the 16-bit output's rounding (2^-9 and 2^-12 relative); expf and the
// IEEE division took about 22 instructions per value with a branch to a slow path, which the
// tensor cores wait out in the wgmma kernel's gated epilogue. The limits stay the reference's:
// v -> +inf gives v, v -> -inf gives -inf / inf = NaN, NaN stays NaN; and where a v is below
// about -87 (1 + e^(-a v) past 2^126, where rcp.approx flushes) the result is -0 instead of a
// value of about |v| 2^-126.
__device__ __forceinline__ float sigmoid_times(float v, float a) {
    return __fdividef(v, 1.0f + __expf(-a * v));
}

__device__ __forceinline__ float min_nan(float a, float b) {
    float r;
    asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

struct ActArgs {  // swiglu_oai, the general SwiGLU: g sigmoid(alpha g) (u + beta), clamp limit
    float alpha, beta, limit;
};

template <int kAct> __device__ __forceinline__ float activate(float g, float u, const ActArgs& a) {
    static_assert(kAct >= 1 && kAct <= 3, "activate: the gated kinds 1..3");
    if constexpr (kAct == 1) {
        return sigmoid_times(g, 1.0f) * u;
    } else if constexpr (kAct == 2) {
        return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)) * u;
    } else {
        // min.NaN / max.NaN, not fminf/fmaxf: those return the other operand for NaN, and a NaN
        // must reach the output as in the reference. Branch-free (the nested comparisons compiled
        // to a branch per value); the same results as the comparisons for the limit the host
        // admits (a float32 > 0, +inf included).
        g = min_nan(g, a.limit);
        u = max_nan(min_nan(u, a.limit), -a.limit);
        return sigmoid_times(g, a.alpha) * (u + a.beta);
    }
}
// gpt-oss's swiglu_oai (beta 1) and the other gated kinds with two scalars.
template <int kAct> __device__ __forceinline__ float activate(float g, float u, float alpha,
                                                             float limit) {
    return activate<kAct>(g, u, ActArgs{alpha, 1.0f, limit});
}

// Non-gated (FC1 [E, I, H], one matrix) and kAct 0 (FC2: no activation).
template <int kAct> __device__ __forceinline__ float activate1(float v, const ActArgs& a) {
    static_assert(kAct == 0 || (kAct >= 4 && kAct <= 7), "activate1: kAct 0 or 4..7");
    (void)a;
    if constexpr (kAct == 4) {
        return v < 0.0f ? 0.0f : v;  // NaN < 0 is false: NaN passes, as in the reference
    } else if constexpr (kAct == 5) {
        return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    } else if constexpr (kAct == 6) {
        return sigmoid_times(v, 1.0f);
    } else {
        return v;
    }
}

}  // namespace
