// SPDX-License-Identifier: Apache-2.0
// FP4 expert GEMV for decode on tensor cores: FC1 with the gated activation fused (gemv_fc1), FC1
// with a non-gated activation (gemv_fc1_single) and FC2 (gemv_fc2).
//
//   FC2:  out[r, n] = sum_k x[r, k] * W[e, n, k] + bias[e, n]                 for rows r of expert e
//   FC1:  out[r, n] = act(x[t, :] . Wg[e, n, :] + bg[e, n],  x[t, :] . Wu[e, n, :] + bu[e, n])
//         with t = row_source[r] / top_k (x is read in token order: no expand launch)
//   FC1, non-gated:  out[r, n] = act(x[t, :] . W[e, n, :] + bias[e, n])  (FC2's tiles, FC1's rows)
//
// with W[e, n, k] = E2M1(nibble) * block_scale(e, n, k / kBlock) * global_scale[e].
//
// Expert-major schedule. grid = (column tiles, expert slots); a block reads e = active[slot]
// (exit when -1) and applies every weight tile it decodes to the rows of expert e, 8 rows per pass,
// so an expert's weights cross HBM once per call however many tokens chose it. The first
// iteration's weights need only e: they are requested as soon as e is known (FC2: before the
// programmatic wait for FC1), while the expert's rows and tokens are still on their way.
//
// Tensor cores: mma.sync m16n8k16 with A = 16 weight rows x 16 codes (decoded and block-scaled in
// 16 bits, exactly), B = 16 codes x 8 activation rows, fp32 accumulators. A block of kThreads
// threads = kWarps warps owns kCtaN weight rows = kTiles m-tiles of 16; the warps split K. In a warp,
// lane (g = lane / 4, t = lane % 4) loads 16 bytes (32 codes, one chunk) of weight rows g and g + 8
// of every m-tile, chunk c = (j * kWarps + warp) * 4 + t, and the 64 bytes of x that match them for
// activation row g. The order of k inside one mma is free as long as A and B agree: mma step 2q
// (2q + 1) of a chunk takes codes 8q .. 8q + 3 (8q + 4 .. 8q + 7) of each lane's chunk, so every
// operand comes straight from the lane's own registers (no shuffles, no shared memory).
// FC1 m-tile rows 0-7 are the gate rows and 8-15 the up rows of the same 8 columns: a lane ends
// with gate and up of the same (column, row) and applies the activation itself.
// The warps' partial sums meet in shared memory and are added in a fixed order (deterministic).
//
// Numerics, exact up to the fp32 accumulation:
//  * decode: plain nibble order -> byte-permute (prmt) lookups, four codes per prmt (the bf16 and
//    fp16 bit patterns of the 8 magnitudes, FORMATS.md); pair-interleaved order and the split
//    order of the tiled layout (experts/layouts.py: gemv_layout) -> shift-and-mask (the code's bits land in
//    the exponent/mantissa fields: code * 2^-14 in fp16, code * 2^-126 in bf16). All give the
//    pairs (e0, e1), (e2, e3), ... so the three orders feed identical products.
//  * block scale: one 16-bit multiply per pair, code * scale * 2^s, with the 16-bit value of every
//    scale byte in a 256-entry shared table. code * scale has at most 6 significant bits; the power
//    2^s (a kernel argument for MXFP4, chosen on the host from the tensor's scale range) keeps every
//    product a normal (bf16) or representable (fp16) number, so the multiply is exact.
//  * products and sums in fp32 inside the tensor core; global scale (times 2^-s) in fp32 in the
//    epilogue. No 16-bit product with an activation is ever formed: large fp16 x cannot overflow.
//  * the activation in fp32 (fp4_mma.cuh); the sigmoid-weighted ones by the fast exponential and
//    division intrinsics, at most about 2^-16 relative against the 16-bit output's rounding.
#include "common.cuh"
#include "fp4_mma.cuh"

