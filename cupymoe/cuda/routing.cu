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
__device__ __forceinline__ float f_rint(float a) {
    float r;
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

// exp(t) for t in [-150, 150]: Cody-Waite reduction + Cephes polynomial, each step one rounded
// fp32 operation. The constants are given by their bits; routing.py mirrors this function.
__device__ __forceinline__ float exp_defined(float t) {
    const float kLog2e = __uint_as_float(0x3FB8AA3Bu);
    const float kLn2Hi = __uint_as_float(0x3F317200u);  // 15 significant bits: n * kLn2Hi exact
    const float kLn2Lo = __uint_as_float(0x35BFBE8Eu);
    const float n = f_rint(f_mul(t, kLog2e));
    float r = f_sub(t, f_mul(n, kLn2Hi));
    r = f_sub(r, f_mul(n, kLn2Lo));
    float p = __uint_as_float(0x39506967u);  // 1.9875691500e-4
    p = f_add(f_mul(p, r), __uint_as_float(0x3AB743CEu));  // 1.3981999507e-3
    p = f_add(f_mul(p, r), __uint_as_float(0x3C088908u));  // 8.3334519073e-3
    p = f_add(f_mul(p, r), __uint_as_float(0x3D2AA9C1u));  // 4.1665795894e-2
    p = f_add(f_mul(p, r), __uint_as_float(0x3E2AAAAAu));  // 1.6666665459e-1
    p = f_add(f_mul(p, r), __uint_as_float(0x3F000000u));  // 5.0000001201e-1
    p = f_add(f_add(f_mul(p, f_mul(r, r)), r), 1.0f);
    const int ni = (int)n;  // |n| <= 217
    const int n1 = ni >> 1;
    const int n2 = ni - n1;
    return f_mul(f_mul(p, __int_as_float((n1 + 127) << 23)), __int_as_float((n2 + 127) << 23));
}

// sigmoid(x) = 1 / (1 + exp(-x)), x not NaN; -x clamped to [-150, 150] (exp is 0 / inf beyond).
__device__ __forceinline__ float sigmoid_defined(float x) {
    float t = -x;
    t = t < -150.0f ? -150.0f : t;
    t = t > 150.0f ? 150.0f : t;
    return f_rcp(f_add(1.0f, exp_defined(t)));
}

__device__ __forceinline__ uint32_t order_bits(float v) {
    if (v != v) return 0u;  // NaN ranks below every number
    uint32_t u = __float_as_uint(v);
    if (u == 0x80000000u) u = 0u;  // -0 == +0
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
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

// ---- register bitonic top-N ------------------------------------------------------------------
template <int N> __device__ __forceinline__ void sort_descending(uint64_t (&a)[N]) {
#pragma unroll
    for (int k = 2; k <= N; k <<= 1) {
#pragma unroll
        for (int j = k >> 1; j > 0; j >>= 1) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const int l = i ^ j;
                if (l > i) {
                    const bool descending = (i & k) == 0;
                    const uint64_t x = a[i], y = a[l];
                    const bool swap = descending ? (x < y) : (x > y);
                    a[i] = swap ? y : x;
                    a[l] = swap ? x : y;
                }
            }
        }
    }
}
template <int N> __device__ __forceinline__ void clean_descending(uint64_t (&a)[N]) {
#pragma unroll
    for (int j = N >> 1; j > 0; j >>= 1) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int l = i ^ j;
            if (l > i) {
                const uint64_t x = a[i], y = a[l];
                a[i] = x < y ? y : x;
                a[l] = x < y ? x : y;
            }
        }
    }
}
// Every lane ends with the N largest of the warp's 32 * N keys, sorted descending. Merging a
// descending A with a reversed partner B by C[i] = max(A[i], B[N-1-i]) is symmetric in A and B,
// so one xor-shuffle per key leaves both partners with the same top-N.
template <int N> __device__ __forceinline__ void warp_top_n(uint64_t (&a)[N]) {
    sort_descending<N>(a);
#pragma unroll
    for (int step = 1; step < 32; step <<= 1) {
        uint64_t b[N];
#pragma unroll
        for (int i = 0; i < N; ++i) b[i] = __shfl_xor_sync(kFull, a[N - 1 - i], step);
#pragma unroll
        for (int i = 0; i < N; ++i) a[i] = a[i] < b[i] ? b[i] : a[i];
        clean_descending<N>(a);
    }
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

// ---- one token on one warp (E <= 32 * kN <= 256, k <= kN) ------------------------------------
// Lane i < k returns slot i's expert and weight. `scratch` (kMethod 2 only): 512 floats per warp.
template <typename T, int kMethod, int kN>
__device__ __forceinline__ void route_token_warp(const T* __restrict__ row, int E, int k,
                                                 int n_group, int topk_group, float scale,
                                                 int renormalize, const float* __restrict__ bias,
                                                 float* scratch, int lane, int& out_id,
                                                 float& out_weight) {
    uint64_t key[kN];
    float val[kN];
#pragma unroll
    for (int j = 0; j < kN; ++j) {
        const int e = lane + 32 * j;
        val[j] = e < E ? cm::to_float(row[e]) : __int_as_float(0x7fc00000);
    }
    if constexpr (kMethod == 2) {
        float* choice = scratch;
        float* gscore = scratch + kMaxWarpExperts;
        int* flag = reinterpret_cast<int*>(scratch + kMaxWarpExperts + kMaxGroupsWarp);
        const bool grouped = n_group > 1 && topk_group < n_group;
        const int group_size = E / n_group;
        __syncwarp();  // the previous token's readers are done with the scratch
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            const int e = lane + 32 * j;
            const float x = val[j];
            const float c = (x != x) ? RT_NEG_INF : f_add(sigmoid_defined(x), bias[e < E ? e : 0]);
            if (grouped && e < E) choice[e] = c;
            val[j] = c;
        }
        if (grouped) {
            __syncwarp();
            select_groups(choice, gscore, flag, n_group, topk_group, group_size, lane, 32, false);
        }
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            const int e = lane + 32 * j;
            const bool kept = e < E && (!grouped || flag[e / group_size]);
            const uint32_t high = val[j] == RT_NEG_INF ? 1u : order_bits(val[j]);
            key[j] = kept ? make_key(high, e) : 0ull;
        }
    } else {
#pragma unroll
        for (int j = 0; j < kN; ++j) {
            const int e = lane + 32 * j;
            key[j] = e < E ? make_key(order_bits(val[j]), e) : 0ull;
        }
    }
    warp_top_n<kN>(key);
    uint64_t mine = 0;
