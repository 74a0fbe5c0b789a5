// The Mamba2 mixer's token recurrence on the CPU (hybridserve.kernels.native): causal conv1d and
// selective state update token by token, in one pass per row, for decode / verify rows and for
// prefill rows alike. The arithmetic of reference.causal_conv1d_update followed by
// reference.selective_state_update:
//   conv:   out_c = sum_k window_c[k] * w_c[k] (+ b_c), silu
//   state:  dt_h = clamp(softplus(dt_h + dt_bias_h)), h = exp(dt_h A_h) h + dt_h x_h B_g^T,
//           y_h = h C_g + D_h x_h
// For prefill this replaces the chunked SSD scan of reference.ssd_prefill with the plain
// recurrence: on a CPU, with the state of one head (P x N) held in L1 across a row's tokens, it
// does the same O(H P N) work per token without the chunk matrices (the chunked form exists for
// tensor cores).
//
// Each row reads its initial conv window and state from read_slot (or zeros, for a prefill row
// without an initial state) before it writes anything, and writes the window and state after
// token t to every slot listed for t. The lists come as CSR: the writes of row r are
// write_token / write_slot[write_offsets[r] .. write_offsets[r + 1]), sorted by token. Slot 0 is
// the null slot: writes to it are skipped. Layouts (contiguous unless a stride is passed):
//   xbc [n, conv_dim] with row stride xbc_stride; dt [n, H] with row stride dt_stride
//   conv_w [conv_dim, W]; conv_b [conv_dim] or null; conv_state [slots, conv_dim, W - 1]
//   A (already -exp(A_log)), D, dt_bias [H]; ssm_state [slots, H, P, N]
//   qsl [R + 1] from 0; read_slot [R]; has_init [R] (uint8) or null (= all); y [n, H, P]
// Return codes: 0 ok, 1 bad shapes, 2 a slot, token or row range out of bounds, 3 the reference's
// order of reads and writes would differ from this row-by-row order (a row reads a slot that an
// earlier row writes, two rows write one slot, or, with strict_row_writes, one row writes a slot
// at two tokens): the caller then takes the reference path. Nothing is written unless the result is 0.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_common.h"

namespace {

// dt = clamp(softplus(v + bias)) (softplus(u) = u above 20) of kDtBatch values at once. Every
// token's dt goes through this one fixed-width function (a short block is padded), so the
// compiler's vectorised exp / log1p, which round differently from the scalar ones, apply to all
// of them alike: a token's dt does not depend on how many tokens share its row (a verify row
// gives exactly its tokens' decode results) or on the storage type of dt. Not inlined, for the
// same reason.
constexpr int64_t kDtBatch = 16;
template <typename T>
__attribute__((noinline)) void softplus_dt(T* v, T bias, T lo, bool clamp_max, T hi) {
    T out[kDtBatch];
    for (int64_t j = 0; j < kDtBatch; ++j) {
        const T u = v[j] + bias;
        const T e = std::exp(u < T(20) ? u : T(20));  // no inf under -ffast-math
        T d = u <= T(20) ? std::log1p(e) : u;
        d = d < lo ? lo : d;
        if (clamp_max && d > hi) d = hi;
        out[j] = d;
    }
    // NaN in, NaN out, as the reference's softplus and clamp give it: the comparisons above,
    // under -ffast-math, turn a NaN into a number (a separate pass keeps the one above vectorised)
    for (int64_t j = 0; j < kDtBatch; ++j) {
        const T u = v[j] + bias;
        v[j] = hs::is_nan(u) ? u : out[j];
    }
}

// src [rows][cols] -> dst [cols][rows]
template <typename T>
inline void transpose(const T* src, T* dst, int64_t rows, int64_t cols) {
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) dst[j * rows + i] = src[i * cols + j];
}

