// Paged attention of decode and verify rows on the CPU (hybridserve.kernels.native).
//
// Plain C ABI over raw pointers (no torch headers: it builds in about a second with g++ and is
// called through ctypes). Layouts, all contiguous:
//   q, out        [T, H, D]
//   kv_cache      [num_blocks, 2, block_size, KVH, D]   (index 0 = K, 1 = V)
// in float32, float64, or bfloat16 (q, kv_cache and out alike; computed in float32 from the
// bfloat16 values, so the result is the float32 kernel's on the widened inputs, rounded once).
// A KV cache narrower than the model (--kv-cache-dtype) has entry points of its own: float32 or
// bfloat16 q and out with bfloat16 or float8 (e4m3, e5m2) K and V, each value widened exactly to
// float32 as it is read, so the result is the float32 kernel's on the widened cache.
//   block_table   [num_rows, bt_stride] int64
//   qsl           [num_rows + 1] int64: row r owns tokens qsl[r] .. qsl[r+1]
//   positions     [T] int64: token t attends keys 0 .. positions[t] of its row
// Every block id and position is checked before anything is read (return 2), so a bad table is
// an error, not a wild read.
//
// One row at a time: its keys are read once, token row by token row (all KV heads), for all its
// query vectors (query heads x the row's tokens), block by block through the block table, so no
// context is gathered into a temporary. Scores then softmax then V, exactly (no online
// rescaling): each query vector's result depends only on its own query and keys, so a token gets
// the same output whether it is decoded alone or verified with drafts.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_common.h"

namespace {

// A call is split over threads only when each gets at least this many (query token, key) pairs.
constexpr int64_t kMinPairsPerThread = 2048;
// The scores of one tile of a row's tokens: at most this many (query vector, key slot) pairs
// (256 KiB in float32), so that they stay in cache between the scores, the softmax and V.
constexpr int64_t kTileScores = 1 << 16;

// Keys a row reads: 1 + its largest position (0 for an empty row).
inline int64_t row_keys(const int64_t* qsl, const int64_t* positions, int64_t r) {
    int64_t L = 0;
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) L = positions[t] + 1 > L ? positions[t] + 1 : L;
    return L;
}

// 0 when every row's positions are >= 0 and every block it reads is in [0, num_blocks).
int check_rows(const int64_t* block_table, int64_t bt_stride, const int64_t* qsl, const int64_t* positions,
               int64_t num_rows, int64_t num_tokens, int64_t num_blocks, int64_t block_size) {
    // the row ranges first (no token is read before they are known to lie in [0, num_tokens))
    if (num_rows > 0 && qsl[0] != 0) return 2;
    for (int64_t r = 0; r < num_rows; ++r)
        if (qsl[r + 1] < qsl[r] || qsl[r + 1] > num_tokens) return 2;
    // a position must leave its row's keys inside the row's block table (this also keeps
    // position + 1 and the block count from overflowing)
    const int64_t max_keys = bt_stride * block_size;
    for (int64_t r = 0; r < num_rows; ++r) {
        for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t)
            if (positions[t] < 0 || positions[t] >= max_keys) return 2;
        const int64_t L = row_keys(qsl, positions, r);
        const int64_t nb = (L + block_size - 1) / block_size;
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t id = block_table[r * bt_stride + b];
            if (id < 0 || id >= num_blocks) return 2;
        }
    }
    return 0;
}