#pragma unroll
    for (int j = 0; j < kN; ++j) mine = (j == lane) ? key[j] : mine;
    const bool slot = lane < k;
    out_id = key_expert(mine);
    if constexpr (kMethod == 2) {
        const float x = slot ? cm::to_float(row[out_id]) : 0.0f;
        const float s = (slot && x == x) ? sigmoid_defined(x) : 0.0f;
        if (renormalize) {
            const float sum = warp_sum_exact(s);
            out_weight = __float_as_uint(sum) ? f_mul(f_div(s, sum), scale) : 0.0f;
        } else {
            out_weight = f_mul(s, scale);
        }
    } else {
        const uint32_t top = key_high(key[0]);
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

// Routing and the expert maps in ONE launch (decode): one block; warp w routes tokens w, w + W,
// ...; then the maps from the ids staged in shared memory. M * k <= 64, E <= 256, k <= kN.
template <typename T, int kMethod, int kN>
__global__ void __launch_bounds__(256) route_fused(
    const T* __restrict__ logits, long long ld, int n_tokens, int E, int k, int n_group,
    int topk_group, float scale, int renormalize, const float* __restrict__ bias,
    int* __restrict__ topk_ids, float* __restrict__ topk_weights, int* __restrict__ offsets,
    int* __restrict__ sorted_rows, int* __restrict__ inverse, int* __restrict__ active,
    int active_len) {
    __shared__ float scratch[kMethod == 2 ? 8 * 512 : 1];
    __shared__ int ids_s[64];
    __shared__ int cnt[rt::kMaxWarpExperts + 1];
    __shared__ long long wsum[32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_warps = blockDim.x >> 5;
    for (int t = warp; t < n_tokens; t += n_warps) {
        int id;
        float w;
        rt::route_token_warp<T, kMethod, kN>(logits + t * ld, E, k, n_group, topk_group, scale,
                                              renormalize, bias, scratch + warp * 512, lane, id,
                                              w);
        if (lane < k) {
            ids_s[t * k + lane] = id;
            topk_ids[t * k + lane] = id;
            topk_weights[t * k + lane] = w;
        }
    }
    __syncthreads();
    rt::build_maps_block(ids_s, n_tokens * k, E, offsets, sorted_rows, inverse, active,
                         active_len, cnt, wsum);
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
