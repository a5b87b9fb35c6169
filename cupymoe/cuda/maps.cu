// SPDX-License-Identifier: Apache-2.0
// Expert maps of top-k ids computed elsewhere: one block for decode sizes, a deterministic
// counting sort in four launches above.
#include "maps.cuh"

// Expert maps in one block of W warps (up to 32; routing/maps.py picks W): see
// rt::build_maps_block.
__global__ void __launch_bounds__(1024) maps_single(const int* __restrict__ ids, int n, int E,
                                                   int* __restrict__ offsets,
                                                   int* __restrict__ sorted_rows,
                                                   int* __restrict__ inverse,
                                                   int* __restrict__ active, int active_len) {
    extern __shared__ int cnt[];  // [(W + 1) * (E + 1)]
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
    int rank[4], expert[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        const int i = blockIdx.x * kTileRows + warp * 128 + q * 32 + lane;
        const int e = i < n ? rt::sanitize_expert(ids[i], E) : -1;
        rank[q] = rt::warp_rank_round(e, i < n, wcnt[warp]);
        expert[q] = e;
    }
    __syncthreads();
    rt::scan_warp_counts(&wcnt[0][0], 8, E + 1, kMaxTileExperts + 1, tile_counts + blockIdx.x, n_tiles);
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