// Rows of at least this many tokens run the state update on a transposed copy of the state, when
// P is a multiple of kTransposeLanes.
constexpr int64_t kTransposeFrom = 8;
// 64 bytes of T, whatever the machine's vector width: the transposed update sums y = h C in
// another order than the per-row loop, so which rows take it must not depend on the machine (a
// prompt prefilled whole or in chunks of other sizes gets the same bits wherever it did on
// AVX-512). A multiple of every Vec<T>::lanes.
template <typename T>
inline constexpr int64_t kTransposeLanes = 64 / static_cast<int64_t>(sizeof(T));
// One token's update of NV vectors of columns p0 .. p0 + NV lanes of a head's transposed state
// hT [N][P]: hT[k][p] = a hT[k][p] + d x[p] B[k]; y[p] = sum_k hT[k][p] C[k] + Dskip x[p]. Even
// and odd k accumulate apart, for each vector: 2 NV independent FMA chains (latency bounds this
// loop). Every column gets the same arithmetic whatever NV is.
template <typename T, int NV>
inline void transposed_step(T* hT, int64_t P, int64_t N, const T* x, const T* B, const T* C, T d, T a, T Dskip,
                            T* y) {
    using V = hs::Vec<T>;
    using VT = typename V::type;
    constexpr int L = V::lanes;
    VT xv[NV], dx[NV], y0[NV], y1[NV];
    for (int u = 0; u < NV; ++u) {
        xv[u] = V::load(x + u * L);
        dx[u] = xv[u] * d;
        y0[u] = xv[u] * T(0);
        y1[u] = xv[u] * T(0);
    }
    int64_t k = 0;
    for (; k + 1 < N; k += 2) {
        for (int u = 0; u < NV; ++u) {
            T* h = hT + k * P + u * L;
            const VT h0 = V::load(h) * a + dx[u] * B[k];
            const VT h1 = V::load(h + P) * a + dx[u] * B[k + 1];
            V::store(h, h0);
            V::store(h + P, h1);
            y0[u] += h0 * C[k];
            y1[u] += h1 * C[k + 1];
        }
    }
    if (k < N) {
        for (int u = 0; u < NV; ++u) {
            T* h = hT + k * P + u * L;
            const VT h0 = V::load(h) * a + dx[u] * B[k];
            V::store(h, h0);
            y0[u] += h0 * C[k];
        }
    }
    for (int u = 0; u < NV; ++u) V::store(y + u * L, (y0[u] + y1[u]) + xv[u] * Dskip);
}

struct Rows {
    const int64_t* qsl;
    int64_t R;
    const int64_t* read_slot;
    const uint8_t* has_init;  // null: every row has an initial state
    const int64_t* write_offsets;
    const int64_t* write_token;
    const int64_t* write_slot;

    bool reads(int64_t r) const { return has_init == nullptr || has_init[r] != 0; }
};

int check(const Rows& rows, int64_t num_slots, bool strict_row_writes, bool parallel) {
    const int64_t R = rows.R;
    if (R > 0 && (rows.qsl[0] != 0 || rows.write_offsets[0] != 0)) return 2;
    std::unordered_map<int64_t, std::pair<int64_t, int64_t>> reader;  // slot -> (first, last) row reading it
    std::unordered_map<int64_t, std::pair<int64_t, int64_t>> writer;  // slot -> (row, token) writing it
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n = rows.qsl[r + 1] - rows.qsl[r];
        if (n < 0) return 2;
        if (rows.reads(r)) {
            const int64_t s = rows.read_slot[r];
            if (s < 0 || s >= num_slots) return 2;
            auto it = reader.find(s);
            if (it == reader.end()) reader[s] = {r, r};
            else it->second.second = r;
        }
        const int64_t e0 = rows.write_offsets[r], e1 = rows.write_offsets[r + 1];
        if (e1 < e0) return 2;
        for (int64_t e = e0; e < e1; ++e) {
            const int64_t t = rows.write_token[e], s = rows.write_slot[e];
            if (t < 0 || t >= n || s < 0 || s >= num_slots) return 2;
            if (e > e0 && t < rows.write_token[e - 1]) return 1;
            if (s == 0) continue;
            auto it = writer.find(s);
            if (it == writer.end()) writer[s] = {r, t};
            else if (it->second.first != r || (strict_row_writes && it->second.second != t)) return 3;
        }
    }
    // rows run in order, each reading before it writes: a slot written by row r may be read by
    // rows up to r, not by a later row (the reference reads every row first). Rows that run in
    // parallel may share no slot between a writer and another reader at all.
    for (const auto& [s, w] : writer) {
        auto it = reader.find(s);
        if (it == reader.end()) continue;
        if (it->second.second > w.first) return 3;
        if (parallel && (it->second.first != w.first || it->second.second != w.first)) return 3;
    }
    return 0;
}

