// SPDX-License-Identifier: Apache-2.0
// Grouped FP4 expert GEMM for sm_90a: wgmma with the decoded weights in registers as the A
// operand, warp-specialised. Same functions, numerics and work items as gemm_fp4.cu (the mma.sync
// version, which serves sm_80 / sm_89 / sm_120 and the shapes this one does not cover):
//
//   FC2:  out[r, n] = sum_k x[r, k] * W[e, n, k] + bias[e, n]                 for rows r of expert e
//   FC1:  out[r, n] = act(x[t, :] . Wg[e, n, :] + bg[e, n],  x[t, :] . Wu[e, n, :] + bu[e, n])
//         with t = row_source[r] / top_k (x is read in token order: no expand launch)
//
// Block tile: 256 weight rows (16 m-tiles of 16, FC1 m-tile = 8 gate + 8 up rows of the same 8
// columns) x kBN expanded rows of one expert; K in stages of 128 codes, kStages deep. The
// activations (B, 16-bit) are the larger operand: each block tile reads its kBN rows once per
// column block, so the weight rows per tile set the bytes per MAC (128 rows moved 1.6x the bytes
// per MAC of 256, and their layer ran 19-26 % slower at 4,096 tokens).
//
// Warp groups (128 x (1 + kGroups) threads). Group 0 is the producer: one thread issues the
// weights and scales of a stage as one TMA box per matrix (3-D tensor maps over [expert, m-tile,
// bytes of the tile's chunks], completing on the stage's "full" mbarrier with their byte count;
// out-of-range m-tiles and chunks are zero-filled), and all 128 threads gather the activation rows
// of the item (in passes of 32 rows, up to its wgmma width) through the expert map with 16-byte
// cp.async into the stage itself. FC2 reading h in the split k order takes the item's rows, which
// are contiguous there, as 2-D TMA boxes instead (Gemm90::x_tma), issued by the same thread.
// One box per matrix rather than one copy per m-tile: the copy engine's cost is per request, and
// 32-48 requests per stage bound the producer at few rows per item (docs/kernels.md, seventh
// round). Groups 1 .. kGroups are the consumers: warp w of group c owns m-tiles 4 kGroups u + 4c
// + w (u < kMT = 4 / kGroups), i.e. the 16 rows that each of its kMT wgmma m64nNk16 give that
// warp. Two groups (two m-tiles per warp) for bn 128, whose accumulators need the registers; four
// (one m-tile per warp) for bn 64, where the consumers' decode, not the tensor cores, sets the
// time of a stage, and four warps per scheduler hide more of its latency than two (2-4 % per
// layer at 16-32 rows per expert: docs/kernels.md, ninth round). Per stage a lane reads its 2 x 16
// bytes of weight rows g, g + 8 of chunk t per m-tile (the split layout's rotated slots,
// conflict-free), decodes each 8-code word into the A fragment of two k16 steps (Decoder +
// exact 16-bit block-scale multiply, fp4_mma.cuh) and issues them as wgmma against the stage's
// activations: the decode is shared by kBN tokens, B never passes through registers, and the
// decode of the next m-tile overlaps the tensor cores' work on this one. setmaxnreg gives the
// consumers 200 registers (two m-tiles' accumulators) and the producer 104, at kBN 144 224 and
// 56, or with four groups 104 and 64. kBN 144 is kBN 128 whose last row tile of an expert takes
// up to 16 more rows (gemm_items.cuh TileClasses), in a wgmma of N = 144.
//
// The k order. In the split layout lane t holds chunk t (codes 32t .. 32t + 31) and the A fragment
// of k16 step (q, h) takes codes 8q + 4h + {0, 1} (logical k 2t, 2t + 1) and 8q + 4h + {2, 3}
// (logical k 2t + 8, 2t + 9) of each lane's chunk: the same k permutation as the GEMV's and the
// mma.sync GEMM's. wgmma reads B in logical order, so B holds the activations permuted to match:
// in core matrix kc of step s = 2q + h, row n, the 4-byte word t is x[n, 32t + 8q + 4h + 2kc ..
// + 1]. Where the source already has its stages in that order (split_position: FC2's h from a
// permuted_h FC1, FC1's x from permute_split) the producer copies each 16-byte piece straight
// into its place (FC2's, whose rows are contiguous, as TMA boxes: the 128-byte swizzle is the
// layout's). Otherwise (x in natural order, the last partial stage of K) thread q of a row
// copies the four pieces 32t + 8q (t = 0..3) into the four 16-byte slots that its regrouping
// will fill, and one stage later (when the copies have landed) reads them and writes them back
// regrouped as four core-matrix rows: no other thread's data, no barrier, no bank conflicts (the
// 8 lanes of a quarter warp touch 8 consecutive rows of one core matrix).
//
// B layout in shared memory: K-major with the 128-byte swizzle. The stage's 128 logical k are two
// halves of 64; in half kh, row n is 128 bytes at kh * kBN * 128 + n * 128 whose 16-byte chunk j
// (logical k 8j .. 8j + 7, i.e. step 4kh + j / 2, core kc = j % 2) sits at chunk j ^ (n % 8).
// The unswizzled layout (core matrices of 8 rows x 16 contiguous bytes) measured 77 % shared-
// memory throughput at 31 % tensor utilisation: the wgmma B reads conflicted. Descriptor of step
// s: start kh * kBN * 128 + (s % 4) * 32, stride (8-row group) byte offset 1024.
//
// Synchronisation per stage slot: full (129 producer arrivals + the bulk copies' bytes) and empty
// (one arrival per consumer thread, after the wgmma that read the slot completed). A producer
// thread arrives once its copies of the stage have landed (cp.async.mbarrier.arrive), for a
// regrouped stage after it fenced its stores into the async proxy, and for a stage of x_tma's
// boxes at once (the boxes count in the bytes); the issuing thread arrives
// once more after it stored the stage's item record (expert, rows, column block), which the
// consumers read at an item's first stage instead of decoding the item themselves. Work items,
// their order and the schedule scan are gemm_items.cuh's; the producer runs up to kStages stages
// ahead across item boundaries, so one item's epilogue overlaps the next item's loads, and
// fetches each item's metadata (three dependent global loads) one load per stage during the
// item before it, so that no item boundary waits on them.
#include "common.cuh"
#include "fp4_mma.cuh"
#include "gemm_items.cuh"

// The wrappers have external linkage (a named namespace): NVRTC warns about every unused
// function of internal linkage, and each specialisation uses only its own width.
namespace wg {

// wgmma m64nNk16, fp32 accumulators, A (4 registers) from registers, B from the descriptor b;
// scale_d = 0 overwrites the accumulators. Wgmma<N, T>::run; one specialisation per N and type,
// both types' written by one CM_WG line per N below.
template <int kN, typename T> struct Wgmma;
// Accumulator operands d[i .. i + 7] (CM_WG_D4: d[i .. i + 3]) and the other operands of every
// wrapper below.
#define CM_WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
    "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define CM_WG_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define CM_WG_IN "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d)
// The specialisation of width kN for element type T, whose PTX name is the string literal TY. P
// and B are the asm operand numbers of scale_d and b (kN / 2 + 5 and kN / 2 + 4), D and A the
// template's lists of the kN / 2 accumulators and of a's four registers, the rest the
// accumulators' constraints (CM_WG_D8 / CM_WG_D4).
#define CM_WG_SPEC(T, TY, kN, P, D, A, B, ...)                                                 \
    template <> struct Wgmma<kN, T> {                                                          \
        __device__ __forceinline__ static void run(float (&d)[kN / 2], const uint32_t (&a)[4], \
                                                   uint64_t b, int scale_d) {                  \
            asm volatile(                                                                      \
                "{ .reg .pred p; setp.ne.b32 p, %" #P ", 0; "                                  \
                "wgmma.mma_async.sync.aligned.m64n" #kN "k16.f32." TY "." TY " {"              \
                D "}, {" A "}, %" #B ", p, 1, 1, 0; }"                                         \
                : __VA_ARGS__                                                                  \
                : CM_WG_IN);                                                                   \
        }                                                                                      \
    };
// Both element types of a width from one line: they differ only in the operand type in the
// instruction's name. An asm template must be a string literal (adjacent literals concatenate, but
// a constexpr char array or a trait's static member is no literal), so the type's PTX name enters
// as a macro argument; CM_WG is the one place that maps a type to it.
#define CM_WG(...) \
    CM_WG_SPEC(__nv_bfloat16, "bf16", __VA_ARGS__) CM_WG_SPEC(__half, "f16", __VA_ARGS__)
