// SPDX-License-Identifier: Apache-2.0
// FP4 expert GEMV for decode: FC1 with the gated activation fused (gemv_fc1) and FC2 (gemv_fc2).
//
//   FC2:  out[r, n] = sum_k x[r, k] * W[e, n, k] + bias[e, n]                 for rows r of expert e
//   FC1:  out[r, n] = act(x[t, :] . Wg[e, n, :] + bg[e, n],  x[t, :] . Wu[e, n, :] + bu[e, n])
//         with t = row_source[r] / top_k (x is read in token order: no expand launch)
//
// with W[e, n, k] = E2M1(nibble) * block_scale(e, n, k / kBlock) * global_scale[e].
//
// Expert-major schedule. grid = (column tiles, expert slots); a block reads e = active[slot]
// (exit when -1) and applies every decoded weight tile to ALL rows of expert e, kMaxRows rows at a
// time, so an expert's weights cross HBM once per call however many tokens chose it.
//
// Block = kThreads threads = kGroups row groups x kLanesK K-lanes (lane_k = tid % kLanesK, inside
// one warp). A row group owns 4 weight rows (FC2: 4 output columns; FC1: 2 columns, gate and up)
// and its kLanesK lanes split K in chunks of 32 codes: one 16-byte load per weight row and chunk,
// all loads of an iteration (4 rows x kUnroll chunks) issued before any decode. The lanes reduce
// with a fixed xor-shuffle butterfly (deterministic, no atomics, no shared memory).
//
// Numerics (fp32 accumulation everywhere):
//  * decode: a shift and one LOP3 per PAIR of codes builds the fp16 bit pattern of the code
//    times 2^-14 (the E2M1 exponent bias 1 vs fp16's 15; E2M1's one subnormal, 0.5, lands on an
//    fp16 subnormal, exactly), then cvt.f32.f16. Exact.
//  * code * x is exact in fp32; products of one scale block are summed in fp32, then multiplied by
//    the block scale (decoded exactly from its byte through a 256-entry shared table) into the
//    fp32 accumulator. The global scale (times 2^14) is applied once, in fp32, in the epilogue.
//    No 16-bit product is ever formed, so large fp16 activations cannot overflow.
//  * the summation order depends on kLanesK (the K split); a given config is bitwise
//    deterministic, and the plain and pair-interleaved nibble orders give identical bits (the
//    products are accumulated in logical k order in both).
#include "common.cuh"

namespace {

constexpr int kChunk = 32;         // codes per 16-byte weight load
constexpr int kRowsPerGroup = 4;   // weight rows owned by one row group
constexpr int kMaxRows = 2;        // activation rows held in registers (more: another pass)
constexpr int kUnroll = 2;         // chunks in flight per K iteration

// 16-byte streaming load (weights are read once per call: keep L1 for the activations).
__device__ __forceinline__ uint4 load_weights(const uint8_t* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

__device__ __forceinline__ float half_bits_to_float(uint32_t bits16) {
    float f;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"((unsigned short)bits16));
    return f;
}

// Eight codes of one little-endian word -> eight floats (value * 2^-14), indexed by nibble slot.
// Pair j = (slot j, slot j + 4) shares one shift-and-mask: the slot's magnitude bits land on fp16
// bits 9..11 (exponent low bits + top mantissa bit) and its sign on bit 15 of each half; masking
// odd/even nibbles first keeps the neighbours out of the kept bits.
__device__ __forceinline__ void decode_word(uint32_t w, float (&f)[8]) {
    constexpr uint32_t kKeep = 0x8E008E00u;  // sign (15, 31) and magnitude (9-11, 25-27) bits
    const uint32_t even = w & 0x0F0F0F0Fu;
    const uint32_t odd = w & 0xF0F0F0F0u;
    const uint32_t h[4] = {((even << 9) | (even << 12)) & kKeep, ((odd << 5) | (odd << 8)) & kKeep,
                           ((even << 1) | (even << 4)) & kKeep, ((odd >> 3) | odd) & kKeep};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        f[j] = half_bits_to_float(h[j] & 0xFFFFu);
        f[j + 4] = half_bits_to_float(h[j] >> 16);
    }
}

// Nibble slot of logical element i of a word: plain order i; SM80 pair-interleaved order stores
// e0 e2 e4 e6 e1 e3 e5 e7 in slots 0..7. Compile-time: only the register choice changes.
template <bool kPairInterleaved> __device__ __forceinline__ constexpr int slot_of(int i) {
    return kPairInterleaved ? (i >> 1) + ((i & 1) << 2) : i;
}

// Eight activations (one 16-byte load) -> fp32, exact.
__device__ __forceinline__ void widen(uint4 v, __nv_bfloat16, float (&x)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}
__device__ __forceinline__ void widen(uint4 v, __half, float (&x)[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = half_bits_to_float(w[i] & 0xFFFFu);
        x[2 * i + 1] = half_bits_to_float(w[i] >> 16);
    }
}

// Gated activations in fp32 (kAct: 1 swiglu, 2 geglu, 3 swiglu_oai).
template <int kAct> __device__ __forceinline__ float activate(float g, float u, float alpha,
                                                             float limit) {
    if constexpr (kAct == 1) {
        return g / (1.0f + expf(-g)) * u;
    } else if constexpr (kAct == 2) {
        return 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)) * u;
    } else {
        // Comparisons, not fminf/fmaxf: those return the other operand for NaN, and a NaN must
        // reach the output like it does in the reference.
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
        return g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}

