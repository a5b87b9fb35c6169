// SPDX-License-Identifier: Apache-2.0
// Routing: top-k expert selection per token, the expert maps, and the fused decode launch.
//
// Selection keys: an unsigned 64-bit key per expert, larger = better:
//   bits 63..32  order-preserving image of the fp32 score (NaN -> 0, below -inf; -0 -> +0),
//   bits 31..0   0xFFFFFFFF - expert, so equal scores prefer the lower expert id.
// A key of 0 is padding (every real key has a non-zero low word).
//
// kMethod: 0 = softmax over all experts, then top-k (weights = p, not renormalised)
//          1 = top-k by logit, softmax over the k (= softmax_topk renormalised = topk_softmax)
//          2 = sigmoid + correction bias, grouped top-k (DeepSeek-V3)
// The sigmoid of kMethod 2 is computed with explicit IEEE round-to-nearest PTX operations (no
// contraction, no flush-to-zero), so the NumPy reference reproduces every choice score bit for bit.
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
// fp32 operation. The constants are given by their bits; routing.py mirrors this function.
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

// ---- register sort and the warp top-k -----------------------------------------------------
__device__ __forceinline__ void exchange_descending(uint64_t& x, uint64_t& y) {
    const uint64_t hi = x < y ? y : x, lo = x < y ? x : y;
    x = hi;
    y = lo;
}
// Sorts N <= 8 keys descending: the optimal networks for 4 (5 exchanges) and 8 (19 exchanges,
// depth 6, Knuth TAOCP 5.3.4) instead of bitonic sorting's 6 and 24.
template <int N> __device__ __forceinline__ void sort_descending(uint64_t (&a)[N]) {
    if constexpr (N == 2) {
        exchange_descending(a[0], a[1]);
    } else if constexpr (N == 4) {
        constexpr int kNet[5][2] = {{0, 1}, {2, 3}, {0, 2}, {1, 3}, {1, 2}};
#pragma unroll
        for (int c = 0; c < 5; ++c) exchange_descending(a[kNet[c][0]], a[kNet[c][1]]);
    } else if constexpr (N == 8) {
        constexpr int kNet[19][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {0, 4}, {1, 5}, {2, 6},
                                     {3, 7}, {0, 1}, {2, 3}, {4, 5}, {6, 7}, {2, 4}, {3, 5},
                                     {1, 4}, {3, 6}, {1, 2}, {3, 4}, {5, 6}};
#pragma unroll
        for (int c = 0; c < 19; ++c) exchange_descending(a[kNet[c][0]], a[kNet[c][1]]);
    }
}

// Warp top-k in k rounds of arg-max. Each lane sorts its N keys (descending) once; a round takes
// the warp's largest head -- redux.max over the heads' score words, then over the expert words of
// the heads that hold that score (the larger expert word is the lower expert) -- and the lane
// holding it pops its head. Lane r < k returns round r's key; `top` is round 0's score word.
template <int N>
__device__ __forceinline__ uint64_t warp_top_k(uint64_t (&key)[N], int k, int lane,
                                               uint32_t& top) {
    sort_descending<N>(key);
    uint64_t mine = 0;
    top = 0;
#pragma unroll
    for (int r = 0; r < N; ++r) {
        if (r < k) {  // k is warp-uniform
            const uint32_t hi = key_high(key[0]), lo = (uint32_t)(key[0] & 0xffffffffull);
            const uint32_t best_hi = __reduce_max_sync(kFull, hi);
            const uint32_t best_lo = __reduce_max_sync(kFull, hi == best_hi ? lo : 0u);
            const uint64_t best = ((uint64_t)best_hi << 32) | best_lo;
            top = r == 0 ? best_hi : top;
            mine = lane == r ? best : mine;
            const bool pop = key[0] == best;  // one lane (or only padding lanes, harmlessly)
#pragma unroll
            for (int i = 0; i + 1 < N; ++i) key[i] = pop ? key[i + 1] : key[i];
            key[N - 1] = pop ? 0ull : key[N - 1];
        }
    }
    return mine;
}

// ---- group selection (kMethod 2) -------------------------------------------------------------
// choice[e] holds the choice score (NaN experts as -inf); writes flag[g] = group g is kept.
// Group score = sum of the two largest choice scores; the topk_group best groups are kept (ties:
// lower group). `first`/`stride` split the work over a warp or a block.
__device__ __forceinline__ void select_groups(const float* choice, float* gscore, int* flag,
                                              int n_group, int topk_group, int group_size,
                                              int first, int stride, bool block_sync) {
    // Comparisons on order_bits (integers): exact for subnormals too, whatever -ftz says.
    for (int g = first; g < n_group; g += stride) {
        float b1 = RT_NEG_INF, b2 = RT_NEG_INF;
        uint32_t o1 = order_bits(b1), o2 = o1;
        for (int i = 0; i < group_size; ++i) {
            const float c = choice[g * group_size + i];
            const uint32_t o = order_bits(c);
            if (o > o1) {
                b2 = b1, o2 = o1;
                b1 = c, o1 = o;
            } else if (o > o2) {
                b2 = c, o2 = o;
            }
        }
        gscore[g] = f_add(b1, b2);
    }
    if (block_sync) __syncthreads(); else __syncwarp();
    for (int g = first; g < n_group; g += stride) {
        const uint32_t mine = order_bits(gscore[g]);
        int rank = 0;
        for (int h = 0; h < n_group; ++h) {
            const uint32_t o = order_bits(gscore[h]);
            rank += (o > mine) || (o == mine && h < g);
        }
        flag[g] = rank < topk_group;
    }
    if (block_sync) __syncthreads(); else __syncwarp();
}