// One token's update of a head's state h [P][N] (the layout of the pool) where the vector path
// applies (float, AVX-512, N and P multiples of 16): 16 rows p at a time, each row's y partial
// sums in one vector and the 16 sums formed by one reduction tree, instead of a horizontal sum
// per row. Returns false where it does not apply (the caller's scalar loop runs). Decode and
// verify rows both take it, so a verified token gets exactly its decode arithmetic.
template <typename T, int NC>
inline bool short_row_step(T* h, int64_t P, const T* x, const T* B, const T* C, T d, T a, T Dskip, T* y) {
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, float> && NC > 0 && NC % 16 == 0) {
        if (P % 16 != 0) return false;
        const __m512 av = _mm512_set1_ps(a);
        __m512 Bv[NC / 16], Cv[NC / 16];
        for (int u = 0; u < NC / 16; ++u) {
            Bv[u] = _mm512_loadu_ps(B + 16 * u);
            Cv[u] = _mm512_loadu_ps(C + 16 * u);
        }
        for (int64_t p0 = 0; p0 < P; p0 += 16) {
            __m512 acc[16];
            for (int j = 0; j < 16; ++j) {
                float* hp = h + (p0 + j) * NC;
                const __m512 coef = _mm512_set1_ps(d * x[p0 + j]);
                __m512 s = _mm512_setzero_ps();
                for (int u = 0; u < NC / 16; ++u) {
                    const __m512 hv = _mm512_fmadd_ps(_mm512_loadu_ps(hp + 16 * u), av, _mm512_mul_ps(coef, Bv[u]));
                    _mm512_storeu_ps(hp + 16 * u, hv);
                    s = _mm512_fmadd_ps(hv, Cv[u], s);
                }
                acc[j] = s;
            }
            const __m512 xv = _mm512_loadu_ps(x + p0);
            _mm512_storeu_ps(y + p0, _mm512_fmadd_ps(xv, _mm512_set1_ps(Dskip), hs::sum16(acc)));
        }
        return true;
    }
#endif
    (void)h, (void)P, (void)x, (void)B, (void)C, (void)d, (void)a, (void)Dskip, (void)y;
    return false;
}

// The conv of one token, out_c = silu(sum_k window[k][c] w_c[k] + b_c), with wT = w as [W][conv_dim].
// Not inlined, so that the float and the bfloat16 scans run the same instructions on the same
// values (-ffast-math leaves the compiler free to vectorise, and so to round, each inlined copy
// its own way).
template <typename T>
__attribute__((noinline)) void conv_token(const T* const* window, const T* wT, const T* b, bool act, int64_t W,
                                          int64_t conv_dim, T* co) {
    const T* x0 = window[0];
    for (int64_t c = 0; c < conv_dim; ++c) co[c] = x0[c] * wT[c];
    for (int64_t k = 1; k < W; ++k) {
        const T* xk = window[k];
        const T* wk = wT + k * conv_dim;
        for (int64_t c = 0; c < conv_dim; ++c) co[c] += xk[c] * wk[c];
    }
    if (b != nullptr)
        for (int64_t c = 0; c < conv_dim; ++c) co[c] += b[c];
    if (act)
        for (int64_t c = 0; c < conv_dim; ++c) co[c] = hs::silu(co[c]);
}

// Tokens per block: a row is scanned block by block, so that a block's conv outputs (and every
// head's state) stay in the core's L2 while each head runs over the block's tokens.
constexpr int64_t kBlockTokens = 64;

// A call is split over threads only when each gets at least this many tokens.
constexpr int64_t kMinTokensPerThread = 8;

