// SPDX-License-Identifier: Apache-2.0
// The expert-parallel exchange's small kernels (cupymoe/parallel/kernels.py launches them): the
// device side of cupymoe/parallel/plan.py, one kernel per step. Rows are moved as uint16_t words
// (bf16 and fp16 alike): bitwise copies. Element-wise kernels take their element count and run
// a grid of ceil(n / 256) blocks of 256 threads; the table kernels run as <<<1, 1>>>.
#include "common.cuh"

// <<<1, 1>>>: exclusive scan of the counts over each owner's experts. base[e] = rows of owner[e]'s
// experts before e; run[d] = rows to rank d; counts_to[d * e_max + local[e]] = count of e.
__global__ void ep_home_tables(const int* offsets, const int* owner, const int* local,
                               int n_experts, int world, int e_max, int* base, int* run,
                               int* counts_to) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    for (int t = 0; t < world * e_max; ++t) counts_to[t] = 0;
    for (int d = 0; d < world; ++d) run[d] = 0;
    for (int e = 0; e < n_experts; ++e) {
        const int c = offsets[e + 1] - offsets[e];
        const int d = owner[e];
        base[e] = run[d];
        run[d] += c;
        counts_to[d * e_max + local[e]] = c;
    }
}

// One thread per (expanded row, word), n = rows * width: send[slot[r]] = x[sorted_rows[r] / top_k].
__global__ void ep_pack_rows(const uint16_t* x, const int* sorted_rows, const int* ids,
                             const int* offsets, const int* owner, const int* base, int top_k,
                             int width, int cap, long long n, uint16_t* send, int* slot) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int r = (int)(i / width), c = (int)(i % width);
    const int src = sorted_rows[r];
    const int e = ids[src];
    const int s = owner[e] * cap + base[e] + (r - offsets[e]);
    send[(long long)s * width + c] = x[(long long)(src / top_k) * width + c];
    if (c == 0) slot[r] = s;
}

// <<<1, 1>>>: the owner's expert offsets, per-source prefixes and rows before each source, and
// its active experts (-1 after the last).
__global__ void ep_local_tables(const int* counts, int world, int n_local, int e_max,
                                int n_active, int* offsets, int* prefix, int* before,
                                int* active) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    int acc = 0;
    for (int j = 0; j < n_local; ++j) {
        offsets[j] = acc;
        for (int s = 0; s < world; ++s) {
            before[s * n_local + j] = acc - offsets[j];
            acc += counts[s * e_max + j];
        }
    }
    offsets[n_local] = acc;
    for (int s = 0; s < world; ++s) {
        int p = 0;
        for (int j = 0; j < n_local; ++j) {
            prefix[s * (n_local + 1) + j] = p;
            p += counts[s * e_max + j];
        }
        prefix[s * (n_local + 1) + n_local] = p;
    }
    int a = 0;
    for (int j = 0; j < n_local && a < n_active; ++j)
        if (offsets[j + 1] > offsets[j]) active[a++] = j;
    for (; a < n_active; ++a) active[a] = -1;
}

// One thread per received position p = s * cap + q, n = world * cap positions: its local row and
// expert (inverse -1 and expert n_local on padding).
__global__ void ep_local_rows(const int* offsets, const int* prefix, const int* before,
                              int n_local, int cap, int n, int* sorted_rows, int* inverse,
                              int* ids) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n) return;
    const int i = (int)g;
    const int s = i / cap, q = i % cap;
    const int* pre = &prefix[s * (n_local + 1)];
    if (q >= pre[n_local]) {
        inverse[i] = -1;
        ids[i] = n_local;
        return;
    }
    int lo = 0, hi = n_local;  // the j with pre[j] <= q < pre[j + 1]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (pre[mid] <= q)
            lo = mid;
        else
            hi = mid;
    }
    const int row = offsets[lo] + before[s * n_local + lo] + (q - pre[lo]);
    sorted_rows[row] = i;
    inverse[i] = row;
    ids[i] = lo;
}

// One thread per word, n = positions * width: ret[p] = y[inverse[p]] (0 for padding).
__global__ void ep_return_rows(const uint16_t* y, const int* inverse, int width, long long n,
                               uint16_t* ret) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int p = (int)(i / width), c = (int)(i % width);
    const int row = inverse[p];
    ret[i] = row >= 0 ? y[(long long)row * width + c] : (uint16_t)0;
}

// One thread per word, n = rows * width: out[r] = rows[index[r]].
__global__ void ep_gather_rows(const uint16_t* rows, const int* index, int width, long long n,
                               uint16_t* out) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = rows[(long long)index[i / width] * width + i % width];
}