// Groups of whole lanes on the warp layout (lane l holds experts kN l .. kN l + kN - 1): a group
// of size kN * L, L a power of two, is lanes g L .. g L + L - 1. Its top-2 is each lane's own
// top-2 then log2(L) butterfly steps (no shared memory, no warp reduction); one shuffle per group
// gathers the group scores. Same scores, ranks and ties as select_groups; returns whether this
// lane's group is kept.
template <int N>
__device__ __forceinline__ bool groups_by_lanes(const float (&choice)[N], int n_group,
                                                int topk_group, int lanes_per_group, int lane) {
    // choice is never NaN (NaN logits, and lanes past E, enter as -inf): order_bits is non-zero
    // and invertible. Groups hold >= 2 experts (Router), so o2 ends as a real runner-up.
    uint32_t o1 = order_bits(choice[0]), o2 = 0u;
#pragma unroll
    for (int j = 1; j < N; ++j) {
        const uint32_t o = order_bits(choice[j]);
        o2 = max(o2, min(o1, o));
        o1 = max(o1, o);
    }
    for (int s = 1; s < lanes_per_group; s <<= 1) {  // warp-uniform
        const uint32_t p1 = __shfl_xor_sync(kFull, o1, s), p2 = __shfl_xor_sync(kFull, o2, s);
        o2 = max(max(o2, p2), min(o1, p1));
        o1 = max(o1, p1);
    }
    const uint32_t mine = order_bits(f_add(from_order_bits(o1), from_order_bits(o2)));
    const int g = lane / lanes_per_group;
    int rank = 0;
    for (int h = 0; h < n_group; ++h) {  // warp-uniform
        const uint32_t o = __shfl_sync(kFull, mine, h * lanes_per_group);
        rank += (o > mine) || (o == mine && h < g);
    }
    return g < n_group && rank < topk_group;
}

// ---- a lane's run of kN consecutive values as floats --------------------------------------------
__device__ __forceinline__ float word_to_float(uint32_t w, int half, float) {
    (void)half;
    return __uint_as_float(w);
}
__device__ __forceinline__ float word_to_float(uint32_t w, int half, __half) {
    return __half2float(__ushort_as_half((unsigned short)(w >> (16 * half))));
}
__device__ __forceinline__ float word_to_float(uint32_t w, int half, __nv_bfloat16) {
    return __bfloat162float(__ushort_as_bfloat16((unsigned short)(w >> (16 * half))));
}
// v[j] = p[first + j] for first + j < E, else `fill`. A run that lies inside E and is aligned to
// its size (at most 16 bytes) is read with as few vector loads as it takes (fp32 kN = 8: two),
// which ptxas issues up front; the lane-strided scalar loads they replace were scheduled next to
// their first use, exposing their latency after the sigmoids.
template <typename T, int kN>
__device__ __forceinline__ void load_run(const T* __restrict__ p, int first, int E, float fill,
                                         float (&v)[kN]) {
    constexpr int kBytes = kN * (int)sizeof(T);
    constexpr int kPiece = kBytes < 16 ? kBytes : 16;
    constexpr int kPer = 32 / (8 * (int)sizeof(T));  // values per 32-bit word: 1 or 2
    if constexpr (kPiece >= 4) {
        const T* run = p + first;
        if (first + kN <= E && ((unsigned long long)run & (kPiece - 1)) == 0) {
            uint32_t w[kBytes / 4];
#pragma unroll
            for (int i = 0; i < kBytes / kPiece; ++i) {
                if constexpr (kPiece == 16) {
                    const uint4 q = __ldg(reinterpret_cast<const uint4*>(run) + i);
                    w[4 * i] = q.x, w[4 * i + 1] = q.y, w[4 * i + 2] = q.z, w[4 * i + 3] = q.w;
                } else if constexpr (kPiece == 8) {
                    const uint2 q = __ldg(reinterpret_cast<const uint2*>(run) + i);
                    w[2 * i] = q.x, w[2 * i + 1] = q.y;
                } else {
                    w[i] = __ldg(reinterpret_cast<const unsigned int*>(run) + i);
                }
            }
#pragma unroll
            for (int j = 0; j < kN; ++j) v[j] = word_to_float(w[j / kPer], j % kPer, T());
            return;
        }
    }
#pragma unroll
    for (int j = 0; j < kN; ++j) v[j] = first + j < E ? cm::to_float(p[first + j]) : fill;
}