// Asks for a block's K (or V) half ahead of its use: the blocks of a row are scattered over the
// pool, so the hardware prefetcher cannot guess the next one, and without this the kernel ran at
// a third of the core's DRAM bandwidth.
template <typename T>
inline void prefetch_half(const T* p, int64_t n) {
    const char* c = reinterpret_cast<const char*>(p);
    const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// The halves a row reads, in order: K of its blocks 0 .. nb-1, then V of the same blocks. The
// kernel prefetches kPrefetchAhead halves ahead along this sequence, into the next row's.
constexpr int64_t kPrefetchAhead = 4;

template <typename S>
struct HalfStream {
    const S* kv;
    const int64_t* block_table;
    int64_t bt_stride, block_stride, half_stride, block_size, num_rows;
    const int64_t* qsl;
    const int64_t* positions;

    // prefetch step s of row r (s may run past the row's 2 nb steps into the following rows)
    void prefetch(int64_t r, int64_t nb, int64_t s) const {
        while (s >= 2 * nb) {
            s -= 2 * nb;
            if (++r >= num_rows) return;
            nb = (row_keys(qsl, positions, r) + block_size - 1) / block_size;
        }
        const int64_t b = s < nb ? s : s - nb;
        const S* p = kv + block_table[r * bt_stride + b] * block_stride + (s < nb ? 0 : half_stride);
        prefetch_half(p, half_stride);
    }
};

// q . k in T: one function for every type of the cache (its keys are widened to T before), so
// that a narrow cache's scores are, bit for bit, the T kernel's on the widened values. Inlined,
// the compiler vectorised the same loop differently per instantiation (-ffast-math lets it
// reorder the sum), and a bfloat16 cache's scores drifted from float32's on the same values.
template <typename T, int DC>
__attribute__((noinline)) T dot_keys(const T* q, const T* k, int64_t D_runtime) {
    const int64_t D = DC > 0 ? DC : D_runtime;
    T s = 0;
    for (int64_t d = 0; d < D; ++d) s += q[d] * k[d];
    return s;
}

#ifdef __AVX512F__
// q . k_j for 16 keys at once (float, D a multiple of 16): one vector of partial sums per key,
// then hs::sum16.
template <int D, typename S>
inline __m512 dots16(const float* q, const S* k0, int64_t tok_stride) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
        const S* k = k0 + j * tok_stride;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), hs::load_as<float>(k));
        for (int d = 16; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), hs::load_as<float>(k + d), a);
        acc[j] = a;
    }
    return hs::sum16(acc);
}
#endif

