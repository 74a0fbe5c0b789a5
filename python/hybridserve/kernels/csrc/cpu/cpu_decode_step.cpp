// One step of a whole model on the CPU, in one call (hybridserve.model.decode_step): decode rows
// (one new token, or one verifying its drafts, each with its logits) and prefill rows (a prompt's
// chunk, from a state kept for it or from zeros).
// Embeddings, then residual blocks x + mixer(norm(x)), each an RMSNorm and a mixer (Mamba2,
// attention with or without rotary embedding, an MLP gated or not), then the final norm and the LM
// head: Nemotron-H's layers are one block each, Bamba's two (mixer, then MLP). At batch 1 the same
// forward as torch ops costs about 450 dispatches of a few microseconds each for a few
// microseconds of arithmetic per layer; here it is one ctypes call.
//
// The mixers call the library's own kernels (hs_mamba_decode, hs_mamba_prefill,
// hs_paged_attention, the norms), so the recurrence, attention and norms are exactly those of the
// per-op path's decode rows; the projections are the matrix-vector products below (the per-op
// path runs them as torch GEMMs, which sum in another order: results agree to rounding, not bit
// for bit). A prefill row's attention is the paged kernel's, where the per-op path runs SDPA.
//
// Layers come as records of kFields int64 (pointers as integers) and kDoubles doubles, written
// once per weight version by the caller; see decode_step.py for the field names. Per step of R
// rows and T = qsl[R] tokens, rows [0, num_decodes) decode rows, the others prefill rows: qsl
// [R + 1] (row r owns tokens qsl[r] .. qsl[r + 1], at least one, and a decode row at most
// ws_stride); input_ids, positions, slot_mapping [T]; logits_indices [num_logits] (increasing:
// the tokens whose logits are computed); block_table [R, bt_stride]; read_slot [R]; write_slots
// [R, ws_stride] (a decode row's state after token t goes to [r, t], a prefill row's final state
// to [r, 0]); has_init [R] (uint8: a prefill row starts from read_slot's state, else from zeros);
// emit_row, emit_token, emit_slot [num_emits] (a prefill row's state after one of its tokens also
// goes to a slot: checkpoints). out: logits [num_logits, vocab], and per logits row the greedy
// token (argmax, the first of equal maxima, as torch.argmax) and whether every logit is finite.
//
// Return codes: 0 ok; 1 bad shapes; 2 a token id, position, KV slot, block id or state slot out
// of range; 3 not a step of independent rows (rows sharing a state slot, a decode row longer
// than the write window, logits indices out of order, an emit outside its prefill row): the
// caller runs the per-op forward; 4 out of memory before anything
// was written; 5 a failure after the caches were written (out of memory, or a check of a kernel
// that check_step should have made): the step is lost and the caller must not run it again.
// Everything that can be checked is checked before the first cache write, so codes 1 to 4 leave
// the caches as they were.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_background.h"
#include "cpu_common.h"
#include "cpu_parallel.h"

extern "C" {
int hs_rms_norm_f32(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t, double);
int hs_rms_norm_f64(const double*, int64_t, const double*, double*, int64_t, int64_t, int64_t, double);
int hs_gated_rms_norm_f32(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                          int64_t, int64_t, double);
int hs_gated_rms_norm_f64(const double*, int64_t, const double*, int64_t, const double*, double*, int64_t,
                          int64_t, int64_t, int64_t, double);
int hs_paged_attention_f32(const float*, const float*, float*, const int64_t*, int64_t, const int64_t*,
                           const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                           int);
int hs_paged_attention_f64(const double*, const double*, double*, const int64_t*, int64_t, const int64_t*,
                           const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                           int);
int hs_mamba_decode_f32(const float*, int64_t, const float*, int64_t, const float*, const float*, float*, int64_t,
                        const float*, const float*, const float*, float*, int64_t, const int64_t*, int64_t,
                        const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int, double, double, float*, int);
int hs_mamba_decode_f64(const double*, int64_t, const double*, int64_t, const double*, const double*, double*,
                        int64_t, const double*, const double*, const double*, double*, int64_t, const int64_t*,
                        int64_t, const int64_t*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int, double, double, double*, int);
int hs_mamba_prefill_f32(const float*, int64_t, const float*, int64_t, const float*, const float*, float*, int64_t,
                         const float*, const float*, const float*, float*, int64_t, const int64_t*, int64_t,
                         const int64_t*, const uint8_t*, const int64_t*, const int64_t*, const int64_t*, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int, double, double, float*, int);
int hs_mamba_prefill_f64(const double*, int64_t, const double*, int64_t, const double*, const double*, double*,
                         int64_t, const double*, const double*, const double*, double*, int64_t, const int64_t*,
                         int64_t, const int64_t*, const uint8_t*, const int64_t*, const int64_t*, const int64_t*,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, double, double, double*, int);
}

