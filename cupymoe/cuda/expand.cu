// SPDX-License-Identifier: Apache-2.0
// Expand: gather token rows into expert order, x_sorted[r] = x[sorted_rows[r] / top_k].
// The row is copied as opaque words of type V (uint4 = 16 bytes when the row allows it).
#include "common.cuh"

// Grid (n_rows, ceil(words / blockDim.x)); one block copies (part of) one expanded row.
template <typename V>
__global__ void expand_rows(const V* __restrict__ x, long long x_ld, const int* __restrict__ sorted_rows,
                            int top_k, int n_rows, int words, V* __restrict__ out) {
    const int r = blockIdx.x;
    const int w = blockIdx.y * blockDim.x + threadIdx.x;
    if (r >= n_rows || w >= words) return;
    const long long token = sorted_rows[r] / top_k;
    out[(long long)r * words + w] = x[token * x_ld + w];
}
