// SPDX-License-Identifier: Apache-2.0
// Grouped FP4 expert GEMM on tensor cores, for batches above the GEMV window: FC1 with the gated
// activation fused (gemm_fc1), FC1 with a non-gated activation (gemm_fc1_single) and FC2
// (gemm_fc2). Same functions and numerics as gemv_fp4.cu:
//
//   FC2:  out[r, n] = sum_k x[r, k] * W[e, n, k] + bias[e, n]                 for rows r of expert e
//   FC1:  out[r, n] = act(x[t, :] . Wg[e, n, :] + bg[e, n],  x[t, :] . Wu[e, n, :] + bu[e, n])
//         with t = row_source[r] / top_k (x is read in token order: no expand launch)
//   FC1, non-gated:  out[r, n] = act(x[t, :] . W[e, n, :] + bias[e, n])  (FC2's tiles, FC1's rows)
//
// Operands. The weights are the A operand, the tokens the N dimension: a block tile is kBM weight
// rows (kBM / 16 m-tiles; FC1 m-tile = 8 gate + 8 up rows of the same 8 columns, as in the GEMV)
// times kBN expanded rows of one expert, so an expert with few rows wastes at most one n-tile of 8
// per warp, never a 64- or 128-row tile. Weights are read in the split layout (the one resident
// copy, experts/layouts.py: gemv_layout): 16 rows x 128 codes of one m-tile are 1 KB of contiguous
// bytes, copied verbatim into shared memory, where the lane (g, t) finds row g of chunk t at the same
// rotated slot (g + 2t) % 8 as the GEMV does in global memory (conflict-free 16-byte reads).
// Activations are gathered through the expert map into shared memory, 16 bytes per row piece, the
// piece index XOR-swizzled so the B-fragment reads of a quarter warp hit eight bank groups.
//
// Pipeline. Every block is persistent: it walks work items i = blockIdx.x + j * gridDim.x, item =
// (row tile of an active expert, column block), row tiles major so concurrent blocks share the
// activation rows in L2. The row tiles of each active expert come from the expert maps on the
// device (a block-wide scan over the active list, once per block, widest tiles first:
// gemm_items.cuh): no host read, every token count capturable. The K loop runs kStages-deep
// cp.async stages of 128 codes; the copy cursor runs kStages - 1 stages ahead across item
// boundaries, so one item's epilogue overlaps the next item's first loads.
//
// Warps. kWarpsM x kWarpsN warps; warp (wm, wn) owns kMT m-tiles and kNT n-tiles. Per stage a lane
// reads the 2 x 16 bytes of its rows g, g + 8 of chunk t of each m-tile, decodes each 8-code word
// once (Decoder + exact 16-bit block-scale multiply, fp4_mma.cuh) and feeds it to kNT n-tiles:
// decode work is shared by kNT * 8 tokens, B fragments by kMT m-tiles. fp32 accumulators; each
// output's K sum runs in one fixed order (bitwise deterministic).
#include "common.cuh"
#include "fp4_mma.cuh"
#include "gemm_items.cuh"