namespace {

constexpr int kFields = 24;
constexpr int kDoubles = 4;

enum Kind : int64_t { kMamba = 0, kAttention = 1, kMlp = 2 };
enum Act : int64_t { kRelu2 = 0, kSilu = 1, kRelu = 2 };

// The record of one residual block, x + mixer(norm(x)) (a decoder layer is one or two of them).
// Field 0 is the kind, field 1 the pre-norm weight; the others by kind:
//   Mamba2:    2 in_proj.w 3 in_proj.b 4 conv w [conv_dim, W] 5 conv b 6 A (= -exp(A_log)) 7 D
//              8 dt_bias 9 gated-norm w 10 out_proj.w 11 out_proj.b 12 conv_state 13 its slots
//              14 ssm_state 15 its slots 16 H 17 P 18 G 19 N 20 W 21 silu 22 norm group size
//   attention: 2 q.w 3 q.b 4 k.w 5 k.b 6 v.w 7 v.b 8 o.w 9 o.b 10 kv_cache 11 its blocks 12 H
//              13 KVH 14 D 15 block_size 16 rotary dimension (0: no rotary embedding)
//   MLP:       2 up.w 3 up.b 4 down.w 5 down.b 6 intermediate size 7 activation (Act) 8 gate.w
//              (0: not gated, down(act(up(x))); else down(act(gate(x)) * up(x))) 9 gate.b
// Doubles: 0 the pre-norm eps; Mamba2: 1 gated-norm eps 2 dt_min 3 dt_max (< 0: none);
// attention: 1 the softmax scale 2 the rotary base (theta).
template <typename T>
inline const T* cptr(const int64_t* rec, int i) {
    return reinterpret_cast<const T*>(static_cast<uintptr_t>(rec[i]));
}
template <typename T>
inline T* mptr(const int64_t* rec, int i) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(rec[i]));
}

template <typename T>
struct Ops;

template <>
struct Ops<float> {
    static constexpr auto rms_norm = hs_rms_norm_f32;
    static constexpr auto gated_rms_norm = hs_gated_rms_norm_f32;
    static constexpr auto paged_attention = hs_paged_attention_f32;
    static constexpr auto mamba_decode = hs_mamba_decode_f32;
    static constexpr auto mamba_prefill = hs_mamba_prefill_f32;
};
template <>
struct Ops<double> {
    static constexpr auto rms_norm = hs_rms_norm_f64;
    static constexpr auto gated_rms_norm = hs_gated_rms_norm_f64;
    static constexpr auto paged_attention = hs_paged_attention_f64;
    static constexpr auto mamba_decode = hs_mamba_decode_f64;
    static constexpr auto mamba_prefill = hs_mamba_prefill_f64;
};

