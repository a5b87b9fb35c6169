// SPDX-License-Identifier: Apache-2.0
// Shared device helpers: 16-bit activation types and the exact decoders of the FP4 family.
// The loader inlines this file into every .cu that includes it (CuPy hashes the source text).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
// NVRTC ships no C library headers: spell the fixed-width types out (they match every CUDA ABI).
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;

namespace cm {

// ---- 16-bit activations <-> fp32 ------------------------------------------------------------
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// ---- E4M3FN: bias 7, subnormals m * 2^-9, max 448, NaN at 0x7F / 0xFF, no infinity ----------
__device__ __forceinline__ float decode_e4m3(uint32_t byte) {
    const uint32_t exponent = (byte >> 3) & 0xFu;
    const uint32_t mantissa = byte & 7u;
    float v;
    if ((byte & 0x7Fu) == 0x7Fu) {
        v = __int_as_float(0x7FC00000);
    } else if (exponent == 0u) {
        v = (float)mantissa * 0.001953125f;  // m * 2^-9, exact
    } else {
        // Re-bias the exponent (7 -> 127) and widen the mantissa (3 -> 23 bits): exact.
        v = __int_as_float((int)(((exponent + 120u) << 23) | (mantissa << 20)));
    }
    return (byte & 0x80u) ? -v : v;
}

// ---- E8M0: unsigned exponent, bias 127, 0xFF = NaN, no zero ----------------------------------
__device__ __forceinline__ float decode_e8m0(uint32_t byte) {
    if (byte == 0xFFu) return __int_as_float(0x7FC00000);
    if (byte == 0u) return __int_as_float(0x00400000);  // 2^-127: the fp32 subnormal
    return __int_as_float((int)(byte << 23));
}

// Block-scale decode by format: kFormat 0 = NVFP4 (E4M3, block 16), 1 = MXFP4 (E8M0, block 32).
template <int kFormat> __device__ __forceinline__ float decode_scale(uint32_t byte) {
    if constexpr (kFormat == 0) {
        return decode_e4m3(byte);
    } else {
        return decode_e8m0(byte);
    }
}
template <int kFormat> struct FormatTraits;
template <> struct FormatTraits<0> { static constexpr int kBlock = 16; };
template <> struct FormatTraits<1> { static constexpr int kBlock = 32; };

// ---- programmatic dependent launch (cupymoe/_runtime/launch.py) -------------------------------
// Waits until the previous kernel on the stream has completed and its writes are visible, then
// lets the next kernel (when it is a programmatic dependent launch) start its prologue. A kernel
// launched this way calls it, in every thread, before it reads what the previous kernel wrote and
// before it writes global memory; before the call it may only read data that no kernel still
// running writes. Releasing only after the wait keeps an invariant every kernel may rely on: when
// a kernel starts, every kernel before its predecessor has completed. No-op for an ordinary
// launch and before sm_90.
__device__ __forceinline__ void wait_upstream() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace cm
