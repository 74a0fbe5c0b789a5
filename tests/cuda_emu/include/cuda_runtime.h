// CPU emulation of the small CUDA subset the hybridserve kernels use (tests only).
//
// Each block runs on its own set of std::threads, one per CUDA thread, with a std::barrier for
// __syncthreads, per-warp barriers for the shuffles and function-local `static` for __shared__
// (blocks run one at a time, so a static local is exactly one block's shared memory). This
// executes the real kernel code on the CPU; it checks indexing and algorithms, not GPU timing,
// memory-model or performance behaviour.
#pragma once

#include <barrier>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
typedef void* cudaStream_t;
enum cudaError_t { cudaSuccess = 0 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "ok"; }

struct float4 {
  float x, y, z, w;
};
struct uint4 {
  uint32_t x, y, z, w;
};
struct uint2 {
  uint32_t x, y;
};
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline uint32_t __umulhi(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

namespace hs_emu {

struct Ctx {
  std::barrier<>* block_bar;
  std::vector<std::unique_ptr<std::barrier<>>>* warp_bars;
  uint64_t* shfl;
};
inline thread_local dim3 tIdx, bIdx;
inline thread_local Ctx* ctx = nullptr;
inline dim3 bDim, gDim;

inline unsigned linear_tid() { return tIdx.x + bDim.x * (tIdx.y + bDim.y * tIdx.z); }

template <typename T>
T shfl_xor(T v, int o) {
  static_assert(sizeof(T) <= 8);
  const unsigned tid = linear_tid();
  const unsigned warp = tid / 32, lane = tid % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  ctx->shfl[tid] = bits;
  (*ctx->warp_bars)[warp]->arrive_and_wait();
  const uint64_t got = ctx->shfl[warp * 32 + (lane ^ static_cast<unsigned>(o))];
  (*ctx->warp_bars)[warp]->arrive_and_wait();
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, Args... args) {
  bDim = block;
  gDim = grid;
  const unsigned nt = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> bar(nt);
        std::vector<std::unique_ptr<std::barrier<>>> wbars;
        for (unsigned w = 0; w * 32 < nt; ++w) {
          const unsigned n = (w + 1) * 32 <= nt ? 32 : nt - w * 32;
          wbars.push_back(std::make_unique<std::barrier<>>(n));
        }
        std::vector<uint64_t> shfl(nt);
        Ctx c{&bar, &wbars, shfl.data()};
        std::vector<std::thread> threads;
        threads.reserve(nt);
        for (unsigned t = 0; t < nt; ++t) {
          threads.emplace_back([&, t] {
            tIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
            bIdx = dim3(bx, by, bz);
            ctx = &c;
            kernel(args...);
            // a thread that returned early must not block the others' barriers
            bar.arrive_and_drop();
            wbars[t / 32]->arrive_and_drop();
          });
        }
        for (auto& th : threads) th.join();
      }
}

}  // namespace hs_emu

#define threadIdx (hs_emu::tIdx)
#define blockIdx (hs_emu::bIdx)
#define blockDim (hs_emu::bDim)
#define gridDim (hs_emu::gDim)
inline void __syncthreads() { hs_emu::ctx->block_bar->arrive_and_wait(); }
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int o) {
  return hs_emu::shfl_xor(v, o);
}