CM_WG(8, 9, "%0, %1, %2, %3", "%4, %5, %6, %7", 8, CM_WG_D4(0))
CM_WG(16, 13, "%0, %1, %2, %3, %4, %5, %6, %7", "%8, %9, %10, %11", 12, CM_WG_D8(0))
CM_WG(32, 21, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
      "%16, %17, %18, %19", 20, CM_WG_D8(0), CM_WG_D8(8))
CM_WG(48, 29,
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23",
      "%24, %25, %26, %27", 28, CM_WG_D8(0), CM_WG_D8(8), CM_WG_D8(16))
CM_WG(64, 37,
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
      "%32, %33, %34, %35", 36, CM_WG_D8(0), CM_WG_D8(8), CM_WG_D8(16), CM_WG_D8(24))
CM_WG(128, 69,
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63",
      "%64, %65, %66, %67", 68, CM_WG_D8(0), CM_WG_D8(8), CM_WG_D8(16), CM_WG_D8(24),
      CM_WG_D8(32), CM_WG_D8(40), CM_WG_D8(48), CM_WG_D8(56))
CM_WG(144, 77,
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71",
      "%72, %73, %74, %75", 76, CM_WG_D8(0), CM_WG_D8(8), CM_WG_D8(16), CM_WG_D8(24),
      CM_WG_D8(32), CM_WG_D8(40), CM_WG_D8(48), CM_WG_D8(56), CM_WG_D8(64))
#undef CM_WG
#undef CM_WG_SPEC
#undef CM_WG_D8
#undef CM_WG_D4
#undef CM_WG_IN

}  // namespace wg

namespace {

constexpr int kChunk = 32;        // codes per 16-byte row piece of the split layout
constexpr int kStageChunks = 4;   // chunks per stage: chunk t for lane t
constexpr int kStageCodes = kChunk * kStageChunks;
constexpr int kMTileBytes = 1024; // one m-tile (16 weight rows) x 128 codes
constexpr int kBMT = 16;          // m-tiles per block tile: kGroups consumer groups x 4 warps x kMT

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarriers and bulk copies ------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("{ .reg .b64 state; mbarrier.arrive.release.cta.shared::cta.b64 state, [%0]; }" ::"r"(
                     bar)
                 : "memory");
}
// Waits for the completion of the phase of parity `parity` (acquire).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2; "
            "selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// A CUtensorMap (cuTensorMapEncodeTiled through the driver; _runtime/tensormap.py), passed by
// value as a __grid_constant__ kernel parameter: the TMA unit reads it in the parameter space.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};

// One box of a 3-D tensor map (coordinates innermost first) into shared memory, completing on
// the mbarrier with the box's byte count (out-of-range elements zero-filled and counted).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TensorMap* map, int c0, int c1, int c2,
                                            uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
        "%3, %4}], [%5];" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}

// One box of a 2-D tensor map (coordinates innermost first), as tma_load_3d.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TensorMap* map, int c0, int c1, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
        "%3}], [%4];" ::"r"(dst),
        "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}

