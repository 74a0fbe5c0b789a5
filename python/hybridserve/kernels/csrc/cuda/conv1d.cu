// Depthwise causal conv1d (docs/kernel-design.md, "Causal conv1d") with per-slot conv states in
// the "DS" layout [num_slots, Dc, W - 1] (oldest column first), fp32 accumulation.
//
// Prefill: one thread per (channel, token); the W - 1 inputs before a row's first token come from
// the row's initial state (or zeros). The final / boundary windows are gathered into a scratch
// buffer by a second kernel and scattered to their slots by the slot-copy kernel afterwards, so
// every initial state is read before any slot is written.
// Update: one thread per (channel, row): the window is loaded once, the row's tokens applied in
// order, and the window after token t written to write_slots[r, t] (0 = skipped).
#include "common.cuh"

namespace hs {
namespace {

constexpr int kMaxW = 8;

// Binary search: the row of flat token t (qsl[row] <= t < qsl[row + 1]).
__device__ __forceinline__ int find_row(const int64_t* qsl, int R, int64_t t) {
  int lo = 0, hi = R - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (qsl[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Input j of row `row` (j < 0: initial-state column W - 1 + j, or 0 without an initial state).
template <typename T, typename S>
__device__ __forceinline__ float row_input(const ConvParams& p, int row, int64_t row_start, int64_t j, int c) {
  if (j >= 0) {
    return to_float(static_cast<const T*>(p.x)[(row_start + j) * p.x_st + c]);
  }
  if (!p.has_init[row]) return 0.f;
  const int S_len = p.W - 1;
  const int64_t slot = p.read_slot[row];
  return to_float(static_cast<const S*>(p.conv_state)[(slot * p.Dc + c) * S_len + (S_len + j)]);
}

template <typename T, typename S>
__global__ void conv_prefill_kernel(const ConvParams p) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t t = blockIdx.y + static_cast<int64_t>(blockIdx.z) * gridDim.y;
  if (c >= p.Dc || t >= p.T) return;
  const int row = find_row(p.qsl, p.R, t);
  const int64_t row_start = p.qsl[row];
  const int64_t j = t - row_start;
  const float* w = static_cast<const float*>(p.weight) + static_cast<int64_t>(c) * p.W;
  float acc = p.bias ? static_cast<const float*>(p.bias)[c] : 0.f;
  for (int k = 0; k < p.W; ++k) {
    acc += w[k] * row_input<T, S>(p, row, row_start, j - (p.W - 1) + k, c);
  }
  if (p.silu) acc = silu(acc);
  static_cast<T*>(p.out)[t * p.Dc + c] = from_float<T>(acc);
}

template <typename T, typename S>
__global__ void conv_gather_kernel(const ConvParams p) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int i = blockIdx.y;
  if (c >= p.Dc || i >= p.n_gather) return;
  const int row = static_cast<int>(p.gather_row[i]);
  const int64_t row_start = p.qsl[row];
  const int64_t j = p.gather_tok[i];
  const int S_len = p.W - 1;
  S* out = static_cast<S*>(p.gather_out) + (static_cast<int64_t>(i) * p.Dc + c) * S_len;
  for (int k = 0; k < S_len; ++k) {
    out[k] = from_float<S>(row_input<T, S>(p, row, row_start, j - (S_len - 1) + k, c));
  }
}

template <typename T, typename S>
__global__ void conv_update_kernel(const ConvParams p) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (c >= p.Dc) return;
  const int64_t tok0 = p.qsl[r];
  const int ntok = static_cast<int>(p.qsl[r + 1] - tok0);
  if (ntok <= 0) return;
  const int S_len = p.W - 1;
  S* cs = static_cast<S*>(p.conv_state);
  const int64_t rs = p.read_slot[r];
  float win[kMaxW];
  for (int k = 0; k < S_len; ++k) {
    win[k] = rs >= 0 ? to_float(cs[(rs * p.Dc + c) * S_len + k]) : 0.f;
  }
  float w[kMaxW];
  const float* wp = static_cast<const float*>(p.weight) + static_cast<int64_t>(c) * p.W;
  for (int k = 0; k < p.W; ++k) w[k] = wp[k];
  const float b = p.bias ? static_cast<const float*>(p.bias)[c] : 0.f;
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  for (int t = 0; t < ntok; ++t) {
    const int64_t tok = tok0 + t;
    const float xv = to_float(x[tok * p.x_st + c]);
    float acc = b;
    for (int k = 0; k < S_len; ++k) acc += w[k] * win[k];
    acc += w[S_len] * xv;
    if (p.silu) acc = silu(acc);
    out[tok * p.Dc + c] = from_float<T>(acc);
    for (int k = 0; k + 1 < S_len; ++k) win[k] = win[k + 1];
    if (S_len > 0) win[S_len - 1] = xv;
    const int64_t ws = p.write_slots[r * p.ws_sr + t * p.ws_w];
    if (ws > 0) {
      for (int k = 0; k < S_len; ++k) cs[(ws * p.Dc + c) * S_len + k] = from_float<S>(win[k]);
    }
  }
}

#define HS_DISPATCH_STATE(DT, ...)             \
  do {                                         \
    switch (DT) {                              \
      case ::hs::DType::F32: {                 \
        using state_t = float;                 \
        __VA_ARGS__();                         \
        break;                                 \
      }                                        \
      case ::hs::DType::F16: {                 \
        using state_t = __half;                \
        __VA_ARGS__();                         \
        break;                                 \
      }                                        \
      case ::hs::DType::BF16: {                \
        using state_t = __nv_bfloat16;         \
        __VA_ARGS__();                         \
        break;                                 \
      }                                        \
    }                                          \
  } while (0)

}  // namespace

void launch_conv_prefill(const ConvParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.R == 0) return;
  const int threads = 128;
  const unsigned cblocks = static_cast<unsigned>((p.Dc + threads - 1) / threads);
  const int64_t ty = p.T < 65535 ? p.T : 65535;
  const int64_t tz = (p.T + ty - 1) / ty;
  HS_DISPATCH_DTYPE(p.x_dtype, [&] {
    HS_DISPATCH_STATE(p.state_dtype, [&] {
      conv_prefill_kernel<scalar_t, state_t>
          <<<dim3(cblocks, static_cast<unsigned>(ty), static_cast<unsigned>(tz)), threads, 0, stream>>>(p);
      if (p.n_gather > 0 && p.W > 1) {
        conv_gather_kernel<scalar_t, state_t>
            <<<dim3(cblocks, static_cast<unsigned>(p.n_gather)), threads, 0, stream>>>(p);
      }
    });
  });
}

void launch_conv_update(const ConvParams& p, cudaStream_t stream) {
  if (p.T == 0 || p.R == 0) return;
  const int threads = 128;
  const unsigned cblocks = static_cast<unsigned>((p.Dc + threads - 1) / threads);
  HS_DISPATCH_DTYPE(p.x_dtype, [&] {
    HS_DISPATCH_STATE(p.state_dtype, [&] {
      conv_update_kernel<scalar_t, state_t><<<dim3(cblocks, static_cast<unsigned>(p.R)), threads, 0, stream>>>(p);
    });
  });
}

}  // namespace hs