namespace {

constexpr int kChunk = 32;  // codes per 16-byte weight load
// 4 blocks of 4 warps per SM (<= 128 registers): 16 warps x 2-4 KB of weights in flight per
// iteration covers the ~32 KB per SM that 4.5 TB/s needs at ~1 us of latency. Without a floor
// ptxas trades registers for spills (56 registers + spills) or for occupancy (168 registers).
// Tiles of 16 and 32 rows fit in 80 registers without spills: 6 blocks per SM (kernels below),
// so that 720 blocks (gpt-oss FC1 at M = 1) run in one wave: 18.3 -> 14.7 us on the H200.
constexpr int kMinBlocks = 4;
constexpr int kMinBlocksNarrow = 6;
// Blocks per SM of a tiling: the counts above are for 4-warp blocks; wider blocks keep the warps.
__host__ __device__ constexpr int min_blocks(int cta_n, int threads) {
    return (cta_n <= 32 ? kMinBlocksNarrow : kMinBlocks) * 128 / threads;
}

// 16-byte streaming load (weights are read once per call: keep L1 for the activations).
__device__ __forceinline__ uint4 load_weights(const uint8_t* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// Asks the L2 for the line holding p (no register, no wait). Only where the GEMV uses it, after
// a programmatic dependent launch (sm_90+); not for sm_120, where NVRTC 12.9 crashes on it.
__device__ __forceinline__ void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1200
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
    (void)p;
#endif
}

// One lane's part of the K loop: its pointers at the current iteration and its accumulators.
// Step u of an iteration reads the chunk u * kStep past the lane's pointers; every load of the
// iteration is issued before the first decode.
template <int kFormat, typename T, int kOrder, int kTiles, int kWarps, int kChunkStride>
struct KLoop {
    using Dec = Decoder<T, kOrder>;
    static constexpr int kBlock = cm::FormatTraits<kFormat>::kBlock;
    static constexpr int kScaleBytes = 2 * kChunk / kBlock;  // rows g, g + 8: 4 (NVFP4), 2 (MXFP4)
    static constexpr int kUnroll = kTiles == 1 ? 2 : 1;      // chunks in flight per lane and row
    // The first iteration's weights load as soon as the expert is known (not in the plain order,
    // whose longer decode leaves no registers for them: 8-byte spills at sm_90).
    static constexpr bool kPreload = kOrder != kPlain;
    static constexpr int kStep = kWarps * 4;                 // chunks per step of the block

    // An address is a block-uniform 64-bit base, advanced once per iteration, plus a loop-invariant
    // 32-bit lane offset: two adds per load, and fewer registers than a 64-bit pointer per row.
    const uint8_t* wbase[2];  // the expert's weights (FC2: twice; FC1: gate, up) at the iteration
    const uint8_t* sbase;     // the expert's scale bytes at the iteration
    uint32_t woff[kTiles][2];  // weight rows g and g + 8 of each m-tile, at the lane's first chunk
    uint32_t soff[kTiles];     // scale bytes of rows g, g + 8 of each m-tile, at that chunk
    const T* xp;              // activation row g at the current iteration
    float acc[kTiles][4];

    // The weight and scale registers of one iteration, and its activations.
    struct Frag {
        uint4 wv[kUnroll][kTiles][2];
        uint32_t sv[kUnroll][kTiles];
    };
    using XFrag = uint4[kUnroll][4];

    // One iteration: every load issued before the first decode.
    template <bool kChecked>
    __device__ __forceinline__ void iteration(const uint32_t* table, int first, int chunks, int k) {
        Frag f;
        XFrag xv;
        load<kChecked>(f, first, chunks);
        load_x<kChecked>(xv, first, chunks, k);
        compute(f, xv, table);
    }

    // The weights and scale bytes of one iteration; kChecked: chunk c = first + u * kStep exists
    // only if c < chunks, the rest read as zeros.
    template <bool kChecked>
    __device__ __forceinline__ void load(Frag& f, int first, int chunks) const {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int c = first + u * kStep;
            const bool live = !kChecked || c < chunks;
#pragma unroll
            for (int m = 0; m < kTiles; ++m) {
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    f.wv[u][m][h] = live ? load_weights(wbase[h] + woff[m][h] + u * kStep * kChunkStride)
                                         : make_uint4(0u, 0u, 0u, 0u);
                const uint8_t* s = sbase + soff[m] + u * kStep * 8 * kScaleBytes;
                if constexpr (kScaleBytes == 4) {
                    f.sv[u][m] = live ? __ldg(reinterpret_cast<const uint32_t*>(s)) : 0u;
                } else {
                    f.sv[u][m] = live ? __ldg(reinterpret_cast<const uint16_t*>(s)) : 0u;
                }
            }
        }
    }