// ---- one token on one warp (E <= 32 * kN <= 256, k <= kN) ------------------------------------
// Lane l holds experts kN l + j, j < kN. select_token_warp: the top-k; lane i < k gets slot i's
// key. val / sig keep what the weights need (weigh_token_warp). `scratch` (kMethod 2, groups that
// are not whole lanes, a power of two of them): 512 floats per warp.
template <typename T, int kMethod, int kN>
__device__ __forceinline__ uint64_t select_token_warp(const T* __restrict__ row, int E, int k,
                                                      int n_group, int topk_group,
                                                      const float* __restrict__ bias,
                                                      float* scratch, int lane, float (&val)[kN],
                                                      float (&sig)[kN], uint32_t& top) {
    uint64_t key[kN];
    const int first = lane * kN;
    load_run<T, kN>(row, first, E, __int_as_float(0x7fc00000), val);
    if constexpr (kMethod == 2) load_run<float, kN>(bias, first, E, 0.0f, sig);
    if constexpr (kMethod == 2) {
        const bool grouped = n_group > 1 && topk_group < n_group;
        const int group_size = E / n_group;
        const int lanes_per_group = group_size / kN;
        const bool by_lanes = group_size % kN == 0 && (lanes_per_group & (lanes_per_group - 1)) == 0;
        float den[kN];
        sigmoid_denominators<kN>(val, den);  // branch-free; a NaN logit computes garbage, unused
        bool slow = false;
#pragma unroll
        for (int j = 0; j < kN; ++j)
            slow |= __float_as_uint(den[j]) >= kRcpFastLimit;  // den >= 1: bits order as values
        float s[kN];
#pragma unroll
        for (int j = 0; j < kN; ++j) s[j] = rcp_rn_fast(den[j]);
        if (__any_sync(kFull, slow)) {  // rare: a logit below about -87
#pragma unroll
            for (int j = 0; j < kN; ++j)
                if (__float_as_uint(den[j]) >= kRcpFastLimit) s[j] = f_rcp(den[j]);
        }
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            const bool nan = val[j] != val[j];
            const float b = sig[j];
            sig[j] = nan ? 0.0f : s[j];
            val[j] = nan ? RT_NEG_INF : f_add(s[j], b);
        }
        uint32_t kept = ~0u;  // bit j: expert first + j may be chosen
        if (grouped && by_lanes) {
            kept = groups_by_lanes<kN>(val, n_group, topk_group, lanes_per_group, lane) ? ~0u : 0u;
        } else if (grouped) {
            float* choice = scratch;
            float* gscore = scratch + kMaxWarpExperts;
            int* flags = reinterpret_cast<int*>(scratch + kMaxWarpExperts + kMaxGroupsWarp);
            __syncwarp();  // the previous token's readers are done with the scratch
#pragma unroll
            for (int j = 0; j < kN; ++j) {
                const int e = first + j;
                if (e < E) choice[e] = val[j];
            }
            __syncwarp();
            select_groups(choice, gscore, flags, n_group, topk_group, group_size, lane, 32, false);
            kept = 0u;
#pragma unroll
            for (int j = 0; j < kN; ++j) {
                const int e = first + j;
                kept |= (e < E && flags[e / group_size] ? 1u : 0u) << j;
            }
        }
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            const int e = first + j;
            const bool ok = e < E && ((kept >> j) & 1u);
            const uint32_t ob = order_bits(val[j]);  // both sides computed: a select
            const uint32_t high = val[j] == RT_NEG_INF ? 1u : ob;
            key[j] = ok ? make_key(high, e) : 0ull;
        }
    } else {
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            const int e = first + j;
            key[j] = e < E ? make_key(order_bits(val[j]), e) : 0ull;
        }
    }
    return warp_top_k<kN>(key, k, lane, top);
}

// Lane i < k: slot i's weight, from select_token_warp's key and state.
template <int kMethod, int kN>
__device__ __forceinline__ float weigh_token_warp(uint64_t mine, uint32_t top,
                                                  const float (&val)[kN], const float (&sig)[kN],
                                                  int k, float scale, int renormalize, int lane) {
    const bool slot = lane < k;
    const int out_id = key_expert(mine);
    float out_weight;
    if constexpr (kMethod == 2) {
        // The chosen expert's sigmoid from the lane that holds it (no reload, no recompute).
        const int src = (out_id / kN) & 31, col = out_id % kN;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            const float v = __shfl_sync(kFull, sig[j], src);
            s = (slot && col == j) ? v : s;
        }
        if (renormalize) {
            const float sum = warp_sum_exact(s);
            out_weight = __float_as_uint(sum) ? f_mul(f_div(s, sum), scale) : 0.0f;
        } else {
            out_weight = f_mul(s, scale);
        }
    } else {
        const float m = top ? from_order_bits(top) : 0.0f;
        const uint32_t h = key_high(mine);
        const float num = (slot && h && top) ? softmax_numerator(from_order_bits(h), m) : 0.0f;
        float denom;
        if constexpr (kMethod == 0) {
            float part = 0.0f;
#pragma unroll
            for (int j = 0; j < kN; ++j) part += top ? softmax_numerator(val[j], m) : 0.0f;
            denom = warp_sum(part);
        } else {
            denom = warp_sum(num);
        }
        out_weight = denom > 0.0f ? num / denom : 0.0f;
    }
    return out_weight;
}

