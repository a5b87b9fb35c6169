// SPDX-License-Identifier: Apache-2.0
// The small-batch routing: top-k and the expert maps in one launch (M * k <= 512, E <= 256,
// k <= 8).
#include "maps.cuh"
#include "topk.cuh"

// Routing and the expert maps in ONE launch (decode). A cluster of C blocks (C = 1: a plain
// launch; C > 1 needs sm_90 and a cluster launch), each of W routing warps and one maps warp (the
// last). Block r routes tokens r, r + C, ...; routing warp w of block r takes every (C W)-th of
// them from r + C w. Block 0's maps warp builds the maps from the ids staged in block 0's shared
// memory: its own routing warps stage theirs and arrive on barrier 1 (then go on to the token's
// weights); the other blocks' warps store theirs there with st.async, which counts the bytes on
// an mbarrier of block 0 (no release fence: with mbarrier.arrive.release.cluster instead, the
// launch took 0.15 us longer at M = 2 .. 8). The maps warps of blocks r > 0 only exit. Several
// blocks are for the issue slots: with two routing warps on a scheduler every phase of a token
// slows down (routing/topk.py: fused_cluster_size). M * k <= kFusedRows, E <= 256, k <= kN,
// W <= 8. Above 64 rows (kWarpRows) the maps take the whole of block 0 instead of its maps warp
// (rt::build_maps_block over the staged ids, once its routing warps are done): one launch
// instead of a routing launch and a maps launch (docs/kernels.md, Routing).
// `bias`: the correction bias [E] (kMethod 2) or the mixing tensor [n_tokens, E] (kMethod 4).
constexpr int kMapsBarrier = 1;
constexpr int kWarpRows = 64, kFusedRows = 512;
// The block maps' counters: a row of E + 1 per warp and the totals (9 warps, E <= 256).
constexpr int kBlockMapWords = 10 * 257;
constexpr int kMapWords = kBlockMapWords > rt::kWarpMapWords ? kBlockMapWords : rt::kWarpMapWords;

// (blocks in this block's cluster, its rank there): (1, 0) without a cluster launch or sm_90.
__device__ __forceinline__ uint2 cluster_place() {
    uint2 c = make_uint2(1u, 0u);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_nctarank;\n\tmov.u32 %1, %%cluster_ctarank;"
        : "=r"(c.x), "=r"(c.y));
#endif
    return c;
}

// Block 0: waits until the other blocks' ids have landed in its shared memory (their st.async
// bytes, counted on the mbarrier `remote`).
__device__ __forceinline__ void wait_remote_ids(unsigned long long* remote, int n_cta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (n_cta > 1) {
        const unsigned bar = (unsigned)__cvta_generic_to_shared(remote);
        unsigned done = 0;
        while (!done)
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, "
                "[%1], 0; selp.u32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(bar)
                : "memory");
    }
#else
    (void)remote, (void)n_cta;
#endif
}

// A routing warp's tokens (route_fused): top-k, ids staged in block 0 (its own shared memory,
// or st.async into it from the other blocks of the cluster), ids and weights to global memory.
template <typename T, int kMethod, int kN>
__device__ __forceinline__ void route_tokens(const T* logits, long long ld, int n_tokens, int E,
                                             int k, int n_group, int topk_group, float scale,
                                             int renormalize, const float* bias, int* topk_ids,
                                             float* topk_weights, int* ids_s, float* scratch,
                                             unsigned long long* remote_ids, bool by_block,
                                             int rank, int n_cta, int warp, int n_route, int lane) {
    const int first = rank + n_cta * warp, step = n_cta * n_route;
    if (rank == 0 && !by_block && first >= n_tokens)
        asm volatile("bar.arrive %0, %1;" ::"n"(kMapsBarrier), "r"(blockDim.x) : "memory");
    for (int t = first; t < n_tokens; t += step) {
        float val[kN], sig[kN];
        uint32_t top;
        const uint64_t mine = rt::select_token_warp<T, kMethod, kN>(
            logits + t * ld, E, k, n_group, topk_group, bias, scratch, lane, val, sig, top);
        const int id = rt::key_expert(mine);
        if (rank == 0) {
            if (lane < k) ids_s[t * k + lane] = id;
            if (!by_block && t + step >= n_tokens)  // this warp's last token: its ids are staged
                asm volatile("bar.arrive %0, %1;" ::"n"(kMapsBarrier), "r"(blockDim.x) : "memory");
        } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            if (t == first) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
            if (lane < k) {
                unsigned dst = (unsigned)__cvta_generic_to_shared(&ids_s[t * k + lane]);
                unsigned bar = (unsigned)__cvta_generic_to_shared(remote_ids);
                asm volatile("mapa.shared::cluster.u32 %0, %0, 0;" : "+r"(dst));
                asm volatile("mapa.shared::cluster.u32 %0, %0, 0;" : "+r"(bar));
                asm volatile(
                    "st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];"
                    ::"r"(dst), "r"(id), "r"(bar)
                    : "memory");
            }
#endif
        }
        const float* mix = kMethod == 4 ? bias + (size_t)t * E : nullptr;
        const float w = rt::weigh_token_warp<kMethod, kN>(mine, top, val, sig, k, scale,
                                                          renormalize, lane, mix);
        if (lane < k) {
            topk_ids[t * k + lane] = id;
            topk_weights[t * k + lane] = w;
        }
    }
}

template <typename T, int kMethod, int kN>
__global__ void __launch_bounds__(288) route_fused(
    const T* __restrict__ logits, long long ld, int n_tokens, int E, int k, int n_group,
    int topk_group, float scale, int renormalize, const float* __restrict__ bias,
    int* __restrict__ topk_ids, float* __restrict__ topk_weights, int* __restrict__ offsets,
    int* __restrict__ sorted_rows, int* __restrict__ inverse, int* __restrict__ active,
    int active_len) {
    __shared__ float scratch[kMethod == 2 ? 8 * 512 : 1];
    __shared__ int ids_s[kFusedRows];
    __shared__ __align__(16) int cnt[kMapWords];
    __shared__ long long wsum[32];
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
    const int n = n_tokens * k;
    const bool by_block = n > kWarpRows;  // uniform
    if (warp == n_route) {
        if (rank != 0) return;
        if (!by_block) {
            rt::zero_map_counts(cnt, lane, n);
            asm volatile("bar.sync %0, %1;" ::"n"(kMapsBarrier), "r"(blockDim.x) : "memory");
            wait_remote_ids(&remote_ids, n_cta);
            rt::build_maps_warp(ids_s, n, E, offsets, sorted_rows, inverse, active, active_len,
                                cnt);
            return;
        }
    } else {
        route_tokens<T, kMethod, kN>(logits, ld, n_tokens, E, k, n_group, topk_group, scale,
                                     renormalize, bias, topk_ids, topk_weights, ids_s,
                                     scratch + warp * 512, &remote_ids, by_block, rank, n_cta,
                                     warp, n_route, lane);
    }
    // Above kWarpRows rows block 0's maps warp and routing warps build the maps together, from
    // one call site: its barriers are the whole block's.
    if (by_block && rank == 0) {
        wait_remote_ids(&remote_ids, n_cta);
        __syncthreads();  // block 0's own ids are staged
        rt::build_maps_block(ids_s, n, E, offsets, sorted_rows, inverse, active, active_len, cnt,
                             wsum);
    }
}
