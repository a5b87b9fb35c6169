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

// An expert's rows in row tiles of kTile rows; a last remainder of up to kSlack rows joins the
// tile before it (kBN 144: tiles of 128 rows, the last of up to 144), so that an expert of 129
// to 144 rows is one item instead of a full one and a narrow one, which costs about half a full
// one in the consumers' decode (docs/kernels.md, fourteenth round).
//
// Row tiles in order of width, widest first, so that the rounds of items over the persistent
// grid (item_of_round) end on the cheapest items (a block's items take time in proportion to
// their wgmma width, and an expert's last, partial tile is narrower): width class c (c = 0 ..
// kClasses - 1) holds the tiles of width kTile - 32c, 32-row multiples, the last class also every
// narrower one. Class 0 is every full tile and a last tile wider than kTile - 32, the other
// classes at most one tile per expert. A last tile that took a remainder (kTile + 1 .. kBN rows,
// a wider wgmma) is "joined" and comes before them all. The order is the joined tiles in slot
// order, class 0 in slot order, then each further class in slot order; the modelled makespan
// at 32-512 rows per expert gained 5-12 % (docs/kernels.md, tenth round), the joined tiles first
// about 3 % more at 128 rows per expert (fifteenth round).
template <int kBN> struct TileClasses {
    static constexpr int kSlack = kBN > 128 ? kBN - 128 : 0;
    static constexpr int kTile = kBN - kSlack;
    // At most four: 16-bit counters of three partial classes (scan_row_tiles).
    static constexpr int kClasses = kTile >= 64 ? (kTile / 32 < 4 ? kTile / 32 : 4) : 1;
    // The class of an expert's last tile of `rem` rows (0 < rem < kTile).
    __device__ __forceinline__ static int of(int rem) {
        return kClasses == 1 ? 0 : min((kTile - rem) / 32, kClasses - 1);
    }
    // An expert of `rows` rows: its class-0 tiles (the return value), the class of its partial
    // tile in `part` (0: none, or the partial tile is one of the class-0 tiles) and whether its
    // last tile is joined (`joined`; not counted in the return value).
    __device__ __forceinline__ static int split(int rows, int& part, bool& joined) {
        const int full = rows / kTile, rem = rows % kTile;
        joined = kSlack > 0 && full > 0 && rem > 0 && rem <= kSlack;
        if (rem == 0 || joined) {
            part = 0;
            return full - joined;
        }
        part = of(rem);
        return full + (part == 0);
    }
    // Rows of a class-0 tile with `left` rows of its expert from its first on.
    __device__ __forceinline__ static int tile_rows(int left) { return left <= kBN ? left : kTile; }
};

// The row-tile table of a launch in shared memory (scan_row_tiles):
//   tile_start[j] (j < slots)  first class-0 tile of slot j (an exclusive scan),
//   tile_start[slots]          every row tile of the launch,
//   tile_start[slots + 1]      the class-0 tiles,
//   tile_start[slots + 2]      the joined tiles,
//   part_slot[r]               (16-bit, after them) the slot of the r-th tile of classes 1..,
//                              then of the r-th joined tile (an expert has at most one of them).
// In this table the joined tiles come last; locate_item rotates them to the front. (Listed
// first, the extra branch between them and class 0 cost the producer two registers, which it
// does not have at kBN 144.)
// experts/gemm.py row_tiles / schedule_ref is the NumPy transcription; _table_bytes its size.
__device__ __forceinline__ const uint16_t* part_slots(const int* tile_start, int slots) {
    return reinterpret_cast<const uint16_t*>(tile_start + slots + 3);
}

template <int kThreads, int kBN>
__device__ __forceinline__ void scan_row_tiles(const Params& p, int* tile_start) {
    using C = TileClasses<kBN>;
    // Per thread: a contiguous run of slots; the class-0 tile count and the 16-bit counts of
    // partial classes 1..3 and of joined tiles (packed) are scanned together across the block.
    __shared__ int warp_total[kThreads / 32];
    __shared__ unsigned long long warp_part[kThreads / 32];
    const int per = (p.slots + kThreads - 1) / kThreads;
    const int j0 = min((int)threadIdx.x * per, p.slots), j1 = min(j0 + per, p.slots);
    int sum = 0;
    unsigned long long part = 0;
    for (int j = j0; j < j1; ++j) {
        const int e = p.active[j];
        const int rows = e >= 0 && e < p.n_experts ? p.expert_offsets[e + 1] - p.expert_offsets[e] : 0;
        int c;
        bool joined;
        const int count = C::split(rows, c, joined);
        tile_start[j] = count | (c << 29) | ((int)joined << 28);  // until the write pass below
        sum += count;
        if (c) part += 1ull << (16 * (c - 1));
        if (joined) part += 1ull << 48;
    }
    // %laneid rather than threadIdx.x % 32: the wgmma producer's lane arithmetic would otherwise
    // share it and hold it across setmaxnreg, which spills at kBN 144's 56 registers.
    int lane;
    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
    const int warp = threadIdx.x / 32;
    int incl = sum;
    unsigned long long pincl = part;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
        const unsigned long long pv = __shfl_up_sync(0xFFFFFFFFu, pincl, d);
        if (lane >= d) incl += v, pincl += pv;
    }
    if (lane == 31) warp_total[warp] = incl, warp_part[warp] = pincl;
    __syncthreads();
    int run = incl - sum, total0 = 0;
    unsigned long long prun = pincl - part, ptotal = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
        if (w < warp) run += warp_total[w], prun += warp_part[w];
        total0 += warp_total[w];
        ptotal += warp_part[w];
    }
    // Each list's first position in part_slot: the totals of the lists before it (classes
    // 1..3, then the joined tiles).
    const int t1 = (int)(ptotal & 0xFFFF), t2 = (int)((ptotal >> 16) & 0xFFFF);
    const int t3 = (int)((ptotal >> 32) & 0xFFFF), tw = (int)(ptotal >> 48);
    int r1 = (int)(prun & 0xFFFF), r2 = t1 + (int)((prun >> 16) & 0xFFFF);
    int r3 = t1 + t2 + (int)((prun >> 32) & 0xFFFF), rw = t1 + t2 + t3 + (int)(prun >> 48);
    uint16_t* const part_slot = const_cast<uint16_t*>(part_slots(tile_start, p.slots));
    for (int j = j0; j < j1; ++j) {
        const int v = tile_start[j], c = v >> 29;
        tile_start[j] = run;
        run += v & ((1 << 28) - 1);
        if (c == 1) part_slot[r1++] = (uint16_t)j;
        if (c == 2) part_slot[r2++] = (uint16_t)j;
        if (c == 3) part_slot[r3++] = (uint16_t)j;
        if ((v >> 28) & 1) part_slot[rw++] = (uint16_t)j;
    }
    if (threadIdx.x == kThreads - 1) {
        tile_start[p.slots] = total0 + t1 + t2 + t3 + tw;
        tile_start[p.slots + 1] = total0;
        tile_start[p.slots + 2] = tw;
    }
    __syncthreads();
}