template <typename T, int kMethod, int kN>
__device__ __forceinline__ void route_token_warp(const T* __restrict__ row, int E, int k,
                                                 int n_group, int topk_group, float scale,
                                                 int renormalize, const float* __restrict__ bias,
                                                 float* scratch, int lane, int& out_id,
                                                 float& out_weight) {
    float val[kN], sig[kN];
    uint32_t top;
    const uint64_t mine = select_token_warp<T, kMethod, kN>(row, E, k, n_group, topk_group, bias,
                                                            scratch, lane, val, sig, top);
    out_id = key_expert(mine);
    out_weight = weigh_token_warp<kMethod, kN>(mine, top, val, sig, k, scale, renormalize, lane);
}

// ---- expert maps in one block ----------------------------------------------------------------
// Exclusive block scan of one 64-bit value per thread; blockDim.x a multiple of 32.
__device__ __forceinline__ long long block_scan(long long v, long long* wsum, long long& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    long long incl = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const long long t = __shfl_up_sync(kFull, incl, d);
        if (lane >= d) incl += t;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    long long base = 0;
    total = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
        const long long s = wsum[w];
        base += w < warp ? s : 0;
        total += s;
    }
    __syncthreads();
    return base + incl - v;
}

__device__ __forceinline__ int sanitize_expert(int e, int E) { return (e >= 0 && e < E) ? e : E; }

// ids [n] (global or shared) -> offsets [E+1], sorted_rows [n], inverse [n], active [active_len].
// Warp 0 ranks the rows in chunks of 32 with match.any + popc (stable: row order); ids outside
// [0, E) go to a bucket after the last expert. cnt: shared [E+1]; wsum: shared [32].
__device__ void build_maps_block(const int* ids, int n, int E, int* __restrict__ offsets,
                                 int* __restrict__ sorted_rows, int* __restrict__ inverse,
                                 int* __restrict__ active, int active_len, int* cnt,
                                 long long* wsum) {
    const int tid = threadIdx.x, lane = tid & 31;
    for (int e = tid; e <= E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    if (tid < 32) {
        const unsigned lower = (1u << lane) - 1u;
        for (int base = 0; base < n; base += 32) {
            const int i = base + lane;
            const int e = i < n ? sanitize_expert(ids[i], E) : -1;
            const unsigned peers = __match_any_sync(kFull, e);
            const int rank = (i < n) ? cnt[e] + __popc(peers & lower) : 0;
            __syncwarp();
            if (i < n && (peers & lower) == 0u) cnt[e] += __popc(peers);
            __syncwarp();
            if (i < n) inverse[i] = rank;
        }
    }
    __syncthreads();
    // offsets and the active list: one scan over (count << 16 | active) per expert bucket.
    const int L = E + 1;
    const int per = (L + blockDim.x - 1) / blockDim.x;
    const int b = min(tid * per, L), end = min(b + per, L);
    long long local = 0;
    for (int e = b; e < end; ++e) local += ((long long)cnt[e] << 16) | (e < E && cnt[e] > 0);
    long long total;
    long long excl = block_scan(local, wsum, total);
    for (int e = b; e < end; ++e) {
        const int c = cnt[e];
        offsets[e] = (int)(excl >> 16);
        cnt[e] = (int)(excl >> 16);
        if (e < E && c > 0) active[excl & 0xffff] = e;
        excl += ((long long)c << 16) | (e < E && c > 0);
    }
    for (int a = (int)(total & 0xffff) + tid; a < active_len; a += blockDim.x) active[a] = -1;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const int row = cnt[sanitize_expert(ids[i], E)] + inverse[i];
        inverse[i] = row;
        sorted_rows[row] = i;
    }
}