// Fetches a tensor map's descriptor into the TMA unit's cache ahead of its first box, so that
// the launch's first copies do not wait for it.
__device__ __forceinline__ void prefetch_map(const TensorMap* map) {
    if (map != nullptr)
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// Orders this thread's ordinary shared-memory stores before later async-proxy reads (wgmma).
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// 16 bytes global -> shared without registers; src_bytes 0 fills the 16 bytes with zeros (and
// reads nothing). Generic-proxy writes: a consumer fences them into the async proxy.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, uint32_t src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most kPending of this thread's committed cp.async groups are in flight.
template <int kPending> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
// Arrives on the mbarrier once this thread's earlier cp.async copies have landed (counted as one
// of its expected arrivals).
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Where column c of h goes when FC1 writes it for a wgmma FC2 (Params::permuted_h): within each
// whole stage of 128 columns, c = 32t + 8q + 4h + 2kc + e moves to 64 (q / 2) + 8j + 2t + e with
// j = 4 (q % 2) + 2h + kc, the order in which the producer otherwise stores the activations into
// the B layout (half q / 2, logical chunk j, word t). Columns from `whole` on (the last partial
// stage) stay in place. experts/layouts.split_positions is the NumPy transcription.
__device__ __forceinline__ int split_position(int c, int whole) {
    if (c >= whole) return c;
    const int l = c & 127, t = l >> 5, q = (l >> 3) & 3, h = (l >> 2) & 1, kc = (l >> 1) & 1;
    return (c & ~127) + 64 * (q >> 1) + 8 * (4 * (q & 1) + 2 * h + kc) + 2 * t + (l & 1);
}

// ---- wgmma ----------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator across a wgmma fence or wait.
template <int kN> __device__ __forceinline__ void pin(float (&d)[kN]) {
#pragma unroll
    for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major operand with the 128-byte swizzle (layout type 1
// in bits 62-63): start address, stride byte offset 1024 (8 rows of 128 bytes), the leading byte
// offset unused (1), base offset 0 (every swizzle atom is 1024-byte aligned). Split in words: the
// low word holds the start address / 16 (bits 0-13) and the leading offset, the high word is a
// constant. A shared address stays below 2^18, so the low word of addr + off is the low word of
// addr plus off / 16 with no carry out of the address field: a wgmma's descriptor is one add to
// its stage's (a mask and two shifts per wgmma were 5-10 % of a stage's consumer instructions).
__device__ __forceinline__ uint32_t desc_lo_sw128(uint32_t addr) { return ((addr & 0x3FFFFu) >> 4) | (1u << 16); }
__device__ __forceinline__ uint64_t desc_sw128(uint32_t lo) {
    return ((uint64_t)((1024 >> 4) | (1u << 30)) << 32) | lo;
}


__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }
// Shared loads at 32-bit shared addresses (the consumers' stage reads): generic pointers need the
// shared window's base re-derived in every stage.
__device__ __forceinline__ uint4 lds128s(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
__device__ __forceinline__ uint32_t lds32s(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ uint32_t lds16s(uint32_t addr) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
    return v;
}
__device__ __forceinline__ void sts16(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"((unsigned short)v) : "memory");
}
__device__ __forceinline__ void sts128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
                 : "memory");
}

template <int kFormat, typename T, int kAct, bool kBias, int kBN, int kStages, int kGroups>
struct Gemm90 {
    using Dec = Decoder<T, kSplit>;
    static constexpr bool kGated = kAct >= 1 && kAct <= 3;  // else one matrix (FC2, non-gated FC1)
    static constexpr int kBlock = cm::FormatTraits<kFormat>::kBlock;
    static constexpr int kScaleBytes = 2 * kChunk / kBlock;       // per lane row: 4 or 2
    static constexpr int kScaleChunkBytes = 8 * kScaleBytes;      // per m-tile and chunk
    static constexpr int kScaleTileBytes = kStageChunks * kScaleChunkBytes;
    static constexpr int kRowsPerTile = kGated ? 8 : 16;          // rows of one matrix per m-tile
    // A stage: activations (B, first: its swizzle atoms are 1024-byte aligned), weights (A),
    // scales (padded to 1 KB so that every stage is a multiple of 1024 bytes). The weights are
    // the TMA boxes as they land: FC1 all gate m-tiles (512 bytes each: 4 chunks x 8 rows x 16
    // bytes), then all up m-tiles; FC2 the m-tiles of 1 KB (4 chunks x 16 rows x 16 bytes).
    static constexpr int kBBytes = kBN * kStageCodes * 2;
    static constexpr int kABytes = kBMT * kMTileBytes;
    static constexpr int kMatTileBytes = kGated ? kMTileBytes / 2 : kMTileBytes;  // one matrix
    static constexpr int kUnitBytes = kRowsPerTile * 16;  // one m-tile, matrix and chunk
    static constexpr int kAOff = kBBytes;
    static constexpr int kSOff = kBBytes + kABytes;
    static constexpr int kSPad = (kBMT * kScaleTileBytes + 1023) / 1024 * 1024;
    static constexpr int kStageBytes = kSOff + kSPad;
    // Consumer warp groups: 2 (two m-tiles per warp) or 4 (one; twice the warps per scheduler to
    // hide the decode's latency where narrow tiles leave the tensor cores waiting on it).
    static_assert(kGroups == 2 || kGroups == 4, "kGroups: 2 or 4");
    static constexpr int kMT = kBMT / (4 * kGroups);  // m-tiles per consumer warp
    static constexpr int kThreads = 128 * (1 + kGroups);
    static constexpr int kCons = 128 * kGroups;  // consumer threads
    // Registers per thread after the split (setmaxnreg), which only redistributes the block's
    // launch allocation (65536 / kThreads, rounded down to 8): 384 x 168 = 128 x 104 + 256 x 200
    // = 128 x 56 + 256 x 224, 640 x 96 = 128 x 64 + 512 x 104. A consumer holds kMT x kAcc
    // accumulators and the A fragments of two wgmma groups: ptxas serialises the wgmma (C7512)
    // at 192 with two m-tiles of 64 accumulators and at 216 with two of 72 (kBN 144), and with
    // one m-tile at 104 once a group holds two fragments. The producer spills below 104 with
    // publish's row passes unrolled; with four groups or at kBN 144 it publishes one pass at a
    // time, in 64 and 56.
    static constexpr int kProducerRegs = kGroups == 4 ? 64 : kBN > 128 ? 56 : 104;
    static constexpr int kConsumerRegs = kGroups == 4 ? 104 : kBN > 128 ? 224 : 200;
    static_assert(128 * kProducerRegs + kCons * kConsumerRegs <= 65536 / kThreads / 8 * 8 * kThreads,
                  "setmaxnreg redistributes the block's own registers");
    static constexpr int kHalfBytes = kBN * 128;                  // B: 64 logical k of kBN rows
    static constexpr int kAcc = kBN / 2;                          // accumulators per thread
    static constexpr int kRowPasses = (kBN + 31) / 32;            // producer: 32 rows per pass
    // Row n of a producer pass within the tile (kBN 144: the last pass's first 16 rows only).
    __device__ __forceinline__ static constexpr bool in_tile(int n) { return kBN % 32 == 0 || n < kBN; }
    // The epilogue stages the output through shared memory, kEpiRows rows at a time, in two
    // buffers of the widest tile (experts/gemm.py _epi_bytes up to kBN 128); a staged row is the
    // tile's kBC columns plus 16 bytes, so that rows 2 apart start 8 banks apart (conflict-free
    // stores).
    static constexpr int kBC = kBMT * kRowsPerTile;               // output columns of a tile
    // kBN 144: the staging buffers are the item's last stage slot, released to the producer only
    // after the epilogue, so that four stages fit the block's shared memory (three ran full
    // 128-row tiles 2-10 % slower: the ring refills during an epilogue). Chunks as large as the
    // buffers allow (48 rows in the slot, 32 at kBN 64, 16 at kBN 128, whose four stages leave
    // no more): each chunk is a barrier and a dependent chain of stores, shared loads and global
    // stores, and the tensor cores idle through the epilogue's chain of them (docs/kernels.md,
    // twenty-second and twenty-third rounds).
    static constexpr bool kEpiInSlot = kBN > 128;
    static constexpr int kEpiRows = kEpiInSlot ? 48 : kBN == 64 ? 32 : 16;
    static constexpr int kEpiChunks = (kBN + kEpiRows - 1) / kEpiRows;
    static constexpr int kJH = kEpiRows / 8;  // n8 blocks per staged chunk
    static constexpr int kEpiStride = kBC * 2 + 16;
    static constexpr int kEpiBytes = 2 * kEpiRows * (kBMT * 16 * 2 + 16);
    static_assert(!kEpiInSlot || kEpiBytes <= kStageBytes, "the staging buffers fit a slot");
    static constexpr int kTableShift = Dec::kExp == -126 ? 116 : 0;
    // K loops at wgmma widths 16 and 8 for tiles of up to 16 and 8 rows (an expert's only tile
    // at 4-16 rows per expert): the tensor cores' time per group shrinks with the width, and
    // with it the consumers' wait for the previous group before they rewrite its fragments
    // (Qwen3.6 M = 256, 8 rows per expert: FC1 117 -> 112 -> 108 µs at widths 32 -> 16 -> 8;
    // docs/kernels.md, eleventh round). Width 8 waits for each group (wait_group 0): with one
    // group in flight ptxas would serialise its wgmma for want of registers (C7512), and at 8
    // columns the tensor cores are done by the time the next fragments are decoded. Four
    // consumer groups only, and not for the non-gated GELU epilogue: with two groups the extra
    // K loops make ptxas serialise the wgmma (C7512), and GELU's erff spills with them (SiLU's
    // fast exponential and sigmoid_times do not).
    static constexpr bool kNarrow = kGroups == 4 && kAct != 5;
    // A K loop at width 48 for tiles of 33-48 rows (about half the experts at 32 rows per expert
    // on average: the width-64 loop ran them at up to twice the tensor cores' time). One more
    // loop is what the registers allow: with widths 24 or 40 too, or in the non-gated FC1 and the
    // biased GEGLU epilogues, ptxas serialises the wgmma (C7512).
    static constexpr bool kMid = kNarrow && kAct <= 3 && !(kAct == 2 && kBias);
    // (m-tile, k16 step pair) fragments decoded and issued as one wgmma group (k_loop). At kBN
    // 128, and with four consumer groups, one: the registers leave no room for more. With two
    // groups, narrow tiles finish a group's wgmma long before the next group's decode (a
    // dependent chain of shared loads and ALU work) is done, so they decode several independent
    // chains at once.
    static constexpr int kBatch = kBN >= 128 || kGroups == 4 ? 1 : kBN >= 64 ? 2 : 4 * kMT;
    static_assert((kBN % 32 == 0 && kBN >= 32 && kBN <= 128) || kBN == 144, "kBN: 32, 64, 96, 128 or 144");
    static_assert(kStageBytes % 1024 == 0 && kBMT % 8 == 0, "stage alignment");
    // The producer publishes a gathered slot kLag stages after its copies: the copies land while
    // it issues the next stages'. It waits on a slot's empty barrier with kLag slots unpublished,
    // which the consumers' early release (after the next stage's first wait) allows from
    // kLag + 2 stages on.
    static constexpr int kLag = 1;
    static_assert(kStages >= kLag + 2, "the producer's lag needs kLag + 2 stages");

    const Params& p;
    uint8_t* smem;
    const int* tile_start;  // the row-tile table (gemm_items.cuh scan_row_tiles; shared)
    const uint32_t* table;  // 256 scale-table entries (shared)
    uint8_t* epi;           // the epilogue's two staging buffers (shared; null where kEpiInSlot)
    uint32_t full, empty;   // shared addresses of the kStages "full" and "empty" mbarriers
    uint32_t recs;          // shared address of the kStages 16-byte item records (post_item)
    const TensorMap* map0;  // weights (FC1 gate), map1: FC1 up, smap: scales (parameter space)
    const TensorMap* map1;
    const TensorMap* smap;
    const TensorMap* xmap;  // FC2: h as boxes of kXBoxRows rows x 64 k (x_tma()); else unread
    int ksteps;

    // The schedule's size, recomputed where it is used rather than held in registers across the
    // item loops: col_blocks() folds from the parameter bank into uniform registers, and
    // n_items() reloads the scanned tile count from shared memory, which the loops' barrier
    // waits keep from being hoisted. Held, the two spilled in the four-group consumers.
    __device__ __forceinline__ int col_blocks() const {
        return ((p.n + kRowsPerTile - 1) / kRowsPerTile + kBMT - 1) / kBMT;
    }
    __device__ __forceinline__ int n_items() const {
        return tile_start[p.slots] * col_blocks();
    }

    // Whether the activations hold their whole stages in the split k order already (FC2's h
    // from a permuted_h FC1, FC1's x from permute_split): the producer copies those as they are.
    __device__ __forceinline__ bool split_source() const {
        return kAct == 0 ? p.permuted_h != 0 : p.permuted_x != 0;
    }

    // FC2 with h in the split k order: the item's rows of h are contiguous, so each whole
    // stage of them is two columns of 2-D TMA boxes (one per 64-k half, kXBoxRows rows each),
    // which the copy engine writes with the 128-byte swizzle of the B layout. The producer
    // threads copy nothing, and the consumers need no proxy fence (the async proxy wrote B).
    // Boxes of 32 rows (48 at kBN 144, whose tile is three of them): the copy engine's cost is
    // per request, and 16-row boxes (two to three times the requests) gained half as much.
    __device__ __forceinline__ bool x_tma() const { return kAct == 0 && p.permuted_h != 0; }
    static constexpr int kXBoxRows = kBN == 144 ? 48 : 32;
    static constexpr int kXBoxBytes = kXBoxRows * 128;

    // The arrivals that complete a stage's full barrier (with its bulk copies' bytes): one per
    // producer thread once its activation pieces are in place, and the issuing thread's record.
    static constexpr int kFullArrivals = 128 + 1;

    // The producer's next item, fetched during the item before it in three dependent global
    // loads, one per stage (fetch_step): the expert id (active), the expert's rows
    // (expert_offsets), the rows' sources (row_source). Each load has a stage's slot wait to
    // land before the next step uses it, so an item's first copies never wait on its three L2
    // round trips (an item is 4-56 stages).
    struct Fetch {
        ItemLoc loc;
        int e, begin, end;
        Item it;
        // Where row n of each pass starts in x, in 16-byte units (k % 8 == 0), or kNoRow: 32
        // bits rather than a pointer, for the producer's registers (56 at kBN 144).
        uint32_t src[kRowPasses];
    };
    __device__ __forceinline__ void fetch_step(Fetch& f, int index, int step) const {
        if (step == 0) {
            f.loc = locate_item<kBN>(p, tile_start, col_blocks(), index);
            f.e = p.active[f.loc.slot];
        } else if (step == 1) {
            f.begin = p.expert_offsets[f.e];
            f.end = p.expert_offsets[f.e + 1];
        } else {
            f.it = place_item<kBN>(f.loc, f.e, f.begin, f.end);
            const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
            for (int ps = 0; ps < kRowPasses; ++ps) {
                const int n = ps * 32 + warp * 8 + lane % 8;
                const int r = f.it.row0 + (n < f.it.rows ? n : 0);
                const int s = p.row_source ? p.row_source[r] / p.top_k : r;  // x's row
                f.src[ps] = n < f.it.rows ? (uint32_t)s * (uint32_t)(p.k / 8) : kNoRow;
            }
        }
    }
    static constexpr int kFetchSteps = 3;
    static constexpr uint32_t kNoRow = 0xFFFFFFFFu;

    // The stage's item for the consumers, who read the record of an item's first stage instead
    // of decoding the item themselves (the same three dependent loads, before each K loop): a
    // shared store, ordered before their full wait by this thread's release arrival.
    __device__ __forceinline__ void post_item(int slot, const Item& it) const {
        sts128(recs + 16 * slot, it.e, it.row0, it.rows, it.cblock);
        mbar_arrive(full + 8 * slot);
    }
    __device__ __forceinline__ Item record(int slot) const {
        const uint4 v = lds128s(recs + 16 * slot);
        return Item{(int)v.x, (int)v.y, (int)v.z, (int)v.w};
    }

    // Producer group: bulk copies of weights and scales (warp 0), activation rows (all).
    __device__ __forceinline__ void produce() const {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
        const int q = lane / 8;  // this lane's pieces 32t + 8q of each row, t = 0..3
        const T* const x = static_cast<const T*>(p.x);
        const bool issues = threadIdx.x == 0;  // the stage's TMA boxes, byte count and record
        int st = 0, pub = 0;  // stages [pub, st) are gathered and not yet published
        Fetch cur, nxt;
        if (blockIdx.x < n_items()) {  // the first item: the one fetch the producer waits for
#pragma unroll
            for (int step = 0; step < kFetchSteps; ++step) fetch_step(cur, blockIdx.x, step);
        }
        for (int index = blockIdx.x; index < n_items(); index = next_item<kBN>(index)) {
            const Item it = cur.it;
            // Only the 32-row passes that the consumers' wgmma reads are gathered (its width
            // rounded up to 32; the width-8 and width-16 loops read the first rows of one pass):
            // passes past it would fill rows that no wgmma reads.
            const int passes = (it.rows + 31) / 32;  // it.rows <= kBN
            uint32_t src[kRowPasses];
#pragma unroll
            for (int ps = 0; ps < kRowPasses; ++ps) src[ps] = cur.src[ps];
            const int c1 = it.cblock * kBMT;
            const int next = next_item<kBN>(index);
            const bool more = next < n_items();

            for (int ks = 0; ks < ksteps; ++ks, ++st) {
                const int slot = st % kStages;
                const uint32_t parity = ((st / kStages) & 1) ^ 1;
                if (more && ks < kFetchSteps) fetch_step(nxt, next, ks);  // lands during the wait
                if (split_source() && (ks + 1) * kStageCodes <= p.k) {
                    // x already holds the stage in the B order: 16-byte pieces straight into
                    // their swizzled slots, no registers, so the producer moves on at once.
                    mbar_wait(empty + 8 * slot, parity);
                    if (pub < st) flush(pub, st);  // a K tail's gathered stage before a whole one
                    ++pub;
                    const uint32_t stage = smem_u32(smem) + slot * kStageBytes;
                    if (x_tma()) {
                        // Box b of half kh: the item's rows kXBoxRows b .. + kXBoxRows - 1.
                        // Rows past the item are read into columns that no store depends on;
                        // rows past h come zero.
                        if (issues) {
                            const int boxes = (it.rows + kXBoxRows - 1) / kXBoxRows;
                            load_weights(stage, ks, c1, it.e, full + 8 * slot, 2 * boxes * kXBoxBytes);
                            for (int b = 0; b < boxes; ++b) {
#pragma unroll
                                for (int kh = 0; kh < 2; ++kh)
                                    tma_load_2d(stage + kh * kHalfBytes + b * kXBoxBytes, xmap,
                                                ks * kStageCodes + 64 * kh, it.row0 + kXBoxRows * b, full + 8 * slot);
                            }
                            post_item(slot, it);
                        }
                        mbar_arrive(full + 8 * slot);  // every producer thread arrives: it copied nothing
                        continue;
                    }
                    if (issues) {
                        load_weights(stage, ks, c1, it.e, full + 8 * slot);
                        post_item(slot, it);
                    }
#pragma unroll
                    for (int ps = 0; ps < kRowPasses; ++ps) {
                        if (ps >= passes) break;  // uniform: the item's
                        const int n = ps * 32 + warp * 8 + lane % 8;
                        if (!in_tile(n)) continue;  // uniform: the warp's
                        const uint32_t row = stage + n * 128;
                        const bool live = src[ps] != kNoRow;
                        // A row that is not live reads nothing: x stands in as a valid address.
                        const T* const from = (live ? x + (size_t)src[ps] * 8 + ks * kStageCodes : x) + 8 * q;
                        int r = n % 8;  // opaque, as in the regrouping path below
                        asm volatile("" : "+r"(r));
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            // Piece 4c + q: the 4 lanes of a row copy 64 contiguous bytes (whole
                            // sectors) per instruction; it goes to half c / 2, chunk 4 (c % 2) + q.
                            const int j = 4 * (c % 2) + q;
                            cp_async16(row + (c / 2) * kHalfBytes + (j ^ r) * 16,
                                       from + 32 * c, live ? 16u : 0u);
                        }
                    }
                    cp_async_arrive(full + 8 * slot);
                    continue;
                }
                mbar_wait(empty + 8 * slot, parity);
                const uint32_t stage = smem_u32(smem) + slot * kStageBytes;
                if (issues) {
                    load_weights(stage, ks, c1, it.e, full + 8 * slot);
                    post_item(slot, it);
                }
                // Piece t (codes 32t + 8q) of row n lands in the 16 bytes that this thread's
                // regrouping will overwrite (half q / 2, logical chunk 4 (q % 2) + t), so the
                // regrouping needs no other thread's data and no barrier.
#pragma unroll
                for (int ps = 0; ps < kRowPasses; ++ps) {
                    if (ps >= passes) break;  // uniform: the item's
                    const int n = ps * 32 + warp * 8 + lane % 8;
                    if (!in_tile(n)) continue;  // uniform: the warp's
                    const uint32_t row = stage + (q / 2) * kHalfBytes + n * 128;
                    // Opaque: ptxas would hoist the pieces' swizzled offsets of every pass out
                    // of the item loop and, in kBN 144's 56 registers, spill them.
                    int r = n % 8;
                    asm volatile("" : "+r"(r));
#pragma unroll
                    for (int t = 0; t < 4; ++t) {
                        const int k = ks * kStageCodes + 32 * t + 8 * q;
                        const bool live = src[ps] != kNoRow && k < p.k;
                        cp_async16(row + ((4 * (q % 2) + t) ^ r) * 16,
                                   live ? x + (size_t)src[ps] * 8 + k : x, live ? 16u : 0u);
                    }
                }
                cp_async_commit();
                if (st - pub >= kLag) {
                    cp_async_wait<kLag>();
                    publish(pub % kStages);
                    ++pub;
                }
            }
            if (more) {  // K of fewer stages than fetch steps
                for (int step = ksteps; step < kFetchSteps; ++step) fetch_step(nxt, next, step);
            }
            // Unconditional: after a block's last item nxt is unset and unused, and a
            // conditional copy keeps cur alive beside it (12 bytes of spills in 18 four-group
            // specialisations).
            cur = nxt;
        }
        flush(pub, st);
    }

    // Stage ks of the item's weights and scales (m-tiles c1 .. c1 + kBMT - 1 of expert e): one
    // box per matrix, 4 chunks of kBMT m-tiles; m-tiles past the matrix and chunks past K come
    // zero-filled (and count in the box's bytes).
    // extra: the bytes of the stage's other boxes on the same barrier (x_tma).
    __device__ __forceinline__ void load_weights(uint32_t stage, int ks, int c1, int e, uint32_t bar,
                                                 uint32_t extra = 0) const {
        mbar_expect_tx(bar, kABytes + kBMT * kScaleTileBytes + extra);
        tma_load_3d(stage + kAOff, map0, ks * kStageChunks * kUnitBytes / 8, c1, e, bar);
        if constexpr (kGated)
            tma_load_3d(stage + kAOff + kBMT * kMatTileBytes, map1, ks * kStageChunks * kUnitBytes / 8, c1, e,
                        bar);
        tma_load_3d(stage + kSOff, smap, ks * kStageChunks * kScaleChunkBytes / 8, c1, e, bar);
    }

    // Publishes the gathered stages [pub, st) once all of this thread's copies have landed.
    __device__ __forceinline__ void flush(int& pub, int st) const {
        cp_async_wait<0>();
        for (; pub < st; ++pub) publish(pub % kStages);
    }

    // A gathered slot into the B order, in place: each thread reads its own pieces t = 0..3
    // (codes 32t + 8q of row n) and writes them regrouped (step 2q + h, core kc: words
    // x[32t + 8q + 4h + 2kc], t = 0..3, at logical chunk j = 4 (q % 2) + 2h + kc of half q / 2,
    // stored at chunk j ^ (n % 8)); then fences and arrives on the slot's full barrier.
    __device__ __forceinline__ void publish(int slot) const {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, q = lane / 8;
        const uint32_t stage = smem_u32(smem) + slot * kStageBytes;
        // One pass at a time where four consumer groups leave the producer 64 registers.
#pragma unroll(kGroups == 4 || kBN > 128 ? 1 : kRowPasses)
        for (int ps = 0; ps < kRowPasses; ++ps) {
            const int n = ps * 32 + warp * 8 + lane % 8;
            if (!in_tile(n)) continue;  // uniform: the warp's
            const int off = (q / 2) * kHalfBytes + n * 128, j0 = 4 * (q % 2), r = n % 8;
            const uint8_t* const from = smem + slot * kStageBytes + off;
            uint4 u[4];
#pragma unroll
            for (int t = 0; t < 4; ++t) u[t] = lds128(from + ((j0 + t) ^ r) * 16);
            const uint32_t row = stage + off;
            sts128(row + ((j0 + 0) ^ r) * 16, u[0].x, u[1].x, u[2].x, u[3].x);
            sts128(row + ((j0 + 1) ^ r) * 16, u[0].y, u[1].y, u[2].y, u[3].y);
            sts128(row + ((j0 + 2) ^ r) * 16, u[0].z, u[1].z, u[2].z, u[3].z);
            sts128(row + ((j0 + 3) ^ r) * 16, u[0].w, u[1].w, u[2].w, u[3].w);
        }
        fence_async_shared();
        mbar_arrive(full + 8 * slot);
    }

    // Consumer groups: decode, wgmma, epilogue. Warp w of group c supplies m-tiles
    // 4 kGroups u + 4c + w (u < kMT): the A fragments of kMT wgmma per k16 step on one B.
    __device__ __forceinline__ void consume() const {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));
        const int group = threadIdx.x / 128 - 1;
        const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
        const int g = lane / 4, t = lane % 4;
        // Row g of chunk t at slot (g + 2t) % 8 of its group of 8 (layouts.split_slot).
        const int a_off =
            kAOff + (group * 4 + warp) * kMatTileBytes + t * kUnitBytes + ((g + 2 * t) % 8) * 16;
        const int s_off = kSOff + (group * 4 + warp) * kScaleTileBytes + t * kScaleChunkBytes + g * kScaleBytes;
        float acc[kMT][kAcc];
        int slot = 0, ep = 0;  // the next stage's slot; output chunks staged (the buffer parity)
        uint32_t phase = 0;    // the parity of the next stage's full barrier
        for (int index = blockIdx.x; index < n_items(); index = next_item<kBN>(index)) {
            mbar_wait(full + 8 * slot, phase);  // the item's first stage, and with it its record
            const Item it = record(slot);
            // The wgmma width of the tile: its rows rounded up to 32 (at most kBN), or to 8 or 16
            // for tiles of up to 16 rows where kNarrow, so an expert's last, partial tile costs
            // the tensor cores about its rows, not kBN. The branch is per item (warp-group uniform)
            // around whole K loops: ptxas serialises wgmma issued under a branch it cannot prove
            // uniform. The kNarrow ternaries keep the width-8 and width-16 loops out of the other
            // specialisations (their branches are never taken there).
            const int width = min(kBN, (it.rows + 31) / 32 * 32);
            int last;  // the item's last slot
            if (kBN > 128 && width > 128) {
                last = k_loop<(kBN > 128 ? kBN : 32)>(acc, slot, phase, a_off, s_off);
            } else if (kBN >= 128 && width > 64) {
                last = k_loop<kBN >= 128 ? 128 : 32>(acc, slot, phase, a_off, s_off);
            } else if (kBN >= 64 && width > 32 && (!kMid || it.rows > 48)) {
                last = k_loop<kBN >= 64 ? 64 : 32>(acc, slot, phase, a_off, s_off);
            } else if (width > 32) {
                last = k_loop<kMid ? 48 : 32>(acc, slot, phase, a_off, s_off);
            } else if (!kNarrow || it.rows > 16) {
                last = k_loop<32>(acc, slot, phase, a_off, s_off);
            } else if (it.rows > 8) {
                last = k_loop<kNarrow ? 16 : 32>(acc, slot, phase, a_off, s_off);
            } else {
                last = k_loop<kNarrow ? 8 : 32>(acc, slot, phase, a_off, s_off);
            }
            if constexpr (kEpiInSlot) {
                // Both groups' wgmma done with the slot before either stages into it: the groups
                // leave their K loops apart, up to two stages.
                asm volatile("bar.sync 1, %0;" ::"n"(kCons) : "memory");
                store_tile(it, group * 4 + warp, acc, ep, smem + last * kStageBytes);
                // The slot's generic-proxy accesses before the producer's bulk copies into it.
                fence_async_shared();
                mbar_arrive(empty + 8 * last);
            } else {
                store_tile(it, group * 4 + warp, acc, ep, epi);
            }
        }
    }

    // The scale-table entries of one m-tile's scale bytes in a stage: NVFP4 {g blk0, g blk1,
    // g+8 blk0, g+8 blk1}, MXFP4 {g, g+8}. Looked up once per stage into registers: read inside
    // decode, each would be read again after every wgmma (whose asm clobbers memory).
    __device__ __forceinline__ void scales(uint32_t sv, uint32_t (&sc)[kScaleBytes]) const {
#pragma unroll
        for (int j = 0; j < kScaleBytes; ++j) sc[j] = table[prmt(sv, 0u, 0x4440u + j)];
    }

    // The A fragments of steps 2q, 2q + 1 of one m-tile from its words of chunk t (rows g and
    // g + 8, or gate and up): decode, exact 16-bit block-scale multiply by the entries sc of
    // scales().
    __device__ __forceinline__ void decode(uint32_t w0, uint32_t w1, const uint32_t (&sc)[kScaleBytes], int q,
                                           uint32_t (&a_lo)[4], uint32_t (&a_hi)[4]) const {
        const int b0 = kScaleBytes == 4 ? q / 2 : 0;
        const uint32_t s0 = sc[b0], s1 = sc[b0 + kScaleBytes / 2];
        uint32_t h0[4], h1[4];
        Dec::run(w0, h0);
        Dec::run(w1, h1);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
            h0[v] = mul2(h0[v], s0, T());
            h1[v] = mul2(h1[v], s1, T());
        }
        a_lo[0] = h0[0]; a_lo[1] = h1[0]; a_lo[2] = h0[1]; a_lo[3] = h1[1];  // codes 8q + 0..3
        a_hi[0] = h0[2]; a_hi[1] = h1[2]; a_hi[2] = h0[3]; a_hi[3] = h1[3];  // codes 8q + 4..7
    }

    // Steps 2q, 2q + 1 of one m-tile against the stage's B (half q / 2, 32-byte offsets 2 (q % 2)
    // and 2 (q % 2) + 1); the first step of an item overwrites the accumulators.
    // b_lo: desc_lo_sw128 of the stage.
    template <int kW>
    __device__ __forceinline__ void issue(float (&acc)[kAcc], const uint32_t (&a_lo)[4], const uint32_t (&a_hi)[4],
                                          uint32_t b_lo, int q, int ks) const {
        const uint32_t lo = b_lo + ((q / 2) * kHalfBytes + (q % 2) * 64) / 16;
        auto& d = *reinterpret_cast<float(*)[kW / 2]>(acc);
        wg::Wgmma<kW, T>::run(d, a_lo, desc_sw128(lo), (ks | q) != 0);
        wg::Wgmma<kW, T>::run(d, a_hi, desc_sw128(lo + 32 / 16), 1);
    }

    // The K loop of one item at wgmma width kW (<= kBN) on the first kW / 2 accumulators of each
    // m-tile (the others belong to rows past the tile, which the epilogue never stores). The slot
    // whose last wgmma group may still read it is released once the next stage's first wait shows
    // that group complete, so the tensor cores do not drain between stages.
    // Returns the item's last slot, which it releases itself unless kEpiInSlot.
    template <int kW>
    __device__ __forceinline__ int k_loop(float (&acc)[kMT][kAcc], int& slot, uint32_t& phase, int a_off,
                                          int s_off) const {
        int reading = -1;
        const uint32_t smem_s = smem_u32(smem);
        for (int ks = 0; ks < ksteps; ++ks) {
            mbar_wait(full + 8 * slot, phase);
            if (split_source() && !x_tma()) fence_async_shared();  // the cp.async pieces, for wgmma
            // Chunks past K arrive zero-filled (TMA, with zero scale bytes) against zero-filled
            // activations: the K tail needs no test here.
            const uint32_t stage = smem_s + slot * kStageBytes;
            uint32_t w0[kMT][4], w1[kMT][4], sc[kMT][kScaleBytes];
#pragma unroll
            for (int u = 0; u < kMT; ++u) {
                const uint32_t a = stage + a_off + u * 4 * kGroups * kMatTileBytes;
                const uint32_t s = stage + s_off + u * 4 * kGroups * kScaleTileBytes;
                // FC1: the up m-tile of the same columns; FC2: rows g + 8 of the chunk.
                const uint4 wv0 = lds128s(a);
                const uint4 wv1 = lds128s(a + (kGated ? kBMT * kMatTileBytes : 128));
                scales(kScaleBytes == 4 ? lds32s(s) : lds16s(s), sc[u]);
                w0[u][0] = wv0.x; w0[u][1] = wv0.y; w0[u][2] = wv0.z; w0[u][3] = wv0.w;
                w1[u][0] = wv1.x; w1[u][1] = wv1.y; w1[u][2] = wv1.z; w1[u][3] = wv1.w;
            }
            const uint32_t b_lo = desc_lo_sw128(stage);
            // kBatch (m-tile, step pair) fragments per commit group, in the order q major, u
            // minor, which keeps each accumulator's k order (bitwise the same for any kBatch).
#pragma unroll
            for (int i0 = 0; i0 < 4 * kMT; i0 += kBatch) {
                uint32_t a_lo[kBatch][4], a_hi[kBatch][4];
#pragma unroll
                for (int j = 0; j < kBatch; ++j) {
                    const int q = (i0 + j) / kMT, u = (i0 + j) % kMT;
                    decode(w0[u][q], w1[u][q], sc[u], q, a_lo[j], a_hi[j]);
                }
                wgmma_fence();
#pragma unroll
                for (int j = 0; j < kBatch; ++j) {
                    const int q = (i0 + j) / kMT, u = (i0 + j) % kMT;
                    issue<kW>(acc[u], a_lo[j], a_hi[j], b_lo, q, ks);
                }
                // The previous group done: its A registers may be rewritten (two groups'
                // fragments live), and at the stage's first group the previous slot is free.
                // Width 8 waits for this group too (kNarrow says why).
                wgmma_commit();
                wgmma_wait<kW == 8 ? 0 : 1>();
                if (i0 == 0 && reading >= 0) mbar_arrive(empty + 8 * reading);
            }
            reading = slot;
            if (++slot == kStages) slot = 0, phase ^= 1u;
        }
        wgmma_wait<0>();
#pragma unroll
        for (int u = 0; u < kMT; ++u) pin(*reinterpret_cast<float(*)[kW / 2]>(acc[u]));
        if (!kEpiInSlot && reading >= 0) mbar_arrive(empty + 8 * reading);
        return reading;
    }

    // Scale, bias, activation, store; accumulator j of n8 block jb of an m-tile is (row g, tokens
    // 8jb + 2t + u) for j = 4jb + u, (row g + 8, same) for j = 4jb + 2 + u. The output goes
    // through shared memory kEpiRows rows at a time: the lanes store their 2-byte values into a
    // staging buffer at the columns' positions (FC2, whose columns are contiguous: whole 8 x 8
    // blocks by stmatrix, stage_fc2), then the consumer threads copy whole rows out in 16-byte
    // pieces. Stored from the fragments straight to global memory, a warp store
    // covered 4 rows x 16 bytes, and the epilogue (during which the tensor cores idle: all
    // groups finish an item together) took 40 % of Qwen3.6's FC2. Two buffers: chunk c + 1 is
    // staged while other warps still copy chunk c out, one barrier per chunk. `epi`: the
    // buffers, at kBN 144 the item's last stage slot (consume() says when it is free).
    __device__ __forceinline__ void store_tile(const Item& it, int w, const float (&acc)[kMT][kAcc], int& ep,
                                               uint8_t* epi) const {
        int lane;  // read afresh rather than held across the K loop
        asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
        const int g = lane / 4, t = lane % 4;
        int post = -(Dec::kExp + kTableShift + p.scale_shift);
        // Opaque per item: ldexpf's parts that depend on post alone would otherwise be hoisted
        // out of the item loop and held across every K loop (two registers: the biased FC2
        // consumers of four groups then spill).
        asm volatile("" : "+r"(post));
        const float f0 = ldexpf(p.global0[it.e], post);
        const float f1 = kGated ? ldexpf(p.global1[it.e], post) : 0.0f;
        const int col0 = it.cblock * kBC;
        const int whole = kAct != 0 && p.permuted_h ? p.n / kStageCodes * kStageCodes : 0;
        constexpr int kCols = kGated ? 1 : 2;  // a lane's columns per m-tile: g (gated), g, g + 8
        int pos[kMT][kCols];                   // their byte offsets in a staged row
        float b0[kMT][kCols], b1[kMT];
#pragma unroll
        for (int u = 0; u < kMT; ++u) {
            const int tile = it.cblock * kBMT + 4 * kGroups * u + w;
#pragma unroll
            for (int h = 0; h < kCols; ++h) {
                const int col = kGated ? tile * 8 + g : tile * 16 + g + 8 * h;
                const bool in = col < p.n;  // columns past n are staged and never copied out
                // split_position keeps a column within its 128-column stage: in the tile's row.
                // (FC2's stage_fc2 places whole blocks and needs no positions.)
                if constexpr (kAct != 0) pos[u][h] = 2 * (split_position(col, whole) - col0);
                b0[u][h] = kBias && in ? p.bias0[(size_t)it.e * p.n + col] : 0.0f;
                if (h == 0) b1[u] = kGated && kBias && in ? p.bias1[(size_t)it.e * p.n + col] : 0.0f;
            }
        }
#pragma unroll
        for (int c = 0; c < kEpiChunks; ++c) {
            if (kEpiRows * c >= it.rows) break;  // uniform: the whole item's
            uint8_t* const buf = epi + (ep & 1) * (kEpiRows * kEpiStride);
            if constexpr (kAct == 0) {
                stage_fc2(it, w, acc, c, smem_u32(buf), lane, f0, b0);
            } else {
                // 32-bit shared addresses: generic pointers take two registers each, which the
                // four-group consumers (104 registers) cannot spare around a gated activation.
                const uint32_t buf_s = smem_u32(buf) + 2 * t * kEpiStride;
#pragma unroll
                for (int u = 0; u < kMT; ++u)
#pragma unroll
                    for (int jh = 0; jh < kJH; ++jh)
#pragma unroll
                        for (int v = 0; v < 2; ++v) {
                            // Uniform: width 8 leaves n8 blocks past the item's 8 rows
                            // unwritten, and kBN 144's last chunk has 16 rows. Other chunks
                            // stage their rows past the item too (never copied out): a row
                            // test here would cut the chunk into blocks of two values, and
                            // ptxas would then overlap only two activations' MUFU chains.
                            if (kNarrow && kEpiRows * c + 8 * jh >= it.rows) break;
                            const int jb = kJH * c + jh;
                            if (jb >= kBN / 8) break;
                            const uint32_t row = buf_s + (8 * jh + v) * kEpiStride;
                            if constexpr (kGated) {
                                sts16(row + pos[u][0], bits16(cm::from_float<T>(activate<kAct>(
                                    acc[u][4 * jb + v] * f0 + b0[u][0], acc[u][4 * jb + 2 + v] * f1 + b1[u],
                                    p.act))));
                            } else {
#pragma unroll
                                for (int h = 0; h < 2; ++h)
                                    sts16(row + pos[u][h], bits16(cm::from_float<T>(activate1<kAct>(
                                        acc[u][4 * jb + 2 * h + v] * f0 + b0[u][h], p.act))));
                            }
                        }
            }
            // The chunk staged; the other buffer's copy-out (chunk c - 1) done by every thread.
            asm volatile("bar.sync 1, %0;" ::"n"(kCons) : "memory");
            copy_out(it, buf, kEpiRows * c, col0);
            ++ep;
        }
    }

    // FC2's chunk c (rows kEpiRows c .. of the item) into the staging buffer at buf: its output
    // columns are contiguous in a staged row (no split order, no activation), so each 8 x 8 block
    // of a warp's fragment (m-tile columns g or g + 8, an n8 block of rows) goes in by one
    // transposing stmatrix: 4 blocks per instruction where sts16 took one value (the stores were
    // half of a 144-row item's epilogue instructions). Lane l gives row l % 8 of block l / 8 =
    // (n8 block 2 pr + l / 16, column half (l / 8) % 2); rows kEpiStride apart start 4 banks
    // apart, so the 8 rows of a block fill the 32 banks once. Same values as the sts16 path.
    __device__ __forceinline__ void stage_fc2(const Item& it, int w, const float (&acc)[kMT][kAcc],
                                              int c, uint32_t buf, int lane, float f0,
                                              const float (&b0)[kMT][2]) const {
        // Width 8 (kNarrow) leaves the second n8 block of a chunk of at most 8 rows unwritten.
        const bool one = kNarrow && kEpiRows * c + 8 >= it.rows;  // uniform: the item's
#pragma unroll
        for (int pr = 0; pr < kJH / 2; ++pr) {  // 16 rows (two n8 blocks) per stmatrix
            // Uniform: rows past the item, and kBN 144's last chunk of 16 rows.
            if (kJH * c + 2 * pr >= kBN / 8 || kEpiRows * c + 16 * pr >= it.rows) break;
            const uint32_t row =
                buf + (16 * pr + 8 * (lane / 16) + lane % 8) * kEpiStride + 16 * ((lane / 8) % 2);
#pragma unroll
            for (int u = 0; u < kMT; ++u) {
                uint32_t r[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int jb = kJH * c + 2 * pr + i / 2, h = i % 2;
                    const float* const a = &acc[u][4 * jb + 2 * h];
                    r[i] = bits16(cm::from_float<T>(a[0] * f0 + b0[u][h])) |
                           bits16(cm::from_float<T>(a[1] * f0 + b0[u][h])) << 16;
                }
                const uint32_t dst = row + 32 * (4 * kGroups * u + w);
                if (one) {
                    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};"
                                 ::"r"(dst), "r"(r[0]), "r"(r[1])
                                 : "memory");
                } else {
                    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                                 ::"r"(dst), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                                 : "memory");
                }
            }
        }
    }

    // Rows r0 .. r0 + kEpiRows - 1 of the item from a staging buffer to out: 16-byte pieces of
    // whole rows where the rows are 16-byte aligned, else element by element.
    __device__ __forceinline__ void copy_out(const Item& it, const uint8_t* buf, int r0, int col0) const {
        const int rows = min(kEpiRows, it.rows - r0), cols = min(kBC, p.n - col0);
        // Consumer thread 0 .. kCons - 1, read afresh: the pieces' rows and columns derived from
        // threadIdx.x would be hoisted out of the item loop and held across the K loops (at kBN
        // 144's four passes per chunk the FC2 consumers then spill).
        int i0;
        asm volatile("mov.u32 %0, %%tid.x;" : "=r"(i0));
        i0 -= 128;
        T* const dst = static_cast<T*>(p.out) + (size_t)(it.row0 + r0) * p.n + col0;
        if (p.n % 8 == 0 && (reinterpret_cast<unsigned long long>(p.out) & 15) == 0) {
            constexpr int kPieces = kBC / 8;  // per row
            constexpr int kPasses = (kEpiRows * kPieces + kCons - 1) / kCons;
#pragma unroll
            for (int s = 0; s < kPasses; ++s) {
                const int i = i0 + kCons * s, r = i / kPieces, j = i % kPieces;
                if (i < kEpiRows * kPieces && r < rows && 8 * j < cols)
                    *reinterpret_cast<uint4*>(dst + (size_t)r * p.n + 8 * j) =
                        *reinterpret_cast<const uint4*>(buf + r * kEpiStride + 16 * j);
            }
        } else {
            for (int i = i0; i < kEpiRows * kBC; i += kCons) {
                const int r = i / kBC, j = i % kBC;
                if (r < rows && j < cols)
                    dst[(size_t)r * p.n + j] = *reinterpret_cast<const T*>(buf + r * kEpiStride + 2 * j);
            }
        }
    }
};