// y[b, j] = x[b, :] . W[j, :] + bias[j] for outputs j in [j0, j1) of rows b < B; W is [out, in]
// row-major (nn.Linear's weight), x is [B, in], y is [B, out].
template <typename T>
void linear_range(const T* x, int64_t B, int64_t in, const T* W, const T* bias, int64_t out, T* y, int64_t j0,
                  int64_t j1) {
#ifdef __AVX512F__
    if constexpr (std::is_same_v<T, float>) {
        // (the last 0 - 15 inputs of a row: masked loads)
        const __mmask16 tail_in = static_cast<__mmask16>((1u << (in % 16)) - 1u);
        // Groups of 4 rows: 4 rows x 4 outputs per tile, each weight vector loaded serving 4 rows,
        // the 16 partial-sum vectors reduced together by hs::sum16 (its tree is the same for
        // every value, so a row's result is the one-row path's below: no row depends on how many
        // share the step). Outputs outer, rows inner: a tile's 4 weight rows stay in cache while
        // every group of rows reads them.
        const int64_t b4 = B / 4 * 4;
        for (int64_t jt = j0; jt < j1 && b4 > 0; jt += 4) {
            const int64_t nj = j1 - jt < 4 ? j1 - jt : 4;
            const float* wr[4];
            for (int j = 0; j < 4; ++j) wr[j] = W + (jt + (j < nj ? j : nj - 1)) * in;
            for (int64_t g = 0; g < b4; g += 4) {
                const float* xr[4] = {x + g * in, x + (g + 1) * in, x + (g + 2) * in, x + (g + 3) * in};
                __m512 acc[16];
                for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
                int64_t i = 0;
                for (; i + 16 <= in; i += 16) {
                    __m512 wv[4];
                    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(wr[j] + i);
                    for (int u = 0; u < 4; ++u) {
                        const __m512 xv = _mm512_loadu_ps(xr[u] + i);
                        for (int j = 0; j < 4; ++j) acc[u * 4 + j] = _mm512_fmadd_ps(wv[j], xv, acc[u * 4 + j]);
                    }
                }
                if (i < in) {
                    __m512 wv[4];
                    for (int j = 0; j < 4; ++j) wv[j] = _mm512_maskz_loadu_ps(tail_in, wr[j] + i);
                    for (int u = 0; u < 4; ++u) {
                        const __m512 xv = _mm512_maskz_loadu_ps(tail_in, xr[u] + i);
                        for (int j = 0; j < 4; ++j) acc[u * 4 + j] = _mm512_fmadd_ps(wv[j], xv, acc[u * 4 + j]);
                    }
                }
                alignas(64) float sums[16];
                _mm512_store_ps(sums, hs::sum16(acc));
                for (int u = 0; u < 4; ++u)
                    for (int j = 0; j < nj; ++j)
                        y[(g + u) * out + jt + j] = bias != nullptr ? sums[u * 4 + j] + bias[jt + j] : sums[u * 4 + j];
            }
        }
        if (b4 == B) return;
        x += b4 * in;
        y += b4 * out;
        B -= b4;
        // The rows left (one at a time): 16 outputs per tile, one vector of partial sums per
        // output; the last tile repeats the last weight row and stores only the real outputs.
        for (int64_t jt = j0; jt < j1; jt += 16) {
            const int64_t nj = j1 - jt < 16 ? j1 - jt : 16;
            const float* wr[16];
            for (int j = 0; j < 16; ++j) wr[j] = W + (jt + (j < nj ? j : nj - 1)) * in;
            const __mmask16 keep = static_cast<__mmask16>(nj == 16 ? 0xffffu : (1u << nj) - 1u);
            const __m512 bv = bias != nullptr ? _mm512_maskz_loadu_ps(keep, bias + jt) : _mm512_setzero_ps();
            for (int64_t b = 0; b < B; ++b) {
                const float* xb = x + b * in;
                __m512 acc[16];
                for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
                int64_t i = 0;
                for (; i + 16 <= in; i += 16) {
                    const __m512 xv = _mm512_loadu_ps(xb + i);
                    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(wr[j] + i), xv, acc[j]);
                }
                if (i < in) {
                    const __m512 xv = _mm512_maskz_loadu_ps(tail_in, xb + i);
                    for (int j = 0; j < 16; ++j)
                        acc[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_in, wr[j] + i), xv, acc[j]);
                }
                _mm512_mask_storeu_ps(y + b * out + jt, keep, _mm512_add_ps(hs::sum16(acc), bv));
            }
        }
        return;
    }
#endif
    using V = hs::Vec<T>;
    using VT = typename V::type;
    constexpr int L = V::lanes;
    for (int64_t b = 0; b < B; ++b) {
        const T* xb = x + b * in;
        for (int64_t j = j0; j < j1; ++j) {
            const T* w = W + j * in;
            VT a0 = V::zero(), a1 = V::zero();
            int64_t i = 0;
            for (; i + 2 * L <= in; i += 2 * L) {
                a0 += V::load(xb + i) * V::load(w + i);
                a1 += V::load(xb + i + L) * V::load(w + i + L);
            }
            for (; i + L <= in; i += L) a0 += V::load(xb + i) * V::load(w + i);
            a0 += a1;
            T s = 0;
            for (int l = 0; l < L; ++l) s += a0[l];
            for (; i < in; ++i) s += xb[i] * w[i];
            y[b * out + j] = bias != nullptr ? s + bias[j] : s;
        }
    }
}

// A projection is split over threads by output tiles only when each thread gets at least this
// many multiply-adds (below it, waking the pool costs more than the split saves).
constexpr int64_t kMinMacsPerThread = 1 << 18;

template <typename T>
bool linear(const T* x, int64_t B, int64_t in, const T* W, const T* bias, int64_t out, T* y, int threads) {
    const int64_t tiles = (out + 15) / 16;
    const int64_t macs = B * in * out;
    int n = threads < 1 ? 1 : threads;
    if (macs / kMinMacsPerThread < n) n = static_cast<int>(macs / kMinMacsPerThread);
    if (n <= 1 || tiles < 2) {
        linear_range<T>(x, B, in, W, bias, out, y, 0, out);
        return true;
    }
    std::vector<int64_t> weight(static_cast<size_t>(tiles + 1));
    for (int64_t t = 0; t <= tiles; ++t) weight[static_cast<size_t>(t)] = t;
    return hs::parallel_rows(tiles, n, weight, 1, [&](int64_t tb, int64_t te) {
        const int64_t e = te * 16 < out ? te * 16 : out;
        linear_range<T>(x, B, in, W, bias, out, y, tb * 16, e);
    });
}