// Expert maps of n <= 64 rows and E <= 256 on ONE warp (no block barrier), for the fused launch.
// cnt: shared [kWarpMapWords], 16-byte aligned, zeroed (zero_map_counts) before the ids are
// staged: the bucket counts (lane l owns buckets 8l .. 8l + 7, lane 31 also bucket 256), then
// per bucket the lanes whose row of the first chunk (rows 0..31) is in it, then the same for
// the second chunk (rows 32..63).
constexpr int kWarpMapBuckets = 33 * 8;
constexpr int kWarpMapWords = 3 * kWarpMapBuckets;
// Up to this many rows the ranks come from match.any, above it from the lane masks. match.any
// takes longer the more distinct values the warp holds, the masks cost an atomic and a load
// whatever the ids. H200, grouped sigmoid with PDL, M = 1 / 4 / 8, us: match.any throughout
// 2.55 / 2.89 / 3.03, masks throughout 2.64 / 2.79 / 2.94; this split measured 2.69 / 2.80 / 2.97
// against the masks' 2.68 / 2.82 / 3.01 in one run (a 16-row split: 2.70 / 2.80 / 2.99), and it
// keeps route_fused<*, 1, 8> free of spills at sm_120 (8 bytes with the masks throughout).
constexpr int kMatchRows = 8;
__device__ __forceinline__ void zero_map_counts(int* cnt, int lane, int n) {
    int4* cnt4 = reinterpret_cast<int4*>(cnt);
    const int4 zero = make_int4(0, 0, 0, 0);
    const int words = n <= kMatchRows ? kWarpMapBuckets : kWarpMapWords;
    for (int i = lane; i < words / 4; i += 32) cnt4[i] = zero;
}
// ids: shared [n]. Lane l ranks rows l and l + 32 (stable: row order): a row's rank in its
// bucket counts the lanes below it in the bucket's mask of its chunk, plus, for the second
// chunk, every first-chunk row of the bucket. The first row of a bucket stores its count; one
// warp scan over the lanes' buckets gives the offsets and the active list. Ids outside [0, E)
// go to bucket E; same results as build_maps_block.
__device__ __forceinline__ void build_maps_warp(const int* ids, int n, int E,
                                                int* __restrict__ offsets,
                                                int* __restrict__ sorted_rows,
                                                int* __restrict__ inverse,
                                                int* __restrict__ active, int active_len,
                                                int* cnt) {
    const int lane = threadIdx.x & 31;
    const unsigned lower = (1u << lane) - 1u;
    int4* cnt4 = reinterpret_cast<int4*>(cnt);
    unsigned* lanes_a = reinterpret_cast<unsigned*>(cnt) + kWarpMapBuckets;
    unsigned* lanes_b = lanes_a + kWarpMapBuckets;
    const int ea = lane < n ? sanitize_expert(ids[lane], E) : -1;
    const int eb = lane + 32 < n ? sanitize_expert(ids[lane + 32], E) : -1;
    unsigned pa;  // the first chunk's lanes in bucket ea
    if (n <= kMatchRows) {  // warp-uniform
        pa = __match_any_sync(kFull, ea);
    } else {
        if (ea >= 0) atomicOr(&lanes_a[ea], 1u << lane);
        if (eb >= 0) atomicOr(&lanes_b[eb], 1u << lane);
        __syncwarp();
        pa = ea >= 0 ? lanes_a[ea] : 0u;
    }
    const int ra = __popc(pa & lower);
    int rb = 0, count = __popc(pa);
    if (n > 32) {  // warp-uniform: the second chunk of rows
        const unsigned pb = eb >= 0 ? lanes_b[eb] : 0u;
        const unsigned before = eb >= 0 ? lanes_a[eb] : 0u;  // the first chunk's rows of eb
        rb = __popc(before) + __popc(pb & lower);
        count += ea >= 0 ? __popc(lanes_b[ea]) : 0;
        if (eb >= 0 && before == 0u && (pb & lower) == 0u) cnt[eb] = __popc(pb);
    }
    if (ea >= 0 && (pa & lower) == 0u) cnt[ea] = count;
    __syncwarp();
    // Counts <= 64 and active experts <= 64: both sums fit one int as (count << 8) + active.
    const int4 lo = cnt4[2 * lane], hi = cnt4[2 * lane + 1];
    const int c[9] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w,
                      lane == 31 ? cnt[256] : 0};
    const int first = 8 * lane;
    int packed = 0;
#pragma unroll
    for (int i = 0; i < 9; ++i) packed += (c[i] << 8) + (first + i < E && c[i] > 0);
    int incl = packed;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int t = __shfl_up_sync(kFull, incl, d);
        incl += lane >= d ? t : 0;
    }
    int start[9];
    int pos = (incl - packed) >> 8, a = (incl - packed) & 0xff;
#pragma unroll
    for (int i = 0; i < 9; ++i) {
        const int b = first + i;
        start[i] = pos;
        if (b <= E && (i < 8 || lane == 31)) offsets[b] = pos;
        if (b < E && c[i] > 0) active[a++] = b;
        pos += c[i];
    }
    cnt4[2 * lane] = make_int4(start[0], start[1], start[2], start[3]);
    cnt4[2 * lane + 1] = make_int4(start[4], start[5], start[6], start[7]);
    if (lane == 31) cnt[256] = start[8];
    const int n_active = __shfl_sync(kFull, incl, 31) & 0xff;
    for (int i = n_active + lane; i < active_len; i += 32) active[i] = -1;
    __syncwarp();
    if (ea >= 0) {
        const int row = cnt[ea] + ra;
        inverse[lane] = row;
        sorted_rows[row] = lane;
    }
    if (eb >= 0) {
        const int row = cnt[eb] + rb;
        inverse[lane + 32] = row;
        sorted_rows[row] = lane + 32;
    }
}

}  // namespace rt

// ================================================================================================
// Kernels
// ================================================================================================

