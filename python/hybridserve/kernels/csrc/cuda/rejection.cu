// Rejection sampling for speculative decoding (docs/kernel-design.md, "Rejection sampling kernel").
//
// Two launches for the whole batch. The vocabulary is cut into tiles of kTile ids, and the first
// launch runs one CTA per (request, tile), so every SM works even for a small batch: one CTA per
// request left most of an H200 idle and spent its time generating the race noise of a 128k
// vocabulary on 64 SMs. Each CTA writes a partial result for its tile; the second launch, one warp
// per request, combines the tiles and writes the tokens.
//
// Greedy rows: each tile's argmax (first index on ties) of every target row of the request; the
// finish walks the rows while the draft equals the argmax. Random rows: the acceptance chain needs
// two gathered scalars per draft (u * q(d) < p(d)), and every CTA of the request computes it (k is
// small); then one pass over the tile of the stop row runs the exponential race
// argmax_x r(x) / E_x, where r = max(p - q, 0) (p with the draft removed when there are no draft
// probabilities) after a rejection, or p for the bonus token. The same pass runs the race over p
// and tracks whether r has any mass, so the fallback to p for a zero residual (rounding only)
// needs no second pass. Ties go to the first index in every combine, so the result does not
// depend on the tiling.
// Randomness: explicit uniforms / Exp(1) noise when given (bit-exact with the torch twin), else a
// counter-based Philox4x32-10 stream keyed by the row's seed at the row's offset.
#include <cfloat>
#include <climits>

#include "common.cuh"

namespace hs {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 16;  // vocabulary ids per thread and tile: four Philox draws of four
constexpr int kTile = kThreads * kPerThread;
constexpr int kGroups = kPerThread / 4;  // groups of four ids per thread; group i of thread t
                                         // starts at id x0 + 4 (t + i kThreads), so a warp's loads
                                         // are contiguous

struct Partial {
  float v0;  // greedy: the tile's maximum; random: the race over r
  int i0;
  float v1;  // random: the race over p
  int i1;
  int any;  // random: r has mass in the tile
  int acc;  // random: accepted drafts (the same in every tile)
};

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

// Four 32-bit draws of stream `stream` at counter `index` for the row keyed by (seed, offset).
// stream 0: acceptance uniforms (index = draft position, word x); stream 1: race noise (index =
// vocabulary id / 4, word = id % 4).
__device__ __forceinline__ uint4 philox_draw(int64_t seed, int64_t offset, uint32_t stream, uint32_t index) {
  const uint2 key = make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32));
  const uint4 ctr = make_uint4(index, stream, static_cast<uint32_t>(offset),
                               static_cast<uint32_t>(static_cast<uint64_t>(offset) >> 32));
  return philox(ctr, key);
}

// U[0, 1) with 24 random bits.
__device__ __forceinline__ float to_uniform(uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ float exp_from_bits(uint32_t bits) { return fmaxf(-logf(1.0f - to_uniform(bits)), FLT_MIN); }

// The four values of a row at ids x .. x + 3 (x a multiple of 4), zero past x1: one 16-byte load
// where the row is aligned for it, else four.
__device__ __forceinline__ float4 load4(const float* row, int x, int x1, bool aligned) {
  if (aligned && x + 3 < x1) return *reinterpret_cast<const float4*>(row + x);
  return make_float4(x < x1 ? row[x] : 0.0f, x + 1 < x1 ? row[x + 1] : 0.0f, x + 2 < x1 ? row[x + 2] : 0.0f,
                     x + 3 < x1 ? row[x + 3] : 0.0f);
}

__device__ __forceinline__ bool aligned16(const float* row) {
  return row == nullptr || (reinterpret_cast<uintptr_t>(row) & 15u) == 0;
}

struct ArgMax {
  float v;
  int i;
};

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
  return a;
}

__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax b;
    b.v = __shfl_xor_sync(0xffffffffu, a.v, o);
    b.i = __shfl_xor_sync(0xffffffffu, a.i, o);
    a = better(a, b);
  }
  return a;
}

// Block-wide argmax (first index among equal maxima); result valid in every thread.
__device__ ArgMax block_argmax(ArgMax a, ArgMax* red) {
  a = warp_argmax(a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = warp_argmax(lane < (blockDim.x >> 5) ? red[lane] : ArgMax{-INFINITY, INT_MAX});
    if (lane == 0) red[0] = a;
  }
  __syncthreads();
  const ArgMax res = red[0];
  __syncthreads();
  return res;
}