// The default rotary embedding (as layers/attention.py's apply_rotary with ForwardContext.rope) on
// the first rd channels of each of the `heads` heads of every token's row x [B, heads * D]: angle
// position * theta^(-2i / rd), channel i < rd / 2 paired with i + rd / 2 (rotate_half).
template <typename T>
void rotate(T* x, int64_t B, int64_t heads, int64_t D, int64_t rd, double theta, const int64_t* positions) {
    const int64_t half = rd / 2;
    std::vector<T> cs(static_cast<size_t>(rd));  // cos | sin of one position
    for (int64_t b = 0; b < B; ++b) {
        const T p = static_cast<T>(positions[b]);
        for (int64_t i = 0; i < half; ++i) {
            const T inv = T(1) / std::pow(static_cast<T>(theta), static_cast<T>(2 * i) / static_cast<T>(rd));
            const T f = p * inv;
            cs[static_cast<size_t>(i)] = std::cos(f);
            cs[static_cast<size_t>(half + i)] = std::sin(f);
        }
        for (int64_t h = 0; h < heads; ++h) {
            T* v = x + (b * heads + h) * D;
            for (int64_t i = 0; i < half; ++i) {
                const T c = cs[static_cast<size_t>(i)], s = cs[static_cast<size_t>(half + i)];
                const T lo = v[i], hi = v[i + half];
                v[i] = lo * c - hi * s;
                v[i + half] = hi * c + lo * s;
            }
        }
    }
}

template <typename T>
inline T activate(T v, int64_t act) {
    if (act == kSilu) return hs::silu(v);
    const T r = v > T(0) ? v : T(0);
    return act == kRelu2 ? r * r : r;
}

// The activation of kActBatch values (times `mul`, the gated MLP's up projection, when given).
// Every value goes through this one fixed-width function (a row's short tail is padded), so the
// vectorised exp, which rounds differently from the scalar one, applies to all of them alike: a
// value does not depend on where in the step's buffer it sits (a row's bits do not depend on
// its batch). Not inlined, for the same reason.
constexpr int64_t kActBatch = 16;
template <typename T>
__attribute__((noinline)) void activate_block(T* v, const T* mul, int64_t act) {
    for (int64_t j = 0; j < kActBatch; ++j) {
        const T r = activate(v[j], act);
        v[j] = mul != nullptr ? r * mul[j] : r;
    }
}

template <typename T>
void activate_row(T* v, const T* mul, int64_t n, int64_t act) {
    int64_t i = 0;
    for (; i + kActBatch <= n; i += kActBatch) activate_block<T>(v + i, mul != nullptr ? mul + i : nullptr, act);
    if (i == n) return;
    T buf[kActBatch] = {}, mbuf[kActBatch] = {};
    for (int64_t j = 0; j < n - i; ++j) {
        buf[j] = v[i + j];
        if (mul != nullptr) mbuf[j] = mul[i + j];
    }
    activate_block<T>(buf, mul != nullptr ? mbuf : nullptr, act);
    for (int64_t j = 0; j < n - i; ++j) v[i + j] = buf[j];
}

// The state writes of a step's prefill rows (rows num_decodes .. R - 1) as hs_mamba_prefill takes
// them: per prefill row, the state after emit_token[e] goes to emit_slot[e] for each emit of the
// row (emit_row[e], a step row), and the state after its last token to write_slots[r, 0]; CSR
// over the prefill rows, sorted by token, at one token the emits first in their order (as
// kernels/native.py's mamba_prefill orders them). qsl is the prefill rows' own, from 0.
struct PrefillWrites {
    std::vector<int64_t> qsl, offsets, token, slot;
};