// xbc, dt and y in the storage type St (T, or bfloat16 computed in float): a bfloat16 block's
// inputs are widened into a float window first and each head's y computed into a float buffer,
// then rounded once, so the arithmetic is meant to be the float kernel's on the widened inputs.
// The conv and dt run in shared functions that are not inlined; the state update is the same
// inlined code on the same float buffers, which under -ffast-math the compiler could still
// compile differently in the two instantiations: tests/kernels/test_kernels_native.py checks the
// equality on the machine that builds the library.
template <typename T, typename St, int NC>
void scan(const St* xbc, int64_t xbc_stride, const St* dt, int64_t dt_stride, const T* conv_w, const T* conv_b,
          T* conv_state, const T* A, const T* Dskip, const T* dt_bias, T* ssm_state, const Rows& rows,
          int64_t conv_dim, int64_t W, int64_t H, int64_t P, int64_t G, int64_t N_runtime, bool act, T dt_min,
          bool clamp_max, T dt_max, St* y, int64_t row_begin, int64_t row_end) {
    constexpr bool same = std::is_same_v<St, T>;
    const int64_t N = NC > 0 ? NC : N_runtime;
    const int64_t S = W - 1;
    const int64_t hpg = H / G;
    const int64_t d_inner = H * P;
    const int64_t head_size = P * N;
    const int64_t state_stride = H * head_size;
    const size_t head_bytes = sizeof(T) * static_cast<size_t>(head_size);
    // conv weights as [W][conv_dim], so that the conv runs along the channels
    std::vector<T> wT(static_cast<size_t>(W * conv_dim));
    for (int64_t c = 0; c < conv_dim; ++c)
        for (int64_t k = 0; k < W; ++k) wT[static_cast<size_t>(k * conv_dim + c)] = conv_w[c * W + k];
    std::vector<T> init_win(static_cast<size_t>((S > 0 ? S : 1) * conv_dim));  // [S][conv_dim]
    std::vector<T> conv_out(static_cast<size_t>(kBlockTokens * conv_dim));   // one block's
    std::vector<T> states(static_cast<size_t>(state_stride));                 // every head's
    std::vector<T> dtv(static_cast<size_t>((kBlockTokens + kDtBatch - 1) / kDtBatch * kDtBatch), T(0));
    // bfloat16 only: the block's inputs b0 - S .. b0 + bn widened, and one head's y
    std::vector<T> xwin(same ? 0 : static_cast<size_t>((S + kBlockTokens) * conv_dim));
    std::vector<T> ybuf(same ? 0 : static_cast<size_t>(P));
    std::vector<const T*> window(static_cast<size_t>(W));  // one token's conv inputs
    for (int64_t r = row_begin; r < row_end; ++r) {
        const int64_t t0 = rows.qsl[r], n = rows.qsl[r + 1] - rows.qsl[r];
        if (n == 0) continue;
        const bool init = rows.reads(r);
        const int64_t e1 = rows.write_offsets[r + 1];
        // A long row keeps each head's state transposed ([N][P]) so that the update and y = h C
        // both run along P with no horizontal sums; a short one (decode, verify) is not worth the
        // two transposes.
        const bool transposed = n >= kTransposeFrom && P % kTransposeLanes<T> == 0;
        // A decode row (one block, its only write the final state) updates its write slot in
        // place: the state is not copied out and back, which was a third of the row's memory
        // traffic. check() has made sure that no later row reads that slot.
        const int64_t e0 = rows.write_offsets[r];
        const bool in_place = init && !transposed && n <= kBlockTokens && e1 - e0 == 1 &&
                              rows.write_token[e0] == n - 1 && rows.write_slot[e0] != 0;
        T* const state_base = in_place ? ssm_state + rows.write_slot[e0] * state_stride : states.data();
        int64_t b0 = 0;  // the block being scanned
        // input j of the row (j < 0: column S + j of the initial window); a bfloat16 input is
        // read from the block's widened window, which holds j = b0 - S .. b0 + bn
        auto input = [&](int64_t j) -> const T* {
            if (j < 0) return init_win.data() + (S + j) * conv_dim;
            if constexpr (same) return xbc + (t0 + j) * xbc_stride;
            else return xwin.data() + (j - b0 + S) * conv_dim;
        };
        if (S > 0) {
            if (init) {
                const T* src = conv_state + rows.read_slot[r] * conv_dim * S;
                for (int64_t c = 0; c < conv_dim; ++c)
                    for (int64_t k = 0; k < S; ++k) init_win[static_cast<size_t>(k * conv_dim + c)] = src[c * S + k];
            } else {
                std::fill(init_win.begin(), init_win.end(), T(0));
            }
        }
        for (int64_t hd = 0; hd < H; ++hd) {
            T* hs = state_base + hd * head_size;
            if (!init) {
                std::fill(hs, hs + head_size, T(0));
                continue;
            }
            const T* src = ssm_state + rows.read_slot[r] * state_stride + hd * head_size;
            if (transposed) transpose(src, hs, P, N);
            else if (src != hs) std::memcpy(hs, src, head_bytes);
        }
        int64_t e_block = rows.write_offsets[r];  // the first write at or after the block's start
        for (; b0 < n; b0 += kBlockTokens) {
            const int64_t bn = n - b0 < kBlockTokens ? n - b0 : kBlockTokens;
            if constexpr (!same) {
                for (int64_t j = b0 - S > 0 ? b0 - S : 0; j < b0 + bn; ++j) {
                    const St* src = xbc + (t0 + j) * xbc_stride;
                    T* dst = xwin.data() + (j - b0 + S) * conv_dim;
                    for (int64_t c = 0; c < conv_dim; ++c) dst[c] = hs::widen(src[c]);
                }
            }
            // conv of the block's tokens: token t's window is inputs t - S .. t
            for (int64_t i = 0; i < bn; ++i) {
                const int64_t t = b0 + i;
                T* co = conv_out.data() + i * conv_dim;
                for (int64_t k = 0; k < W; ++k) window[static_cast<size_t>(k)] = input(t - S + k);
                conv_token<T>(window.data(), wT.data(), conv_b, act, W, conv_dim, co);
            }
            int64_t e_next = e_block;
            while (e_next < e1 && rows.write_token[e_next] < b0 + bn) ++e_next;
            if (S > 0) {
                for (int64_t e = e_block; e < e_next; ++e) {
                    if (rows.write_slot[e] == 0) continue;
                    // the window after token t (inputs t - S + 1 .. t), stored as [conv_dim][S]
                    const int64_t t = rows.write_token[e];
                    T* dst = conv_state + rows.write_slot[e] * conv_dim * S;
                    for (int64_t k = 0; k < S; ++k) {
                        const T* xk = input(t - S + 1 + k);
                        for (int64_t c = 0; c < conv_dim; ++c) dst[c * S + k] = xk[c];
                    }
                }
            }
            // state update, one head at a time over the block's tokens
            for (int64_t hd = 0; hd < H; ++hd) {
                const int64_t g = hd / hpg;
                T* hs = state_base + hd * head_size;
                for (int64_t i = 0; i < bn; ++i)
                    dtv[static_cast<size_t>(i)] = static_cast<T>(hs::widen(dt[(t0 + b0 + i) * dt_stride + hd]));
                for (int64_t i = 0; i < bn; i += kDtBatch)
                    softplus_dt<T>(dtv.data() + i, dt_bias[hd], dt_min, clamp_max, dt_max);
                int64_t e = e_block;
                for (int64_t i = 0; i < bn; ++i) {
                    const int64_t t = b0 + i;
                    const T* co = conv_out.data() + i * conv_dim;
                    const T* x = co + hd * P;
                    const T* B = co + d_inner + g * N;
                    const T* C = co + d_inner + G * N + g * N;
                    const T d = dtv[static_cast<size_t>(i)];
                    const T a = std::exp(d * A[hd]);
                    St* const yout = y + ((t0 + t) * H + hd) * P;
                    T* yo;
                    if constexpr (same) yo = yout;
                    else yo = ybuf.data();
                    if (transposed) {
                        constexpr int64_t L = hs::Vec<T>::lanes;
                        int64_t p0 = 0;
                        for (; p0 + 2 * L <= P; p0 += 2 * L)
                            transposed_step<T, 2>(hs + p0, P, N, x + p0, B, C, d, a, Dskip[hd], yo + p0);
                        for (; p0 < P; p0 += L)
                            transposed_step<T, 1>(hs + p0, P, N, x + p0, B, C, d, a, Dskip[hd], yo + p0);
                    } else if (!short_row_step<T, NC>(hs, P, x, B, C, d, a, Dskip[hd], yo)) {
                        for (int64_t p = 0; p < P; ++p) {
                            T* hp = hs + p * N;
                            const T coef = d * x[p];
                            T acc = 0;
                            for (int64_t k = 0; k < N; ++k) {
                                hp[k] = hp[k] * a + coef * B[k];
                                acc += hp[k] * C[k];
                            }
                            yo[p] = acc + Dskip[hd] * x[p];
                        }
                    }
                    if constexpr (!same)
                        for (int64_t p = 0; p < P; ++p) yout[p] = hs::narrow<St>(yo[p]);
                    for (; e < e_next && rows.write_token[e] == t; ++e) {
                        if (rows.write_slot[e] == 0 || in_place) continue;
                        T* dst = ssm_state + rows.write_slot[e] * state_stride + hd * head_size;
                        if (transposed) transpose(hs, dst, N, P);
                        else hs::copy_to_unread_slot(dst, hs, head_bytes);
                    }
                }
            }
            e_block = e_next;
        }
    }
    hs::stream_fence();  // the slots written by copy_to_unread_slot, before the rows are reported done
}

