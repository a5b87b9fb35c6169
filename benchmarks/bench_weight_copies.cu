// SPDX-License-Identifier: Apache-2.0
// The probe kernel of bench_weight_copies.py (its docstring says what it measures).
// mode 0: cp.async 16 B, m-tile-major layout; 1: 32 bulk copies of 512 B; 2: two bulk copies of
// 8 KB, stage-contiguous layout; 3: cp.async 16 B, stage-contiguous layout.
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void wait(unsigned bar, unsigned par) {
  unsigned done = 0;
  do { asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(par) : "memory"); } while (!done);
}
extern "C" __global__ void __launch_bounds__(256) probe(const unsigned char* __restrict__ w, int mode, int n_items,
    int stages, int mtiles_per_exp, int cblocks, long long mat_bytes, int nst) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) unsigned long long bars[16];
  const unsigned full = smem_u32(&bars[0]), empty = smem_u32(&bars[8]);
  if (threadIdx.x == 0) {
    for (int i = 0; i < nst; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(full + 8 * i), "r"(mode == 0 || mode == 3 ? 128 : 1));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 128;" :: "r"(empty + 8 * i));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const long long mt_bytes = (long long)stages * 512;
  int st = 0;
  const int tid = threadIdx.x;
  if (tid < 128) {
    for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
      const int e = it / cblocks, c = it % cblocks;
      const unsigned char* base0 = w + (long long)e * mtiles_per_exp * mt_bytes + (long long)c * 16 * mt_bytes;
      for (int s = 0; s < stages; ++s, ++st) {
        const int slot = st % nst;
        wait(empty + 8 * slot, ((st / nst) & 1) ^ 1);
        const unsigned dst = smem_u32(sm) + slot * 16384, bar = full + 8 * slot;
        if (mode == 0 || mode == 3) {
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            const int f = u * 128 + tid;           // 16-byte piece of the stage: matrix j, m-tile i, q
            const int j = f / 512, i = (f / 32) % 16, q = f % 32;
            const unsigned char* g = mode == 0 ? base0 + j * mat_bytes + i * mt_bytes + s * 512 + q * 16
                                               : base0 + j * mat_bytes + (long long)s * 8192 + i * 512 + q * 16;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst + f * 16), "l"(g) : "memory");
          }
          asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
        } else if (tid == 0) {
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(16384) : "memory");
          if (mode == 1) {
            for (int j = 0; j < 2; ++j)
              for (int i = 0; i < 16; ++i)
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 512, [%2];" :: "r"(dst + (j * 16 + i) * 512), "l"(base0 + j * mat_bytes + i * mt_bytes + s * 512), "r"(bar) : "memory");
          } else {
            for (int j = 0; j < 2; ++j)
              asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 8192, [%2];" :: "r"(dst + j * 8192), "l"(base0 + j * mat_bytes + (long long)s * 8192), "r"(bar) : "memory");
          }
        }
      }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {
    for (int it = blockIdx.x; it < n_items; it += gridDim.x)
      for (int s = 0; s < stages; ++s, ++st) {
        const int slot = st % nst;
        wait(full + 8 * slot, (st / nst) & 1);
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(empty + 8 * slot) : "memory");
      }
  }
}