template <int kFormat, typename T, int kAct, bool kBias, int kBN, int kStages, int kGroups>
__device__ __forceinline__ void gemm90_body(const Params& p, const TensorMap* map0, const TensorMap* map1,
                                            const TensorMap* smap, const TensorMap* xmap = nullptr) {
    using G = Gemm90<kFormat, T, kAct, kBias, kBN, kStages, kGroups>;
    extern __shared__ __align__(16) uint8_t dyn_raw[];
    __shared__ uint32_t table[256];
    __shared__ __align__(8) uint64_t bars[2 * kStages];  // full[0..kStages), empty[..]
    // The stages start at the first 1024-byte boundary (the launch adds 1 KB of slack).
    uint8_t* const dyn_smem = dyn_raw + ((1024u - (smem_u32(dyn_raw) & 1023u)) & 1023u);
    uint8_t* const epi = G::kEpiInSlot ? nullptr : dyn_smem + kStages * G::kStageBytes;
    // kStages item records of 16 bytes
    uint8_t* const recs = dyn_smem + kStages * G::kStageBytes + (G::kEpiInSlot ? 0 : G::kEpiBytes);
    int* tile_start = reinterpret_cast<int*>(recs + 16 * kStages);

    for (int i = threadIdx.x; i < 256; i += G::kThreads) {
        const uint32_t b = scale_bits<kFormat, T>(i, G::kTableShift + p.scale_shift);
        table[i] = b | (b << 16);
    }
    const uint32_t full = smem_u32(bars), empty = smem_u32(bars + kStages);
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full + 8 * s, G::kFullArrivals);
            mbar_init(empty + 8 * s, G::kCons);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    // The maps are kernel parameters, not an upstream kernel's data: safe before the wait.
    if (threadIdx.x == 0) {
        prefetch_map(map0);
        prefetch_map(map1);
        prefetch_map(smap);
        prefetch_map(xmap);
    }
    // Programmatic dependent launch: as gemm_fp4.cu (FC1 waits before the maps, FC2 after).
    if constexpr (kAct != 0) cm::wait_upstream();
    scan_row_tiles<G::kThreads, kBN>(p, tile_start);  // ends with a barrier (table, mbarriers too)
    if constexpr (kAct == 0) cm::wait_upstream();

    G gemm{p, dyn_smem, tile_start, table, epi, full, empty, smem_u32(recs), map0, map1, smap, xmap,
           (p.chunks + kStageChunks - 1) / kStageChunks};
    if (threadIdx.x < 128) {
        gemm.produce();
    } else {
        gemm.consume();
    }
}

}  // namespace