namespace {

constexpr int kChunk = 32;             // codes per 16-byte row piece of the split layout
constexpr int kStageChunks = 4;        // chunks per pipeline stage: chunk t for lane t
constexpr int kStageCodes = kChunk * kStageChunks;
constexpr int kMTileBytes = 1024;      // one m-tile (16 weight rows) x 128 codes
constexpr int kXRowBytes = kStageCodes * 2;  // one activation row of a stage: 16 pieces

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared; valid = false writes 16 zero bytes and reads none.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kPending> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// Shared-memory reads as plain C++ loads (not volatile asm): the compiler may then schedule them
// freely between the barriers, e.g. the next quarter's activations ahead of this quarter's mmas.
__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ uint32_t lds32(const uint8_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
__device__ __forceinline__ uint32_t lds16(const uint8_t* p) { return *reinterpret_cast<const uint16_t*>(p); }

// Swizzled 16-byte piece of an activation row in shared memory: piece p = 4 t + q of row n. The
// eight lanes of a quarter warp read pieces 4t + q (t = 0..3) of two adjacent rows; flipping bit 0
// by bit 3 of p and bit 1 by the row's parity sends them to eight different bank groups.
__device__ __forceinline__ int x_piece(int p, int row) {
    return p ^ ((p >> 3) & 1) ^ ((row & 1) << 1);
}

template <int kFormat, typename T, int kAct, bool kBias, int kWarpsM, int kWarpsN, int kMT,
          int kNT, int kStages>
struct Gemm {
    using Dec = Decoder<T, kSplit>;
    // kAct (fp4_mma.cuh): 0 FC2, 1..3 gated FC1 (m-tile = 8 columns x gate, up), 4..7 non-gated
    // FC1 (FC2's m-tiles and epilogue, plus the activation).
    static constexpr bool kGated = kAct >= 1 && kAct <= 3;
    static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
    static constexpr int kBMT = kWarpsM * kMT;          // m-tiles per block
    static constexpr int kBN = kWarpsN * kNT * 8;       // expanded rows per block tile
    static constexpr int kBlock = cm::FormatTraits<kFormat>::kBlock;
    static constexpr int kScaleBytes = 2 * kChunk / kBlock;       // per lane row: 4 or 2
    static constexpr int kScaleChunkBytes = 8 * kScaleBytes;      // per m-tile and chunk
    static constexpr int kScaleTileBytes = kStageChunks * kScaleChunkBytes;  // per m-tile, stage
    static constexpr int kRowsPerTile = kGated ? 8 : 16;          // rows of one matrix per m-tile
    static constexpr int kABytes = kBMT * kMTileBytes;
    static constexpr int kSBytes = kBMT * kScaleTileBytes;
    static constexpr int kXBytes = kBN * kXRowBytes;
    static constexpr int kStageBytes = kABytes + kSBytes + kXBytes;
    // Pieces of 16 bytes one stage copies, and how many per thread.
    static constexpr int kAPieces = kABytes / 16, kSPieces = kSBytes / 16, kXPieces = kXBytes / 16;
    static constexpr int kXRowsPerThread = kXPieces / kThreads;  // rows a thread copies
    static_assert(kXPieces % kThreads == 0, "x pieces: whole passes");
    static_assert(kSPieces <= kThreads, "scale pieces: one pass");
    static_assert(kStages >= 2, "kStages: at least double buffering");
    // bf16's split decode gives code * 2^-126: the table carries 2^116 (as in the GEMV).
    static constexpr int kTableShift = Dec::kExp == -126 ? 116 : 0;

    const Params& p;
    uint8_t* smem;
    const int* tile_start;  // the row-tile table (gemm_items.cuh scan_row_tiles; shared)
    const uint32_t* table;  // 256 scale-table entries (shared)
    int col_blocks, tiles, ksteps, n_items;

    __device__ __forceinline__ Item item(int index) const {
        return decode_item<kBN>(p, tile_start, col_blocks, index);
    }

    __device__ __forceinline__ size_t expert_bytes() const {
        return (size_t)tiles * kRowsPerTile * p.chunks * 16;
    }

    // What this thread copies for one item: source pointers at K step 0 (nullptr: nothing to read,
    // the piece is zero-filled). The piece indices are fixed per thread (kThreads is a multiple of
    // 64), so an item costs one pointer computation per piece and a K step one add.
    static constexpr int kAPer = kAPieces / kThreads;  // weight pieces per thread and stage
    static_assert(kAPieces % kThreads == 0 && kThreads % 64 == 0, "weight pieces: whole passes");
    static constexpr int kAStride = kStageChunks * (kGated ? 128 : 256);  // bytes per K step
    static constexpr int kSStride = kStageChunks * kScaleChunkBytes;
    struct Copy {
        const uint8_t* a[kAPer];
        const uint8_t* s;
        const T* x[kXRowsPerThread];
    };

    // Chunk (0..3) of the stage that this thread's weight pieces and scale piece belong to.
    __device__ __forceinline__ int a_chunk() const {
        return kGated ? (threadIdx.x % 32) / 8 : (threadIdx.x % 64) / 16;
    }
    __device__ __forceinline__ int s_chunk() const {
        return (threadIdx.x % (kScaleTileBytes / 16)) * 16 / kScaleChunkBytes;
    }

    __device__ __forceinline__ void prepare(const Item& it, Copy& c) const {
        const size_t eb = (size_t)it.e * expert_bytes();
#pragma unroll
        for (int j = 0; j < kAPer; ++j) {
            const int i = threadIdx.x + j * kThreads;
            const int mt = i / 64, piece = i % 64;
            const int tile = it.cblock * kBMT + mt;
            const uint8_t* base = kGated && piece >= 32 ? p.w1 : p.w0;
            const size_t off = kGated ? (size_t)tile * p.chunks * 128 + (piece % 32) * 16
                                      : (size_t)tile * p.chunks * 256 + piece * 16;
            c.a[j] = tile < tiles ? base + eb + off : nullptr;
        }
        {
            constexpr int kPer = kScaleTileBytes / 16;  // pieces per m-tile
            const int mt = threadIdx.x / kPer, piece = threadIdx.x % kPer;
            const int tile = it.cblock * kBMT + mt;
            const size_t sb = (size_t)it.e * tiles * p.chunks * kScaleChunkBytes;
            c.s = threadIdx.x < kSPieces && tile < tiles
                      ? p.scales + sb + (size_t)tile * p.chunks * kScaleChunkBytes + piece * 16
                      : nullptr;
        }
        const T* x = static_cast<const T*>(p.x);
#pragma unroll
        for (int j = 0; j < kXRowsPerThread; ++j) {
            const int n = (threadIdx.x + j * kThreads) / 16;
            const int r = it.row0 + n;
            const int src = p.row_source ? p.row_source[r < it.row0 + it.rows ? r : it.row0] / p.top_k : r;
            c.x[j] = n < it.rows ? x + (size_t)src * p.k + (threadIdx.x % 16) * 8 : nullptr;
        }
    }

    // Issue the copies of stage `slot` for K step `ks`.
    __device__ __forceinline__ void load(int slot, int ks, const Copy& c) const {
        uint8_t* stage = smem + slot * kStageBytes;
        const bool a_live = ks * kStageChunks + a_chunk() < p.chunks;
#pragma unroll
        for (int j = 0; j < kAPer; ++j) {
            const bool valid = a_live && c.a[j] != nullptr;
            cp_async16(smem_u32(stage + (threadIdx.x + j * kThreads) * 16),
                       valid ? c.a[j] + ks * kAStride : p.w0, valid);
        }
        if (kSPieces >= kThreads || threadIdx.x < kSPieces) {
            const bool valid = c.s != nullptr && ks * kStageChunks + s_chunk() < p.chunks;
            cp_async16(smem_u32(stage + kABytes + threadIdx.x * 16),
                       valid ? c.s + ks * kSStride : p.scales, valid);
        }
        const int piece = threadIdx.x % 16;
        const bool k_live = ks * kStageCodes + piece * 8 < p.k;
#pragma unroll
        for (int j = 0; j < kXRowsPerThread; ++j) {
            const int n = (threadIdx.x + j * kThreads) / 16;
            const bool valid = k_live && c.x[j] != nullptr;
            cp_async16(smem_u32(stage + kABytes + kSBytes + n * kXRowBytes + x_piece(piece, n) * 16),
                       valid ? c.x[j] + ks * kStageCodes : static_cast<const T*>(p.x), valid);
        }
    }

    // The decodes and mmas of one stage.
    __device__ __forceinline__ void compute(int slot, float (&acc)[kMT][kNT][4]) const {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int wm = warp % kWarpsM, wn = warp / kWarpsM;
        const int g = lane / 4, t = lane % 4;
        const uint8_t* const stage = smem + slot * kStageBytes;
        const uint8_t* const sx = stage + kABytes + kSBytes;
        uint4 wv[kMT][2];
        uint32_t sv[kMT];
#pragma unroll
        for (int i = 0; i < kMT; ++i) {
            const int mt = wm * kMT + i;
            // Row g of chunk t at slot (g + 2t) % 8 of its group of 8 (layouts.split_slot).
            const int slot_g = (g + 2 * t) % 8;
            const uint8_t* const a = stage + mt * kMTileBytes +
                               (kGated ? t * 128 + slot_g * 16 : t * 256 + slot_g * 16);
            wv[i][0] = lds128(a);
            wv[i][1] = lds128(a + (kGated ? 512 : 128));  // up row g / row g + 8
            const uint8_t* const s = stage + kABytes + mt * kScaleTileBytes + t * kScaleChunkBytes +
                               g * kScaleBytes;
            sv[i] = kScaleBytes == 4 ? lds32(s) : lds16(s);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint4 xb[kNT];
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
                const int row = (wn * kNT + j) * 8 + g;
                xb[j] = lds128(sx + row * kXRowBytes + x_piece(4 * t + q, row) * 16);
            }
#pragma unroll
            for (int i = 0; i < kMT; ++i) {
                const uint32_t w0[4] = {wv[i][0].x, wv[i][0].y, wv[i][0].z, wv[i][0].w};
                const uint32_t w1[4] = {wv[i][1].x, wv[i][1].y, wv[i][1].z, wv[i][1].w};
                // Scale bytes: NVFP4 {g blk0, g blk1, g+8 blk0, g+8 blk1}; MXFP4 {g, g+8}.
                const int b0 = kScaleBytes == 4 ? q / 2 : 0;
                const uint32_t s0 = table[prmt(sv[i], 0u, 0x4440u + b0)];
                const uint32_t s1 = table[prmt(sv[i], 0u, 0x4440u + b0 + kScaleBytes / 2)];
                uint32_t h0[4], h1[4];
                Dec::run(w0[q], h0);
                Dec::run(w1[q], h1);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    h0[u] = mul2(h0[u], s0, T());
                    h1[u] = mul2(h1[u], s1, T());
                }
                const uint32_t a_lo[4] = {h0[0], h1[0], h0[1], h1[1]};  // codes 8q + 0..3
                const uint32_t a_hi[4] = {h0[2], h1[2], h0[3], h1[3]};  // codes 8q + 4..7
#pragma unroll
                for (int j = 0; j < kNT; ++j) {
                    mma(acc[i][j], a_lo, xb[j].x, xb[j].y, T());
                    mma(acc[i][j], a_hi, xb[j].z, xb[j].w, T());
                }
            }
        }
    }

