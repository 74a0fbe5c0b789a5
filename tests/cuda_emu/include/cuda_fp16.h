// CPU emulation: IEEE half via _Float16 (tests only).
#pragma once
#include "cuda_runtime.h"
struct __half {
  uint16_t x;
};
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.x, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float v) {
  _Float16 f = static_cast<_Float16>(v);
  __half h;
  std::memcpy(&h.x, &f, 2);
  return h;
}