    // The activations of one iteration; kChecked: x element k0 exists only if k0 < k (an mma
    // needs the whole warp, so lanes past K take part with zeros).
    template <bool kChecked>
    __device__ __forceinline__ void load_x(XFrag& xv, int first, int chunks, int k) const {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int c = first + u * kStep;
            const bool live = !kChecked || c < chunks;
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const bool in_k = !kChecked || (live && c * kChunk + 8 * q < k);
                xv[u][q] = in_k ? __ldg(reinterpret_cast<const uint4*>(xp + u * kStep * kChunk) + q)
                                : make_uint4(0u, 0u, 0u, 0u);
            }
        }
    }

    // The decodes and mmas of one iteration, then the pointers move to the next one.
    __device__ __forceinline__ void compute(const Frag& f, const XFrag& xv, const uint32_t* table) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
#pragma unroll
                for (int m = 0; m < kTiles; ++m) {
                    const uint32_t w0[4] = {f.wv[u][m][0].x, f.wv[u][m][0].y, f.wv[u][m][0].z,
                                            f.wv[u][m][0].w};
                    const uint32_t w1[4] = {f.wv[u][m][1].x, f.wv[u][m][1].y, f.wv[u][m][1].z,
                                            f.wv[u][m][1].w};
                    // Scale bytes: NVFP4 {g blk0, g blk1, g+8 blk0, g+8 blk1}; MXFP4 {g, g+8}.
                    const int b0 = kScaleBytes == 4 ? q / 2 : 0;
                    // (prmt moves the byte down and clears the rest: one instruction.)
                    const uint32_t s0 = table[prmt(f.sv[u][m], 0u, 0x4440u + b0)];
                    const uint32_t s1 = table[prmt(f.sv[u][m], 0u, 0x4440u + b0 + kScaleBytes / 2)];
                    uint32_t h0[4], h1[4];
                    Dec::run(w0[q], h0);
                    Dec::run(w1[q], h1);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        h0[i] = mul2(h0[i], s0, T());
                        h1[i] = mul2(h1[i], s1, T());
                    }
                    // A fragment: {row g k 2t.., row g+8 k 2t.., row g k 2t+8.., row g+8 k 2t+8..}
                    const uint32_t a_lo[4] = {h0[0], h1[0], h0[1], h1[1]};  // codes 8q + 0..3
                    const uint32_t a_hi[4] = {h0[2], h1[2], h0[3], h1[3]};  // codes 8q + 4..7
                    mma(acc[m], a_lo, xv[u][q].x, xv[u][q].y, T());
                    mma(acc[m], a_hi, xv[u][q].z, xv[u][q].w, T());
                }
            }
        }
        wbase[0] += kUnroll * kStep * kChunkStride;
        wbase[1] += kUnroll * kStep * kChunkStride;
        sbase += kUnroll * kStep * 8 * kScaleBytes;
        xp += kUnroll * kStep * kChunk;
    }
};

// The arguments of one launch, gathered for the shared body.
struct Params {
    const void* x;              // activations: [tokens, k] (FC1, token order) or [rows, k] (FC2)
    const int* row_source;      // FC1: expanded row -> token * top_k + slot; FC2: nullptr
    const uint8_t* w0;          // FC2 weights, FC1 gate: [E, n, chunks * 16]
    const uint8_t* w1;          // FC1 up (same layout); FC2: nullptr
    const uint8_t* scales;      // [E, tiles, chunks, 8, 2, 32 / kBlock] raw scale bytes
    const float* global0;       // [E] global scale of w0
    const float* global1;       // [E] global scale of w1 (FC1)
    const float* bias0;         // [E, n] float32 (kBias)
    const float* bias1;         // [E, n] float32 (FC1 with kBias)
    const int* expert_offsets;  // [E + 1]
    const int* active;          // [slots] expert ids, -1 = no expert
    void* out;                  // [rows, n] of T, expanded order
    int n_experts, n, k, chunks, top_k, scale_shift;
    ActArgs act;
    int dependent;  // FC2 launched as a programmatic dependent of FC1 (plain order: L2 prefetch)
};

// kAct 0 = FC2 (m-tile = 16 output columns); 1..3 = gated FC1 (m-tile = 8 columns x gate, up);
// 4..7 = non-gated FC1: FC2's tiles and epilogue (plus the activation), FC1's rows and wait.
template <int kFormat, typename T, int kOrder, int kCtaN, int kThreads, int kAct,
          bool kBias>