template <typename T, typename S, typename KS, int DC>
void paged_attention(const S* q, const KS* kv, S* out, const int64_t* block_table, int64_t bt_stride,
                     const int64_t* qsl, const int64_t* positions, int64_t num_rows, int64_t H,
                     int64_t KVH, int64_t D_runtime, int64_t block_size, T scale, int64_t row_begin,
                     int64_t row_end) {
    const int64_t D = DC > 0 ? DC : D_runtime;
    const int64_t Gq = H / KVH;
    const int64_t tok_stride = KVH * D;                   // one token's K (or V) in a block
    const int64_t half_stride = block_size * tok_stride;  // the K part of a block
    const int64_t block_stride = 2 * half_stride;
    std::vector<T> scores;
    std::vector<T> acc;
    std::vector<int64_t> qv_pos;
    std::vector<int64_t> qv_koff;  // offset of the query's KV head inside a token's row
    std::vector<const T*> qv_ptr;
    std::vector<T> qwide;  // the row's queries in T, where S is narrower
    // one token's keys in T, where KS is narrower
    std::vector<T> kwide(std::is_same_v<KS, T> ? 0 : static_cast<size_t>(tok_stride));
    const HalfStream<KS> stream{kv, block_table, bt_stride, block_stride, half_stride, block_size, num_rows, qsl,
                               positions};
    bool primed = false;
    for (int64_t r = row_begin; r < row_end; ++r) {
        const int64_t row_t0 = qsl[r], row_t1 = qsl[r + 1];
        if (row_t1 <= row_t0) continue;
        // A long row (a prompt's chunk) runs in tiles of its tokens whose scores stay in cache
        // (each query vector's arithmetic is its own: tiles change no bit).
        const int64_t row_lp = ((row_keys(qsl, positions, r) + 15) / 16 + 1) * 16;
        const int64_t tile = std::max<int64_t>(1, kTileScores / (row_lp * H));
        for (int64_t t0 = row_t0; t0 < row_t1; t0 += tile) {
            const int64_t t1 = std::min(row_t1, t0 + tile);
            int64_t L = 0;  // keys the tile reads: 1 + its largest position
            for (int64_t t = t0; t < t1; ++t) L = positions[t] + 1 > L ? positions[t] + 1 : L;
            // query vectors: every head of every token of the tile (i = (t - t0) * H + head), so one
            // pass over a token's K row (all KV heads, contiguous) serves them all
            const int64_t nq = (t1 - t0) * H;
            // a score row: room for every key slot of the row's blocks (the 16-key chunks below)
            const int64_t Lp = ((L + block_size - 1) / block_size * block_size + 15) / 16 * 16;
            scores.resize(static_cast<size_t>(nq * Lp));
            acc.assign(static_cast<size_t>(nq * D), T(0));
            qv_pos.resize(static_cast<size_t>(nq));
            qv_koff.resize(static_cast<size_t>(nq));
            qv_ptr.resize(static_cast<size_t>(nq));
            if constexpr (!std::is_same_v<S, T>) {
                qwide.resize(static_cast<size_t>(nq * D));
                for (int64_t j = 0; j < nq * D; ++j) qwide[static_cast<size_t>(j)] = hs::widen(q[t0 * H * D + j]);
            }
            for (int64_t t = t0; t < t1; ++t) {
                for (int64_t h = 0; h < H; ++h) {
                    const int64_t i = (t - t0) * H + h;
                    qv_pos[i] = positions[t];
                    qv_koff[i] = (h / Gq) * D;
                    if constexpr (std::is_same_v<S, T>) qv_ptr[i] = q + (t * H + h) * D;
                    else qv_ptr[i] = qwide.data() + i * D;
                }
            }
            const int64_t* blocks = block_table + r * bt_stride;
            const int64_t nb = (L + block_size - 1) / block_size;
            if (!primed) {
                for (int64_t s = 0; s < kPrefetchAhead; ++s) stream.prefetch(r, nb, s);
                primed = true;
            }
            // scores[i][j] = scale * q_i . k_j for j <= pos_i
            for (int64_t b = 0; b < nb; ++b) {
                const KS* kblock = kv + blocks[b] * block_stride;
                stream.prefetch(r, nb, b + kPrefetchAhead);
                const int64_t j0 = b * block_size;
                const int64_t jn = L - j0 < block_size ? L - j0 : block_size;
                int64_t jj = 0;
    #ifdef __AVX512F__
                if constexpr (std::is_same_v<T, float> && DC > 0 && DC % 16 == 0) {
                    // chunks of 16 key slots (a block of a multiple of 16 tokens holds them), also
                    // past the row's last key: a key's score must not depend on how many keys
                    // follow it (a token verified with drafts gets exactly its decode result). The
                    // scores past a query's position are computed and never read.
                    if (block_size % 16 == 0) {
                        for (; jj < jn; jj += 16) {
                            const KS* krow = kblock + jj * tok_stride;
                            for (int64_t i = 0; i < nq; ++i) {
                                if (j0 + jj > qv_pos[i]) continue;
                                const __m512 sc = _mm512_mul_ps(dots16<DC>(qv_ptr[i], krow + qv_koff[i], tok_stride),
                                                                _mm512_set1_ps(scale));
                                _mm512_storeu_ps(scores.data() + i * Lp + j0 + jj, sc);
                            }
                        }
                    }
                }
    #endif
                for (; jj < jn; ++jj) {
                    const KS* kstored = kblock + jj * tok_stride;
                    const T* krow;
                    if constexpr (std::is_same_v<KS, T>) {
                        krow = kstored;
                    } else {
                        for (int64_t d = 0; d < tok_stride; ++d) kwide[static_cast<size_t>(d)] = hs::widen(kstored[d]);
                        krow = kwide.data();
                    }
                    const int64_t j = j0 + jj;
                    for (int64_t i = 0; i < nq; ++i) {
                        if (j > qv_pos[i]) continue;
                        scores[i * Lp + j] = dot_keys<T, DC>(qv_ptr[i], krow + qv_koff[i], D) * scale;
                    }
                }
            }
            // softmax over each query vector's own keys
            for (int64_t i = 0; i < nq; ++i) {
                T* s = scores.data() + i * Lp;
                const int64_t n = qv_pos[i] + 1;
                T m = s[0];
                for (int64_t j = 1; j < n; ++j) m = s[j] > m ? s[j] : m;
                T sum = 0;
                for (int64_t j = 0; j < n; ++j) {
                    const T e = std::exp(s[j] - m);
                    s[j] = e;
                    sum += e;
                }
                const T inv = T(1) / sum;
                for (int64_t j = 0; j < n; ++j) s[j] *= inv;
            }
            // out_i = sum_j p_ij v_j
            if constexpr (DC > 0 && DC % hs::Vec<T>::lanes == 0) {
                // one query at a time with its output in registers: two sets of accumulators (even
                // and odd keys), so the sum over keys is not one serial chain through memory
                using V = hs::Vec<T>;
                using VT = typename V::type;
                constexpr int nv = DC / V::lanes;
                // block by block (its V rows stay in L1 for every query vector), each query's output
                // in registers within the block; keys in order, so the sum does not depend on how many
                // keys follow a query's position
                for (int64_t b = 0; b < nb; ++b) {
                    const KS* vblock = kv + blocks[b] * block_stride + half_stride;
                    stream.prefetch(r, nb, nb + b + kPrefetchAhead);
                    const int64_t j0 = b * block_size;
                    for (int64_t i = 0; i < nq; ++i) {
                        const int64_t n = qv_pos[i] + 1 - j0;  // this query's keys in the block
                        if (n <= 0) continue;
                        const int64_t jn = n < block_size ? n : block_size;
                        const T* p = scores.data() + i * Lp + j0;
                        const KS* v = vblock + qv_koff[i];
                        T* a = acc.data() + i * D;
                        VT a0[nv];
                        for (int u = 0; u < nv; ++u) a0[u] = V::load(a + u * V::lanes);
                        for (int64_t jj = 0; jj < jn; ++jj) {
                            const KS* vr = v + jj * tok_stride;
                            for (int u = 0; u < nv; ++u) a0[u] += hs::load_as<T>(vr + u * V::lanes) * p[jj];
                        }
                        for (int u = 0; u < nv; ++u) V::store(a + u * V::lanes, a0[u]);
                    }
                }
            } else {
                for (int64_t b = 0; b < nb; ++b) {
                    const KS* vblock = kv + blocks[b] * block_stride + half_stride;
                    stream.prefetch(r, nb, nb + b + kPrefetchAhead);
                    const int64_t j0 = b * block_size;
                    const int64_t jn = L - j0 < block_size ? L - j0 : block_size;
                    for (int64_t jj = 0; jj < jn; ++jj) {
                        const KS* vrow = vblock + jj * tok_stride;
                        const int64_t j = j0 + jj;
                        for (int64_t i = 0; i < nq; ++i) {
                            if (j > qv_pos[i]) continue;
                            const T p = scores[i * Lp + j];
                            const KS* v = vrow + qv_koff[i];
                            T* a = acc.data() + i * D;
                            for (int64_t d = 0; d < D; ++d) a[d] += p * hs::widen(v[d]);
                        }
                    }
                }
            }
            if constexpr (std::is_same_v<S, T>) {
                for (int64_t t = t0; t < t1; ++t)
                    std::memcpy(out + t * H * D, acc.data() + (t - t0) * H * D, sizeof(T) * static_cast<size_t>(H * D));
            } else {
                for (int64_t j = 0; j < nq * D; ++j) out[t0 * H * D + j] = hs::narrow<S>(acc[static_cast<size_t>(j)]);
            }
        }
    }
}