// Where item `index` of a launch lies, from the shared row-tile table alone: its slot, its column
// block, and its row tile's index within the expert (-1: the expert's last tile, partial or
// joined). Row tile index / col_blocks in the order of scan_row_tiles, column block the
// remainder.
struct ItemLoc {
    int slot;
    int tile;
    int cblock;
};
template <int kBN>
__device__ __forceinline__ ItemLoc locate_item(const Params& p, const int* tile_start, int col_blocks,
                                               int index) {
    int rt = index / col_blocks;
    ItemLoc loc;
    loc.cblock = index - rt * col_blocks;
    if constexpr (TileClasses<kBN>::kSlack > 0) {
        // The scan lists the joined tiles last; they go first: the row tiles rotated by their count.
        const int all = tile_start[p.slots], joined = tile_start[p.slots + 2];
        rt = rt < joined ? rt + all - joined : rt - joined;
    }
    const int total0 = tile_start[p.slots + 1];
    if (rt < total0) {
        int lo = 0, hi = p.slots;  // tile_start[lo] <= rt < tile_start[hi] (the total at slots)
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (tile_start[mid] <= rt) lo = mid; else hi = mid;
        }
        loc.slot = lo;
        loc.tile = rt - tile_start[lo];
    } else {
        loc.slot = part_slots(tile_start, p.slots)[rt - total0];
        loc.tile = -1;
    }
    return loc;
}

// The items of this block of a persistent grid (the wgmma kernel's walk; experts/gemm.py
// block_items is the transcription). The grid takes the items in rounds of gridDim.x. Where tiles
// take a remainder (kSlack > 0) it takes them in block order on even rounds and in reverse on odd
// ones: over the widest-first order, whose joined tiles cost 1.15 full ones, a plain round-robin
// gives the low blocks the widest item of every round (docs/kernels.md, fifteenth round).
// Elsewhere plainly round-robin (the alternation measured 0-2 % slower at bn 64). Increasing,
// so a block's walk ends at its first index past the items.
template <int kBN> __device__ __forceinline__ int item_of_round(int r) {
    const int b = (int)blockIdx.x, g = (int)gridDim.x;
    return r * g + ((TileClasses<kBN>::kSlack > 0 && (r & 1)) ? g - 1 - b : b);
}
// The item after `index` (one of this block's): the round recomputed rather than a counter held
// across the item loop, for the producer's registers.
template <int kBN> __device__ __forceinline__ int next_item(int index) {
    if constexpr (TileClasses<kBN>::kSlack > 0) return item_of_round<kBN>(index / (int)gridDim.x + 1);
    return index + (int)gridDim.x;
}

// The item at `loc` of expert e = active[loc.slot], whose rows are begin .. end - 1 (its
// expert_offsets): the global loads are the caller's, so that a pipelined caller can issue them
// ahead (gemm_sm90.cu's producer fetches its next item one load per stage).
template <int kBN>
__device__ __forceinline__ Item place_item(const ItemLoc& loc, int e, int begin, int end) {
    using C = TileClasses<kBN>;
    Item it;
    it.e = e;
    it.cblock = loc.cblock;
    if (loc.tile >= 0) {
        it.row0 = begin + loc.tile * C::kTile;
        it.rows = C::tile_rows(end - it.row0);
    } else {  // the expert's last tile: partial (fewer than kTile rows) or joined (kTile + rem)
        const int tile = (end - begin - C::kSlack - 1) / C::kTile;  // 0 when rows <= kSlack
        it.row0 = begin + tile * C::kTile;
        it.rows = end - it.row0;
    }
    return it;
}

// Item `index` of a launch.
template <int kBN>
__device__ __forceinline__ Item decode_item(const Params& p, const int* tile_start, int col_blocks,
                                            int index) {
    const ItemLoc loc = locate_item<kBN>(p, tile_start, col_blocks, index);
    const int e = p.active[loc.slot];
    return place_item<kBN>(loc, e, p.expert_offsets[e], p.expert_offsets[e + 1]);
}

}  // namespace
