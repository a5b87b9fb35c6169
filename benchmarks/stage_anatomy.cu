// SPDX-License-Identifier: Apache-2.0
// The probe kernel of stage_anatomy.py (its docstring says what it measures): the wgmma GEMM's
// stage (256 weight rows x N columns x 128 k, two consumer warp groups, a producer group) built
// up one ingredient at a time, one block per SM, no epilogue and no work items.
// Flags: SYNC  full/empty mbarriers per stage (ring of 4), the consumers' early release;
//        LDSW  the consumers read each stage's weight words, scale bytes and table entries from
//              shared memory (else the words come from registers);
//        PROD  the producer streams each stage: one 18 KB bulk copy from HBM (the weights) and a
//              gather of 144 rows x 256 B of an L2-resident x by 16-byte cp.async (5 passes of 4
//              per thread, each row's source from a row table, as the kernel's split path);
//        FENCE the consumers' fence.proxy.async after each full wait (the kernel's split-order path);
//        RND   random bits in shared memory (the decoded weights and B) instead of a pattern: the
//              tensor cores draw more power and the clock drops (the cycles per stage do not);
//        N     the wgmma width.
// Output: one line per variant, cycles per stage on the SMs' own clocks (median block) against
// the tensor cores' ideal (two groups x 16 wgmma of 64 x N x 16 / 2,048 cycles).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>
#include "ops.inc"  // wgrs64 / wgrs128 / wgrs144 (stage_anatomy.py writes it)
__device__ __forceinline__ void fence_() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit_() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int W> __device__ __forceinline__ void wait_() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(W) : "memory"); }
__device__ __forceinline__ uint64_t desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
template <int N> __device__ __forceinline__ void wg(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b);
template <> __device__ __forceinline__ void wg<64>(float (&d)[32], const uint32_t (&a)[4], uint64_t b) { wgrs64(d, a, b, 1); }
template <> __device__ __forceinline__ void wg<128>(float (&d)[64], const uint32_t (&a)[4], uint64_t b) { wgrs128(d, a, b, 1); }
template <> __device__ __forceinline__ void wg<144>(float (&d)[72], const uint32_t (&a)[4], uint64_t b) { wgrs144(d, a, b, 1); }
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d; asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u)); return d;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) { uint32_t d; asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s)); return d; }
__device__ __forceinline__ void decode(uint32_t w0, uint32_t w1, uint32_t s0, uint32_t s1, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
  constexpr uint32_t kKeep = 0x81C081C0u, kMag = 0x01C001C0u, kSign = 0x80008000u;
  uint32_t h0[4], h1[4];
  h0[0] = w0 & kKeep; h0[1] = (w0 * 8u) & kKeep; h0[2] = ((w0 & 0x40074007u) * 66u) & kKeep; h0[3] = ((w0 >> 3) & kMag) | ((w0 * 4u) & kSign);
  h1[0] = w1 & kKeep; h1[1] = (w1 * 8u) & kKeep; h1[2] = ((w1 & 0x40074007u) * 66u) & kKeep; h1[3] = ((w1 >> 3) & kMag) | ((w1 * 4u) & kSign);
#pragma unroll
  for (int v = 0; v < 4; ++v) { h0[v] = hmul2(h0[v], s0); h1[v] = hmul2(h1[v], s1); }
  lo[0] = h0[0]; lo[1] = h1[0]; lo[2] = h0[1]; lo[3] = h1[1];
  hi[0] = h0[2]; hi[1] = h1[2]; hi[2] = h0[3]; hi[3] = h1[3];
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) { asm volatile("{ .reg .b64 st; mbarrier.arrive.release.cta.shared::cta.b64 st, [%0]; }" ::"r"(bar) : "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) { asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory"); }
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) { asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory"); }
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) { asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory"); }
__device__ __forceinline__ void bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
constexpr int kStages = 4, kBBytes = 144 * 256, kABytes = 16384, kSBytes = 2048;
constexpr int kStageBytes = kBBytes + kABytes + kSBytes;  // 55,296 (multiple of 1024)

template <int N, bool SYNC, bool LDSW, bool PROD, bool FENCE = false, bool RND = false>
__global__ void __launch_bounds__(384, 1) anat(const uint8_t* __restrict__ wts, long long wbytes, const uint16_t* __restrict__ x,
                                               const int* __restrict__ rowsrc, int stages, float* out, long long* clk) {
  extern __shared__ __align__(1024) uint8_t raw[];
  uint8_t* sm = raw + ((1024 - ((uint32_t)__cvta_generic_to_shared(raw) & 1023)) & 1023);
  __shared__ __align__(8) uint64_t bars[2 * kStages];
  __shared__ uint32_t table[256];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(sm);
  const uint32_t full = (uint32_t)__cvta_generic_to_shared(bars), empty = full + 8 * kStages;
  for (int i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(sm)[i] = RND ? (uint32_t)i * 2654435761u ^ 0x9E3779B9u : 0x01000100u * (i & 7);
  for (int i = threadIdx.x; i < 256; i += blockDim.x) table[i] = 0x3F803F80u;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) { mbar_init(full + 8 * s, 129); mbar_init(empty + 8 * s, 256); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  long long c0 = clock64();
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    if (!PROD && !SYNC) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, q = lane / 8;
    for (int st = 0; st < stages; ++st) {
      const int slot = st % kStages;
      if (SYNC) mbar_wait(empty + 8 * slot, ((st / kStages) & 1) ^ 1);
      const uint32_t stage = base + slot * kStageBytes;
      if (PROD) {
        if (threadIdx.x == 0) {
          const long long off = ((long long)(blockIdx.x + st * gridDim.x) * (kABytes + kSBytes)) % (wbytes - 32768);
          mbar_expect_tx(full + 8 * slot, kABytes + kSBytes);
          bulk(stage + kBBytes, wts + (off & ~127ll), kABytes + kSBytes, full + 8 * slot);
        }
#pragma unroll 1
        for (int ps = 0; ps < 5; ++ps) {
          const int n = ps * 32 + warp * 8 + lane % 8;
          if (n >= 144) continue;
          const int r = rowsrc[(blockIdx.x * 144 + n + st * 7) & 4095];
          const uint16_t* from = x + (size_t)r * 2048 + (st % 16) * 128 + 8 * q;
          const uint32_t row = stage + n * 128;
          int sw = n % 8;
          asm volatile("" : "+r"(sw));
#pragma unroll
          for (int c = 0; c < 4; ++c) cp_async16(row + (c / 2) * (144 * 128) + (((4 * (c % 2) + q) ^ sw) * 16), from + 32 * c);
        }
      }
      if (SYNC) {
        if (PROD) cp_async_arrive(full + 8 * slot); else mbar_arrive(full + 8 * slot);
        if (threadIdx.x == 0) mbar_arrive(full + 8 * slot);
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
  const int group = threadIdx.x / 128 - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int a_off = kBBytes + (group * 4 + warp) * 512 + t * 128 + ((g + 2 * t) % 8) * 16;
  const int s_off = kBBytes + kABytes + (group * 4 + warp) * 128 + t * 32 + g * 4;
  float acc[2][N / 2];
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) acc[u][i] = 0.f;
  uint32_t rw = threadIdx.x * 2654435761u;
  int reading = -1;
  for (int st = 0; st < stages; ++st) {
    const int slot = st % kStages;
    if (SYNC) mbar_wait(full + 8 * slot, (st / kStages) & 1);
    if (FENCE) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const uint32_t stage = base + slot * kStageBytes;
    uint32_t w0[2][4], w1[2][4], sc[2][2];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      if (LDSW) {
        const uint32_t a = stage + a_off + u * 8 * 512;
        uint4 v0, v1;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v0.x), "=r"(v0.y), "=r"(v0.z), "=r"(v0.w) : "r"(a));
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v1.x), "=r"(v1.y), "=r"(v1.z), "=r"(v1.w) : "r"(a + 8192));
        uint32_t sv;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(sv) : "r"(stage + s_off + u * 8 * 128));
        sc[u][0] = table[prmt(sv, 0, 0x4440)]; sc[u][1] = table[prmt(sv, 0, 0x4442)];
        w0[u][0] = v0.x; w0[u][1] = v0.y; w0[u][2] = v0.z; w0[u][3] = v0.w;
        w1[u][0] = v1.x; w1[u][1] = v1.y; w1[u][2] = v1.z; w1[u][3] = v1.w;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) { rw = rw * 1664525u + 1013904223u; w0[u][j] = rw; w1[u][j] = rw ^ 0x5A5A5A5Au; }
        sc[u][0] = sc[u][1] = 0x3F803F80u;
      }
    }
    const uint32_t bst = stage;