// The arguments of one launch, gathered for the shared body.
struct Params {
    const void* x;              // activations: [tokens, k] (FC1, token order) or [rows, k] (FC2)
    const int* row_source;      // FC1: expanded row -> token * top_k + slot; FC2: nullptr
    const uint8_t* w0;          // FC2 weights, FC1 gate: [E, n, k_pad / 2]
    const uint8_t* w1;          // FC1 up (same layout); FC2: nullptr
    const uint8_t* scales;      // [E, tiles, chunks, 4 rows, 32 / kBlock] raw scale bytes
    const float* global0;       // [E] global scale of w0
    const float* global1;       // [E] global scale of w1 (FC1)
    const float* bias0;         // [E, n] float32 (kBias)
    const float* bias1;         // [E, n] float32 (FC1 with kBias)
    const int* expert_offsets;  // [E + 1]
    const int* active;          // [slots] expert ids, -1 = no expert
    void* out;                  // [rows, n] of T, expanded order
    int n_experts, n, k, chunks, top_k;
    float alpha, limit;
};

// kAct 0 = FC2 (one matrix, 4 columns per group); 1..3 = FC1 (gate + up, 2 columns per group).
template <int kFormat, typename T, bool kPairInterleaved, int kCtaN, int kThreads, int kAct,
          bool kBias>