// FC2: persistent grid (at most one block per SM), 128 x (1 + kGroups) threads; dynamic shared
// memory = kStages stages + the epilogue's staging buffers (not at kBN 144, which stages in a
// slot) + kStages item records + the row-tile table (experts/gemm.py computes it).
// Arguments as gemm_fp4.cu's gemm_fc2, then permuted_h and the tensor maps of w and scales
// (experts/gemm.py _maps: over the same bytes as w and scales) and of x (h) as 16-bit [rows, k]
// in boxes of Gemm90::kXBoxRows rows x 64 k with the 128-byte swizzle, read where permuted_h
// (Gemm90::x_tma).
template <int kFormat, typename T, bool kBias, int kBN, int kStages, int kGroups>
__global__ void __launch_bounds__(128 * (1 + kGroups), 1)
    gemm90_fc2(const T* __restrict__ x, const uint8_t* __restrict__ w,
               const uint8_t* __restrict__ scales, const float* __restrict__ global_scale,
               const float* __restrict__ bias, const int* __restrict__ expert_offsets,
               const int* __restrict__ active, T* __restrict__ out, int n_experts, int slots, int n,
               int k, int chunks, int scale_shift, int permuted_h, const __grid_constant__ TensorMap w_map,
               const __grid_constant__ TensorMap s_map, const __grid_constant__ TensorMap x_map) {
    const Params p{x,      nullptr, w,     nullptr,   scales, global_scale,
                   nullptr, bias,   nullptr, expert_offsets, active, out,
                   n_experts, slots, n,    k,         chunks, 1,
                   scale_shift, {0.0f, 0.0f, 0.0f}, permuted_h};
    gemm90_body<kFormat, T, 0, kBias, kBN, kStages, kGroups>(p, &w_map, nullptr, &s_map, &x_map);
}