template <typename T, typename S, typename KS>
int dispatch(const S* q, const KS* kv, S* out, const int64_t* block_table, int64_t bt_stride,
             const int64_t* qsl, const int64_t* positions, int64_t num_rows, int64_t num_tokens,
             int64_t num_blocks, int64_t H, int64_t KVH, int64_t D, int64_t block_size, double scale,
             int threads) {
    if (H <= 0 || KVH <= 0 || H % KVH != 0 || D <= 0 || block_size <= 0 || num_rows < 0 || bt_stride < 0)
        return 1;
    if (check_rows(block_table, bt_stride, qsl, positions, num_rows, num_tokens, num_blocks, block_size) != 0)
        return 2;
    const T s = static_cast<T>(scale);
    // rows weighted by their (query token, key) pairs; rows are independent
    std::vector<int64_t> weight(static_cast<size_t>(num_rows + 1), 0);
    for (int64_t r = 0; r < num_rows; ++r)
        weight[static_cast<size_t>(r + 1)] =
            weight[static_cast<size_t>(r)] + (qsl[r + 1] - qsl[r]) * row_keys(qsl, positions, r);
    const bool ok = hs::parallel_rows(num_rows, threads, weight, kMinPairsPerThread, [&](int64_t b, int64_t e) {
#define HS_ATTN(DC)                                                                                       \
    paged_attention<T, S, KS, DC>(q, kv, out, block_table, bt_stride, qsl, positions, num_rows, H, KVH, D, block_size, \
                           s, b, e)
        switch (D) {
            case 32: HS_ATTN(32); break;
            case 64: HS_ATTN(64); break;
            case 128: HS_ATTN(128); break;
            default: HS_ATTN(0);
        }
#undef HS_ATTN
    });
    return ok ? 0 : 4;
}

}  // namespace