// Drafts of the requests before r (its first draft's index; its first target row is this + r).
// Computed by the block from num_drafts rather than by two cumsums on the host stream: the batch
// has few requests, and each extra launch costs more than this sum.
__device__ int64_t drafts_before(const int64_t* num_drafts, int r, int64_t* red) {
  int64_t sum = 0;
  for (int q = threadIdx.x; q < r; q += blockDim.x) sum += num_drafts[q];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += red[w];
  __syncthreads();
  return total;
}

__global__ void __launch_bounds__(kThreads) rejection_tile_kernel(const RejectionParams p) {
  __shared__ ArgMax red[32];
  __shared__ int64_t red64[32];
  __shared__ int s_acc;
  __shared__ int s_any;
  __shared__ bool s_ok[kThreads];
  const int r = blockIdx.x, tile = blockIdx.y, tiles = gridDim.y;
  const int k = static_cast<int>(p.num_drafts[r]);
  const int64_t ds = drafts_before(p.num_drafts, r, red64);
  const int64_t s = ds + r;
  const int x0 = tile * kTile, x1 = x0 + kTile < p.V ? x0 + kTile : p.V;
  Partial* part = static_cast<Partial*>(p.partials);
  if (p.is_greedy[r]) {
    const float* src = p.logits ? p.logits : p.probs;
    const int64_t stride = p.logits ? p.logits_stride : p.probs_stride;
    for (int j = 0; j <= k; ++j) {
      const float* row = src + (s + j) * stride;
      const bool al = aligned16(row);
      float4 v[kGroups];
#pragma unroll
      for (int i = 0; i < kGroups; ++i) v[i] = load4(row, x0 + 4 * (threadIdx.x + i * kThreads), x1, al);
      ArgMax a{-INFINITY, INT_MAX};
#pragma unroll
      for (int i = 0; i < kGroups; ++i) {
        const int x = x0 + 4 * (threadIdx.x + i * kThreads);
        const float w[4] = {v[i].x, v[i].y, v[i].z, v[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (x + j < x1) a = better(a, ArgMax{w[j], x + j});
        }
      }
      a = block_argmax(a, red);
      if (threadIdx.x == 0) part[(s + j) * tiles + tile] = Partial{a.v, a.i, 0.0f, 0, 0, 0};
    }
    return;
  }
  // The acceptance tests of all drafts run at once, one thread each, and thread 0 then finds the
  // first rejection in shared memory: the chain's gathers are one memory round trip rather than
  // k in a row, which every CTA of the request would otherwise wait for.
  if (threadIdx.x == 0) {
    s_acc = -1;
    s_any = 0;
  }
  for (int base = 0; base < k; base += kThreads) {
    const int j = base + threadIdx.x;
    if (j < k) {
      const int64_t d = p.draft_ids[ds + j];
      const float pd = p.probs[(s + j) * p.probs_stride + d];
      const float qd = p.draft_probs ? p.draft_probs[(ds + j) * p.dp_stride + d] : 1.0f;
      const float u = p.uniforms ? p.uniforms[ds + j]
                                 : to_uniform(philox_draw(p.seeds[r], p.offsets[r], 0u, static_cast<uint32_t>(j)).x);
      s_ok[threadIdx.x] = u * qd < pd;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const int n = k - base < kThreads ? k - base : kThreads;
      for (int i = 0; i < n && s_acc < 0; ++i) {
        if (!s_ok[i]) s_acc = base + i;
      }
    }
    __syncthreads();
    if (s_acc >= 0) break;  // the same in every thread
  }
  __syncthreads();
  if (threadIdx.x == 0 && s_acc < 0) s_acc = k;
  __syncthreads();
  const int acc = s_acc;
  const bool rejected = acc < k;
  const float* prow = p.probs + (s + acc) * p.probs_stride;
  const float* qrow = (rejected && p.draft_probs) ? p.draft_probs + (ds + acc) * p.dp_stride : nullptr;
  const float* nrow = p.noise ? p.noise + static_cast<int64_t>(r) * p.noise_stride : nullptr;
  const int64_t d = rejected ? p.draft_ids[ds + acc] : -1;
  const bool al = aligned16(prow) && aligned16(qrow) && aligned16(nrow);
  // all loads of the tile first, so that each thread has them in flight together
  float4 pv[kGroups], qv[kGroups], nv[kGroups];
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    const int x = x0 + 4 * (threadIdx.x + i * kThreads);
    pv[i] = load4(prow, x, x1, al);
    qv[i] = qrow ? load4(qrow, x, x1, al) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    nv[i] = nrow ? load4(nrow, x, x1, al) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  ArgMax br{-INFINITY, INT_MAX}, bp{-INFINITY, INT_MAX};
  bool any = false;
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    const int x = x0 + 4 * (threadIdx.x + i * kThreads);
    if (x >= x1) break;
    float e[4];
    if (nrow) {
      e[0] = nv[i].x, e[1] = nv[i].y, e[2] = nv[i].z, e[3] = nv[i].w;
    } else {
      const uint4 bits = philox_draw(p.seeds[r], p.offsets[r], 1u, static_cast<uint32_t>(x / 4));
      e[0] = exp_from_bits(bits.x), e[1] = exp_from_bits(bits.y), e[2] = exp_from_bits(bits.z);
      e[3] = exp_from_bits(bits.w);
    }
    const float pw[4] = {pv[i].x, pv[i].y, pv[i].z, pv[i].w};
    const float qw[4] = {qv[i].x, qv[i].y, qv[i].z, qv[i].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (x + j >= x1) break;
      const float px = pw[j];
      float rx = px;
      if (rejected) rx = qrow ? fmaxf(px - qw[j], 0.0f) : (x + j == d ? 0.0f : px);
      const float ej = nrow ? fmaxf(e[j], FLT_MIN) : e[j];
      br = better(br, ArgMax{rx / ej, x + j});
      bp = better(bp, ArgMax{px / ej, x + j});
      any |= rx > 0.0f;
    }
  }
  if (any) s_any = 1;  // benign race: every writer stores 1
  br = block_argmax(br, red);
  bp = block_argmax(bp, red);
  if (threadIdx.x == 0) part[s * tiles + tile] = Partial{br.v, br.i, bp.v, bp.i, s_any, acc};
}

