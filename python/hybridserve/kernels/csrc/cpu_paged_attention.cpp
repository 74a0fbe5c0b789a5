// Paged attention of decode and verify rows on the CPU (hybridserve.kernels.native).
//
// Plain C ABI over raw pointers (no torch headers: it builds in about a second with g++ and is
// called through ctypes). Layouts, all contiguous:
//   q, out        [T, H, D]
//   kv_cache      [num_blocks, 2, block_size, KVH, D]   (index 0 = K, 1 = V)
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

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

template <typename T, int DC>
struct Dim {
    static inline int64_t get(int64_t) { return DC; }
};
template <typename T>
struct Dim<T, 0> {
    static inline int64_t get(int64_t d) { return d; }
};

// Keys a row reads: 1 + its largest position (0 for an empty row).
inline int64_t row_keys(const int64_t* qsl, const int64_t* positions, int64_t r) {
    int64_t L = 0;
    for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) L = positions[t] + 1 > L ? positions[t] + 1 : L;
    return L;
}

// 0 when every row's positions are >= 0 and every block it reads is in [0, num_blocks).
int check_rows(const int64_t* block_table, int64_t bt_stride, const int64_t* qsl, const int64_t* positions,
               int64_t num_rows, int64_t num_blocks, int64_t block_size) {
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t t0 = qsl[r], t1 = qsl[r + 1];
        if (t1 < t0 || (r == 0 && t0 != 0)) return 2;
        for (int64_t t = t0; t < t1; ++t)
            if (positions[t] < 0) return 2;
        const int64_t L = row_keys(qsl, positions, r);
        const int64_t nb = (L + block_size - 1) / block_size;
        if (nb > bt_stride) return 2;
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

template <typename T>
struct HalfStream {
    const T* kv;
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
        const T* p = kv + block_table[r * bt_stride + b] * block_stride + (s < nb ? 0 : half_stride);
        prefetch_half(p, half_stride);
    }
};

