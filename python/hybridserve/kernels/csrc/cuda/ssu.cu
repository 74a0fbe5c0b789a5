// Multi-token selective state update (decode and speculative verify; docs/kernel-design.md,
// "Selective state update"): the state after token t of a row is written to write_slots[r, t] (0 = null slot,
// skipped).
//
// Grid: (ceil(P / ROWS_PER_BLOCK), H, R). Block: 4 warps; each warp owns RPW rows (p) of the
// head's P x N state tile, lanes split N (NPL elements per lane). The tile is loaded once from the
// read slot into registers BEFORE any write, then the row's tokens are applied in order.
#include "common.cuh"

namespace hs {
namespace {

constexpr int kWarps = 4;

// Index of the i-th element a lane holds along N. VEC: 4 consecutive floats per lane (float4-able).
template <bool VEC>
__device__ __forceinline__ int n_index(int i, int lane) {
  if constexpr (VEC) {
    return (i >> 2) * 128 + lane * 4 + (i & 3);
  } else {
    return i * 32 + lane;
  }
}

template <typename T, int NPL, int RPW, bool VEC>
__global__ void __launch_bounds__(kWarps * 32) ssu_kernel(const SsuParams p) {
  const int r = blockIdx.z;
  const int h = blockIdx.y;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int p0 = blockIdx.x * (kWarps * RPW) + warp * RPW;

  const int64_t tok0 = p.qsl[r];
  const int ntok = static_cast<int>(p.qsl[r + 1] - tok0);
  if (ntok <= 0) return;
  const int64_t rs = p.read_slot[r];
  const int g = h / (p.H / p.G);
  const int64_t head_off = static_cast<int64_t>(h) * p.P * p.N;
  const int64_t slot_elems = static_cast<int64_t>(p.H) * p.P * p.N;

  float st[RPW][NPL];
  // ---- load the initial state (read slot; negative = padding row -> zero state) ----
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int pp = p0 + rr;
    if constexpr (VEC) {
#pragma unroll
      for (int i = 0; i < NPL; i += 4) {
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (rs >= 0 && pp < p.P) {
          const float* src = p.state + rs * slot_elems + head_off + static_cast<int64_t>(pp) * p.N;
          v = *reinterpret_cast<const float4*>(src + n_index<true>(i, lane));
        }
        st[rr][i] = v.x;
        st[rr][i + 1] = v.y;
        st[rr][i + 2] = v.z;
        st[rr][i + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < NPL; ++i) {
        const int n = n_index<false>(i, lane);
        float v = 0.f;
        if (rs >= 0 && pp < p.P && n < p.N) {
          v = p.state[rs * slot_elems + head_off + static_cast<int64_t>(pp) * p.N + n];
        }
        st[rr][i] = v;
      }
    }
  }

  const T* x = static_cast<const T*>(p.x);
  const T* Bp = static_cast<const T*>(p.B);
  const T* Cp = static_cast<const T*>(p.C);
  T* out = static_cast<T*>(p.out);
  const float A = p.A[h];
  const float Dh = p.D[h];
  const float bias = p.dt_bias[h];

  for (int t = 0; t < ntok; ++t) {
    const int64_t tok = tok0 + t;
    const float dt = process_dt(load_dt<T>(p.dt, p.dt_f32, tok * p.dt_st + h * p.dt_sh), bias, p.dt_min, p.dt_max);
    const float dA = expf(dt * A);
    float bv[NPL], cv[NPL];
#pragma unroll
    for (int i = 0; i < NPL; ++i) {
      const int n = n_index<VEC>(i, lane);
      const bool ok = VEC || n < p.N;
      bv[i] = ok ? to_float(Bp[tok * p.b_st + g * p.b_sg + n]) : 0.f;
      cv[i] = ok ? to_float(Cp[tok * p.c_st + g * p.c_sg + n]) : 0.f;
    }
    const int64_t ws = p.write_slots[r * p.ws_sr + t * p.ws_w];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      const int pp = p0 + rr;
      const bool prow = pp < p.P;  // warp-uniform
      const float xv = prow ? to_float(x[tok * p.x_st + h * p.x_sh + pp]) : 0.f;
      const float dtx = dt * xv;
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < NPL; ++i) {
        st[rr][i] = st[rr][i] * dA + dtx * bv[i];
        acc += st[rr][i] * cv[i];
      }
      acc = warp_sum(acc);
      if (prow && lane == 0) {
        out[(tok * p.H + h) * p.P + pp] = from_float<T>(acc + Dh * xv);
      }
      if (prow && ws > 0) {
        float* dst = p.state + ws * slot_elems + head_off + static_cast<int64_t>(pp) * p.N;
        if constexpr (VEC) {
#pragma unroll
          for (int i = 0; i < NPL; i += 4) {
            *reinterpret_cast<float4*>(dst + n_index<true>(i, lane)) =
                make_float4(st[rr][i], st[rr][i + 1], st[rr][i + 2], st[rr][i + 3]);
          }
        } else {
#pragma unroll
          for (int i = 0; i < NPL; ++i) {
            const int n = n_index<false>(i, lane);
            if (n < p.N) dst[n] = st[rr][i];
          }
        }
      }
    }
  }
}

template <typename T, int NPL>
void launch_npl(const SsuParams& p, cudaStream_t stream) {
  constexpr int RPW = 4;
  dim3 grid((p.P + kWarps * RPW - 1) / (kWarps * RPW), p.H, p.R);
  dim3 block(kWarps * 32);
  // float4 state accesses: whole lanes of 4 and a 16-byte aligned pool
  const bool vec = NPL >= 4 && p.N == 32 * NPL && reinterpret_cast<uintptr_t>(p.state) % 16 == 0;
  if constexpr (NPL >= 4) {
    if (vec) {
      ssu_kernel<T, NPL, RPW, true><<<grid, block, 0, stream>>>(p);
      return;
    }
  }
  ssu_kernel<T, NPL, RPW, false><<<grid, block, 0, stream>>>(p);
}

}  // namespace

void launch_ssu(const SsuParams& p, cudaStream_t stream) {
  if (p.R == 0 || p.T == 0) return;
  HS_DISPATCH_DTYPE(p.x_dtype, [&] {
    if (p.N <= 32) {
      launch_npl<scalar_t, 1>(p, stream);
    } else if (p.N <= 64) {
      launch_npl<scalar_t, 2>(p, stream);
    } else if (p.N <= 128) {
      launch_npl<scalar_t, 4>(p, stream);
    } else {
      launch_npl<scalar_t, 8>(p, stream);  // N <= 256 (checked by the caller)
    }
  });
}

}  // namespace hs