    // Scale, bias, activation, store; C fragment: (row g, tokens 2t, 2t+1), (row g + 8, same).
    __device__ __forceinline__ void epilogue(const Item& it, const float (&acc)[kMT][kNT][4]) const {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int wm = warp % kWarpsM, wn = warp / kWarpsM;
        const int g = lane / 4, t = lane % 4;
        const int post = -(Dec::kExp + kTableShift + p.scale_shift);
        const float f0 = ldexpf(p.global0[it.e], post);
        const float f1 = kGated ? ldexpf(p.global1[it.e], post) : 0.0f;
        T* out = static_cast<T*>(p.out);
#pragma unroll
        for (int i = 0; i < kMT; ++i) {
            const int tile = it.cblock * kBMT + wm * kMT + i;
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
                const int n0 = (wn * kNT + j) * 8 + 2 * t;
                if constexpr (kGated) {
                    const int col = tile * 8 + g;
                    if (col >= p.n) continue;
                    const float bg = kBias ? p.bias0[(size_t)it.e * p.n + col] : 0.0f;
                    const float bu = kBias ? p.bias1[(size_t)it.e * p.n + col] : 0.0f;
#pragma unroll
                    for (int u = 0; u < 2; ++u)
                        if (n0 + u < it.rows)
                            out[(size_t)(it.row0 + n0 + u) * p.n + col] = cm::from_float<T>(
                                activate<kAct>(acc[i][j][u] * f0 + bg, acc[i][j][2 + u] * f1 + bu,
                                               p.act));
                } else {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int col = tile * 16 + g + 8 * h;
                        if (col >= p.n) continue;
                        const float b = kBias ? p.bias0[(size_t)it.e * p.n + col] : 0.0f;
#pragma unroll
                        for (int u = 0; u < 2; ++u)
                            if (n0 + u < it.rows)
                                out[(size_t)(it.row0 + n0 + u) * p.n + col] = cm::from_float<T>(
                                    activate1<kAct>(acc[i][j][2 * h + u] * f0 + b, p.act));
                    }
                }
            }
        }
    }
};

