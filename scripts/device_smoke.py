# SPDX-License-Identifier: Apache-2.0
"""One-shot probe of the GPU machine: CuPy/NVRTC versions, bf16 arrays, the loader, a launch."""

import numpy as np

import cupy
import ml_dtypes

print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(),
      "driver", cupy.cuda.runtime.driverGetVersion())
from cupy_backends.cuda.libs import nvrtc

print("nvrtc", nvrtc.getVersion(), "archs", nvrtc.getSupportedArchs())
dev = cupy.cuda.Device()
print("device", cupy.cuda.runtime.getDeviceProperties(dev.id)["name"], dev.attributes["MultiProcessorCount"],
      "L2", dev.attributes["L2CacheSize"])
try:
    a = cupy.asarray(np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16))
    print("bf16 array ok:", a.dtype, (a + a).get(), a.astype(cupy.float32).get(), a.view(cupy.uint16).get())
except Exception as e:
    print("bf16 array FAILED:", type(e).__name__, e)

from cupymoe._compile import KernelSpec, get_kernel, compile_options
import cupymoe._compile as c
src = c.kernel_source  # noqa
# tiny kernel through RawModule with common.cuh inlined via a temp stage file is not possible
# (package data only); use a RawModule directly with the inlined header to test includes.
code = c._inline('#include "common.cuh"\n' + r'''
template <int kFormat> __global__ void probe(const unsigned char* b, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = kFormat == 2 ? cm::decode_e2m1(b[i] & 15u) : cm::decode_scale<kFormat>(b[i]);
}''', set())
for fmt in (0, 1, 2):
    m = cupy.RawModule(code=code, options=compile_options(), name_expressions=(f"probe<{fmt}>",))
    k = m.get_function(f"probe<{fmt}>")
    b = cupy.arange(256, dtype=cupy.uint8)
    out = cupy.empty(256, cupy.float32)
    k((1,), (256,), (b, out, np.int32(256)))
    o = out.get()
    if fmt == 0:
        ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    elif fmt == 1:
        ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    else:
        ref = (np.arange(256, dtype=np.uint8) & 15).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    same = np.array_equal(o.view(np.uint32), ref.view(np.uint32)) or np.array_equal(o, ref, equal_nan=True)
    bad = np.nonzero(~((o == ref) | (np.isnan(o) & np.isnan(ref))))[0]
    print("decode", fmt, "bit-exact" if same else "MISMATCH", bad[:8], o[bad[:4]], ref[bad[:4]])