template <typename T, typename St>
int run(const St* xbc, int64_t xbc_stride, const St* dt, int64_t dt_stride, const T* conv_w, const T* conv_b,
        T* conv_state, int64_t num_conv_slots, const T* A, const T* Dskip, const T* dt_bias, T* ssm_state,
        int64_t num_ssm_slots, const Rows& rows, bool strict_row_writes, int64_t conv_dim, int64_t W, int64_t H,
        int64_t P, int64_t G, int64_t N, int act, double dt_min, double dt_max, St* y, int threads) {
    // dt_max < 0 means no upper clamp (an infinite bound is not passed: see hs::silu)
    if (W < 1 || H <= 0 || P <= 0 || G <= 0 || N <= 0 || H % G != 0 || conv_dim != H * P + 2 * G * N) return 1;
    const int64_t num_slots = num_conv_slots < num_ssm_slots ? num_conv_slots : num_ssm_slots;
    // rows weighted by their tokens (every row at least one: its state is read and written)
    std::vector<int64_t> weight(static_cast<size_t>(rows.R + 1), 0);
    for (int64_t r = 0; r < rows.R; ++r) {
        const int64_t n = rows.qsl[r + 1] - rows.qsl[r];
        weight[static_cast<size_t>(r + 1)] = weight[static_cast<size_t>(r)] + (n > 1 ? n : 1);
    }
    const bool parallel = threads > 1 && weight[static_cast<size_t>(rows.R)] >= 2 * kMinTokensPerThread;
    const int rc = check(rows, num_slots, strict_row_writes, parallel);
    if (rc != 0) return rc;
    const T lo = static_cast<T>(dt_min);
    const bool clamp_max = dt_max >= 0;
    const T hi = static_cast<T>(clamp_max ? dt_max : 0.0);
    const bool ok = hs::parallel_rows(rows.R, parallel ? threads : 1, weight, kMinTokensPerThread, [&](int64_t b, int64_t e) {
#define HS_SCAN(NC)                                                                                            \
    scan<T, St, NC>(xbc, xbc_stride, dt, dt_stride, conv_w, conv_b, conv_state, A, Dskip, dt_bias, ssm_state, rows, \
                conv_dim, W, H, P, G, N, act != 0, lo, clamp_max, hi, y, b, e)
        switch (N) {
            case 16: HS_SCAN(16); break;
            case 32: HS_SCAN(32); break;
            case 64: HS_SCAN(64); break;
            case 128: HS_SCAN(128); break;
            default: HS_SCAN(0);
        }
#undef HS_SCAN
    });
    return ok ? 0 : 4;
}

