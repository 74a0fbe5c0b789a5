// Device helpers shared by the hybridserve kernels (CUDA headers only, no torch).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.h"

namespace hs {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// torch.nn.functional.softplus(v, threshold=20): v itself above the threshold (no overflow).
__device__ __forceinline__ float softplus_thr(float v) {
  return v > 20.f ? v : log1pf(expf(v));
}

// The dt pipeline (docs/kernel-design.md, "dt pipeline"), identical for prefill and decode.
__device__ __forceinline__ float process_dt(float raw, float bias, float dt_min, float dt_max) {
  float v = softplus_thr(raw + bias);
  // fmaxf / fminf return the other operand for a NaN: kept NaN, as torch.clamp keeps it
  return v != v ? v : fminf(fmaxf(v, dt_min), dt_max);
}

// Raw dt of token t, head h: stored as T (the activation dtype) or as float32 (dt_f32).
template <typename T>
__device__ __forceinline__ float load_dt(const void* dt, bool dt_f32, int64_t off) {
  return dt_f32 ? static_cast<const float*>(dt)[off] : to_float(static_cast<const T*>(dt)[off]);
}

__device__ __forceinline__ float silu(float v) {
  return v / (1.f + expf(-v));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace hs

// Dispatch a runtime DType to a compile-time scalar type `scalar_t`.
#define HS_DISPATCH_DTYPE(DT, ...)                 \
  do {                                             \
    switch (DT) {                                  \
      case ::hs::DType::F32: {                     \
        using scalar_t = float;                    \
        __VA_ARGS__();                             \
        break;                                     \
      }                                            \
      case ::hs::DType::F16: {                     \
        using scalar_t = __half;                   \
        __VA_ARGS__();                             \
        break;                                     \
      }                                            \
      case ::hs::DType::BF16: {                    \
        using scalar_t = __nv_bfloat16;            \
        __VA_ARGS__();                             \
        break;                                     \
      }                                            \
    }                                              \
  } while (0)