template <int kFormat, typename T, int kAct, bool kBias, int kWarpsM, int kWarpsN, int kMT,
          int kNT, int kStages>
__device__ __forceinline__ void gemm_body(const Params& p) {
    using G = Gemm<kFormat, T, kAct, kBias, kWarpsM, kWarpsN, kMT, kNT, kStages>;
    constexpr int kThreads = G::kThreads;
    extern __shared__ __align__(16) uint8_t dyn_smem[];
    __shared__ uint32_t table[256];
    int* tile_start = reinterpret_cast<int*>(dyn_smem + kStages * G::kStageBytes);

    for (int i = threadIdx.x; i < 256; i += kThreads) {
        const uint32_t b = scale_bits<kFormat, T>(i, G::kTableShift + p.scale_shift);
        table[i] = b | (b << 16);
    }
    // Programmatic dependent launch: FC1 follows the routing and waits before it reads the maps;
    // FC2 follows FC1, so the maps are complete when it starts and it scans them before its wait.
    if constexpr (kAct != 0) cm::wait_upstream();
    scan_row_tiles<kThreads, G::kBN>(p, tile_start);  // ends with a barrier (table too)
    if constexpr (kAct == 0) cm::wait_upstream();

    G gemm{p, dyn_smem, tile_start, table, 0, 0, 0, 0};
    const int tiles = (p.n + G::kRowsPerTile - 1) / G::kRowsPerTile;
    gemm.tiles = tiles;
    gemm.col_blocks = (tiles + G::kBMT - 1) / G::kBMT;
    gemm.ksteps = (p.chunks + kStageChunks - 1) / kStageChunks;
    gemm.n_items = tile_start[p.slots] * gemm.col_blocks;
    const int mine = blockIdx.x < gemm.n_items
                         ? (gemm.n_items - 1 - (int)blockIdx.x) / (int)gridDim.x + 1
                         : 0;
    const int steps = mine * gemm.ksteps;
    if (steps == 0) return;

    // Copy cursor: item index, its K step, its decoded item and this thread's row sources.
    int load_index = blockIdx.x, load_ks = 0;
    Item load_item = gemm.item(load_index);
    typename G::Copy copy;
    gemm.prepare(load_item, copy);
    const auto advance_load = [&]() {
        if (++load_ks == gemm.ksteps) {
            load_ks = 0;
            load_index += gridDim.x;
            if (load_index < gemm.n_items) {
                load_item = gemm.item(load_index);
                gemm.prepare(load_item, copy);
            }
        }
    };
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
        if (s < steps) {
            gemm.load(s, load_ks, copy);
            advance_load();
        }
        cp_async_commit();
    }

    int index = blockIdx.x, ks = 0;
    Item cur = gemm.item(index);
    float acc[kMT][kNT][4];
    const auto zero = [&]() {
#pragma unroll
        for (int i = 0; i < kMT; ++i)
#pragma unroll
            for (int j = 0; j < kNT; ++j)
#pragma unroll
                for (int u = 0; u < 4; ++u) acc[i][j][u] = 0.0f;
    };
    zero();
    for (int s = 0; s < steps; ++s) {
        cp_async_wait<kStages - 2>();
        __syncthreads();  // stage s is complete for all; stage s - 1 is free
        const int next = s + kStages - 1;
        if (next < steps) {
            gemm.load(next % kStages, load_ks, copy);
            advance_load();
        }
        cp_async_commit();
        gemm.compute(s % kStages, acc);
        if (++ks == gemm.ksteps) {
            gemm.epilogue(cur, acc);
            zero();
            ks = 0;
            index += gridDim.x;
            if (index < gemm.n_items) cur = gemm.item(index);
        }
    }
    cp_async_wait<0>();
}

}  // namespace

