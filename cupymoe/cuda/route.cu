// SPDX-License-Identifier: Apache-2.0
// Routing launches: one warp per token (E <= 256, k <= 8) or one block per token (any E up to
// 2048, k <= 64), which write only the top-k ids and weights (the maps follow in maps.cu); and,
// above the one-launch sizes of route_fused.cu, the warp routing with the expert maps in two
// launches (route_tiles, then maps_tiles_place).
#include "maps.cuh"
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

// ---- routing and the expert maps above route_fused's sizes: two launches -------------------
// route_tiles: block b routes the tokens [b T, (b + 1) T) of its tile on its W = blockDim.x / 32
// warps (T <= 32: one token per warp; above, 32 warps of T / 32 tokens each), stages their ids
// and ranks the tile's T k <= 1024 rows stably by expert bucket (a 32-row round of match.any per
// ranking warp, then a column scan over those warps). It writes the tile's count per bucket to
// row b of the tile table `work` (G rows of E + 1; any contents before: routing/topk.py,
// route_workspace_words) and each row's rank within the tile to inverse. maps_tiles_place, the
// next launch, places the rows. routing/topk.py (route_tile_tokens) sizes T so that a small
// batch still has a warp per scheduler (a scheduler with several routing warps slows each token
// down) and the table keeps at most 128 tiles. Dynamic shared memory: 512 floats per warp for
// kMethod 2, else none. E <= 256, k <= kN.
constexpr int kTileMaxRows = 1024;

template <typename T, int kMethod, int kN>
__global__ void __launch_bounds__(1024, 1) route_tiles(
    const T* __restrict__ logits, long long ld, int n_tokens, int E, int k, int n_group,
    int topk_group, float scale, int renormalize, const float* __restrict__ bias,
    int* __restrict__ topk_ids, float* __restrict__ topk_weights, int* __restrict__ inverse,
    int tile_tokens, int* __restrict__ work) {
    extern __shared__ float scratch[];  // kMethod 2: 512 floats per warp
    __shared__ int ids_s[kTileMaxRows];
    __shared__ int cnt[32 * 257];  // the ranking warps' bucket counters (E + 1 <= 257)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    const int L = E + 1, first = blockIdx.x * tile_tokens;
    const int tokens = min(tile_tokens, n_tokens - first), R = tokens * k;
    const int W = (R + 31) / 32;  // ranking warps (R <= blockDim.x)
    for (int i = threadIdx.x; i < W * L; i += blockDim.x) cnt[i] = 0;
    cm::wait_upstream();  // the logits, and every buffer written here, belong to earlier kernels
    for (int tl = warp; tl < tokens; tl += n_warps) {
        const int t = first + tl;
        const float* mix = kMethod == 4 ? bias + (size_t)t * E : nullptr;
        int id;
        float w;
        rt::route_token_warp<T, kMethod, kN>(logits + t * ld, E, k, n_group, topk_group, scale,
                                              renormalize, bias, scratch + warp * 512, lane, mix,
                                              id, w);
        if (lane < k) {
            ids_s[tl * k + lane] = id;
            topk_ids[t * k + lane] = id;
            topk_weights[t * k + lane] = w;
        }
    }
    __syncthreads();
    const int r = threadIdx.x;  // the tile's row 32 warp + lane
    const int e = r < R ? rt::sanitize_expert(ids_s[r], E) : -1;
    int rank = 0;
    if (warp < W) rank = rt::warp_rank_round(e, r < R, cnt + warp * L);
    __syncthreads();
    rt::scan_warp_counts(cnt, W, L, L, work + (size_t)blockIdx.x * L, 1);
    __syncthreads();
    if (r < R) inverse[(size_t)first * k + r] = rank + cnt[warp * L + e];
}

// Block g places the rows of tile g (tile_rows = T k of them, one thread each; 1024 threads).
// Every block reads the whole tile table: thread (q, e), q < Q = blockDim.x / (E + 1), sums
// bucket e over the tiles [q C, q C + C), C = ceil(G / Q) (a warp reads consecutive buckets of
// a tile: coalesced; 16 loads in flight), all of them and those before g apart. One scan over
// the buckets' totals gives each bucket's first row; bucket e's first row in tile g adds its
// rows in the tiles before g. Row i's place is that plus its rank within the tile (inverse);
// sorted_rows[place] = i. Block 0 writes the offsets and the active list. Each block repeats
// the table's sums (G (E + 1) words from the L2) instead of waiting for one that has them.
// A programmatic dependent launch: waits for route_tiles.
__global__ void __launch_bounds__(1024) maps_tiles_place(
    const int* __restrict__ ids, int n, int E, int tile_rows, const int* __restrict__ work,
    int* __restrict__ offsets, int* __restrict__ sorted_rows, int* __restrict__ inverse,
    int* __restrict__ active, int active_len) {
    __shared__ int part[2 * 1024];  // per (q, e): the tiles' counts, all / before g
    __shared__ int start[257];
    __shared__ long long wsum[32];
    const int L = E + 1, G = gridDim.x, g = blockIdx.x, tid = threadIdx.x;
    const int Q = blockDim.x / L, q = tid / L, e = tid % L;
    const int C = (G + Q - 1) / Q, g0 = q * C, g1 = q < Q ? min(G, g0 + C) : g0;
    cm::wait_upstream();
    constexpr int kBatch = 16;
    int all = 0, before = 0;
    for (int b = g0; b < g1; b += kBatch) {
        int v[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) v[j] = b + j < g1 ? work[(size_t)(b + j) * L + e] : 0;
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
            all += v[j];
            before += b + j < g ? v[j] : 0;
        }
    }
    if (q < Q) {
        part[q * L + e] = all;
        part[1024 + q * L + e] = before;
    }
    __syncthreads();
    long long local = 0;
    int mine_before = 0;
    if (tid < L) {
        int total = 0;
        for (int p = 0; p < Q; ++p) {
            total += part[p * L + tid];
            mine_before += part[1024 + p * L + tid];
        }
        local = ((long long)total << 16) | (tid < E && total > 0);  // count, active
    }
    long long sum;
    const long long excl = rt::block_scan(local, wsum, sum);
    if (tid < L) {
        start[tid] = (int)(excl >> 16) + mine_before;
        if (g == 0) {
            offsets[tid] = (int)(excl >> 16);
            if (tid < E && (local >> 16) > 0) active[excl & 0xffff] = tid;
        }
    }
    if (g == 0)
        for (int a = (int)(sum & 0xffff) + tid; a < active_len; a += blockDim.x) active[a] = -1;
    __syncthreads();
    const int i = g * tile_rows + tid;
    if (tid >= tile_rows || i >= n) return;
    const int place = start[rt::sanitize_expert(ids[i], E)] + inverse[i];
    inverse[i] = place;
    sorted_rows[place] = i;
}