// One warp per token, 4 tokens per block (block 128). E <= 32 * kN <= 256, k <= kN.
template <typename T, int kMethod, int kN>
__global__ void __launch_bounds__(128, 1) route_warp(
    const T* __restrict__ logits, long long ld, int n_tokens, int E, int k, int n_group,
    int topk_group, float scale, int renormalize, const float* __restrict__ bias,
    int* __restrict__ topk_ids, float* __restrict__ topk_weights) {
    __shared__ float scratch[kMethod == 2 ? 4 * 512 : 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * 4 + warp;
    if (t >= n_tokens) return;  // whole warps only: no later block-wide barrier
    int id;
    float w;
    rt::route_token_warp<T, kMethod, kN>(logits + t * ld, E, k, n_group, topk_group, scale,
                                          renormalize, bias, scratch + warp * 512, lane, id, w);
    if (lane < k) {
        topk_ids[t * k + lane] = id;
        topk_weights[t * k + lane] = w;
    }
}

// Routing and the expert maps in ONE launch (decode). A cluster of C blocks (C = 1: a plain
// launch; C > 1 needs sm_90 and a cluster launch), each of W routing warps and one maps warp (the
// last). Block r routes tokens r, r + C, ...; routing warp w of block r takes every (C W)-th of
// them from r + C w. Block 0's maps warp builds the maps from the ids staged in block 0's shared
// memory: its own routing warps stage theirs and arrive on barrier 1 (then go on to the token's
// weights); the other blocks' warps store theirs there with st.async, which counts the bytes on
// an mbarrier of block 0 (no release fence: with mbarrier.arrive.release.cluster instead, the
// launch took 0.15 us longer at M = 2 .. 8). The maps warps of blocks r > 0 only exit. Several
// blocks are for the issue slots: with two routing warps on a scheduler every phase of a token
// slows down (routing.py: fused_cluster_size). M * k <= 64, E <= 256, k <= kN, W <= 8.
constexpr int kMapsBarrier = 1;

// (blocks in this block's cluster, its rank there): (1, 0) without a cluster launch or sm_90.
__device__ __forceinline__ uint2 cluster_place() {
    uint2 c = make_uint2(1u, 0u);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_nctarank;\n\tmov.u32 %1, %%cluster_ctarank;"
        : "=r"(c.x), "=r"(c.y));
#endif
    return c;
}

template <typename T, int kMethod, int kN>
__global__ void __launch_bounds__(288) route_fused(
    const T* __restrict__ logits, long long ld, int n_tokens, int E, int k, int n_group,
    int topk_group, float scale, int renormalize, const float* __restrict__ bias,
    int* __restrict__ topk_ids, float* __restrict__ topk_weights, int* __restrict__ offsets,
    int* __restrict__ sorted_rows, int* __restrict__ inverse, int* __restrict__ active,
    int active_len) {
    __shared__ float scratch[kMethod == 2 ? 8 * 512 : 1];
    __shared__ int ids_s[64];
    __shared__ __align__(16) int cnt[rt::kWarpMapWords];
    __shared__ __align__(8) unsigned long long remote_ids;  // mbarrier: the other blocks' ids
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_route = (blockDim.x >> 5) - 1;
    const uint2 place = cluster_place();
    const int n_cta = (int)place.x, rank = (int)place.y;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (n_cta > 1) {  // block-uniform. Block 0 sets up the mbarrier, published by the cluster
        // barrier that every thread arrives on here and the other blocks wait on before storing.
        if (rank == 0 && threadIdx.x == 0) {
            const int own = (n_tokens + n_cta - 1) / n_cta;  // block 0's tokens
            const unsigned bar = (unsigned)__cvta_generic_to_shared(&remote_ids);
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                         "r"((n_tokens - own) * k * 4)
                         : "memory");
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
        asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    }
#endif
    cm::wait_upstream();  // the logits, and every buffer written here, belong to earlier kernels
    if (warp == n_route) {
        if (rank != 0) return;
        rt::zero_map_counts(cnt, lane, n_tokens * k);
        asm volatile("bar.sync %0, %1;" ::"n"(kMapsBarrier), "r"(blockDim.x) : "memory");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (n_cta > 1) {
            const unsigned bar = (unsigned)__cvta_generic_to_shared(&remote_ids);
            unsigned done = 0;
            while (!done)
                asm volatile(
                    "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, "
                    "[%1], 0; selp.u32 %0, 1, 0, p; }"
                    : "=r"(done)
                    : "r"(bar)
                    : "memory");
        }
#endif
        rt::build_maps_warp(ids_s, n_tokens * k, E, offsets, sorted_rows, inverse, active,
                            active_len, cnt);
        return;
    }
    const int first = rank + n_cta * warp, step = n_cta * n_route;
    if (rank == 0 && first >= n_tokens)
        asm volatile("bar.arrive %0, %1;" ::"n"(kMapsBarrier), "r"(blockDim.x) : "memory");
    for (int t = first; t < n_tokens; t += step) {
        float val[kN], sig[kN];
        uint32_t top;
        const uint64_t mine = rt::select_token_warp<T, kMethod, kN>(
            logits + t * ld, E, k, n_group, topk_group, bias, scratch + warp * 512, lane, val,
            sig, top);
        const int id = rt::key_expert(mine);
        if (rank == 0) {
            if (lane < k) ids_s[t * k + lane] = id;
            if (t + step >= n_tokens)  // this warp's last token: its ids are all staged
                asm volatile("bar.arrive %0, %1;" ::"n"(kMapsBarrier), "r"(blockDim.x) : "memory");
        } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            if (t == first) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
            if (lane < k) {
                unsigned dst = (unsigned)__cvta_generic_to_shared(&ids_s[t * k + lane]);
                unsigned bar = (unsigned)__cvta_generic_to_shared(&remote_ids);
                asm volatile("mapa.shared::cluster.u32 %0, %0, 0;" : "+r"(dst));
                asm volatile("mapa.shared::cluster.u32 %0, %0, 0;" : "+r"(bar));
                asm volatile(
                    "st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];"
                    ::"r"(dst), "r"(id), "r"(bar)
                    : "memory");
            }
#endif
        }
        const float w =
            rt::weigh_token_warp<kMethod, kN>(mine, top, val, sig, k, scale, renormalize, lane);
        if (lane < k) {
            topk_ids[t * k + lane] = id;
            topk_weights[t * k + lane] = w;
        }
    }
}