// Non-gated FC1 (relu, gelu, silu, identity): FC2's kernel with FC1's row gather and wait, and
// the activation in the epilogue. Arguments as gemm_fp4.cu's gemm_fc1_single, then permuted_h,
// permuted_x and the tensor maps of w and scales.
template <int kFormat, typename T, int kAct, bool kBias, int kBN, int kStages, int kGroups>
__global__ void __launch_bounds__(128 * (1 + kGroups), 1)
    gemm90_fc1_single(const T* __restrict__ x, const int* __restrict__ row_source,
                      const uint8_t* __restrict__ w, const uint8_t* __restrict__ scales,
                      const float* __restrict__ global_scale, const float* __restrict__ bias,
                      const int* __restrict__ expert_offsets, const int* __restrict__ active,
                      T* __restrict__ out, int n_experts, int slots, int n, int k, int chunks,
                      int top_k, int scale_shift, int permuted_h, int permuted_x,
                      const __grid_constant__ TensorMap w_map, const __grid_constant__ TensorMap s_map) {
    static_assert(kAct >= 4 && kAct <= 7, "kAct: 4 relu, 5 gelu, 6 silu, 7 identity");
    const Params p{x,      row_source, w,     nullptr,   scales, global_scale,
                   nullptr, bias,   nullptr, expert_offsets, active, out,
                   n_experts, slots, n,    k,         chunks, top_k,
                   scale_shift, {0.0f, 0.0f, 0.0f}, permuted_h, permuted_x};
    gemm90_body<kFormat, T, kAct, kBias, kBN, kStages, kGroups>(p, &w_map, nullptr, &s_map);
}