__device__ __forceinline__ void gemv_body(const Params& p) {
    using Dec = Decoder<T, kOrder>;
    constexpr int kWarps = kThreads / 32;
    constexpr int kTiles = kCtaN / 16;
    constexpr bool kGated = kAct >= 1 && kAct <= 3;
    constexpr bool kFc1 = kAct != 0;  // follows the routing: waits before it reads the maps
    constexpr int kColsPerTile = kGated ? 8 : 16;
    // Split order: tiles of kColsPerTile rows (FC1: 8 columns of gate, and of up, in their own
    // arrays; FC2: 16 rows), chunk-major inside a tile, [E, tiles, chunks, rows, 16 bytes]: the
    // 16 rows of a chunk are 256 contiguous bytes and a tile's K range one contiguous stream.
    constexpr int kChunkStride = (kOrder == kSplit ? kColsPerTile : 1) * (kChunk / 2);
    using Loop = KLoop<kFormat, T, kOrder, kTiles, kWarps, kChunkStride>;
    constexpr int kScaleBytes = Loop::kScaleBytes;
    static_assert(kWarps >= 2 && kThreads % 32 == 0 && kCtaN % 16 == 0 && kTiles * 32 <= kThreads,
                  "kThreads: 2+ warps; kCtaN: a multiple of 16, at most 16 * kThreads / 32");
    // bf16 pair-interleaved decodes code * 2^-126: the table carries 2^116 so A = code*scale*2^-10.
    constexpr int kTableShift = Dec::kExp == -126 ? 116 : 0;

    __shared__ uint32_t table[256];                 // 16-bit scale value, in both halves
    __shared__ float4 partial[kWarps][kTiles][32];  // per-warp sums, one float4 per lane

    static_assert(256 % kThreads == 0, "the scale table: whole passes of the block");
#pragma unroll
    for (int j = 0; j < 256 / kThreads; ++j) {
        const int i = j * kThreads + threadIdx.x;
        const uint32_t b = scale_bits<kFormat, T>(i, kTableShift + p.scale_shift);
        table[i] = b | (b << 16);
    }
    __syncthreads();
    // Programmatic dependent launch (common.cuh): FC1 follows the routing launch and waits before
    // it reads the maps; FC2 follows FC1, so the maps are complete and it reads them, and starts
    // its weight loads, while FC1 finishes, waiting only before it reads x (FC1's output).
    if constexpr (kFc1) cm::wait_upstream();
    const int e = p.active[blockIdx.y];
    if (e < 0 || e >= p.n_experts) return;  // uniform per block: no later barrier is split

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int row_begin = p.expert_offsets[e];
    const int row_end = p.expert_offsets[e + 1];
    const size_t row_bytes = (size_t)p.chunks * (kChunk / 2);
    const int tiles = (p.n + kColsPerTile - 1) / kColsPerTile;

    // Weight rows g and g + 8 of each m-tile (FC1: gate and up of column 8 * tile + g). Rows past n
    // are clamped to n - 1 in the row-major orders (valid memory) and zero rows of the last tile in
    // the split layout; their sums are never stored.
    const size_t expert_bytes =
        kOrder == kSplit ? (size_t)tiles * kColsPerTile * row_bytes : (size_t)p.n * row_bytes;
    const uint8_t* const wbase0 = p.w0 + (size_t)e * expert_bytes;
    const uint8_t* const wbase1 = (kGated ? p.w1 : p.w0) + (size_t)e * expert_bytes;
    const uint8_t* const sbase = p.scales + (size_t)e * tiles * p.chunks * 8 * kScaleBytes;
    // The epilogue's global scales, loaded now: their latency hides behind the K loop instead of
    // adding to the end of a short launch.
    const float global0 = p.global0[e];
    const float global1 = kGated ? p.global1[e] : 0.0f;
    int wrow[kTiles][2], stile[kTiles];
#pragma unroll
    for (int m = 0; m < kTiles; ++m) {
        stile[m] = min(blockIdx.x * kTiles + m, tiles - 1);
        wrow[m][0] = min(stile[m] * kColsPerTile + g, p.n - 1);
        wrow[m][1] = kGated ? wrow[m][0] : min(stile[m] * kColsPerTile + g + 8, p.n - 1);
    }

    // Step u of iteration i reads chunk (i * kUnroll + u) * kStep + warp * 4 + t. Iterations whose
    // chunks all lie inside K (every lane of the warp) run without bounds checks; the last one or
    // two run checked.
    constexpr int kAdvance = Loop::kUnroll * Loop::kStep;  // chunks per iteration
    const int lane_chunk = warp * 4 + t;
    const int full_chunks = p.k / kChunk;  // chunks entirely inside K
    const int warp_last = kAdvance - Loop::kStep + warp * 4 + 3;  // last chunk of iteration 0

    // Weight bytes of m-tile m, row g (h = 0) or g + 8 (h = 1), at the lane's first chunk. In the
    // split layout row g of chunk c sits at slot (g + 2 * (c % 4)) % 8 of its group of 8
    // (layouts.split_slot; every chunk of lane t has c % 4 == t): the 16-byte pieces a quarter warp
    // loads then come back through eight different L1 bank groups instead of two.
    const auto lane_woff = [&](int m, int h) -> uint32_t {
        return kOrder == kSplit
                   ? ((stile[m] * p.chunks + lane_chunk) * kColsPerTile + (g + 2 * t) % 8 +
                      (kGated ? 0 : 8 * h)) *
                         (kChunk / 2)
                   : wrow[m][h] * (uint32_t)row_bytes + lane_chunk * (kChunk / 2);
    };
    // The loop state that does not depend on the pass, and the first iteration's weights and
    // scale bytes: they need only the expert, so they are requested now, while the expert's rows
    // (and, in FC1, their tokens) are still on their way -- in FC2 before the wait, since weights
    // are no kernel's output.
    Loop loop;
    // The lane's offsets and the expert's bases: set before the preload and again by each pass
    // (recomputing them is cheaper than holding them in registers through the plain order's pass).
    const auto start_loop = [&]() {
#pragma unroll
        for (int m = 0; m < kTiles; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) loop.woff[m][h] = lane_woff(m, h);
            loop.soff[m] = ((stile[m] * p.chunks + lane_chunk) * 8 + g) * kScaleBytes;
        }
        loop.wbase[0] = wbase0;
        loop.wbase[1] = wbase1;
        loop.sbase = sbase;
    };
    if constexpr (Loop::kPreload) start_loop();
    const bool first_unchecked = warp_last < full_chunks;  // uniform per warp
    const bool first_exists = lane_chunk - t < p.chunks;   // uniform per warp
    // This lane's activation row (B column g) in a pass starting at row r0. FC1 reads x in token
    // order. A lane past the expert's last row reads the pass's first row, the address lane g = 0
    // loads (one L1 broadcast instead of a second row in the same bank groups): B column g only
    // feeds the sums of activation row g, which are then never stored.
    const auto source_row = [&](int r0) -> int {
        const int row = r0 + g < row_end ? r0 + g : r0;
        return p.row_source ? p.row_source[row] / p.top_k : row;
    };
    // The first pass's row is requested before the weights: behind them it arrived only with them
    // (H200 timeline, Qwen FC1 at M = 1: 1.6 us after the offsets, 0.45 us when issued first).
    const int first_src = row_begin < row_end ? source_row(row_begin) : 0;
    typename Loop::Frag first_frag;
    if constexpr (Loop::kPreload) {
        if (first_unchecked) {
            loop.template load<false>(first_frag, lane_chunk, p.chunks);
        } else if (first_exists) {
            loop.template load<true>(first_frag, lane_chunk, p.chunks);
        }
    } else if (!kFc1 && p.dependent && lane_chunk < p.chunks) {
        // As a programmatic dependent of FC1, FC2 asks the L2 for its first weight chunks before
        // the wait: they arrive while FC1 finishes.
#pragma unroll
        for (int m = 0; m < kTiles; ++m) {
#pragma unroll
            for (int h = 0; h < 2; ++h) prefetch_l2(wbase0 + lane_woff(m, h));
        }
    }
    if constexpr (!kFc1) cm::wait_upstream();  // x is FC1's output
    // One pass of 8 rows; `pre`: the first pass, whose iteration 0 uses first_frag. Called with a
    // constant at each site, so the frag is dead after the first pass (no registers held).
    const auto run_pass = [&](int r0, bool pre) {
        const int src = r0 == row_begin ? first_src : source_row(r0);

        start_loop();
#pragma unroll
        for (int m = 0; m < kTiles; ++m) {
#pragma unroll
            for (int i = 0; i < 4; ++i) loop.acc[m][i] = 0.0f;
        }
        loop.xp = static_cast<const T*>(p.x) + (size_t)src * p.k + lane_chunk * kChunk;

        int first = lane_chunk;  // this lane's chunk in step 0 of the current iteration
        int last = warp_last;     // the warp's last chunk of the current iteration
        if (pre) {  // the first pass: iteration 0 from the registers loaded above
            // Two whole arms on purpose: one `if (first_exists)` around a single compute (the
            // checked / unchecked x loads chosen inside) made Qwen FC1 + FC2 at M = 1 0.5 us slower
            // in the layer (H200, same run: 12.3 -> 12.8 us), with the same K loop.
            typename Loop::XFrag xv;
            if (first_unchecked) {
                loop.template load_x<false>(xv, first, p.chunks, p.k);
                loop.compute(first_frag, xv, table);
                first += kAdvance;
                last += kAdvance;
            } else if (first_exists) {
                loop.template load_x<true>(xv, first, p.chunks, p.k);
                loop.compute(first_frag, xv, table);
                first += kAdvance;
                last += kAdvance;
            }
        }
        for (; last < full_chunks; last += kAdvance) {  // uniform per warp
            loop.template iteration<false>(table, first, p.chunks, p.k);
            first += kAdvance;
        }
        for (; first - t < p.chunks; first += kAdvance)
            loop.template iteration<true>(table, first, p.chunks, p.k);
        const float (&acc)[kTiles][4] = loop.acc;

        // Per-warp sums -> shared; thread i < kTiles * 32 adds the warps in order and stores.
        if constexpr (kWarps > 1) {
#pragma unroll
            for (int m = 0; m < kTiles; ++m)
                partial[warp][m][lane] = make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
            __syncthreads();
        }
        if (threadIdx.x < kTiles * 32) {
            const int m = threadIdx.x / 32;
            const int ln = threadIdx.x % 32;
            float v[4];
            if constexpr (kWarps > 1) {
                float4 s = partial[0][m][ln];
#pragma unroll
                for (int w = 1; w < kWarps; ++w) {
                    const float4 o = partial[w][m][ln];
                    s.x += o.x;
                    s.y += o.y;
                    s.z += o.z;
                    s.w += o.w;
                }
                v[0] = s.x, v[1] = s.y, v[2] = s.z, v[3] = s.w;
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) v[i] = acc[m][i];
            }
            // C fragment: v[0], v[1] = (row g, act rows 2t, 2t+1); v[2], v[3] = (row g + 8, same).
            const int tile = blockIdx.x * kTiles + m;
            const int gg = ln / 4;
            const int r = r0 + 2 * (ln % 4);
            const int post = -(Dec::kExp + kTableShift + p.scale_shift);
            const float f0 = ldexpf(global0, post);
            T* out = static_cast<T*>(p.out);
            if constexpr (kGated) {
                const int col = tile * 8 + gg;
                const float f1 = ldexpf(global1, post);
                if (tile < tiles && col < p.n) {
                    const float bg = kBias ? p.bias0[(size_t)e * p.n + col] : 0.0f;
                    const float bu = kBias ? p.bias1[(size_t)e * p.n + col] : 0.0f;
#pragma unroll
                    for (int i = 0; i < 2; ++i)
                        if (r + i < row_end)
                            out[(size_t)(r + i) * p.n + col] = cm::from_float<T>(
                                activate<kAct>(v[i] * f0 + bg, v[2 + i] * f1 + bu, p.act));
                }
            } else {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int col = tile * 16 + gg + 8 * h;
                    if (tile >= tiles || col >= p.n) continue;
                    const float b = kBias ? p.bias0[(size_t)e * p.n + col] : 0.0f;
#pragma unroll
                    for (int i = 0; i < 2; ++i)
                        if (r + i < row_end)
                            out[(size_t)(r + i) * p.n + col] =
                                cm::from_float<T>(activate1<kAct>(v[2 * h + i] * f0 + b, p.act));
                }
            }
        }
        if constexpr (kWarps > 1) __syncthreads();  // partial[] is reused by the next pass
    };
    int r0 = row_begin;
    if constexpr (Loop::kPreload) {
        if (r0 < row_end) run_pass(r0, true);
        r0 += 8;
    }
    for (; r0 < row_end; r0 += 8) run_pass(r0, false);
}

}  // namespace