extern "C" {

// Return codes: 0 ok, 1 bad shapes, 2 a row range, position or block id out of bounds (nothing
// read), 4 out of memory or no thread could be started.
#define HS_PAGED_ATTENTION(NAME, T, S, KS)                                                                        \
    int NAME(const S* q, const KS* kv, S* out, const int64_t* block_table, int64_t bt_stride, const int64_t* qsl,  \
             const int64_t* positions, int64_t num_rows, int64_t num_tokens, int64_t num_blocks, int64_t H,        \
             int64_t KVH, int64_t D, int64_t block_size, double scale, int threads) {                             \
        try {                                                                                                      \
            return dispatch<T, S, KS>(q, kv, out, block_table, bt_stride, qsl, positions, num_rows, num_tokens,          \
                               num_blocks, H, KVH, D, block_size, scale, threads);                                \
        } catch (...) {                                                                                            \
            return 4;                                                                                              \
        }                                                                                                          \
    }

HS_PAGED_ATTENTION(hs_paged_attention_f32, float, float, float)
HS_PAGED_ATTENTION(hs_paged_attention_f64, double, double, double)
HS_PAGED_ATTENTION(hs_paged_attention_bf16, float, hs::bf16, hs::bf16)
// a KV cache narrower than the model
HS_PAGED_ATTENTION(hs_paged_attention_f32_kv_bf16, float, float, hs::bf16)
HS_PAGED_ATTENTION(hs_paged_attention_f32_kv_fp8e4m3, float, float, hs::fp8e4m3)
HS_PAGED_ATTENTION(hs_paged_attention_f32_kv_fp8e5m2, float, float, hs::fp8e5m2)
HS_PAGED_ATTENTION(hs_paged_attention_bf16_kv_fp8e4m3, float, hs::bf16, hs::fp8e4m3)
HS_PAGED_ATTENTION(hs_paged_attention_bf16_kv_fp8e5m2, float, hs::bf16, hs::fp8e5m2)

#undef HS_PAGED_ATTENTION

}  // extern "C"
