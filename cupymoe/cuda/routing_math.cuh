// SPDX-License-Identifier: Apache-2.0
// Routing arithmetic shared by the routing kernels: exact fp32 operations, the defined exp and
// sigmoid, order-preserving selection keys, softmax numerators and warp sums.
//
//
// Selection keys: an unsigned 64-bit key per expert, larger = better:
//   bits 63..32  order-preserving image of the fp32 score (NaN -> 0, below -inf; -0 -> +0),
//   bits 31..0   0xFFFFFFFF - expert, so equal scores prefer the lower expert id.
// A key of 0 is padding (every real key has a non-zero low word).
//
// kMethod: 0 = softmax over all experts, then top-k (weights = p, not renormalised)
//          1 = top-k by logit, softmax over the k (= softmax_topk renormalised = topk_softmax)
//          2 = sigmoid + correction bias, grouped top-k (DeepSeek-V3)
//          3 = sparse mixer top-2 (ONNX Runtime use_sparse_mixer; E in {8, 16}, k = 2): the
//              choice of 0, weights by sparse_mixer_numerator (warp kernels only)
//          4 = top-k by logit, weights gathered from a mixing tensor [M, E] fp32 (ONNX Runtime's
//              QMoE router_weights), divided by their sum when `renormalize`
// The sigmoid of kMethod 2 is computed with explicit IEEE round-to-nearest PTX operations (no
// contraction, no flush-to-zero), so the NumPy reference reproduces every choice score bit for bit.
#pragma once

#include "common.cuh"

