// SPDX-License-Identifier: Apache-2.0
// Top-k on a warp: register sorting networks, the warp top-k of selection keys, group selection
// (kMethod 2), and one token routed by one warp (E <= 32 * kN <= 256, k <= kN). kMethod:
// routing_math.cuh.
#pragma once

#include "routing_math.cuh"

namespace rt {

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

// Lane i < k: slot i's weight, from select_token_warp's key and state. `mix`: the token's row
// of the mixing tensor (kMethod 4; unused otherwise).
template <int kMethod, int kN>
__device__ __forceinline__ float weigh_token_warp(uint64_t mine, uint32_t top,
                                                  const float (&val)[kN], const float (&sig)[kN],
                                                  int k, float scale, int renormalize, int lane,
                                                  const float* __restrict__ mix) {
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
    } else if constexpr (kMethod == 3) {
        // Sparse mixer, k = 2: round r's winner logit from lane r's key; every lane adds the
        // numerators of its experts that each round keeps (round 2 drops round 1's winner), one
        // warp sum per round. A NaN winner (key_high 0) gets 0.
        const uint64_t k0 = __shfl_sync(kFull, mine, 0), k1 = __shfl_sync(kFull, mine, 1);
        const uint32_t h0 = key_high(k0), h1 = key_high(k1);
        const int id0 = key_expert(k0);
        const float m0 = h0 ? from_order_bits(h0) : 0.0f, m1 = h1 ? from_order_bits(h1) : 0.0f;
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int j = 0; j < kN; ++j) {  // val past E is NaN: numerator 0
            s0 += sparse_mixer_numerator(val[j], m0);
            s1 += lane * kN + j == id0 ? 0.0f : sparse_mixer_numerator(val[j], m1);
        }
        s0 = warp_sum(s0);
        s1 = warp_sum(s1);
        const uint32_t h = lane == 0 ? h0 : h1;
        out_weight = (slot && h) ? 1.0f / (lane == 0 ? s0 : s1) : 0.0f;  // the winner: s >= 1
    } else if constexpr (kMethod == 4) {
        const float num = slot ? __ldg(mix + out_id) : 0.0f;
        if (renormalize) {
            const float denom = warp_sum(num);
            out_weight = denom > 0.0f ? num / denom : 0.0f;
        } else {
            out_weight = num;
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
                                                 float* scratch, int lane, const float* mix,
                                                 int& out_id, float& out_weight) {
    float val[kN], sig[kN];
    uint32_t top;
    const uint64_t mine = select_token_warp<T, kMethod, kN>(row, E, k, n_group, topk_group, bias,
                                                            scratch, lane, val, sig, top);
    out_id = key_expert(mine);
    out_weight =
        weigh_token_warp<kMethod, kN>(mine, top, val, sig, k, scale, renormalize, lane, mix);
}

}  // namespace rt
