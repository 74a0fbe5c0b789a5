// Rejection sampling for speculative decoding (docs/kernel-design.md, "Rejection sampling kernel"):
// one launch, one CTA per request.
//
// Greedy rows: accept while draft == argmax (first index on ties); the argmax of each position is
// computed lazily, only up to the first mismatch. Random rows: the acceptance chain needs two
// gathered scalars per draft (u * q(d) < p(d)); then ONE pass over the vocabulary of the stop row
// samples the emitted token by the exponential race argmax_x r(x) / E_x, where r = max(p - q, 0)
// (p with the draft removed when there are no draft probabilities) after a rejection, or p for the
// bonus token. The same pass tracks the race over p and whether r has any mass, so the fallback to
// p for a zero residual (rounding only) needs no second pass.
// Randomness: explicit uniforms / Exp(1) noise when given (bit-exact with the torch twin), else a
// counter-based Philox4x32-10 stream keyed by the row's seed at the row's offset.
#include <cfloat>
#include <climits>

#include "common.cuh"

namespace hs {
namespace {

constexpr int kThreads = 1024;

__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    const uint32_t hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
    const uint32_t hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += W0;
    k.y += W1;
  }
  return c;
}

// U[0, 1) with 24 random bits. stream 0: acceptance uniforms (index = draft position); stream 1:
// race noise (index = vocabulary id).
__device__ __forceinline__ float philox_uniform(int64_t seed, int64_t offset, uint32_t stream, uint32_t index) {
  const uint2 key = make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32));
  const uint4 ctr = make_uint4(index, stream, static_cast<uint32_t>(offset),
                               static_cast<uint32_t>(static_cast<uint64_t>(offset) >> 32));
  return static_cast<float>(philox(ctr, key).x >> 8) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ float exp_noise(const RejectionParams& p, int r, int x) {
  float e;
  if (p.noise) {
    e = p.noise[static_cast<int64_t>(r) * p.noise_stride + x];
  } else {
    e = -logf(1.0f - philox_uniform(p.seeds[r], p.offsets[r], 1u, static_cast<uint32_t>(x)));
  }
  return fmaxf(e, FLT_MIN);
}

struct ArgMax {
  float v;
  int i;
};

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

// Block-wide argmax (first index among equal maxima); result valid in every thread.
__device__ ArgMax block_argmax(ArgMax a, ArgMax* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax b;
    b.v = __shfl_xor_sync(0xffffffffu, a.v, o);
    b.i = __shfl_xor_sync(0xffffffffu, a.i, o);
    a = better(a, b);
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < (blockDim.x >> 5) ? red[lane] : ArgMax{-INFINITY, INT_MAX};
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      ArgMax b;
      b.v = __shfl_xor_sync(0xffffffffu, a.v, o);
      b.i = __shfl_xor_sync(0xffffffffu, a.i, o);
      a = better(a, b);
    }
    if (lane == 0) red[0] = a;
  }
  __syncthreads();
  const ArgMax res = red[0];
  __syncthreads();
  return res;
}

__global__ void __launch_bounds__(kThreads) rejection_kernel(const RejectionParams p) {
  __shared__ ArgMax red[32];
  __shared__ int s_acc;
  __shared__ int s_any;
  const int r = blockIdx.x;
  const int k = static_cast<int>(p.num_drafts[r]);
  const int64_t s = p.start[r];
  const int64_t ds = p.dstart[r];
  int acc = 0;
  int64_t final_tok = 0;
  if (p.is_greedy[r]) {
    const float* src = p.logits ? p.logits : p.probs;
    const int64_t stride = p.logits ? p.logits_stride : p.probs_stride;
    for (int j = 0; j <= k; ++j) {
      const float* row = src + (s + j) * stride;
      ArgMax a{-INFINITY, INT_MAX};
      for (int x = threadIdx.x; x < p.V; x += kThreads) a = better(a, ArgMax{row[x], x});
      a = block_argmax(a, red);
      if (j < k && static_cast<int64_t>(a.i) == p.draft_ids[ds + j]) {
        ++acc;
        continue;
      }
      final_tok = a.i;
      break;
    }
  } else {
    if (threadIdx.x == 0) {
      int a = 0;
      for (int j = 0; j < k; ++j) {
        const int64_t d = p.draft_ids[ds + j];
        const float pd = p.probs[(s + j) * p.probs_stride + d];
        const float qd = p.draft_probs ? p.draft_probs[(ds + j) * p.dp_stride + d] : 1.0f;
        const float u = p.uniforms ? p.uniforms[ds + j]
                                   : philox_uniform(p.seeds[r], p.offsets[r], 0u, static_cast<uint32_t>(j));
        if (u * qd < pd) {
          ++a;
        } else {
          break;
        }
      }
      s_acc = a;
      s_any = 0;
    }
    __syncthreads();
    acc = s_acc;
    const bool rejected = acc < k;
    const float* prow = p.probs + (s + acc) * p.probs_stride;
    const float* qrow = (rejected && p.draft_probs) ? p.draft_probs + (ds + acc) * p.dp_stride : nullptr;
    const int64_t d = rejected ? p.draft_ids[ds + acc] : -1;
    ArgMax br{-INFINITY, INT_MAX}, bp{-INFINITY, INT_MAX};
    bool any = false;
    for (int x = threadIdx.x; x < p.V; x += kThreads) {
      const float px = prow[x];
      float rx = px;
      if (rejected) rx = qrow ? fmaxf(px - qrow[x], 0.0f) : (x == d ? 0.0f : px);
      const float e = exp_noise(p, r, x);
      br = better(br, ArgMax{rx / e, x});
      bp = better(bp, ArgMax{px / e, x});
      any |= rx > 0.0f;
    }
    if (any) s_any = 1;  // benign race: every writer stores 1
    br = block_argmax(br, red);
    bp = block_argmax(bp, red);
    final_tok = s_any ? br.i : bp.i;
  }
  for (int j = threadIdx.x; j <= k; j += kThreads) {
    int64_t v = -1;
    if (j < acc) {
      v = p.draft_ids[ds + j];
    } else if (j == acc) {
      v = final_tok;
    }
    p.out_tokens[s + j] = v;
  }
  if (threadIdx.x == 0) p.out_accepted[r] = acc;
}

}  // namespace

void launch_rejection(const RejectionParams& p, cudaStream_t stream) {
  if (p.R == 0) return;
  rejection_kernel<<<p.R, kThreads, 0, stream>>>(p);
}

}  // namespace hs
