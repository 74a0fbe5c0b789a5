// Chunked SSD scan for prefill (docs/kernel-design.md, "Chunked SSD scan"), fp32 compute on CUDA
// cores.
//
// Chunks never mix rows and hold at most Q tokens; their boundaries sit at absolute multiples of Q
// and right after every emitted token (metadata from the host: chunk_start / chunk_len /
// row_chunk_off), so an emitted state is the state after a chunk. Every kernel indexes a chunk's
// tokens from chunk_start (lam restarts there): nothing assumes that a chunk starts or ends at a
// multiple of Q. Pipeline (5 launches, one stream):
//   K0 dt_cumsum   : dtp = clamp(softplus(dt + bias)), lam = inclusive cumsum(dtp * A) per chunk
//   K1 chunk_state : S_c[p][n] = sum_j exp(lam_last - lam_j) dtp_j x_j[p] B_j[n]   (from zero)
//   K2 cb          : CB_c[i][j] = C_i . B_j per group (lower-triangular tiles only)
//   K3 passing     : per row, sequential over its chunks: states[c] <- state entering chunk c,
//                    h = exp(lam_last) h + S_c; the row's final state -> states[NC + r]
//   K4 chunk_scan  : y_i = sum_{j<=i} CB_ij exp(lam_i - lam_j) dtp_j x_j
//                          + exp(lam_i) C_i . H_prev + D x_i
// The caller then scatters final / boundary states from `states` to their slots (slot copy).
// All matmuls are 64x64 register-tiled fp32 GEMMs (no TF32): exact enough for fp32-state tests.
// Why CUDA cores and not tensor cores: docs/kernel-design.md.
#include "common.cuh"