// FC1 with a gated activation: as FC2; arguments as gemm_fp4.cu's gemm_fc1, then permuted_h,
// permuted_x and the tensor maps of gate, up and scales.
template <int kFormat, typename T, int kAct, bool kBias, int kBN, int kStages, int kGroups>
__global__ void __launch_bounds__(128 * (1 + kGroups), 1)
    gemm90_fc1(const T* __restrict__ x, const int* __restrict__ row_source,
               const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up,
               const uint8_t* __restrict__ scales, const float* __restrict__ gate_global,
               const float* __restrict__ up_global, const float* __restrict__ gate_bias,
               const float* __restrict__ up_bias, const int* __restrict__ expert_offsets,
               const int* __restrict__ active, T* __restrict__ out, int n_experts, int slots, int n,
               int k, int chunks, int top_k, int scale_shift, float alpha, float beta,
               float limit, int permuted_h, int permuted_x, const __grid_constant__ TensorMap gate_map,
               const __grid_constant__ TensorMap up_map, const __grid_constant__ TensorMap s_map) {
    static_assert(kAct >= 1 && kAct <= 3, "kAct: 1 swiglu, 2 geglu, 3 swiglu_oai");
    const Params p{x,         row_source, gate,    up,        scales,         gate_global,
                   up_global, gate_bias,  up_bias, expert_offsets, active,    out,
                   n_experts, slots,      n,       k,         chunks,         top_k,
                   scale_shift, {alpha, beta, limit}, permuted_h, permuted_x};
    gemm90_body<kFormat, T, kAct, kBias, kBN, kStages, kGroups>(p, &gate_map, &up_map, &s_map);
}