// Decode / verify rows: the window and state after token t go to write_slots[r, t] (t < n_r).
template <typename T, typename St>
int decode_rows(const St* xbc, int64_t xbc_stride, const St* dt, int64_t dt_stride, const T* conv_w, const T* conv_b,
                T* conv_state, int64_t num_conv_slots, const T* A, const T* Dskip, const T* dt_bias, T* ssm_state,
                int64_t num_ssm_slots, const int64_t* qsl, int64_t R, const int64_t* read_slot,
                const int64_t* write_slots, int64_t ws_stride, int64_t conv_dim, int64_t W, int64_t H, int64_t P,
                int64_t G, int64_t N, int act, double dt_min, double dt_max, St* y, int threads) {
    if (R < 0 || ws_stride < 0) return 1;
    std::vector<int64_t> offsets(static_cast<size_t>(R + 1), 0), tokens, slots;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n = qsl[r + 1] - qsl[r];
        if (n < 0 || n > ws_stride) return 2;
        for (int64_t t = 0; t < n; ++t) {
            tokens.push_back(t);
            slots.push_back(write_slots[r * ws_stride + t]);
        }
        offsets[static_cast<size_t>(r + 1)] = static_cast<int64_t>(tokens.size());
    }
    const Rows rows{qsl, R, read_slot, nullptr, offsets.data(), tokens.data(), slots.data()};
    return run<T, St>(xbc, xbc_stride, dt, dt_stride, conv_w, conv_b, conv_state, num_conv_slots, A, Dskip, dt_bias,
                  ssm_state, num_ssm_slots, rows, false, conv_dim, W, H, P, G, N, act, dt_min, dt_max, y, threads);
}