__device__ __forceinline__ void gemv_body(const Params& p) {
    constexpr int kLanesK = kThreads * kRowsPerGroup / kCtaN;
    constexpr int kGroups = kThreads / kLanesK;
    constexpr int kBlock = cm::FormatTraits<kFormat>::kBlock;
    constexpr int kBlocksPerChunk = kChunk / kBlock;       // 2 (NVFP4) or 1 (MXFP4)
    constexpr int kWordsPerBlock = kBlock / 8;             // 2 or 4
    constexpr int kScaleBytes = kRowsPerGroup * kBlocksPerChunk;  // 8 or 4: one vector load
    constexpr bool kGated = kAct != 0;
    constexpr int kCols = kGated ? 2 : 4;                  // output columns per group
    static_assert(kLanesK >= 1 && kLanesK <= 32 && (kLanesK & (kLanesK - 1)) == 0,
                  "kLanesK = kThreads * 4 / kCtaN must be a power of two <= 32");
    static_assert(kThreads % 32 == 0 && kGroups * kLanesK == kThreads, "bad block shape");

    __shared__ float scale_table[256];  // exact decode of every scale byte

    const int e = p.active[blockIdx.y];
    if (e < 0 || e >= p.n_experts) return;  // uniform per block: before any barrier
    for (int i = threadIdx.x; i < 256; i += kThreads) scale_table[i] = cm::decode_scale<kFormat>(i);
    __syncthreads();

    const int lane_k = threadIdx.x % kLanesK;
    const int group = blockIdx.x * kGroups + threadIdx.x / kLanesK;
    const int col0 = group * kCols;  // first output column of this group
    const int row_begin = p.expert_offsets[e];
    const int row_end = p.expert_offsets[e + 1];
    const size_t row_bytes = (size_t)p.chunks * (kChunk / 2);

    // Weight row g of the group (g < 2: gate / w0, g >= 2: up / w1 for FC1). Columns past n are
    // clamped to n - 1 (a valid row; their results are never stored).
    const uint8_t* wrow[kRowsPerGroup];
#pragma unroll
    for (int g = 0; g < kRowsPerGroup; ++g) {
        const int col = min(col0 + (kGated ? (g & 1) : g), p.n - 1);
        const uint8_t* base = (kGated && g >= 2) ? p.w1 : p.w0;
        wrow[g] = base + ((size_t)e * p.n + col) * row_bytes;
    }
    const int tiles = (p.n + kCols - 1) / kCols;  // groups past n (last block) re-read the last
    const uint8_t* srow = p.scales + ((size_t)e * tiles + min(group, tiles - 1)) * p.chunks * kScaleBytes;

    for (int r0 = row_begin; r0 < row_end; r0 += kMaxRows) {
        const int rows = min(kMaxRows, row_end - r0);  // uniform per block: no divergence
        const T* xrow[kMaxRows];
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
            const int row = min(r0 + r, row_end - 1);
            const int src = p.row_source ? p.row_source[row] / p.top_k : row;
            xrow[r] = static_cast<const T*>(p.x) + (size_t)src * p.k;
        }
        float acc[kRowsPerGroup][kMaxRows];
#pragma unroll
        for (int g = 0; g < kRowsPerGroup; ++g)
#pragma unroll
            for (int r = 0; r < kMaxRows; ++r) acc[g][r] = 0.0f;

        for (int c0 = lane_k; c0 < p.chunks; c0 += kUnroll * kLanesK) {
            // All weight and scale loads of the iteration first (16-byte aligned: k_pad % 32 == 0).
            uint4 wv[kUnroll][kRowsPerGroup];
            uint32_t sv[kUnroll][kScaleBytes / 4];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int c = c0 + u * kLanesK;
                const bool live = c < p.chunks;
#pragma unroll
                for (int g = 0; g < kRowsPerGroup; ++g)
                    wv[u][g] = live ? load_weights(wrow[g] + (size_t)c * (kChunk / 2))
                                    : make_uint4(0u, 0u, 0u, 0u);
                const uint8_t* sp = srow + (size_t)c * kScaleBytes;
                if constexpr (kScaleBytes == 8) {
                    const uint2 s = live ? __ldg(reinterpret_cast<const uint2*>(sp)) : make_uint2(0u, 0u);
                    sv[u][0] = s.x;
                    sv[u][1] = s.y;
                } else {
                    sv[u][0] = live ? __ldg(reinterpret_cast<const uint32_t*>(sp)) : 0u;
                }
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int c = c0 + u * kLanesK;
                if (u > 0 && c >= p.chunks) break;
                const uint32_t words[kRowsPerGroup][4] = {
                    {wv[u][0].x, wv[u][0].y, wv[u][0].z, wv[u][0].w},
                    {wv[u][1].x, wv[u][1].y, wv[u][1].z, wv[u][1].w},
                    {wv[u][2].x, wv[u][2].y, wv[u][2].z, wv[u][2].w},
                    {wv[u][3].x, wv[u][3].y, wv[u][3].z, wv[u][3].w}};
#pragma unroll
                for (int b = 0; b < kBlocksPerChunk; ++b) {
                    float part[kRowsPerGroup][kMaxRows];  // this scale block's sums
#pragma unroll
                    for (int g = 0; g < kRowsPerGroup; ++g)
#pragma unroll
                        for (int r = 0; r < kMaxRows; ++r) part[g][r] = 0.0f;
#pragma unroll
                    for (int q = 0; q < kWordsPerBlock; ++q) {
                        const int word = b * kWordsPerBlock + q;
                        const int k0 = c * kChunk + word * 8;
                        // x of the word for every present row (the K padding past k reads zeros).
                        float xf[kMaxRows][8];
#pragma unroll
                        for (int r = 0; r < kMaxRows; ++r) {
                            const bool present = (r == 0 || r < rows) && k0 < p.k;
                            const uint4 xv = present ? __ldg(reinterpret_cast<const uint4*>(xrow[r] + k0))
                                                     : make_uint4(0u, 0u, 0u, 0u);
                            widen(xv, T(), xf[r]);
                        }
#pragma unroll
                        for (int g = 0; g < kRowsPerGroup; ++g) {
                            float wf[8];
                            decode_word(words[g][word], wf);
#pragma unroll
                            for (int r = 0; r < kMaxRows; ++r) {
                                if (r > 0 && r >= rows) break;  // absent rows: no math
#pragma unroll
                                for (int i = 0; i < 8; ++i)  // logical k order in both nibble orders
                                    part[g][r] = fmaf(wf[slot_of<kPairInterleaved>(i)], xf[r][i], part[g][r]);
                            }
                        }
                    }
#pragma unroll
                    for (int g = 0; g < kRowsPerGroup; ++g) {
                        const int byte = g * kBlocksPerChunk + b;
                        const float s = scale_table[(sv[u][byte / 4] >> (8 * (byte % 4))) & 0xFFu];
#pragma unroll
                        for (int r = 0; r < kMaxRows; ++r) acc[g][r] = fmaf(part[g][r], s, acc[g][r]);
                    }
                }
            }
        }

        // Butterfly over the K-lanes: afterwards every lane holds every total.