// x into the split k order of the wgmma B layout (split_position) for an FC1 with permuted_x:
// the producer then copies FC1's activation tiles as it copies FC2's, by cp.async without a
// regrouping. Thread u of a row: for u < 4 * (k / 128), stage u / 4, quarter q = u % 4 (the
// producer's four 16-byte pieces 32t + 8q, t = 0..3, stored regrouped as four contiguous 16-byte
// chunks at 64 (q / 2) + 32 (q % 2)); the columns of the last partial stage copied as they are.
// Needs k % 8 == 0 (16-byte rows); the wgmma kernel's own requirement. Reads only x: it waits for
// the kernel before it (it may overwrite a buffer that kernel reads) and lets the next one start.
template <typename T>
__global__ void __launch_bounds__(256)
    permute_split(const T* __restrict__ x, T* __restrict__ out, int rows, int k) {
    cm::wait_upstream();
    const int whole = k / kStageCodes, units = 4 * whole + (k - whole * kStageCodes);
    const long long total = (long long)rows * units;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / units), u = (int)(i - (long long)r * units);
        const T* const src = x + (size_t)r * k;
        T* const dst = out + (size_t)r * k;
        if (u < 4 * whole) {
            const int s = u / 4, q = u % 4;
            uint4 v[4];
#pragma unroll
            for (int t = 0; t < 4; ++t)
                v[t] = *reinterpret_cast<const uint4*>(src + s * kStageCodes + 32 * t + 8 * q);
            uint4* const d = reinterpret_cast<uint4*>(dst + s * kStageCodes + 64 * (q / 2) + 32 * (q % 2));
            d[0] = make_uint4(v[0].x, v[1].x, v[2].x, v[3].x);
            d[1] = make_uint4(v[0].y, v[1].y, v[2].y, v[3].y);
            d[2] = make_uint4(v[0].z, v[1].z, v[2].z, v[3].z);
            d[3] = make_uint4(v[0].w, v[1].w, v[2].w, v[3].w);
        } else {
            const int c = whole * kStageCodes + (u - 4 * whole);
            dst[c] = src[c];
        }
    }
}