// 0, or 3 where an emit names a row that is not a prefill row or a token outside its row.
int prefill_writes(const int64_t* qsl, int64_t R, int64_t num_decodes, const int64_t* write_slots,
                   int64_t ws_stride, const int64_t* emit_row, const int64_t* emit_token, const int64_t* emit_slot,
                   int64_t num_emits, PrefillWrites& w) {
    const int64_t P = R - num_decodes, t0 = qsl[num_decodes];
    w.qsl.assign(static_cast<size_t>(P + 1), 0);
    w.offsets.assign(static_cast<size_t>(P + 1), 0);
    for (int64_t p = 0; p <= P; ++p) w.qsl[static_cast<size_t>(p)] = qsl[num_decodes + p] - t0;
    struct Write {
        int64_t row, token, slot;
    };
    std::vector<Write> all;
    all.reserve(static_cast<size_t>(num_emits + P));
    for (int64_t e = 0; e < num_emits; ++e) {
        const int64_t p = emit_row[e] - num_decodes;
        if (p < 0 || p >= P) return 3;
        const int64_t n = w.qsl[static_cast<size_t>(p + 1)] - w.qsl[static_cast<size_t>(p)];
        if (emit_token[e] < 0 || emit_token[e] >= n) return 3;
        all.push_back({p, emit_token[e], emit_slot[e]});
    }
    for (int64_t p = 0; p < P; ++p) {
        const int64_t n = w.qsl[static_cast<size_t>(p + 1)] - w.qsl[static_cast<size_t>(p)];
        if (n > 0) all.push_back({p, n - 1, write_slots[(num_decodes + p) * ws_stride]});
    }
    std::stable_sort(all.begin(), all.end(), [](const Write& a, const Write& b) {
        return a.row != b.row ? a.row < b.row : a.token < b.token;
    });
    w.token.resize(all.size());
    w.slot.resize(all.size());
    for (size_t k = 0; k < all.size(); ++k) {
        w.token[k] = all[k].token;
        w.slot[k] = all[k].slot;
        ++w.offsets[static_cast<size_t>(all[k].row + 1)];
    }
    for (int64_t p = 0; p < P; ++p) w.offsets[static_cast<size_t>(p + 1)] += w.offsets[static_cast<size_t>(p)];
    return 0;
}

// Everything the step reads that could be out of range, checked before anything is written
// (codes 1 to 3; 0: the step may run). Fills `pw` with the prefill rows' state writes.
int check_step(const int64_t* layers, int64_t num_layers, int64_t hidden, int64_t vocab, const int64_t* input_ids,
               const int64_t* positions, const int64_t* slot_mapping, const int64_t* block_table,
               int64_t bt_stride, const int64_t* read_slot, const int64_t* write_slots, int64_t ws_stride,
               const int64_t* qsl, const int64_t* logits_indices, int64_t R, int64_t num_decodes,
               const uint8_t* has_init, const int64_t* emit_row, const int64_t* emit_token, const int64_t* emit_slot,
               int64_t num_emits, int64_t num_logits, PrefillWrites& pw) {
    if (R <= 0 || hidden <= 0 || vocab <= 0 || num_layers < 0 || bt_stride < 0 || ws_stride < 1) return 1;
    if (num_decodes < 0 || num_decodes > R || num_emits < 0 || num_logits < 0) return 1;
    if (qsl[0] != 0) return 3;
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n = qsl[r + 1] - qsl[r];
        // a decode row: one token, or one verifying its drafts; a prefill row: any tokens
        if (n < 1 || (r < num_decodes && n > ws_stride)) return 3;
    }
    const int64_t T = qsl[R];
    for (int64_t i = 0; i < num_logits; ++i)  // (increasing and below T: at most T of them)
        if (logits_indices[i] < 0 || logits_indices[i] >= T || (i > 0 && logits_indices[i] <= logits_indices[i - 1]))
            return 3;
    for (int64_t t = 0; t < T; ++t)
        if (input_ids[t] < 0 || input_ids[t] >= vocab) return 2;
    if (prefill_writes(qsl, R, num_decodes, write_slots, ws_stride, emit_row, emit_token, emit_slot, num_emits, pw) != 0)
        return 3;
    // rows whose state slots overlap are not independent: the per-op path orders their reads and
    // writes (or falls back to the reference twins). (slot, row, token) of every write, sorted:
    // no slot written by two rows, or by a prefill row at two tokens (the prefill kernel refuses
    // that), none read by a row other than its writer. (Slot 0 is the null slot: writes to it
    // are skipped.)
    struct Write {
        int64_t slot, row, token;
        bool operator<(const Write& o) const {
            return slot != o.slot ? slot < o.slot : (row != o.row ? row < o.row : token < o.token);
        }
    };
    std::vector<Write> writes;
    for (int64_t r = 0; r < num_decodes; ++r)
        for (int64_t i = 0; i < qsl[r + 1] - qsl[r]; ++i)
            if (write_slots[r * ws_stride + i] != 0) writes.push_back({write_slots[r * ws_stride + i], r, i});
    for (int64_t p = 0; p < R - num_decodes; ++p)
        for (int64_t e = pw.offsets[static_cast<size_t>(p)]; e < pw.offsets[static_cast<size_t>(p + 1)]; ++e)
            if (pw.slot[static_cast<size_t>(e)] != 0)
                writes.push_back({pw.slot[static_cast<size_t>(e)], num_decodes + p, pw.token[static_cast<size_t>(e)]});
    std::sort(writes.begin(), writes.end());
    for (size_t k = 1; k < writes.size(); ++k) {
        const Write &a = writes[k - 1], &b = writes[k];
        if (a.slot != b.slot) continue;
        if (a.row != b.row || (b.row >= num_decodes && a.token != b.token)) return 3;
    }
    auto reads = [&](int64_t r) { return r < num_decodes || has_init[r] != 0; };
    for (int64_t c = 0; c < R; ++c) {
        if (!reads(c)) continue;
        auto it = std::lower_bound(writes.begin(), writes.end(), Write{read_slot[c], 0, 0});
        for (; it != writes.end() && it->slot == read_slot[c]; ++it)
            if (it->row != c) return 3;
    }
    for (int64_t l = 0; l < num_layers; ++l) {
        const int64_t* rec = layers + l * kFields;
        if (rec[0] == kMamba) {
            const int64_t slots = rec[13] < rec[15] ? rec[13] : rec[15];
            for (int64_t r = 0; r < R; ++r)
                if (reads(r) && (read_slot[r] < 0 || read_slot[r] >= slots)) return 2;
            for (const Write& w : writes)
                if (w.slot < 0 || w.slot >= slots) return 2;
        } else if (rec[0] == kAttention) {
            const int64_t blocks = rec[11], bs = rec[15];
            for (int64_t r = 0; r < R; ++r) {
                const int64_t* table = block_table + r * bt_stride;
                int64_t last = 0;
                for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) {
                    if (slot_mapping[t] < 0 || slot_mapping[t] >= blocks * bs) return 2;
                    if (positions[t] < 0 || positions[t] >= bt_stride * bs) return 2;
                    last = positions[t] > last ? positions[t] : last;
                }
                for (int64_t k = 0; k <= last / bs; ++k)
                    if (table[k] < 0 || table[k] >= blocks) return 2;
                // each new token's K / V go where its row reads its position from
                for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t)
                    if (table[positions[t] / bs] * bs + positions[t] % bs != slot_mapping[t]) return 3;
            }
        } else if (rec[0] != kMlp) {
            return 1;
        }
    }
    return 0;
}

