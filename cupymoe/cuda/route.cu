// SPDX-License-Identifier: Apache-2.0
// Routing launches that write only the top-k ids and weights (the maps follow in maps.cu): one
// warp per token (E <= 256, k <= 8) or one block per token (any E up to 2048, k <= 64).
#include "topk.cuh"


// One warp per token, 4 tokens per block (block 128). E <= 32 * kN <= 256, k <= kN. `bias`: the
// correction bias [E] (kMethod 2) or the mixing tensor [n_tokens, E] (kMethod 4).
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
    const float* mix = kMethod == 4 ? bias + (size_t)t * E : nullptr;
    rt::route_token_warp<T, kMethod, kN>(logits + t * ld, E, k, n_group, topk_group, scale,
                                          renormalize, bias, scratch + warp * 512, lane, mix, id,
                                          w);
    if (lane < k) {
        topk_ids[t * k + lane] = id;
        topk_weights[t * k + lane] = w;
    }
}

// General path: one block (256 threads) per token, any E <= 4096, k <= 64. Keys live in shared
// memory; top-k by k rounds of block arg-max (each thread keeps its best key below the last
// winner, so only the winner's thread rescans). Dynamic shared memory: see routing/topk.py.
// `bias` as in route_warp. The sparse mixer (kMethod 3, E <= 16) always takes the warp kernels.
template <typename T, int kMethod>
__global__ void __launch_bounds__(256) route_block(
    const T* __restrict__ logits, long long ld, int E, int k, int n_group, int topk_group,
    float scale, int renormalize, const float* __restrict__ bias, int* __restrict__ topk_ids,
    float* __restrict__ topk_weights) {
    static_assert(kMethod != 3, "the sparse mixer runs on the warp kernels");
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
        } else if constexpr (kMethod == 4) {
            num[q] = slot ? bias[(size_t)t * E + ids[q]] : 0.0f;
            local += num[q];
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
    } else if constexpr (kMethod == 1 || kMethod == 4) {
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
        } else if constexpr (kMethod == 4) {
            w = renormalize ? (denom > 0.0f ? num[q] / denom : 0.0f) : num[q];
        } else {
            w = denom > 0.0f ? num[q] / denom : 0.0f;
        }
        topk_ids[t * k + i] = ids[q];
        topk_weights[t * k + i] = w;
    }
}
