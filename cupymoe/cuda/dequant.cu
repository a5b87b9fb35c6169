// SPDX-License-Identifier: Apache-2.0
// Dequantize block-scaled E2M1 expert weights to a dense [experts, N, K] array.
//
//   out[s, n, k] = E2M1[nibble(e, n, k)] * scale(e, n, k / kBlock) * global_scale[e],  e = experts[s]
//
// computed in fp32 as (code * scale) * global_scale -- the first product is exact, the second is
// one fp32 rounding, exactly like NumPy's float32 -- then rounded to nearest even into OutT.
// The batched path (above the GEMV row window) feeds this output to cuBLAS.
#include "common.cuh"

namespace {

// E2M1 code -> fp32 through the bit pattern: for magnitudes 2..7 the three code bits are exponent
// (biased by 1) and mantissa in the right place, so adding 126 to the fp32 exponent finishes the
// job; magnitudes 0 and 1 (zero and the one subnormal, 0.5) are selected. Exact, no table.
__device__ __forceinline__ float e2m1_to_float(uint32_t code) {
    const uint32_t mag = code & 7u;
    uint32_t bits = (mag << 22) + (126u << 23);
    bits = (mag >= 2u) ? bits : (mag == 1u ? 0x3F000000u : 0u);
    return __uint_as_float(bits | ((code & 8u) << 28));  // the sign, also for -0 (code 0x8)
}

// Nibble slot of logical element i (0..7) inside one 32-bit word of eight codes.
// Plain order: slot i. SM80 pair-interleaved order: slots hold e0 e2 e4 e6 e1 e3 e5 e7.
template <bool kPairInterleaved> __device__ __forceinline__ int nibble_slot(int i) {
    if constexpr (kPairInterleaved) {
        return (i >> 1) + ((i & 1) << 2);
    } else {
        return i;
    }
}

// Two fp32 values rounded to OutT and packed into one 32-bit word (low address first).
template <typename OutT> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);  // .x = a (low half), RNE
    return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Decode one word (eight codes, one scale block) and store its eight outputs with 16-byte stores.
template <typename OutT, bool kPairInterleaved>
__device__ __forceinline__ void decode_word(uint32_t word, float scale, float global_scale,
                                            OutT* __restrict__ dst) {
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint32_t code = (word >> (4 * nibble_slot<kPairInterleaved>(i))) & 0xFu;
        // Two separate roundings in this order (the first is exact); __fmul_rn keeps the compiler
        // from reassociating the product.
        v[i] = __fmul_rn(__fmul_rn(e2m1_to_float(code), scale), global_scale);
    }
    if constexpr (sizeof(OutT) == 4) {
        uint4* d = reinterpret_cast<uint4*>(dst);
        d[0] = make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                          __float_as_uint(v[3]));
        d[1] = make_uint4(__float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
                          __float_as_uint(v[7]));
    } else {
        *reinterpret_cast<uint4*>(dst) = make_uint4(pack2<OutT>(v[0], v[1]), pack2<OutT>(v[2], v[3]),
                                                    pack2<OutT>(v[4], v[5]), pack2<OutT>(v[6], v[7]));
    }
}

// One chunk of kWords * 8 codes of one row: a single vector load of 4 * kWords bytes, then decode.
template <int kFormat, typename OutT, bool kPairInterleaved, int kWords>
__device__ __forceinline__ void decode_chunk(const uint8_t* __restrict__ row_packed,
                                             const uint8_t* __restrict__ row_scales,
                                             float global_scale, OutT* __restrict__ row_out,
                                             int chunk) {
    constexpr int kBlock = cm::FormatTraits<kFormat>::kBlock;
    uint32_t words[kWords];
    if constexpr (kWords == 4) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row_packed) + chunk);
        words[0] = raw.x;
        words[1] = raw.y;
        words[2] = raw.z;
        words[3] = raw.w;
    } else {
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(row_packed) + chunk);
        words[0] = raw.x;
        words[1] = raw.y;
    }
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
        const int first = (chunk * kWords + w) * 8;  // first logical element of this word
        const float scale = cm::decode_scale<kFormat>(__ldg(row_scales + first / kBlock));
        decode_word<OutT, kPairInterleaved>(words[w], scale, global_scale, row_out + first);
    }
}

template <int kFormat, typename OutT, bool kPairInterleaved, int kWords>
__device__ __forceinline__ void dequantize_rows(const uint8_t* __restrict__ packed,
                                                const uint8_t* __restrict__ scales,
                                                const float* __restrict__ global_scale,
                                                const int32_t* __restrict__ experts,
                                                OutT* __restrict__ out, int n_out, int n_experts,
                                                int n, int k) {
    constexpr int kBlock = cm::FormatTraits<kFormat>::kBlock;
    const int chunks_per_row = k / (8 * kWords);
    const long long total = (long long)n_out * n * chunks_per_row;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < total; t += stride) {
        const int chunk = (int)(t % chunks_per_row);
        const long long out_row = t / chunks_per_row;  // s * n + row
        const int slot = (int)(out_row / n);
        const int row = (int)(out_row - (long long)slot * n);
        const int expert = experts == nullptr ? slot : __ldg(experts + slot);
        OutT* row_out = out + out_row * k;
        if (expert < 0 || expert >= n_experts) {  // the host validates; never read out of range
            const OutT nan = cm::from_float<OutT>(__int_as_float(0x7FC00000));
            for (int i = 0; i < 8 * kWords; ++i) row_out[chunk * 8 * kWords + i] = nan;
            continue;
        }
        const long long src_row = (long long)expert * n + row;
        decode_chunk<kFormat, OutT, kPairInterleaved, kWords>(
            packed + src_row * (k / 2), scales + src_row * (k / kBlock),
            __ldg(global_scale + expert), row_out, chunk);
    }
}

}  // namespace

// Grid: 1-D, grid-stride over (output expert slot, row, chunk); block: any multiple of 32 threads.
// Each thread decodes one chunk per step: 16 bytes (32 codes) when K % 32 == 0, otherwise 8 bytes
// (16 codes; NVFP4 only, K % 16 == 0). Rows of `packed` must be 16-byte (8-byte) aligned and `out`
// 16-byte aligned: the host checks both. `experts` (nullptr = all experts in order) maps output
// slot s to expert experts[s]; an id out of range writes NaN rows instead of reading out of range.
template <int kFormat, typename OutT, bool kPairInterleaved>
__global__ void dequantize_fp4(const uint8_t* __restrict__ packed,  // [E, N, K/2]
                               const uint8_t* __restrict__ scales,  // [E, N, K/kBlock]
                               const float* __restrict__ global_scale,  // [E]
                               const int32_t* __restrict__ experts,  // [n_out] or nullptr
                               OutT* __restrict__ out,  // [n_out, N, K]
                               int n_out, int n_experts, int n, int k) {
    if (k % 32 == 0) {
        dequantize_rows<kFormat, OutT, kPairInterleaved, 4>(packed, scales, global_scale, experts,
                                                            out, n_out, n_experts, n, k);
    } else {
        dequantize_rows<kFormat, OutT, kPairInterleaved, 2>(packed, scales, global_scale, experts,
                                                            out, n_out, n_experts, n, k);
    }
}
