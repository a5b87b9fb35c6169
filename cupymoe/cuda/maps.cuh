// SPDX-License-Identifier: Apache-2.0
// Expert maps of a block or of one warp: a stable counting sort of the flat top-k slots by expert
// (expert_offsets, sorted_rows, inverse, active_experts; see routing/types.py, Routing).
#pragma once

#include "routing_math.cuh"

namespace rt {

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

// One round of a warp's stable ranking: lane l holds a row of expert bucket e (live rows only;
// the dead lanes pass e = -1), the warp's 32 rows are consecutive. Returns the row's rank among
// the rows of its bucket this warp has ranked so far (0 for a dead lane) and adds the round's
// rows to the warp's counters `mine` (shared).
__device__ __forceinline__ int warp_rank_round(int e, bool live, int* mine) {
    const unsigned lower = (1u << (threadIdx.x & 31)) - 1u;
    const unsigned peers = __match_any_sync(kFull, e);
    const int rank = live ? mine[e] + __popc(peers & lower) : 0;
    __syncwarp();
    if (live && (peers & lower) == 0u) mine[e] += __popc(peers);
    __syncwarp();
    return rank;
}

// The column scan that makes the W warps' ranks block-wide: for each bucket e < L, warp w's
// counter cnt[w * stride + e] becomes the bucket's rows in the warps before w, and
// out[e * out_stride] the bucket's total. The block's threads share the buckets.
__device__ __forceinline__ void scan_warp_counts(int* cnt, int W, int L, int stride, int* out,
                                                 int out_stride) {
    for (int e = threadIdx.x; e < L; e += blockDim.x) {
        int running = 0;
        for (int w = 0; w < W; ++w) {
            const int c = cnt[w * stride + e];
            cnt[w * stride + e] = running;
            running += c;
        }
        out[e * out_stride] = running;
    }
}

// ids [n] (global or shared) -> offsets [E+1], sorted_rows [n], inverse [n], active [active_len].
// Warp w of the block's W ranks rows [w * seg, (w + 1) * seg) (seg: n / W rounded up to 32) in
// chunks of 32 with match.any + popc into its own counters; a column scan over the warps makes
// each warp's counter its first rank within the expert, and the ranks stay stable (warps in row
// order, lanes in row order within a chunk). Several warps, because one warp ranking every row
// is a dependent chain of n / 32 match.any rounds (timings: docs/measurements.md, session 20).
// Ids outside [0, E) go to a bucket after the last expert. cnt: shared [(W + 1) * (E + 1)] (the
// warps' counters, then the totals); wsum: shared [32].
__device__ void build_maps_block(const int* ids, int n, int E, int* __restrict__ offsets,
                                 int* __restrict__ sorted_rows, int* __restrict__ inverse,
                                 int* __restrict__ active, int active_len, int* cnt,
                                 long long* wsum) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int W = blockDim.x >> 5, L = E + 1;
    int* const totals = cnt + W * L;
    for (int i = tid; i < (W + 1) * L; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    const int seg = (n + 32 * W - 1) / (32 * W) * 32;
    const int last = min(n, (warp + 1) * seg);
    for (int base = warp * seg; base < last; base += 32) {
        const int i = base + lane;
        const int e = i < last ? sanitize_expert(ids[i], E) : -1;
        const int rank = warp_rank_round(e, i < last, cnt + warp * L);
        if (i < last) inverse[i] = rank;
    }
    __syncthreads();
    scan_warp_counts(cnt, W, L, L, totals, 1);
    __syncthreads();
    // offsets and the active list: one scan over (count << 16 | active) per expert bucket.
    const int per = (L + blockDim.x - 1) / blockDim.x;
    const int b = min(tid * per, L), end = min(b + per, L);
    long long local = 0;
    for (int e = b; e < end; ++e) local += ((long long)totals[e] << 16) | (e < E && totals[e] > 0);
    long long total;
    long long excl = block_scan(local, wsum, total);
    for (int e = b; e < end; ++e) {
        const int c = totals[e];
        offsets[e] = (int)(excl >> 16);
        totals[e] = (int)(excl >> 16);
        if (e < E && c > 0) active[excl & 0xffff] = e;
        excl += ((long long)c << 16) | (e < E && c > 0);
    }
    for (int a = (int)(total & 0xffff) + tid; a < active_len; a += blockDim.x) active[a] = -1;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        const int e = sanitize_expert(ids[i], E);
        const int row = totals[e] + cnt[(i / seg) * L + e] + inverse[i];
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