namespace hs {
namespace {

constexpr int BM = 64, BN = 64, BK = 16, kPad = 4, kThreads = 256;
constexpr int kMaxQ = 1024;  // the largest chunk_size ops.cpp accepts
// two blocks of 256 threads per SM (registers capped at 128 a thread): the configuration measured
constexpr int kMinBlocks = 2;

// One GEMM block's operand tiles.
struct GemmSmem {
  float a[BK][BM + kPad];  // a[k][m]
  float b[BK][BN + kPad];  // b[k][n]
};

template <bool KCONTIG, int MN>
__device__ __forceinline__ void tile_pos(int e, int& mn, int& k) {
  if constexpr (KCONTIG) {
    mn = e / BK;
    k = e % BK;
  } else {
    mn = e % MN;
    k = e / MN;
  }
}

// acc += A[m0.., k] * B[k, n0..] over k in [0, K), A/B supplied by loaders.
//   a(m, k), b(k, n) return the operand values (0 outside the valid range).
//   A_KCONTIG / B_KCONTIG: whether consecutive k is the contiguous direction of the global
//   operand (picks the thread->element mapping of the tile loads for coalescing).
//   The thread (tx, ty) = (tid % 16, tid / 16) accumulates acc[i][j] = C[ty + 16 i][tx + 16 j].
template <bool A_KCONTIG, bool B_KCONTIG, typename LA, typename LB>
__device__ __forceinline__ void gemm_tile(float (&acc)[4][4], int K, LA a, LB b, GemmSmem& sm) {
  const int tid = threadIdx.x;
  constexpr int QA = (BM * BK) / kThreads, QB = (BN * BK) / kThreads;
  // a k slice's operands in registers: the next slice is loaded while the current one multiplies
  float ra[QA], rb[QB];
  auto load = [&](int k0) {
#pragma unroll
    for (int q = 0; q < QA; ++q) {
      int m, k;
      tile_pos<A_KCONTIG, BM>(tid + q * kThreads, m, k);
      ra[q] = (k0 + k < K) ? a(m, k0 + k) : 0.f;
    }
#pragma unroll
    for (int q = 0; q < QB; ++q) {
      int n, k;
      tile_pos<B_KCONTIG, BN>(tid + q * kThreads, n, k);
      rb[q] = (k0 + k < K) ? b(k0 + k, n) : 0.f;
    }
  };
  load(0);
  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int q = 0; q < QA; ++q) {
      int m, k;
      tile_pos<A_KCONTIG, BM>(tid + q * kThreads, m, k);
      sm.a[k][m] = ra[q];
    }
#pragma unroll
    for (int q = 0; q < QB; ++q) {
      int n, k;
      tile_pos<B_KCONTIG, BN>(tid + q * kThreads, n, k);
      sm.b[k][n] = rb[q];
    }
    __syncthreads();
    if (k0 + BK < K) load(k0 + BK);  // in flight while this slice multiplies
    const int tx = tid & 15, ty = tid >> 4;
#pragma unroll
    for (int k = 0; k < BK; ++k) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = sm.a[k][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = sm.b[k][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
}

// ---- K0 -----------------------------------------------------------------------------------
template <typename T>
__global__ void dt_cumsum_kernel(const SsdParams p) {
  const int c = blockIdx.x;
  const int64_t start = p.chunk_start[c];
  const int len = static_cast<int>(p.chunk_len[c]);
  for (int h = threadIdx.x; h < p.H; h += blockDim.x) {
    const float A = p.A[h];
    const float bias = p.dt_bias[h];
    float acc = 0.f;
    for (int i = 0; i < len; ++i) {
      const int64_t t = start + i;
      const float v = process_dt(load_dt<T>(p.dt, p.dt_f32, t * p.dt_st + h * p.dt_sh), bias, p.dt_min, p.dt_max);
      acc += v * A;
      p.dtp[t * p.H + h] = v;
      p.lam[t * p.H + h] = acc;
    }
  }
}

// ---- K1: chunk states from zero, M = P, N = N, K = chunk tokens ------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks) chunk_state_kernel(const SsdParams p) {
  __shared__ GemmSmem sm;
  const int tiles_n = (p.N + BN - 1) / BN;
  const int tile = blockIdx.x;
  const int m0 = (tile / tiles_n) * BM, n0 = (tile % tiles_n) * BN;
  const int h = blockIdx.y;
  const int c = blockIdx.z;
  const int g = h / (p.H / p.G);
  const int64_t start = p.chunk_start[c];
  const int len = static_cast<int>(p.chunk_len[c]);
  // each token's weight exp(lam_last - lam_j) dtp_j, once per block instead of once per element
  __shared__ float w_s[kMaxQ];
  const float lam_last = p.lam[(start + len - 1) * p.H + h];
  for (int k = threadIdx.x; k < len; k += kThreads) {
    const int64_t t = start + k;
    w_s[k] = expf(lam_last - p.lam[t * p.H + h]) * p.dtp[t * p.H + h];
  }
  __syncthreads();
  const T* xh = static_cast<const T*>(p.x) + start * p.x_st + h * p.x_sh + m0;
  const T* Bg = static_cast<const T*>(p.B) + start * p.b_st + g * p.b_sg + n0;
  const int pm = p.P - m0, nm = p.N - n0;  // valid rows / columns of this tile
  auto la = [&](int m, int k) -> float {  // x_j[p]
    return m < pm ? to_float(xh[k * p.x_st + m]) : 0.f;
  };
  auto lb = [&](int k, int n) -> float {  // w_j B_j[n]
    return n < nm ? w_s[k] * to_float(Bg[k * p.b_st + n]) : 0.f;
  };
  float acc[4][4] = {};
  gemm_tile<false, false>(acc, len, la, lb, sm);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  float* S = p.states + (static_cast<int64_t>(c) * p.H + h) * p.P * p.N;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int pp = m0 + ty + 16 * i;
    if (pp >= p.P) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int nn = n0 + tx + 16 * j;
      if (nn < p.N) S[static_cast<int64_t>(pp) * p.N + nn] = acc[i][j];
    }
  }
}

// ---- K2: CB = C B^T per (chunk, group), lower-triangular tiles -------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks) cb_kernel(const SsdParams p) {
  __shared__ GemmSmem sm;
  const int tq = (p.Q + BM - 1) / BM;
  const int ti = blockIdx.x / tq, tj = blockIdx.x % tq;
  if (tj > ti) return;  // never read (masked by causality in K4)
  const int g = blockIdx.y;
  const int c = blockIdx.z;
  const int64_t start = p.chunk_start[c];
  const int len = static_cast<int>(p.chunk_len[c]);
  const int i0 = ti * BM, j0 = tj * BN;
  if (i0 >= len) return;
  const T* B = static_cast<const T*>(p.B);
  const T* C = static_cast<const T*>(p.C);
  auto la = [&](int m, int k) -> float {
    const int i = i0 + m;
    if (i >= len) return 0.f;
    return to_float(C[(start + i) * p.c_st + g * p.c_sg + k]);
  };
  auto lb = [&](int k, int n) -> float {
    const int j = j0 + n;
    if (j >= len) return 0.f;
    return to_float(B[(start + j) * p.b_st + g * p.b_sg + k]);
  };
  float acc[4][4] = {};
  gemm_tile<true, true>(acc, p.N, la, lb, sm);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  float* out = p.cb + (static_cast<int64_t>(c) * p.G + g) * p.Q * p.Q;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int ii = i0 + ty + 16 * i;
    if (ii >= p.Q) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int jj = j0 + tx + 16 * j;
      if (jj < p.Q) out[static_cast<int64_t>(ii) * p.Q + jj] = acc[i][j];
    }
  }
}