// FC2: persistent grid (at most one block per resident slot), block = 32 * kWarpsM * kWarpsN;
// dynamic shared memory = kStages stages + the row-tile table (experts/gemm.py computes it).
template <int kFormat, typename T, bool kBias, int kWarpsM, int kWarpsN, int kMT, int kNT,
          int kStages>
__global__ void __launch_bounds__(32 * kWarpsM * kWarpsN, 1)
    gemm_fc2(const T* __restrict__ x, const uint8_t* __restrict__ w,
             const uint8_t* __restrict__ scales, const float* __restrict__ global_scale,
             const float* __restrict__ bias, const int* __restrict__ expert_offsets,
             const int* __restrict__ active, T* __restrict__ out, int n_experts, int slots, int n,
             int k, int chunks, int scale_shift) {
    const Params p{x,      nullptr, w,     nullptr,   scales, global_scale,
                   nullptr, bias,   nullptr, expert_offsets, active, out,
                   n_experts, slots, n,    k,         chunks, 1,
                   scale_shift, {0.0f, 0.0f, 0.0f}};
    gemm_body<kFormat, T, 0, kBias, kWarpsM, kWarpsN, kMT, kNT, kStages>(p);
}

// FC1 with a non-gated activation (kAct 4 relu, 5 gelu, 6 silu, 7 identity): FC2's tiles (one
// matrix [E, n, k]), x in token order through row_source, FC1's wait.
template <int kFormat, typename T, int kAct, bool kBias, int kWarpsM, int kWarpsN, int kMT,
          int kNT, int kStages>