// The arguments of a step, in the order of every entry point (and of decode_step.py's call).
#define HS_STEP_PARAMS(T)                                                                                  \
    const int64_t *layers, const double *layer_doubles, int64_t num_layers, int64_t hidden, int64_t vocab,  \
        const T *embed, const T *final_norm, double final_eps, const T *lm_head, const int64_t *input_ids,  \
        const int64_t *positions, const int64_t *slot_mapping, const int64_t *block_table, int64_t bt_stride, \
        const int64_t *read_slot, const int64_t *write_slots, int64_t ws_stride, const int64_t *qsl,         \
        const int64_t *logits_indices, int64_t R, int64_t num_decodes, const uint8_t *has_init,             \
        const int64_t *emit_row, const int64_t *emit_token, const int64_t *emit_slot, int64_t num_emits,     \
        int64_t num_logits, T *logits, int64_t *argmax, uint8_t *all_finite, int threads
#define HS_STEP_ARGS                                                                                         \
    layers, layer_doubles, num_layers, hidden, vocab, embed, final_norm, final_eps, lm_head, input_ids,       \
        positions, slot_mapping, block_table, bt_stride, read_slot, write_slots, ws_stride, qsl, logits_indices, R, \
        num_decodes, has_init, emit_row, emit_token, emit_slot, num_emits, num_logits, logits, argmax, all_finite, \
        threads

// check_step's arguments out of a step's
#define HS_CHECK_ARGS                                                                                   \
    layers, num_layers, hidden, vocab, input_ids, positions, slot_mapping, block_table, bt_stride, read_slot, \
        write_slots, ws_stride, qsl, logits_indices, R, num_decodes, has_init, emit_row, emit_token, emit_slot, \
        num_emits, num_logits