#pragma unroll
        for (int off = kLanesK / 2; off > 0; off /= 2)
#pragma unroll
            for (int g = 0; g < kRowsPerGroup; ++g)
#pragma unroll
                for (int r = 0; r < kMaxRows; ++r)
                    acc[g][r] += __shfl_xor_sync(0xFFFFFFFFu, acc[g][r], off, kLanesK);

        // Epilogue: output (column j, row r) is written by lane (j * kMaxRows + r) % kLanesK.
        T* out = static_cast<T*>(p.out);
        const float g0 = p.global0[e] * 16384.0f;  // 2^14 undoes the decode's 2^-14 (exact)
        const float g1 = kGated ? p.global1[e] * 16384.0f : 0.0f;
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
            const int col = col0 + j;
#pragma unroll
            for (int r = 0; r < kMaxRows; ++r) {
                if ((j * kMaxRows + r) % kLanesK != lane_k || col >= p.n || r0 + r >= row_end) continue;
                float v;
                if constexpr (kGated) {
                    float gate = acc[j][r] * g0;
                    float up = acc[j + 2][r] * g1;
                    if constexpr (kBias) {
                        gate += p.bias0[(size_t)e * p.n + col];
                        up += p.bias1[(size_t)e * p.n + col];
                    }
                    v = activate<kAct>(gate, up, p.alpha, p.limit);
                } else {
                    v = acc[j][r] * g0;
                    if constexpr (kBias) v += p.bias0[(size_t)e * p.n + col];
                }
                out[(size_t)(r0 + r) * p.n + col] = cm::from_float<T>(v);
            }
        }
    }
}

}  // namespace

// FC2: grid = (ceil(n / kCtaN) column tiles, expert slots), block = kThreads; a block owns kCtaN
// output columns (rows of W) of the expert in its slot.
template <int kFormat, typename T, bool kPairInterleaved, int kCtaN, int kThreads, bool kBias>
__global__ void __launch_bounds__(kThreads)
    gemv_fc2(const T* __restrict__ x, const uint8_t* __restrict__ w,
             const uint8_t* __restrict__ scales, const float* __restrict__ global_scale,
             const float* __restrict__ bias, const int* __restrict__ expert_offsets,
             const int* __restrict__ active, T* __restrict__ out, int n_experts, int n, int k,
             int chunks) {
    const Params p{x,     nullptr, w,      nullptr,        scales, global_scale, nullptr,   bias,
                   nullptr, expert_offsets, active, out, n_experts, n, k,  chunks, 1, 0.0f, 0.0f};
    gemv_body<kFormat, T, kPairInterleaved, kCtaN, kThreads, 0, kBias>(p);
}

// FC1: grid = (ceil(n / (kCtaN / 2)), expert slots); a block owns kCtaN weight rows = kCtaN / 2
// output columns (a column's gate and up rows are read by the same row group). x is read in token
// order through row_source.
template <int kFormat, typename T, bool kPairInterleaved, int kCtaN, int kThreads, int kAct,
          bool kBias>
__global__ void __launch_bounds__(kThreads)
    gemv_fc1(const T* __restrict__ x, const int* __restrict__ row_source,
             const uint8_t* __restrict__ gate, const uint8_t* __restrict__ up,
             const uint8_t* __restrict__ scales, const float* __restrict__ gate_global,
             const float* __restrict__ up_global, const float* __restrict__ gate_bias,
             const float* __restrict__ up_bias, const int* __restrict__ expert_offsets,
             const int* __restrict__ active, T* __restrict__ out, int n_experts, int n, int k,
             int chunks, int top_k, float alpha, float limit) {
    static_assert(kAct >= 1 && kAct <= 3, "kAct: 1 swiglu, 2 geglu, 3 swiglu_oai");
    const Params p{x,       row_source,     gate,   up,  scales,    gate_global, up_global,
                   gate_bias, up_bias,      expert_offsets, active, out, n_experts, n, k,
                   chunks,  top_k,          alpha,  limit};
    gemv_body<kFormat, T, kPairInterleaved, kCtaN, kThreads, kAct, kBias>(p);
}