// General path: one block (256 threads) per token, any E <= 4096, k <= 64. Keys live in shared
// memory; top-k by k rounds of block arg-max (each thread keeps its best key below the last
// winner, so only the winner's thread rescans). Dynamic shared memory: see routing.py.
template <typename T, int kMethod>
__global__ void __launch_bounds__(256) route_block(
    const T* __restrict__ logits, long long ld, int E, int k, int n_group, int topk_group,
    float scale, int renormalize, const float* __restrict__ bias, int* __restrict__ topk_ids,
    float* __restrict__ topk_weights) {
    extern __shared__ uint32_t smem[];
    uint32_t* high = smem;                                          // [E]
    float* val = reinterpret_cast<float*>(smem + E);                // [E]
    float* gscore = reinterpret_cast<float*>(smem + 2 * E);         // [n_group]
    int* flag = reinterpret_cast<int*>(smem + 2 * E + n_group);     // [n_group]
    __shared__ uint64_t red[2][8];
    __shared__ uint64_t chosen[64];
    __shared__ float fred[8];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int t = blockIdx.x;
    const T* row = logits + t * ld;
    for (int e = tid; e < E; e += 256) {
        const float x = cm::to_float(row[e]);
        if constexpr (kMethod == 2) {
            const float c = (x != x) ? RT_NEG_INF : rt::f_add(rt::sigmoid_defined(x), bias[e]);
            val[e] = c;
            high[e] = c == RT_NEG_INF ? 1u : rt::order_bits(c);
        } else {
            val[e] = x;
            high[e] = rt::order_bits(x);
        }
    }
    __syncthreads();
    if constexpr (kMethod == 2) {
        if (n_group > 1 && topk_group < n_group) {
            const int group_size = E / n_group;
            rt::select_groups(val, gscore, flag, n_group, topk_group, group_size, tid, 256, true);
            for (int e = tid; e < E; e += 256)
                if (!flag[e / group_size]) high[e] = 0u;
            __syncthreads();
        }
    }
    auto best_below = [&](uint64_t limit) {
        uint64_t best = 0;
        for (int e = tid; e < E; e += 256) {
            const uint64_t key = rt::make_key(high[e], e);
            best = (key < limit && key > best) ? key : best;
        }
        return best;
    };
    uint64_t best = best_below(~0ull);
    for (int r = 0; r < k; ++r) {
        uint64_t m = best;
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) {
            const uint64_t o = __shfl_xor_sync(rt::kFull, m, s);
            m = o > m ? o : m;
        }
        if (lane == 0) red[r & 1][warp] = m;
        __syncthreads();
        uint64_t win = 0;
#pragma unroll
        for (int w = 0; w < 8; ++w) win = red[r & 1][w] > win ? red[r & 1][w] : win;
        if (tid == 0) chosen[r] = win;
        if (best == win) best = best_below(win);
    }
    __syncthreads();
    const uint32_t top = rt::key_high(chosen[0]);
    float denom_all = 0.0f;
    if constexpr (kMethod == 0) {
        const float m = top ? rt::from_order_bits(top) : 0.0f;
        float part = 0.0f;
        for (int e = tid; e < E; e += 256) part += top ? rt::softmax_numerator(val[e], m) : 0.0f;
        part = rt::warp_sum(part);
        if (lane == 0) fred[warp] = part;
        __syncthreads();
#pragma unroll
        for (int w = 0; w < 8; ++w) denom_all += fred[w];
    }
    if (warp != 0) return;
    int ids[2];
    float num[2];
    float local = 0.0f;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int i = lane + 32 * q;
        const bool slot = i < k;
        const uint64_t key = slot ? chosen[i] : 0ull;
        ids[q] = rt::key_expert(key);
        if constexpr (kMethod == 2) {
            const float x = slot ? cm::to_float(row[ids[q]]) : 0.0f;
            num[q] = (slot && x == x) ? rt::sigmoid_defined(x) : 0.0f;
            local = rt::f_add(local, num[q]);
        } else {
            const float m = top ? rt::from_order_bits(top) : 0.0f;
            const uint32_t h = rt::key_high(key);
            num[q] = (slot && h && top) ? rt::softmax_numerator(rt::from_order_bits(h), m) : 0.0f;
            local += num[q];
        }
    }
    float denom;
    if constexpr (kMethod == 0) {
        denom = denom_all;
    } else if constexpr (kMethod == 1) {
        denom = rt::warp_sum(local);
    } else {
        denom = rt::warp_sum_exact(local);
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int i = lane + 32 * q;
        if (i >= k) continue;
        float w;
        if constexpr (kMethod == 2) {
            const bool nonzero = __float_as_uint(denom) != 0u;
            w = renormalize ? (nonzero ? rt::f_mul(rt::f_div(num[q], denom), scale) : 0.0f)
                            : rt::f_mul(num[q], scale);
        } else {
            w = denom > 0.0f ? num[q] / denom : 0.0f;
        }
        topk_ids[t * k + i] = ids[q];
        topk_weights[t * k + i] = w;
    }
}