// ---- K3: state passing, one thread per (row, head, VEC consecutive state elements) ------------
// The chunks of a row are sequential, so a thread keeps kAhead chunk states in flight: it loads
// them all before it stores any. Loading one at a time left each thread waiting on memory for
// every chunk and made this small pass most of the scan's time. The decay of every chunk is
// computed once per block into shared memory. The arithmetic (and its order) is unchanged.
constexpr int kPassThreads = 256;
constexpr int kAhead = 8;

template <int VEC>
struct Vec;
template <>
struct Vec<1> {
  using type = float;
  __device__ static float mul_add(float d, float h, float s) { return d * h + s; }
};
template <>
struct Vec<4> {
  using type = float4;
  __device__ static float4 mul_add(float d, float4 h, float4 s) {
    return make_float4(d * h.x + s.x, d * h.y + s.y, d * h.z + s.z, d * h.w + s.w);
  }
};

template <int VEC>
__global__ void __launch_bounds__(kPassThreads) state_passing_kernel(const SsdParams p) {
  using V = typename Vec<VEC>::type;
  __shared__ float decay[kPassThreads];
  const int64_t pn = static_cast<int64_t>(p.P) * p.N;
  const int64_t e = (static_cast<int64_t>(blockIdx.x) * kPassThreads + threadIdx.x) * VEC;
  const int h = blockIdx.y;
  const int r = blockIdx.z;
  const int64_t c0 = p.row_chunk_off[r], c1 = p.row_chunk_off[r + 1];
  if (c1 <= c0) return;  // the same for the whole block
  const bool active = e < pn;
  const int64_t slot_elems = static_cast<int64_t>(p.H) * pn;
  const int64_t head_off = static_cast<int64_t>(h) * pn + e;
  V hs;
  float* hsf = reinterpret_cast<float*>(&hs);
#pragma unroll
  for (int v = 0; v < VEC; ++v) hsf[v] = 0.f;
  if (active && p.has_init[r]) {
    const float* init = p.state + p.read_slot[r] * slot_elems + head_off;  // any alignment
#pragma unroll
    for (int v = 0; v < VEC; ++v) hsf[v] = init[v];
  }
  for (int64_t base = c0; base < c1; base += kPassThreads) {
    const int64_t n = c1 - base < kPassThreads ? c1 - base : kPassThreads;
    __syncthreads();  // the previous window's decays are no longer read
    if (threadIdx.x < n) {
      const int64_t c = base + threadIdx.x;
      decay[threadIdx.x] = expf(p.lam[(p.chunk_start[c] + p.chunk_len[c] - 1) * p.H + h]);
    }
    __syncthreads();
    if (!active) continue;
    for (int64_t i0 = 0; i0 < n; i0 += kAhead) {
      V s[kAhead];
#pragma unroll
      for (int i = 0; i < kAhead; ++i) {
        if (i0 + i < n) s[i] = *reinterpret_cast<const V*>(p.states + (base + i0 + i) * slot_elems + head_off);
      }
#pragma unroll
      for (int i = 0; i < kAhead; ++i) {
        if (i0 + i < n) {
          *reinterpret_cast<V*>(p.states + (base + i0 + i) * slot_elems + head_off) = hs;
          hs = Vec<VEC>::mul_add(decay[i0 + i], hs, s[i]);
        }
      }
    }
  }
  if (active) *reinterpret_cast<V*>(p.states + (static_cast<int64_t>(p.NC) + r) * slot_elems + head_off) = hs;
}

