// SPDX-License-Identifier: Apache-2.0
// The work items of the grouped GEMM kernels (gemm_fp4.cu: mma.sync, gemm_sm90.cu: wgmma): the
// launch arguments, one item = (row tile of an active expert, column block), the block-wide scan
// of the row tiles over the active experts, and the decode of an item index. Row tiles major:
// concurrent blocks share the activation rows in L2. The NumPy transcription is
// experts/gemm.py: row_tiles / schedule_ref.
#pragma once

#include "common.cuh"
#include "fp4_mma.cuh"

namespace {

// The arguments of one launch.
struct Params {
    const void* x;              // FC1: [tokens, k] (token order); FC2: [rows, k] (expanded order)
    const int* row_source;      // FC1: expanded row -> token * top_k + slot; FC2: nullptr
    const uint8_t* w0;          // FC2 weights / FC1 gate, split layout [E, tiles, chunks, rows, 16]
    const uint8_t* w1;          // FC1 up (same layout); FC2: nullptr
    const uint8_t* scales;      // [E, tiles, chunks, 8 * 2 * 32 / kBlock] (layouts.tile_scales)
    const float* global0;       // [E]
    const float* global1;       // [E] (FC1)
    const float* bias0;         // [E, n] float32 (kBias)
    const float* bias1;         // [E, n] float32 (FC1 with kBias)
    const int* expert_offsets;  // [E + 1]
    const int* active;          // [slots] expert ids with rows, padded with -1
    void* out;                  // [rows, n] of T, expanded order
    int n_experts, slots, n, k, chunks, top_k, scale_shift;
    ActArgs act;
    // The wgmma kernel only (gemm_sm90.cu), 0 elsewhere: FC1 writes h, FC2 reads x, with each
    // whole 128-column stage in the split k order (split_position); FC1 reads x so.
    int permuted_h;
    int permuted_x;
};

// One work item: row tile of an expert and a column block.
struct Item {
    int e;       // expert
    int row0;    // first expanded row of the tile
    int rows;    // rows of the tile (1..kBN)
    int cblock;  // column block: m-tiles cblock * kBMT ..
};

// Block-wide exclusive scan of ceil(rows / kBN) over the active slots into tile_start[0..slots].
template <int kThreads, int kBN>
__device__ __forceinline__ void scan_row_tiles(const Params& p, int* tile_start) {
    __shared__ int warp_total[kThreads / 32];
    const int per = (p.slots + kThreads - 1) / kThreads;
    const int j0 = min((int)threadIdx.x * per, p.slots), j1 = min(j0 + per, p.slots);
    int sum = 0;
    for (int j = j0; j < j1; ++j) {
        const int e = p.active[j];
        const int rows = e >= 0 && e < p.n_experts ? p.expert_offsets[e + 1] - p.expert_offsets[e] : 0;
        const int count = (rows + kBN - 1) / kBN;
        tile_start[j] = count;
        sum += count;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int incl = sum;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
        if (lane >= d) incl += v;
    }
    if (lane == 31) warp_total[warp] = incl;
    __syncthreads();
    int run = incl - sum;
    for (int w = 0; w < warp; ++w) run += warp_total[w];
    for (int j = j0; j < j1; ++j) {
        const int count = tile_start[j];
        tile_start[j] = run;
        run += count;
    }
    if (threadIdx.x == kThreads - 1) tile_start[p.slots] = run;
    __syncthreads();
}

// Item `index` of a launch: row tile index / col_blocks of the scanned slots, column block the
// remainder (tile_start from scan_row_tiles).
template <int kBN>
__device__ __forceinline__ Item decode_item(const Params& p, const int* tile_start, int col_blocks,
                                            int index) {
    const int rt = index / col_blocks;
    int lo = 0, hi = p.slots;  // tile_start[lo] <= rt < tile_start[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (tile_start[mid] <= rt) lo = mid; else hi = mid;
    }
    Item it;
    it.e = p.active[lo];
    const int begin = p.expert_offsets[it.e];
    const int end = p.expert_offsets[it.e + 1];
    it.row0 = begin + (rt - tile_start[lo]) * kBN;
    it.rows = min(kBN, end - it.row0);
    it.cblock = index - rt * col_blocks;
    return it;
}

}  // namespace