// FC2: grid = (ceil(ceil(n / 16) / (kCtaN / 16)), expert slots), block = kThreads; a block owns
// kCtaN output columns (rows of W) of the expert in its slot.
template <int kFormat, typename T, int kOrder, int kCtaN, int kThreads, bool kBias>
__global__ void __launch_bounds__(kThreads, min_blocks(kCtaN, kThreads))
    gemv_fc2(const T* __restrict__ x, const uint8_t* __restrict__ w,
             const uint8_t* __restrict__ scales, const float* __restrict__ global_scale,
             const float* __restrict__ bias, const int* __restrict__ expert_offsets,
             const int* __restrict__ active, T* __restrict__ out, int n_experts, int n, int k,
             int chunks, int scale_shift, int dependent) {
    const Params p{x,       nullptr,        w,      nullptr, scales,    global_scale, nullptr,
                   bias,    nullptr,        expert_offsets, active, out, n_experts,   n,
                   k,       chunks,         1,      scale_shift, {0.0f, 0.0f, 0.0f}, dependent};
    gemv_body<kFormat, T, kOrder, kCtaN, kThreads, 0, kBias>(p);
}

// FC1: grid = (ceil(ceil(n / 8) / (kCtaN / 16)), expert slots); a block owns kCtaN weight rows =
// kCtaN / 2 output columns (gate and up rows of each). x is read in token order through row_source.
template <int kFormat, typename T, int kOrder, int kCtaN, int kThreads, int kAct,
          bool kBias>
