// The Mamba1 selective scan (Jamba's mixer; docs/kernel-design.md, "Mamba1 selective scan"):
// per channel c with state h_c [N], token by token within a row,
//   h_c = exp(dt_c * A_c) * h_c + dt_c * x_c * B,   y_c = h_c . C + D_c * x_c
// (dt already processed; the gate is the caller's). Decode, verify and prefill rows alike: the
// state after token t of row r goes to every slot its write list names for t (CSR: write_token /
// write_slot[write_offsets[r] .. [r + 1]), sorted by token; slot 0 skipped).
//
// Grid: (ceil(Dc / kThreads), R). One thread per channel keeps its state (N floats) in registers
// across the row's tokens; the block's threads read the same B and C of a token (one broadcast
// load each). Each thread reads its initial state before it writes any slot. As for the other
// state kernels, rows run in parallel: a row must not read a slot another row of the call writes.
#include "common.cuh"

namespace hs {
namespace {

constexpr int kThreads = 128;

template <int NMAX>
__global__ void __launch_bounds__(kThreads) mamba1_kernel(const Mamba1Params p) {
  const int r = blockIdx.y;
  const int c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= p.Dc) return;
  const int64_t tok0 = p.qsl[r];
  const int ntok = static_cast<int>(p.qsl[r + 1] - tok0);
  const int64_t slot_elems = static_cast<int64_t>(p.Dc) * p.N;
  const int64_t chan = static_cast<int64_t>(c) * p.N;

  float h[NMAX], a[NMAX];
  const bool reads = p.has_init == nullptr || p.has_init[r] != 0;
  const float* src = reads ? p.state + p.read_slot[r] * slot_elems + chan : nullptr;
#pragma unroll
  for (int n = 0; n < NMAX; ++n) {
    h[n] = (n < p.N && reads) ? src[n] : 0.f;
    a[n] = n < p.N ? p.A[chan + n] : 0.f;
  }
  const float Dc = p.D[c];
  int64_t e = p.write_offsets[r];
  const int64_t e1 = p.write_offsets[r + 1];
  for (int t = 0; t < ntok; ++t) {
    const int64_t tok = tok0 + t;
    const float dt = p.dt[tok * p.dt_st + c];
    const float xv = p.x[tok * p.x_st + c];
    const float dx = dt * xv;
    const float* Bt = p.B + tok * p.b_st;
    const float* Ct = p.C + tok * p.c_st;
    float acc = 0.f;
#pragma unroll
    for (int n = 0; n < NMAX; ++n) {
      if (n < p.N) {
        h[n] = expf(dt * a[n]) * h[n] + dx * Bt[n];
        acc += h[n] * Ct[n];
      }
    }
    p.out[tok * p.Dc + c] = acc + Dc * xv;
    for (; e < e1 && p.write_token[e] == t; ++e) {
      const int64_t s = p.write_slot[e];
      if (s <= 0) continue;
      float* dst = p.state + s * slot_elems + chan;
#pragma unroll
      for (int n = 0; n < NMAX; ++n) {
        if (n < p.N) dst[n] = h[n];
      }
    }
  }
}

template <int NMAX>
void launch_n(const Mamba1Params& p, cudaStream_t stream) {
  dim3 grid((p.Dc + kThreads - 1) / kThreads, p.R);
  mamba1_kernel<NMAX><<<grid, kThreads, 0, stream>>>(p);
}

}  // namespace

void launch_mamba1(const Mamba1Params& p, cudaStream_t stream) {
  if (p.R == 0 || p.T == 0) return;
  if (p.N <= 16) {
    launch_n<16>(p, stream);
  } else if (p.N <= 32) {
    launch_n<32>(p, stream);
  } else if (p.N <= 64) {
    launch_n<64>(p, stream);
  } else {
    launch_n<128>(p, stream);  // N <= 128 (checked by the caller)
  }
}

}  // namespace hs