// Prefill rows: initial state from read_slot where has_init, writes given as CSR (the final state
// and the emitted boundary states).
template <typename T, typename St>
int prefill_rows(const St* xbc, int64_t xbc_stride, const St* dt, int64_t dt_stride, const T* conv_w,
                 const T* conv_b, T* conv_state, int64_t num_conv_slots, const T* A, const T* Dskip,
                 const T* dt_bias, T* ssm_state, int64_t num_ssm_slots, const int64_t* qsl, int64_t R,
                 const int64_t* read_slot, const uint8_t* has_init, const int64_t* write_offsets,
                 const int64_t* write_token, const int64_t* write_slot, int64_t conv_dim, int64_t W, int64_t H,
                 int64_t P, int64_t G, int64_t N, int act, double dt_min, double dt_max, St* y, int threads) {
    if (R < 0) return 1;
    const Rows rows{qsl, R, read_slot, has_init, write_offsets, write_token, write_slot};
    return run<T, St>(xbc, xbc_stride, dt, dt_stride, conv_w, conv_b, conv_state, num_conv_slots, A, Dskip, dt_bias,
                  ssm_state, num_ssm_slots, rows, true, conv_dim, W, H, P, G, N, act, dt_min, dt_max, y, threads);
}

}  // namespace

extern "C" {

// Return codes: those of run() above, and 4 for out of memory (no exception leaves the library).
#define HS_MAMBA_DECODE(NAME, T, St)                                                                                 \
    int NAME(const St* xbc, int64_t xbc_stride, const St* dt, int64_t dt_stride, const T* conv_w, const T* conv_b, \
             T* conv_state, int64_t num_conv_slots, const T* A, const T* Dskip, const T* dt_bias, T* ssm_state,  \
             int64_t num_ssm_slots, const int64_t* qsl, int64_t R, const int64_t* read_slot,                     \
             const int64_t* write_slots, int64_t ws_stride, int64_t conv_dim, int64_t W, int64_t H, int64_t P,   \
             int64_t G, int64_t N, int act, double dt_min, double dt_max, St* y, int threads) {                  \
        try {                                                                                                    \
            return decode_rows<T, St>(xbc, xbc_stride, dt, dt_stride, conv_w, conv_b, conv_state, num_conv_slots, A, \
                                  Dskip, dt_bias, ssm_state, num_ssm_slots, qsl, R, read_slot, write_slots,       \
                                  ws_stride, conv_dim, W, H, P, G, N, act, dt_min, dt_max, y, threads);          \
        } catch (...) {                                                                                          \
            return 4;                                                                                            \
        }                                                                                                        \
    }

#define HS_MAMBA_PREFILL(NAME, T, St)                                                                                \
    int NAME(const St* xbc, int64_t xbc_stride, const St* dt, int64_t dt_stride, const T* conv_w, const T* conv_b, \
             T* conv_state, int64_t num_conv_slots, const T* A, const T* Dskip, const T* dt_bias, T* ssm_state,  \
             int64_t num_ssm_slots, const int64_t* qsl, int64_t R, const int64_t* read_slot,                     \
             const uint8_t* has_init, const int64_t* write_offsets, const int64_t* write_token,                  \
             const int64_t* write_slot, int64_t conv_dim, int64_t W, int64_t H, int64_t P, int64_t G, int64_t N, \
             int act, double dt_min, double dt_max, St* y, int threads) {                                        \
        try {                                                                                                    \
            return prefill_rows<T, St>(xbc, xbc_stride, dt, dt_stride, conv_w, conv_b, conv_state, num_conv_slots,  \
                                   A, Dskip, dt_bias, ssm_state, num_ssm_slots, qsl, R, read_slot, has_init,     \
                                   write_offsets, write_token, write_slot, conv_dim, W, H, P, G, N, act, dt_min, \
                                   dt_max, y, threads);                                                          \
        } catch (...) {                                                                                          \
            return 4;                                                                                            \
        }                                                                                                        \
    }

HS_MAMBA_DECODE(hs_mamba_decode_f32, float, float)
HS_MAMBA_DECODE(hs_mamba_decode_f64, double, double)
HS_MAMBA_DECODE(hs_mamba_decode_bf16, float, hs::bf16)
HS_MAMBA_PREFILL(hs_mamba_prefill_f32, float, float)
HS_MAMBA_PREFILL(hs_mamba_prefill_f64, double, double)
HS_MAMBA_PREFILL(hs_mamba_prefill_bf16, float, hs::bf16)

#undef HS_MAMBA_DECODE
#undef HS_MAMBA_PREFILL

}  // extern "C"