#pragma unroll
    for (int i0 = 0; i0 < 8; ++i0) {
      const int q = i0 / 2, u = i0 % 2;
      uint32_t lo[4], hi[4];
      decode(w0[u][q], w1[u][q], sc[u][q / 2], sc[u][q / 2], lo, hi);
      fence_();
      const uint32_t b = bst + (q / 2) * (144 * 128) + (q % 2) * 64;
      wg<N>(*reinterpret_cast<float(*)[N / 2]>(acc[u]), lo, desc(b));
      wg<N>(*reinterpret_cast<float(*)[N / 2]>(acc[u]), hi, desc(b + 32));
      commit_();
      wait_<1>();
      if (SYNC && i0 == 0 && reading >= 0) mbar_arrive(empty + 8 * reading);
    }
    reading = slot;
  }
  wait_<0>();
  if (SYNC && reading >= 0) mbar_arrive(empty + 8 * reading);
  float s = 0.f;
#pragma unroll
  for (int u = 0; u < 2; ++u)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) s += acc[u][i];
  if (s == 12345.f) out[threadIdx.x] = s;
  if (threadIdx.x == 128) clk[blockIdx.x] = clock64() - c0;
}

template <int N, bool SYNC, bool LDSW, bool PROD, bool FENCE = false, bool RND = false>
void run(const char* name, const uint8_t* w, long long wb, const uint16_t* x, const int* rs, float* out, long long* clk, int sms) {
  auto k = anat<N, SYNC, LDSW, PROD, FENCE, RND>;
  const int smem = kStages * kStageBytes + 1024;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int stages = 2000;
  k<<<sms, 384, smem>>>(w, wb, x, rs, 8, out, clk);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  std::vector<float> ts;
  std::vector<double> cyc;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0);
    k<<<sms, 384, smem>>>(w, wb, x, rs, stages, out, clk);
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
    std::vector<long long> c(sms); cudaMemcpy(c.data(), clk, sms * 8, cudaMemcpyDeviceToHost);
    std::sort(c.begin(), c.end()); cyc.push_back((double)c[sms / 2]);
  }
  std::sort(ts.begin(), ts.end()); std::sort(cyc.begin(), cyc.end());
  const double ideal = 2.0 * 16 * (64.0 * N * 16 / 2048);  // two groups x 16 wgmma per stage
  const double per = cyc[2] / stages;
  const double mbs = PROD ? (double)sms * stages * (kABytes + kSBytes) / (ts[2] * 1e-3) / 1e12 : 0;
  printf("%-34s N=%d cycles/stage %.0f (ideal %.0f, %.0f %%) %.3f ms, %.0f MHz, HBM %.2f TB/s, %s\n", name, N, per, ideal,
         100 * ideal / per, ts[2], cyc[2] / (ts[2] * 1e3), mbs, cudaGetErrorString(cudaGetLastError()));
}
int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const long long wb = 2ll << 30;
  uint8_t* w; uint16_t* x; int* rs; float* out; long long* clk;
  cudaMalloc(&w, wb); cudaMemset(w, 0x5B, wb);
  cudaMalloc(&x, 4096 * 2048 * 2); cudaMemset(x, 0, 4096 * 2048 * 2);
  cudaMalloc(&rs, 4096 * 4);
  std::vector<int> h(4096); for (int i = 0; i < 4096; ++i) h[i] = (i * 2654435761u) % 4096;
  cudaMemcpy(rs, h.data(), 4096 * 4, cudaMemcpyHostToDevice);
  cudaMalloc(&out, 4096); cudaMalloc(&clk, 8 * sms);
  run<144, false, false, false>("decode only", w, wb, x, rs, out, clk, sms);
  run<144, false, true, false>("+ weight/scale/table loads", w, wb, x, rs, out, clk, sms);
  run<144, true, false, false>("+ mbarriers (no copies)", w, wb, x, rs, out, clk, sms);
  run<144, true, true, false>("+ loads + mbarriers", w, wb, x, rs, out, clk, sms);
  run<144, false, false, true>("+ producer traffic (no sync)", w, wb, x, rs, out, clk, sms);
  run<144, true, false, true>("+ producer + mbarriers", w, wb, x, rs, out, clk, sms);
  run<144, true, true, true>("all (the kernel's stage)", w, wb, x, rs, out, clk, sms);
  run<144, true, true, true, true>("all + proxy fence per stage", w, wb, x, rs, out, clk, sms);
  run<144, true, true, true, false, true>("all, random data", w, wb, x, rs, out, clk, sms);
  run<144, true, true, true, true, true>("all + fence, random data", w, wb, x, rs, out, clk, sms);
  run<144, false, false, false, false, true>("decode only, random data", w, wb, x, rs, out, clk, sms);
  run<128, true, true, true, true, true>("all + fence, random, N 128", w, wb, x, rs, out, clk, sms);
  run<64, true, true, true, true, true>("all + fence, random, N 64", w, wb, x, rs, out, clk, sms);
  return 0;
}