template <typename T>
int decode_step(HS_STEP_PARAMS(T)) {
    PrefillWrites pw;
    const int rc = check_step(HS_CHECK_ARGS, pw);
    if (rc != 0) return rc;
    const int64_t B = qsl[R];  // tokens: every projection runs on B rows of activations
    const int64_t Bd = qsl[num_decodes];  // the decode rows' tokens come first
    // the widest intermediate of any layer sizes the scratch buffers
    int64_t widest = hidden;
    for (int64_t l = 0; l < num_layers; ++l) {
        const int64_t* rec = layers + l * kFields;
        int64_t w = 0;
        if (rec[0] == kMamba) {
            const int64_t d_inner = rec[16] * rec[17];
            w = 2 * d_inner + 2 * rec[18] * rec[19] + rec[16];
        } else if (rec[0] == kAttention) {
            w = (rec[12] + 2 * rec[13]) * rec[14];
        } else {
            w = rec[6];
        }
        widest = w > widest ? w : widest;
    }
    std::vector<T> h(static_cast<size_t>(B * hidden)), xn(static_cast<size_t>(B * hidden)),
        mix(static_cast<size_t>(B * hidden));
    std::vector<T> a(static_cast<size_t>(B * widest)), c(static_cast<size_t>(B * widest)),
        d(static_cast<size_t>(B * widest));
    for (int64_t b = 0; b < B; ++b)
        std::memcpy(h.data() + b * hidden, embed + input_ids[b] * hidden, sizeof(T) * static_cast<size_t>(hidden));
    bool ok = true;
    for (int64_t l = 0; l < num_layers && ok; ++l) {
        const int64_t* rec = layers + l * kFields;
        const double* dbl = layer_doubles + l * kDoubles;
        if (Ops<T>::rms_norm(h.data(), hidden, cptr<T>(rec, 1), xn.data(), hidden, B, hidden, dbl[0]) != 0) return 5;
        if (rec[0] == kMamba) {
            const int64_t H = rec[16], P = rec[17], G = rec[18], N = rec[19], W = rec[20];
            const int64_t d_inner = H * P, conv_dim = d_inner + 2 * G * N, proj = d_inner + conv_dim + H;
            // a = [z | xBC | dt] per row; c = y; d = the gated norm's output
            ok = linear<T>(xn.data(), B, hidden, cptr<T>(rec, 2), cptr<T>(rec, 3), proj, a.data(), threads);
            const T* z = a.data();
            const T* xbc = a.data() + d_inner;
            const T* dt = a.data() + d_inner + conv_dim;
            int r = 0;
            if (num_decodes > 0)
                r = Ops<T>::mamba_decode(xbc, proj, dt, proj, cptr<T>(rec, 4), cptr<T>(rec, 5), mptr<T>(rec, 12),
                                         rec[13], cptr<T>(rec, 6), cptr<T>(rec, 7), cptr<T>(rec, 8),
                                         mptr<T>(rec, 14), rec[15], qsl, num_decodes, read_slot, write_slots,
                                         ws_stride, conv_dim, W, H, P, G, N, static_cast<int>(rec[21]), dbl[2],
                                         dbl[3], c.data(), threads);
            if (r != 0) return 5;
            if (num_decodes < R)  // the prefill rows: from their initial state, or from zeros
                r = Ops<T>::mamba_prefill(xbc + Bd * proj, proj, dt + Bd * proj, proj, cptr<T>(rec, 4),
                                          cptr<T>(rec, 5), mptr<T>(rec, 12), rec[13], cptr<T>(rec, 6),
                                          cptr<T>(rec, 7), cptr<T>(rec, 8), mptr<T>(rec, 14), rec[15], pw.qsl.data(),
                                          R - num_decodes, read_slot + num_decodes, has_init + num_decodes,
                                          pw.offsets.data(), pw.token.data(), pw.slot.data(), conv_dim, W, H, P, G,
                                          N, static_cast<int>(rec[21]), dbl[2], dbl[3], c.data() + Bd * d_inner,
                                          threads);
            if (r != 0) return 5;
            r = Ops<T>::gated_rms_norm(c.data(), d_inner, z, proj, cptr<T>(rec, 9), d.data(), d_inner, B, d_inner,
                                       rec[22], dbl[1]);
            if (r != 0) return 5;
            ok = ok && linear<T>(d.data(), B, d_inner, cptr<T>(rec, 10), cptr<T>(rec, 11), hidden, mix.data(), threads);
        } else if (rec[0] == kAttention) {
            const int64_t H = rec[12], KVH = rec[13], D = rec[14], bs = rec[15];
            const int64_t qw = H * D, kw = KVH * D;
            // a = q; c = k | v per row (kw each); d = the attention output
            ok = linear<T>(xn.data(), B, hidden, cptr<T>(rec, 2), cptr<T>(rec, 3), qw, a.data(), threads) &&
                 linear<T>(xn.data(), B, hidden, cptr<T>(rec, 4), cptr<T>(rec, 5), kw, c.data(), threads) &&
                 linear<T>(xn.data(), B, hidden, cptr<T>(rec, 6), cptr<T>(rec, 7), kw, c.data() + B * kw, threads);
            if (rec[16] > 0) {
                rotate<T>(a.data(), B, H, D, rec[16], dbl[2], positions);
                rotate<T>(c.data(), B, KVH, D, rec[16], dbl[2], positions);
            }
            T* kv = mptr<T>(rec, 10);
            for (int64_t b = 0; b < B; ++b) {
                const int64_t blk = slot_mapping[b] / bs, off = slot_mapping[b] % bs;
                T* kdst = kv + ((blk * 2 + 0) * bs + off) * kw;
                T* vdst = kv + ((blk * 2 + 1) * bs + off) * kw;
                std::memcpy(kdst, c.data() + b * kw, sizeof(T) * static_cast<size_t>(kw));
                std::memcpy(vdst, c.data() + B * kw + b * kw, sizeof(T) * static_cast<size_t>(kw));
            }
            const int r = Ops<T>::paged_attention(a.data(), kv, d.data(), block_table, bt_stride, qsl, positions,
                                                  R, B, rec[11], H, KVH, D, bs, dbl[1], threads);
            if (r != 0) return 5;
            ok = ok && linear<T>(d.data(), B, qw, cptr<T>(rec, 8), cptr<T>(rec, 9), hidden, mix.data(), threads);
        } else if (rec[0] == kMlp) {
            const int64_t inter = rec[6];
            if (rec[8] != 0) {  // gated: a = act(gate(x)) * up(x)
                ok = linear<T>(xn.data(), B, hidden, cptr<T>(rec, 8), cptr<T>(rec, 9), inter, a.data(), threads) &&
                     linear<T>(xn.data(), B, hidden, cptr<T>(rec, 2), cptr<T>(rec, 3), inter, c.data(), threads);
                for (int64_t b = 0; b < B; ++b) activate_row<T>(a.data() + b * inter, c.data() + b * inter, inter, rec[7]);
            } else {
                ok = linear<T>(xn.data(), B, hidden, cptr<T>(rec, 2), cptr<T>(rec, 3), inter, a.data(), threads);
                for (int64_t b = 0; b < B; ++b) activate_row<T>(a.data() + b * inter, nullptr, inter, rec[7]);
            }
            ok = ok && linear<T>(a.data(), B, inter, cptr<T>(rec, 4), cptr<T>(rec, 5), hidden, mix.data(), threads);
        } else {
            return 5;
        }
        for (int64_t i = 0; i < B * hidden; ++i) h[static_cast<size_t>(i)] += mix[static_cast<size_t>(i)];
    }
    if (!ok) return 5;
    // the final norm and the LM head of the tokens whose logits are asked (each row's own: the
    // bits of a token's logits do not depend on which others are asked)
    const int64_t L = num_logits;
    for (int64_t i = 0; i < L; ++i)
        std::memcpy(a.data() + i * hidden, h.data() + logits_indices[i] * hidden, sizeof(T) * static_cast<size_t>(hidden));
    if (L > 0 && Ops<T>::rms_norm(a.data(), hidden, final_norm, xn.data(), hidden, L, hidden, final_eps) != 0) return 5;
    if (L > 0 && !linear<T>(xn.data(), L, hidden, lm_head, nullptr, vocab, logits, threads)) return 5;
    for (int64_t b = 0; b < L; ++b) {
        const T* row = logits + b * vocab;
        int64_t best = 0;
        bool finite = true;
        for (int64_t j = 0; j < vocab; ++j) {
            finite = finite && hs::is_finite(row[j]);
            if (row[j] > row[best]) best = j;
        }
        argmax[b] = best;
        all_finite[b] = finite ? 1 : 0;
    }
    return 0;
}