// Combines one request's tiles, one warp per request.
__global__ void __launch_bounds__(32) rejection_finish_kernel(const RejectionParams p, int tiles) {
  __shared__ int64_t red64[32];
  const int r = blockIdx.x, lane = threadIdx.x;
  const int k = static_cast<int>(p.num_drafts[r]);
  const int64_t ds = drafts_before(p.num_drafts, r, red64);
  const int64_t s = ds + r;
  const Partial* part = static_cast<const Partial*>(p.partials);
  int acc = 0;
  int64_t final_tok = 0;
  if (p.is_greedy[r]) {
    for (int j = 0; j <= k; ++j) {
      ArgMax a{-INFINITY, INT_MAX};
      for (int t = lane; t < tiles; t += 32) {
        const Partial& q = part[(s + j) * tiles + t];
        a = better(a, ArgMax{q.v0, q.i0});
      }
      a = warp_argmax(a);
      if (j < k && static_cast<int64_t>(a.i) == p.draft_ids[ds + j]) {
        ++acc;
        continue;
      }
      final_tok = a.i;
      break;
    }
  } else {
    ArgMax br{-INFINITY, INT_MAX}, bp{-INFINITY, INT_MAX};
    int any = 0;
    for (int t = lane; t < tiles; t += 32) {
      const Partial& q = part[s * tiles + t];
      br = better(br, ArgMax{q.v0, q.i0});
      bp = better(bp, ArgMax{q.v1, q.i1});
      any |= q.any;
    }
    br = warp_argmax(br);
    bp = warp_argmax(bp);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) any |= __shfl_xor_sync(0xffffffffu, any, o);
    acc = part[s * tiles].acc;
    final_tok = any ? br.i : bp.i;
  }
  for (int j = lane; j <= k; j += 32) {
    int64_t v = -1;
    if (j < acc) {
      v = p.draft_ids[ds + j];
    } else if (j == acc) {
      v = final_tok;
    }
    p.out_tokens[s + j] = v;
  }
  if (lane == 0) p.out_accepted[r] = acc;
}

int num_tiles(int V) { return (V + kTile - 1) / kTile; }

}  // namespace

int64_t rejection_workspace_bytes(int64_t M, int V) {
  return M * num_tiles(V) * static_cast<int64_t>(sizeof(Partial));
}

void launch_rejection(const RejectionParams& p, cudaStream_t stream) {
  if (p.R == 0) return;
  const int tiles = num_tiles(p.V);
  rejection_tile_kernel<<<dim3(static_cast<unsigned>(p.R), static_cast<unsigned>(tiles)), kThreads, 0, stream>>>(p);
  rejection_finish_kernel<<<p.R, 32, 0, stream>>>(p, tiles);
}

}  // namespace hs