__global__ void __launch_bounds__(kThreads, min_blocks(kCtaN, kThreads))
    gemv_fc1(const T* __restrict__ x, const int* __restrict__ row_source,
             const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up,
             const uint8_t* __restrict__ scales, const float* __restrict__ gate_global,
             const float* __restrict__ up_global, const float* __restrict__ gate_bias,
             const float* __restrict__ up_bias, const int* __restrict__ expert_offsets,
             const int* __restrict__ active, T* __restrict__ out, int n_experts, int n, int k,
             int chunks, int top_k, int scale_shift, float alpha, float beta, float limit) {
    static_assert(kAct >= 1 && kAct <= 3, "kAct: 1 swiglu, 2 geglu, 3 swiglu_oai");
    const Params p{x,         row_source,     gate,   up,  scales,    gate_global, up_global,
                   gate_bias, up_bias,        expert_offsets, active, out, n_experts, n, k,
                   chunks,    top_k,          scale_shift,    {alpha, beta, limit},  0};
    gemv_body<kFormat, T, kOrder, kCtaN, kThreads, kAct, kBias>(p);
}

// FC1 with a non-gated activation (kAct 4 relu, 5 gelu, 6 silu, 7 identity): FC2's grid, block
// and weight tiles (one matrix [E, n, k] of 16-row tiles); x in token order through row_source.
// Four blocks per SM at every tiling: in the 80 registers of six, the narrow pair-order tiles
// spilled 20 bytes at sm_90 (FC1's wait ahead of the preload keeps more live than FC2's).
template <int kFormat, typename T, int kOrder, int kCtaN, int kThreads, int kAct, bool kBias>
__global__ void __launch_bounds__(kThreads, kMinBlocks * 128 / kThreads)
    gemv_fc1_single(const T* __restrict__ x, const int* __restrict__ row_source,
                    const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales,
                    const float* __restrict__ global_scale, const float* __restrict__ bias,
                    const int* __restrict__ expert_offsets, const int* __restrict__ active,
                    T* __restrict__ out, int n_experts, int n, int k, int chunks, int top_k,
                    int scale_shift) {
    static_assert(kAct >= 4 && kAct <= 7, "kAct: 4 relu, 5 gelu, 6 silu, 7 identity");
    const Params p{x,       row_source,     w,      nullptr, scales,    global_scale, nullptr,
                   bias,    nullptr,        expert_offsets, active, out, n_experts,   n,
                   k,       chunks,         top_k,  scale_shift, {0.0f, 0.0f, 0.0f}, 0};
    gemv_body<kFormat, T, kOrder, kCtaN, kThreads, kAct, kBias>(p);
}