// A step in the caller; an exception (out of memory) is code 4.
template <typename T>
int guarded_step(HS_STEP_PARAMS(T)) {
    try {
        return decode_step<T>(HS_STEP_ARGS);
    } catch (...) {
        return 4;
    }
}

// The same step on the background thread (cpu_background.h): the checks that leave the caches
// untouched run here, in the caller, and return their code (1 to 3) with nothing posted; 0 means
// the step was posted and hs_decode_step_wait gives its code; 6 means nothing was posted because
// a step is already out (another engine's) or the thread cannot start: the caller runs it itself.
// Every array must stay alive and unchanged until the wait returns.
template <typename T>
int launch_step(HS_STEP_PARAMS(T)) {
    PrefillWrites pw;
    const int rc = check_step(HS_CHECK_ARGS, pw);
    if (rc != 0) return rc;
    try {
        return hs::background().post([=] { return guarded_step<T>(HS_STEP_ARGS); }) ? 0 : 6;
    } catch (...) {
        return 6;
    }
}

}  // namespace

extern "C" {

#define HS_DECODE_STEP(SUF, T)                                                                            \
    int hs_decode_step_##SUF(HS_STEP_PARAMS(T)) { return guarded_step<T>(HS_STEP_ARGS); }                \
    int hs_decode_step_launch_##SUF(HS_STEP_PARAMS(T)) { return launch_step<T>(HS_STEP_ARGS); }

HS_DECODE_STEP(f32, float)
HS_DECODE_STEP(f64, double)

#undef HS_DECODE_STEP
#undef HS_STEP_PARAMS
#undef HS_STEP_ARGS
#undef HS_CHECK_ARGS

// The code of the step hs_decode_step_launch_* posted (as hs_decode_step_* returns it), once it
// has run; -1 if none is out.
int hs_decode_step_wait() { return hs::background().wait(); }

}  // extern "C"