__global__ void __launch_bounds__(32 * kWarpsM * kWarpsN, 1)
    gemm_fc1_single(const T* __restrict__ x, const int* __restrict__ row_source,
                    const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales,
                    const float* __restrict__ global_scale, const float* __restrict__ bias,
                    const int* __restrict__ expert_offsets, const int* __restrict__ active,
                    T* __restrict__ out, int n_experts, int slots, int n, int k, int chunks,
                    int top_k, int scale_shift) {
    static_assert(kAct >= 4 && kAct <= 7, "kAct: 4 relu, 5 gelu, 6 silu, 7 identity");
    const Params p{x,      row_source, w,     nullptr,   scales, global_scale,
                   nullptr, bias,   nullptr, expert_offsets, active, out,
                   n_experts, slots, n,    k,         chunks, top_k,
                   scale_shift, {0.0f, 0.0f, 0.0f}};
    gemm_body<kFormat, T, kAct, kBias, kWarpsM, kWarpsN, kMT, kNT, kStages>(p);
}

// FC1: as FC2; an m-tile is 8 output columns (gate and up rows of each); x in token order.
template <int kFormat, typename T, int kAct, bool kBias, int kWarpsM, int kWarpsN, int kMT,
          int kNT, int kStages>
__global__ void __launch_bounds__(32 * kWarpsM * kWarpsN, 1)
    gemm_fc1(const T* __restrict__ x, const int* __restrict__ row_source,
             const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up,
             const uint8_t* __restrict__ scales, const float* __restrict__ gate_global,
             const float* __restrict__ up_global, const float* __restrict__ gate_bias,
             const float* __restrict__ up_bias, const int* __restrict__ expert_offsets,
             const int* __restrict__ active, T* __restrict__ out, int n_experts, int slots, int n,
             int k, int chunks, int top_k, int scale_shift, float alpha, float beta,
             float limit) {
    static_assert(kAct >= 1 && kAct <= 3, "kAct: 1 swiglu, 2 geglu, 3 swiglu_oai");
    const Params p{x,         row_source, gate,    up,        scales,         gate_global,
                   up_global, gate_bias,  up_bias, expert_offsets, active,    out,
                   n_experts, slots,      n,       k,         chunks,         top_k,
                   scale_shift, {alpha, beta, limit}};
    gemm_body<kFormat, T, kAct, kBias, kWarpsM, kWarpsN, kMT, kNT, kStages>(p);
}
