// CPU emulation of the small CUDA subset the hybridserve kernels use (tests only).
//
// Each block runs its CUDA threads as fibers (ucontext) on the calling thread, switched at
// __syncthreads and at the warp shuffles, with function-local `static` for __shared__ (blocks run
// one at a time, so a static local is exactly one block's shared memory). Fibers rather than one
// OS thread per CUDA thread: a barrier then costs a few hundred context swaps in one process
// instead of waking 256 threads, which on a busy two-core machine made these tests minutes long.
// Between two barriers the threads run one after another in index order, so a missing
// __syncthreads shows up deterministically wherever a thread reads what a later thread writes.
// This executes the real kernel code on the CPU; it checks indexing and algorithms, not GPU
// timing, memory-model or performance behaviour.
#pragma once

#include <ucontext.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
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

// The running fiber's indices (set by the scheduler at every switch).
inline dim3 tIdx, bIdx;
inline dim3 bDim, gDim;

struct Fiber {
  ucontext_t uc;
  dim3 tid;
  bool done = false;
};

struct Block {
  ucontext_t main;
  std::vector<Fiber> fibers;
  unsigned cur = 0;
  uint64_t pass = 0;      // passes of the scheduler over the fibers, in index order
  uint64_t progress = 0;  // barrier arrivals and finished fibers: a pass without any is a deadlock
  std::function<void()> body;
};
inline Block* block = nullptr;

// Back to the scheduler; it resumes this fiber on a later pass.
inline void yield() {
  Fiber& f = block->fibers[block->cur];
  swapcontext(&f.uc, &block->main);
}

// std::barrier's semantics for fibers. A dropped thread no longer counts in later phases. Every
// waiter, the one that completes the phase too, goes on only in the scheduler's next pass, so
// that the threads run the code after a barrier in index order (a completion in the middle of a
// pass, by the last arrival or by a thread that returned, would otherwise let the threads after
// it in that pass go first).
struct Barrier {
  unsigned expected;
  unsigned arrived = 0;
  uint64_t phase = 0;
  uint64_t completed_in_pass = 0;
  explicit Barrier(unsigned n) : expected(n) {}
  void complete_if_full() {
    if (arrived > 0 && arrived == expected) {
      arrived = 0;
      ++phase;
      completed_in_pass = block->pass;
    }
  }
  void arrive_and_wait() {
    const uint64_t p = phase;
    ++arrived;
    ++block->progress;
    complete_if_full();
    do yield();
    while (phase == p || block->pass == completed_in_pass);
  }
  void arrive_and_drop() {
    --expected;
    complete_if_full();
  }
};

struct Ctx {
  Barrier* block_bar;
  std::vector<Barrier>* warp_bars;
  uint64_t* shfl;
};
inline Ctx* ctx = nullptr;

inline unsigned linear_tid() { return tIdx.x + bDim.x * (tIdx.y + bDim.y * tIdx.z); }

template <typename T>
T shfl_xor(T v, int o) {
  static_assert(sizeof(T) <= 8);
  const unsigned tid = linear_tid();
  const unsigned warp = tid / 32, lane = tid % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  ctx->shfl[tid] = bits;
  (*ctx->warp_bars)[warp].arrive_and_wait();
  const uint64_t got = ctx->shfl[warp * 32 + (lane ^ static_cast<unsigned>(o))];
  (*ctx->warp_bars)[warp].arrive_and_wait();
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

inline void fiber_entry() {
  block->body();
  Fiber& f = block->fibers[block->cur];
  // a thread that returned early must not block the others' barriers
  const unsigned t = linear_tid();
  ctx->block_bar->arrive_and_drop();
  (*ctx->warp_bars)[t / 32].arrive_and_drop();
  f.done = true;
  ++block->progress;
  // returning resumes uc_link, the scheduler
}

// Fiber stacks, kept across launches (kernels hold a few small register arrays).
constexpr size_t kStack = 256 * 1024;
inline std::vector<std::unique_ptr<char[]>> stacks;

template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 blk, Args... args) {
  bDim = blk;
  gDim = grid;
  const unsigned nt = blk.x * blk.y * blk.z;
  while (stacks.size() < nt) stacks.emplace_back(new char[kStack]);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Barrier bar(nt);
        std::vector<Barrier> wbars;
        for (unsigned w = 0; w * 32 < nt; ++w) wbars.emplace_back((w + 1) * 32 <= nt ? 32 : nt - w * 32);
        std::vector<uint64_t> shfl(nt);
        Ctx c{&bar, &wbars, shfl.data()};
        Block b;
        b.fibers.resize(nt);
        b.body = [&] { kernel(args...); };
        block = &b;
        ctx = &c;
        bIdx = dim3(bx, by, bz);
        for (unsigned t = 0; t < nt; ++t) {
          Fiber& f = b.fibers[t];
          f.tid = dim3(t % blk.x, (t / blk.x) % blk.y, t / (blk.x * blk.y));
          getcontext(&f.uc);
          f.uc.uc_stack.ss_sp = stacks[t].get();
          f.uc.uc_stack.ss_size = kStack;
          f.uc.uc_link = &b.main;
          makecontext(&f.uc, fiber_entry, 0);
        }
        for (unsigned live = nt; live > 0;) {
          const uint64_t before = b.progress;
          ++b.pass;
          live = 0;
          for (unsigned t = 0; t < nt; ++t) {
            Fiber& f = b.fibers[t];
            if (f.done) continue;
            b.cur = t;
            tIdx = f.tid;
            swapcontext(&b.main, &f.uc);
            live += f.done ? 0 : 1;
          }
          if (live > 0 && b.progress == before) {
            // (thrown here, on the caller's stack, never through a fiber's: torch makes it a
            // Python RuntimeError; the waiting fibers are left, their stacks reused next launch)
            block = nullptr;
            ctx = nullptr;
            throw std::runtime_error("hs_emu: every live thread of block (" + std::to_string(bx) + "," +
                                     std::to_string(by) + "," + std::to_string(bz) +
                                     ") waits: a barrier not all of them reach");
          }
        }
        block = nullptr;
        ctx = nullptr;
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