template <typename T, int DC>
void paged_attention(const T* q, const T* kv, T* out, const int64_t* block_table, int64_t bt_stride,
                     const int64_t* qsl, const int64_t* positions, int64_t num_rows, int64_t H,
                     int64_t KVH, int64_t D_runtime, int64_t block_size, T scale) {
    const int64_t D = Dim<T, DC>::get(D_runtime);
    const int64_t Gq = H / KVH;
    const int64_t tok_stride = KVH * D;                   // one token's K (or V) in a block
    const int64_t half_stride = block_size * tok_stride;  // the K part of a block
    const int64_t block_stride = 2 * half_stride;
    std::vector<T> scores;
    std::vector<T> acc;
    std::vector<int64_t> qv_pos;
    std::vector<int64_t> qv_koff;  // offset of the query's KV head inside a token's row
    std::vector<const T*> qv_ptr;
    const HalfStream<T> stream{kv, block_table, bt_stride, block_stride, half_stride, block_size, num_rows, qsl,
                               positions};
    bool primed = false;
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t t0 = qsl[r], t1 = qsl[r + 1];
        if (t1 <= t0) continue;
        const int64_t L = row_keys(qsl, positions, r);
        // query vectors: every head of every token of the row (i = (t - t0) * H + head), so one
        // pass over a token's K row (all KV heads, contiguous) serves them all
        const int64_t nq = (t1 - t0) * H;
        scores.resize(static_cast<size_t>(nq * L));
        acc.assign(static_cast<size_t>(nq * D), T(0));
        qv_pos.resize(static_cast<size_t>(nq));
        qv_koff.resize(static_cast<size_t>(nq));
        qv_ptr.resize(static_cast<size_t>(nq));
        for (int64_t t = t0; t < t1; ++t) {
            for (int64_t h = 0; h < H; ++h) {
                const int64_t i = (t - t0) * H + h;
                qv_pos[i] = positions[t];
                qv_koff[i] = (h / Gq) * D;
                qv_ptr[i] = q + (t * H + h) * D;
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
            const T* kblock = kv + blocks[b] * block_stride;
            stream.prefetch(r, nb, b + kPrefetchAhead);
            const int64_t j0 = b * block_size;
            const int64_t jn = L - j0 < block_size ? L - j0 : block_size;
            for (int64_t jj = 0; jj < jn; ++jj) {
                const T* krow = kblock + jj * tok_stride;
                const int64_t j = j0 + jj;
                for (int64_t i = 0; i < nq; ++i) {
                    if (j > qv_pos[i]) continue;
                    const T* qi = qv_ptr[i];
                    const T* k = krow + qv_koff[i];
                    T s = 0;
                    for (int64_t d = 0; d < D; ++d) s += qi[d] * k[d];
                    scores[i * L + j] = s * scale;
                }
            }
        }
        // softmax over each query vector's own keys
        for (int64_t i = 0; i < nq; ++i) {
            T* s = scores.data() + i * L;
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
        for (int64_t b = 0; b < nb; ++b) {
            const T* vblock = kv + blocks[b] * block_stride + half_stride;
            stream.prefetch(r, nb, nb + b + kPrefetchAhead);
            const int64_t j0 = b * block_size;
            const int64_t jn = L - j0 < block_size ? L - j0 : block_size;
            for (int64_t jj = 0; jj < jn; ++jj) {
                const T* vrow = vblock + jj * tok_stride;
                const int64_t j = j0 + jj;
                for (int64_t i = 0; i < nq; ++i) {
                    if (j > qv_pos[i]) continue;
                    const T p = scores[i * L + j];
                    const T* v = vrow + qv_koff[i];
                    T* a = acc.data() + i * D;
                    for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
                }
            }
        }
        for (int64_t t = t0; t < t1; ++t)
            std::memcpy(out + t * H * D, acc.data() + (t - t0) * H * D, sizeof(T) * static_cast<size_t>(H * D));
    }
}

template <typename T>
int dispatch(const T* q, const T* kv, T* out, const int64_t* block_table, int64_t bt_stride,
             const int64_t* qsl, const int64_t* positions, int64_t num_rows, int64_t num_blocks, int64_t H,
             int64_t KVH, int64_t D, int64_t block_size, double scale) {
    if (KVH <= 0 || H % KVH != 0 || D <= 0 || block_size <= 0) return 1;
    if (check_rows(block_table, bt_stride, qsl, positions, num_rows, num_blocks, block_size) != 0) return 2;
    const T s = static_cast<T>(scale);
    switch (D) {
        case 32:
            paged_attention<T, 32>(q, kv, out, block_table, bt_stride, qsl, positions, num_rows, H, KVH, D,
                                   block_size, s);
            break;
        case 64:
            paged_attention<T, 64>(q, kv, out, block_table, bt_stride, qsl, positions, num_rows, H, KVH, D,
                                   block_size, s);
            break;
        case 128:
            paged_attention<T, 128>(q, kv, out, block_table, bt_stride, qsl, positions, num_rows, H, KVH, D,
                                    block_size, s);
            break;
        default:
            paged_attention<T, 0>(q, kv, out, block_table, bt_stride, qsl, positions, num_rows, H, KVH, D,
                                  block_size, s);
    }
    return 0;
}

}  // namespace

extern "C" {

int hs_paged_attention_f32(const float* q, const float* kv, float* out, const int64_t* block_table,
                           int64_t bt_stride, const int64_t* qsl, const int64_t* positions, int64_t num_rows,
                           int64_t num_blocks, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                           double scale) {
    return dispatch<float>(q, kv, out, block_table, bt_stride, qsl, positions, num_rows, num_blocks, H, KVH, D,
                           block_size,
                           scale);
}

int hs_paged_attention_f64(const double* q, const double* kv, double* out, const int64_t* block_table,
                           int64_t bt_stride, const int64_t* qsl, const int64_t* positions, int64_t num_rows,
                           int64_t num_blocks, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                           double scale) {
    return dispatch<double>(q, kv, out, block_table, bt_stride, qsl, positions, num_rows, num_blocks, H, KVH, D,
                           block_size,
                            scale);
}

}  // extern "C"
