// CPU emulation: bfloat16 with round-to-nearest-even (tests only).
#pragma once
#include "cuda_runtime.h"
struct __nv_bfloat16 {
  uint16_t x;
};
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = static_cast<uint32_t>(b.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  __nv_bfloat16 b;
  if (std::isnan(v)) {
    b.x = 0x7fc0;
    return b;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  b.x = static_cast<uint16_t>(u >> 16);
  return b;
}