// Expert maps, one block (decode sizes and the fallback): see rt::build_maps_block.
__global__ void __launch_bounds__(256) maps_single(const int* __restrict__ ids, int n, int E,
                                                   int* __restrict__ offsets,
                                                   int* __restrict__ sorted_rows,
                                                   int* __restrict__ inverse,
                                                   int* __restrict__ active, int active_len) {
    extern __shared__ int cnt[];  // [E + 1]
    __shared__ long long wsum[32];
    rt::build_maps_block(ids, n, E, offsets, sorted_rows, inverse, active, active_len, cnt, wsum);
}

// ---- large M * k: a deterministic counting sort in four launches ------------------------------
// Tiles of 1024 rows. tile_counts [(E + 1) * n_tiles] (expert-major) lives in sorted_rows until
// the last launch, so the caller guarantees (E + 1) * n_tiles <= n and E <= 1024.
constexpr int kTileRows = 1024;
constexpr int kMaxTileExperts = 1024;

// Grid n_tiles, block 256: warp w ranks rows [w * 128, w * 128 + 128) of the tile with match.any
// into its own counters; a column scan over the 8 warps makes the ranks tile-wide (stable).
__global__ void __launch_bounds__(256) maps_tile_rank(const int* __restrict__ ids, int n, int E,
                                                      int n_tiles, int* __restrict__ tile_counts,
                                                      int* __restrict__ inverse) {
    __shared__ int wcnt[8][kMaxTileExperts + 1];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    for (int e = tid; e <= E; e += 256)
#pragma unroll
        for (int w = 0; w < 8; ++w) wcnt[w][e] = 0;
    __syncthreads();
    const unsigned lower = (1u << lane) - 1u;
    int rank[4], expert[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int i = blockIdx.x * kTileRows + warp * 128 + q * 32 + lane;
        const int e = i < n ? rt::sanitize_expert(ids[i], E) : -1;
        const unsigned peers = __match_any_sync(rt::kFull, e);
        rank[q] = i < n ? wcnt[warp][e] + __popc(peers & lower) : 0;
        expert[q] = e;
        __syncwarp();
        if (i < n && (peers & lower) == 0u) wcnt[warp][e] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    for (int e = tid; e <= E; e += 256) {
        int running = 0;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const int c = wcnt[w][e];
            wcnt[w][e] = running;
            running += c;
        }
        tile_counts[e * n_tiles + blockIdx.x] = running;
    }
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int i = blockIdx.x * kTileRows + warp * 128 + q * 32 + lane;
        if (i < n) inverse[i] = rank[q] + wcnt[warp][expert[q]];
    }
}

// One block of 1024: exclusive scan of tile_counts in place (-> each (expert, tile)'s first row),
// then offsets and the active list.
__global__ void __launch_bounds__(1024) maps_tile_scan(int* __restrict__ tile_counts, int n_tiles,
                                                       int E, int* __restrict__ offsets,
                                                       int* __restrict__ active, int active_len) {
    __shared__ long long wsum[32];
    const int tid = threadIdx.x;
    const int L = (E + 1) * n_tiles;
    int per = (L + 1023) / 1024;
    int b = min(tid * per, L), end = min(b + per, L);
    long long local = 0, total;
    for (int i = b; i < end; ++i) local += tile_counts[i];
    long long excl = rt::block_scan(local, wsum, total);
    for (int i = b; i < end; ++i) {
        const int c = tile_counts[i];
        tile_counts[i] = (int)excl;
        excl += c;
    }
    __syncthreads();
    per = (E + 1 + 1023) / 1024;
    b = min(tid * per, E + 1);
    end = min(b + per, E + 1);
    local = 0;
    for (int e = b; e < end; ++e)
        local += e < E && tile_counts[(e + 1) * n_tiles] > tile_counts[e * n_tiles];
    excl = rt::block_scan(local, wsum, total);
    for (int e = b; e < end; ++e) {
        offsets[e] = tile_counts[e * n_tiles];
        if (e < E && tile_counts[(e + 1) * n_tiles] > tile_counts[e * n_tiles])
            active[excl++] = e;
    }
    for (int a = (int)total + tid; a < active_len; a += 1024) active[a] = -1;
}

// Grid over rows: inverse[i] = first row of (expert, tile) + rank within the tile.
__global__ void maps_tile_place(const int* __restrict__ ids, int n, int E, int n_tiles,
                                const int* __restrict__ tile_starts, int* __restrict__ inverse) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int e = rt::sanitize_expert(ids[i], E);
    inverse[i] += tile_starts[e * n_tiles + i / kTileRows];
}

// Grid over rows: sorted_rows[inverse[i]] = i.
__global__ void maps_scatter(int n, const int* __restrict__ inverse,
                             int* __restrict__ sorted_rows) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) sorted_rows[inverse[i]] = i;
}