// ---- K4: outputs, M = chunk tokens, N = P -----------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks) chunk_scan_kernel(const SsdParams p) {
  __shared__ GemmSmem sm;
  const int tiles_p = (p.P + BN - 1) / BN;
  const int tiles_q = (p.Q + BM - 1) / BM;
  int64_t bid = blockIdx.x;
  const int tp = static_cast<int>(bid % tiles_p);
  bid /= tiles_p;
  const int ti = static_cast<int>(bid % tiles_q);
  bid /= tiles_q;
  const int h = static_cast<int>(bid % p.H);
  const int64_t c = bid / p.H;
  const int64_t start = p.chunk_start[c];
  const int len = static_cast<int>(p.chunk_len[c]);
  const int i0 = ti * BM, p0 = tp * BN;
  if (i0 >= len) return;
  const int g = h / (p.H / p.G);
  const T* x = static_cast<const T*>(p.x);
  const int kmax = (i0 + BM < len) ? i0 + BM : len;  // tokens this tile reads: its rows and before
  // the tokens' lam and dtp, once per block (strided by H in global memory)
  __shared__ float lam_s[kMaxQ];
  __shared__ float dtp_s[kMaxQ];
  for (int k = threadIdx.x; k < kmax; k += kThreads) {
    const int64_t t = start + k;
    lam_s[k] = p.lam[t * p.H + h];
    dtp_s[k] = p.dtp[t * p.H + h];
  }
  __syncthreads();
  const T* xh = x + start * p.x_st + h * p.x_sh + p0;
  const int pm = p.P - p0;  // valid columns of this tile
  const float* cb = p.cb + (c * p.G + g) * p.Q * p.Q;
  float acc[4][4] = {};
  // intra-chunk part: A[i][j] = CB_ij exp(lam_i - lam_j) (j <= i, masked before the exp)
  {
    auto la = [&](int m, int k) -> float {
      const int i = i0 + m;
      if (i >= len || k > i) return 0.f;
      return cb[static_cast<int64_t>(i) * p.Q + k] * expf(lam_s[i] - lam_s[k]);
    };
    auto lb = [&](int k, int n) -> float {  // dtp_j x_j[p]
      return n < pm ? dtp_s[k] * to_float(xh[k * p.x_st + n]) : 0.f;
    };
    gemm_tile<true, false>(acc, kmax, la, lb, sm);
  }
  // carried state: A[i][n] = exp(lam_i) C_i[n], B[n][p] = H_prev[p][n]
  {
    const float* hprev = p.states + (c * p.H + h) * static_cast<int64_t>(p.P) * p.N + static_cast<int64_t>(p0) * p.N;
    const T* Cg = static_cast<const T*>(p.C) + start * p.c_st + g * p.c_sg;
    auto la = [&](int m, int k) -> float {
      const int i = i0 + m;
      return i < len ? expf(lam_s[i]) * to_float(Cg[i * p.c_st + k]) : 0.f;
    };
    auto lb = [&](int k, int n) -> float {
      return n < pm ? hprev[static_cast<int64_t>(n) * p.N + k] : 0.f;
    };
    gemm_tile<true, true>(acc, p.N, la, lb, sm);
  }
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const float Dh = p.D[h];
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int ii = i0 + ty + 16 * i;
    if (ii >= len) continue;
    const int64_t t = start + ii;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int pp = p0 + tx + 16 * j;
      if (pp >= p.P) continue;
      const float xv = to_float(x[t * p.x_st + h * p.x_sh + pp]);
      out[(t * p.H + h) * p.P + pp] = from_float<T>(acc[i][j] + Dh * xv);
    }
  }
}

}  // namespace

void launch_ssd(const SsdParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.NC == 0) return;
  HS_DISPATCH_DTYPE(p.x_dtype, [&] {
    dt_cumsum_kernel<scalar_t><<<p.NC, 128, 0, stream>>>(p);
    {
      const int tiles = ((p.P + BM - 1) / BM) * ((p.N + BN - 1) / BN);
      chunk_state_kernel<scalar_t><<<dim3(tiles, p.H, p.NC), kThreads, 0, stream>>>(p);
    }
    {
      const int tq = (p.Q + BM - 1) / BM;
      cb_kernel<scalar_t><<<dim3(tq * tq, p.G, p.NC), kThreads, 0, stream>>>(p);
    }
    {
      // float4 when every thread's four elements share one aligned vector (states is a fresh
      // allocation, so only P * N decides)
      const int64_t pn = static_cast<int64_t>(p.P) * p.N;
      const bool vec = pn % 4 == 0 && reinterpret_cast<uintptr_t>(p.states) % 16 == 0;
      const int64_t per_block = static_cast<int64_t>(kPassThreads) * (vec ? 4 : 1);
      const dim3 grid(static_cast<unsigned>((pn + per_block - 1) / per_block), p.H, p.R);
      if (vec) {
        state_passing_kernel<4><<<grid, kPassThreads, 0, stream>>>(p);
      } else {
        state_passing_kernel<1><<<grid, kPassThreads, 0, stream>>>(p);
      }
    }
    {
      const int64_t blocks = static_cast<int64_t>(p.NC) * p.H * ((p.Q + BM - 1) / BM) * ((p.P + BN - 1) / BN);
      chunk_scan_kernel<scalar_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
    }
  });
}

}  // namespace hs
