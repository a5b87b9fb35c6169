// SPDX-License-Identifier: Apache-2.0
// The wgmma issue patterns of the sm_90a grouped GEMM without data movement or barriers.
// benchmarks/wgmma_ceiling.py generates ops.inc (one wrapper wgrsN / wgssN per m64nNk16 shape,
// A from registers or shared memory) and rows.inc (one T(...) line per pattern), then builds and
// runs this file. Output: one CSV line per pattern.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "ops.inc"

__device__ __forceinline__ void fence_() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit_() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int W> __device__ __forceinline__ void wait_() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(W) : "memory"); }
__device__ __forceinline__ uint64_t desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
template <int N> struct Op;
#define OPS(n) template <> struct Op<n> { \
  template <bool SS> __device__ __forceinline__ static void run(float (&d)[n/2], const uint32_t (&a)[4], uint64_t ad, uint64_t b, int sd) { \
    if constexpr (SS) wgss##n(d, ad, b, sd); else wgrs##n(d, a, b, sd); } };
OPS(32) OPS(64) OPS(128) OPS(256)

// ALU: integer operations per thread rewriting A before each group (where the decode sits).
template <int N, int G, int W, int NWG, bool SS, int ALU>
__global__ void __launch_bounds__(128 * NWG, 1) bench(float* out, int iters, long long* clk) {
  extern __shared__ __align__(1024) uint8_t sm_raw[];
  uint8_t* sm = sm_raw + ((1024 - ((uint32_t)__cvta_generic_to_shared(sm_raw) & 1023)) & 1023);
  for (int i = threadIdx.x; i < 65536 / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(sm)[i] = 0;
  __syncthreads();
  long long c0 = clock64();
  float d[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  uint32_t a[4] = {threadIdx.x & 1, 0u, 0u, 0u};
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
  const uint64_t ad = desc(base + 49152);
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
#pragma unroll
      for (int u = 0; u < ALU; ++u) a[u & 3] = (a[u & 3] * 3u + (uint32_t)it) & 0x00010001u;
      fence_();
#pragma unroll
      for (int g = 0; g < G; ++g) Op<N>::template run<SS>(d, a, ad, desc(base + (g % 4) * 32), 1);
      commit_();
      wait_<W>();
    }
  }
  wait_<0>();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += d[i];
  if (s == 12345.f) out[threadIdx.x] = s;
  if (threadIdx.x == 0) clk[blockIdx.x] = clock64() - c0;
}

template <int N, int G, int W, int NWG, bool SS, int ALU>
void time_it(float* out, long long* clk, int sms) {
  auto k = bench<N, G, W, NWG, SS, ALU>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536 + 1024);
  int iters = 2000;
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  k<<<sms, 128 * NWG, 65536 + 1024>>>(out, 10, clk);
  std::vector<float> ts;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0);
    k<<<sms, 128 * NWG, 65536 + 1024>>>(out, iters, clk);
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  std::vector<long long> c(sms); cudaMemcpy(c.data(), clk, sms * 8, cudaMemcpyDeviceToHost);
  double flops = 2.0 * 64 * N * 16 * (4.0 * G * iters) * NWG * sms;
  double ms = ts[2];
  printf("%d,%d,%d,%d,%d,%d,%.4f,%.1f,%.0f,%.2f,%s\n", N, G, W, NWG, (int)SS, ALU, ms, flops / ms / 1e9,
         c[0] / (ms * 1e3), c[0] / (4.0 * G * iters * NWG), cudaGetErrorString(cudaGetLastError()));
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out; long long* clk; cudaMalloc(&out, 4096); cudaMalloc(&clk, 8 * sms);
#define T(N, G, W, NWG, SS, ALU) time_it<N, G, W, NWG, SS, ALU>(out, clk, sms);
#include "rows.inc"
  return 0;
}