namespace rt {

constexpr unsigned kFull = 0xffffffffu;
#define RT_NEG_INF __int_as_float(0xff800000)
constexpr int kMaxWarpExperts = 256;  // the warp kernels: E <= 256, 32 * kN >= E
constexpr int kMaxGroupsWarp = 128;   // group size >= 2

// ---- exact fp32 arithmetic (PTX .rn without .ftz: identical to NumPy float32) -------------
__device__ __forceinline__ float f_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_sub(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_mul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f_rcp(float a) {  // correctly rounded 1 / a (= div.rn(1, a))
    float r;
    asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

// exp(t) for t in [-150, 150]: Cody-Waite reduction + Cephes polynomial, each step one rounded
// fp32 operation. The constants are given by their bits; routing/reference.py mirrors this function.
// N values at once, each step for all N before the next (ptxas still overlaps only about two of
// the dependent chains of ~25 operations: ~900 cycles for 8 values on one warp, H200).
template <int N> __device__ __forceinline__ void exp_defined(const float (&t)[N], float (&out)[N]) {
    constexpr uint32_t kPoly[6] = {0x39506967u,   // 1.9875691500e-4
                                   0x3AB743CEu,   // 1.3981999507e-3
                                   0x3C088908u,   // 8.3334519073e-3
                                   0x3D2AA9C1u,   // 4.1665795894e-2
                                   0x3E2AAAAAu,   // 1.6666665459e-1
                                   0x3F000000u};  // 5.0000001201e-1
    const float kLog2e = __uint_as_float(0x3FB8AA3Bu);
    const float kLn2Hi = __uint_as_float(0x3F317200u);  // 15 significant bits: n * kLn2Hi exact
    const float kLn2Lo = __uint_as_float(0x35BFBE8Eu);
    // n = rint(t log2e) by the round-to-nearest-even of adding 1.5 * 2^23 (|t log2e| <= 217), and
    // its integer from the sum's low mantissa bits: two adds and an integer subtract instead of
    // FRND and F2I, which issue at a quarter of the rate and wait longer.
    const float kRound = __uint_as_float(0x4B400000u);  // 1.5 * 2^23
    float n[N], r[N], p[N];
    int ni[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const float big = f_add(f_mul(t[j], kLog2e), kRound);
        n[j] = f_sub(big, kRound);
        ni[j] = (int)(__float_as_uint(big) - 0x4B400000u);
    }
#pragma unroll
    for (int j = 0; j < N; ++j) r[j] = f_sub(t[j], f_mul(n[j], kLn2Hi));
#pragma unroll
    for (int j = 0; j < N; ++j) r[j] = f_sub(r[j], f_mul(n[j], kLn2Lo));
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = __uint_as_float(kPoly[0]);
#pragma unroll
    for (int c = 1; c < 6; ++c) {
#pragma unroll
        for (int j = 0; j < N; ++j) p[j] = f_add(f_mul(p[j], r[j]), __uint_as_float(kPoly[c]));
    }
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = f_add(f_add(f_mul(p[j], f_mul(r[j], r[j])), r[j]), 1.0f);
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int n1 = ni[j] >> 1;  // |n| <= 217: 2^n as two normal factors
        const int n2 = ni[j] - n1;
        out[j] = f_mul(f_mul(p[j], __int_as_float((n1 + 127) << 23)), __int_as_float((n2 + 127) << 23));
    }
}

// sigmoid(x) = 1 / (1 + exp(-x)), x not NaN; -x clamped to [-150, 150] (exp is 0 / inf beyond).
template <int N>
__device__ __forceinline__ void sigmoid_denominators(const float (&x)[N], float (&den)[N]) {
    float t[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        t[j] = -x[j];
        t[j] = t[j] < -150.0f ? -150.0f : t[j];
        t[j] = t[j] > 150.0f ? 150.0f : t[j];
    }
    exp_defined<N>(t, den);
#pragma unroll
    for (int j = 0; j < N; ++j) den[j] = f_add(1.0f, den[j]);
}
__device__ __forceinline__ float sigmoid_defined(float x) {
    const float v[1] = {x};
    float den[1];
    sigmoid_denominators<1>(v, den);
    return f_rcp(den[0]);
}

// rcp.rn's own fast path without its range branch (so that independent reciprocals interleave):
// the approximate reciprocal and one Newton step in fma, correctly rounded -- bit for bit what
// rcp.rn returns -- for 1 <= y < 2^126. Above (a result near or below the subnormals, or inf)
// the caller uses f_rcp.
constexpr uint32_t kRcpFastLimit = 0x7E800000u;  // bits of 2^126
__device__ __forceinline__ float rcp_rn_fast(float y) {
    float r, e, out;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(y));
    asm("fma.rn.f32 %0, %1, %2, 0fBF800000;" : "=f"(e) : "f"(y), "f"(r));  // y r - 1
    asm("fma.rn.f32 %0, %1, %2, %1;" : "=f"(out) : "f"(r), "f"(-e));       // r - r e
    return out;
}

// Branch-free (selects and one xor): with early returns ptxas gave every call of an unrolled
// loop its own divergent branch region (BSSY / BSYNC), about 40 cycles each on one warp.
__device__ __forceinline__ uint32_t order_bits(float v) {
    uint32_t u = __float_as_uint(v);
    u = u == 0x80000000u ? 0u : u;                                   // -0 == +0
    const uint32_t flip = (uint32_t)((int)u >> 31) | 0x80000000u;  // negative: ~u; else u | sign
    return v != v ? 0u : u ^ flip;                                   // NaN below every number
}
__device__ __forceinline__ float from_order_bits(uint32_t h) {  // h != 0
    return __uint_as_float((h & 0x80000000u) ? (h & 0x7fffffffu) : ~h);
}
__device__ __forceinline__ uint64_t make_key(uint32_t high, int expert) {
    return ((uint64_t)high << 32) | (uint64_t)(0xffffffffu - (uint32_t)expert);
}
__device__ __forceinline__ int key_expert(uint64_t key) {
    return (int)(0xffffffffu - (uint32_t)(key & 0xffffffffull));
}
__device__ __forceinline__ uint32_t key_high(uint64_t key) { return (uint32_t)(key >> 32); }

// softmax numerator relative to the maximum m: NaN -> 0; x == m -> 1 (covers m = +-inf).
__device__ __forceinline__ float softmax_numerator(float x, float m) {
    if (x != x) return 0.0f;
    return x == m ? 1.0f : expf(x - m);
}

// Sparse mixer (ONNX Runtime, jitter eps 0.01): x's softmax numerator relative to a round's winner
// m, or 0 when x is NaN or the jitter mask drops it: (m - x) > (2 eps) max(|x|, m). The mask test
// is made in IEEE fp32 (one rounding for the difference, one for the product) and compared as
// order_bits integers, exact under -ftz, as routing/reference.py does it.
__device__ __forceinline__ float sparse_mixer_numerator(float x, float m) {
    const float two_eps = __uint_as_float(0x3CA3D70Au);  // float32(0.02) = 2 * float32(0.01)
    const float ax = __uint_as_float(__float_as_uint(x) & 0x7fffffffu);
    const float fac = order_bits(ax) > order_bits(m) ? ax : m;
    const bool masked = order_bits(f_sub(m, x)) > order_bits(f_mul(two_eps, fac));
    return (x != x || masked) ? 0.0f : softmax_numerator(x, m);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(kFull, v, s);  // same bits on every lane
    return v;
}
__device__ __forceinline__ float warp_sum_exact(float v) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) v = f_add(v, __shfl_xor_sync(kFull, v, s));
    return v;
}

}  // namespace rt
