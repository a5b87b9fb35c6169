// SPDX-License-Identifier: Apache-2.0
// Finalize: out[t] = sum_j topk_weights[t, j] * y[inverse[t * k + j]] (+ bias), j = 0..k-1 in
// order, fp32 accumulation (fma), one rounding to the output type.
#include "common.cuh"

template <typename T, int kVec> struct alignas(sizeof(T) * kVec) Pack {
    T v[kVec];
};

// Grid (n_tokens, ceil(hidden / (kVec * blockDim.x))). The token's k (weight, row) pairs are
// staged in shared memory once per block, so the k row loads are independent and all in flight.
// bias: [hidden] of type TB or nullptr. top_k <= 64.
template <typename TY, typename TO, typename TB, int kVec>
__global__ void __launch_bounds__(128) finalize_rows(
    const TY* __restrict__ y, const float* __restrict__ weights, const int* __restrict__ inverse,
    const TB* __restrict__ bias, int top_k, int hidden, TO* __restrict__ out) {
    __shared__ float w_s[64];
    __shared__ int row_s[64];
    const int t = blockIdx.x;
    for (int j = threadIdx.x; j < top_k; j += blockDim.x) {
        w_s[j] = weights[t * top_k + j];
        row_s[j] = inverse[t * top_k + j];
    }
    __syncthreads();
    // As a programmatic dependent of the layer's FC2 (cupymoe/_launch.py): the routing maps read
    // above are older than FC2 and complete (common.cuh); y is FC2's output.
    cm::wait_upstream();
    const int col = (blockIdx.y * blockDim.x + threadIdx.x) * kVec;
    if (col >= hidden) return;
    float acc[kVec];
#pragma unroll
    for (int q = 0; q < kVec; ++q) acc[q] = 0.0f;
#pragma unroll 8
    for (int j = 0; j < top_k; ++j) {
        const Pack<TY, kVec> v =
            *reinterpret_cast<const Pack<TY, kVec>*>(y + (long long)row_s[j] * hidden + col);
        const float w = w_s[j];
#pragma unroll
        for (int q = 0; q < kVec; ++q) acc[q] = fmaf(w, cm::to_float(v.v[q]), acc[q]);
    }
    if (bias != nullptr) {
        const Pack<TB, kVec> b = *reinterpret_cast<const Pack<TB, kVec>*>(bias + col);
#pragma unroll
        for (int q = 0; q < kVec; ++q) acc[q] += cm::to_float(b.v[q]);
    }
    Pack<TO, kVec> o;
#pragma unroll
    for (int q = 0; q < kVec; ++q) o.v[q] = cm::from_float<TO>(acc[q]);
    *reinterpret_cast<Pack<TO, kVec>*>(out + (long long)t * hidden + col) = o;
}
