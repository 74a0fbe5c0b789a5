// The Mamba2 mixer's decode / verify tokens on the CPU (hybridserve.kernels.native): causal
// conv1d update and selective state update in one pass, the part of the mixer between in_proj's
// split and the gated norm. The arithmetic of reference.causal_conv1d_update followed by
// reference.selective_state_update:
//   conv:   out_c = sum_k window_c[k] * w_c[k] (+ b_c), silu; the window (W - 1 last inputs) after
//           token t goes to write_slots[r, t]
//   state:  dt_h = clamp(softplus(dt_h + dt_bias_h)), h = exp(dt_h A_h) h + dt_h x_h B_g^T,
//           y_h = h C_g + D_h x_h; the state after token t goes to write_slots[r, t]
// Slot 0 is the null slot: writes to it are skipped. A row reads its read_slot before it writes
// anything. Layouts (contiguous unless a stride is passed):
//   xbc [n, conv_dim] with row stride xbc_stride; dt [n, H] with row stride dt_stride
//   conv_w [conv_dim, W]; conv_b [conv_dim] or null; conv_state [slots, conv_dim, W - 1]
//   A (already -exp(A_log)), D, dt_bias [H]; ssm_state [slots, H, P, N]
//   qsl [R + 1] from 0; read_slot [R]; write_slots [R, ws_stride]; y [n, H, P]
// Return codes: 0 ok, 1 bad shapes, 2 a slot or row range out of bounds (nothing was written),
// 3 a row would read a slot that an earlier row of the call writes (the caller then takes the
// reference path, which reads every row's state before any write).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace {

template <typename T>
inline T softplus20(T v) {
    return v > T(20) ? v : std::log1p(std::exp(v));
}

// exp's argument is capped so that no inf appears (the library is built with -ffast-math, which
// assumes none): below -80, silu is within 1e-33 of 0 either way.
template <typename T>
inline T silu(T v) {
    const T e = -v < T(80) ? -v : T(80);
    return v / (T(1) + std::exp(e));
}

int check(const int64_t* qsl, int64_t R, const int64_t* read_slot, const int64_t* write_slots, int64_t ws_stride,
          int64_t num_slots) {
    if (R > 0 && qsl[0] != 0) return 2;
    std::unordered_map<int64_t, int64_t> last_reader;  // slot -> last row that reads it
    last_reader.reserve(static_cast<size_t>(R) * 2);
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n = qsl[r + 1] - qsl[r];
        if (n < 0 || n > ws_stride) return 2;
        if (read_slot[r] < 0 || read_slot[r] >= num_slots) return 2;
        last_reader[read_slot[r]] = r;
        for (int64_t t = 0; t < n; ++t) {
            const int64_t s = write_slots[r * ws_stride + t];
            if (s < 0 || s >= num_slots) return 2;
        }
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t n = qsl[r + 1] - qsl[r];
        for (int64_t t = 0; t < n; ++t) {
            const int64_t s = write_slots[r * ws_stride + t];
            if (s == 0) continue;
            auto it = last_reader.find(s);
            if (it != last_reader.end() && it->second > r) return 3;
        }
    }
    return 0;
}

template <typename T, int NC>
void decode(const T* xbc, int64_t xbc_stride, const T* dt, int64_t dt_stride, const T* conv_w, const T* conv_b,
            T* conv_state, const T* A, const T* Dskip, const T* dt_bias, T* ssm_state, const int64_t* qsl,
            int64_t R, const int64_t* read_slot, const int64_t* write_slots, int64_t ws_stride, int64_t conv_dim,
            int64_t W, int64_t H, int64_t P, int64_t G, int64_t N_runtime, int64_t d_inner, bool act, T dt_min,
            bool clamp_max, T dt_max, T* y) {
    const int64_t N = NC > 0 ? NC : N_runtime;
    const int64_t S = W - 1;
    const int64_t hpg = H / G;
    const int64_t state_stride = H * P * N;
    std::vector<T> window(static_cast<size_t>(conv_dim * (S > 0 ? S : 1)));
    std::vector<T> conv_out;  // [n, conv_dim]
    std::vector<T> h(static_cast<size_t>(P * N));
    for (int64_t r = 0; r < R; ++r) {
        const int64_t t0 = qsl[r], n = qsl[r + 1] - qsl[r];
        if (n == 0) continue;
        const int64_t* ws = write_slots + r * ws_stride;
        // conv update over the row's tokens
        conv_out.resize(static_cast<size_t>(n * conv_dim));
        if (S > 0)
            std::memcpy(window.data(), conv_state + read_slot[r] * conv_dim * S,
                        sizeof(T) * static_cast<size_t>(conv_dim * S));
        for (int64_t t = 0; t < n; ++t) {
            const T* xt = xbc + (t0 + t) * xbc_stride;
            T* co = conv_out.data() + t * conv_dim;
            for (int64_t c = 0; c < conv_dim; ++c) {
                T* win = window.data() + c * S;
                const T* wc = conv_w + c * W;
                T o = S > 0 ? win[0] * wc[0] : xt[c] * wc[0];
                for (int64_t k = 1; k < S; ++k) o += win[k] * wc[k];
                if (S > 0) o += xt[c] * wc[S];
                if (conv_b != nullptr) o += conv_b[c];
                co[c] = act ? silu(o) : o;
                for (int64_t k = 0; k + 1 < S; ++k) win[k] = win[k + 1];
                if (S > 0) win[S - 1] = xt[c];
            }
            if (ws[t] != 0 && S > 0)
                std::memcpy(conv_state + ws[t] * conv_dim * S, window.data(),
                            sizeof(T) * static_cast<size_t>(conv_dim * S));
        }
        // state update, one head at a time over the row's tokens
        for (int64_t hd = 0; hd < H; ++hd) {
            const int64_t g = hd / hpg;
            std::memcpy(h.data(), ssm_state + read_slot[r] * state_stride + hd * P * N,
                        sizeof(T) * static_cast<size_t>(P * N));
            for (int64_t t = 0; t < n; ++t) {
                const T* co = conv_out.data() + t * conv_dim;
                const T* x = co + hd * P;
                const T* B = co + d_inner + g * N;
                const T* C = co + d_inner + G * N + g * N;
                T d = softplus20(dt[(t0 + t) * dt_stride + hd] + dt_bias[hd]);
                d = d < dt_min ? dt_min : d;
                if (clamp_max && d > dt_max) d = dt_max;
                const T a = std::exp(d * A[hd]);
                T* yo = y + ((t0 + t) * H + hd) * P;
                for (int64_t p = 0; p < P; ++p) {
                    T* hp = h.data() + p * N;
                    const T coef = d * x[p];
                    T acc = 0;
                    for (int64_t k = 0; k < N; ++k) {
                        hp[k] = hp[k] * a + coef * B[k];
                        acc += hp[k] * C[k];
                    }
                    yo[p] = acc + Dskip[hd] * x[p];
                }
                if (ws[t] != 0)
                    std::memcpy(ssm_state + ws[t] * state_stride + hd * P * N, h.data(),
                                sizeof(T) * static_cast<size_t>(P * N));
            }
        }
    }
}

template <typename T>
int run(const T* xbc, int64_t xbc_stride, const T* dt, int64_t dt_stride, const T* conv_w, const T* conv_b,
        T* conv_state, int64_t num_conv_slots, const T* A, const T* Dskip, const T* dt_bias, T* ssm_state,
        int64_t num_ssm_slots, const int64_t* qsl, int64_t R, const int64_t* read_slot, const int64_t* write_slots,
        int64_t ws_stride, int64_t conv_dim, int64_t W, int64_t H, int64_t P, int64_t G, int64_t N,
        int64_t d_inner, int act, double dt_min, double dt_max, T* y) {
    // dt_max < 0 means no upper clamp (an infinite bound is not passed: see silu)
    if (W < 1 || H <= 0 || P <= 0 || G <= 0 || N <= 0 || H % G != 0 || conv_dim != d_inner + 2 * G * N ||
        d_inner != H * P)
        return 1;
    const int64_t num_slots = num_conv_slots < num_ssm_slots ? num_conv_slots : num_ssm_slots;
    const int rc = check(qsl, R, read_slot, write_slots, ws_stride, num_slots);
    if (rc != 0) return rc;
    const T lo = static_cast<T>(dt_min);
    const bool clamp_max = dt_max >= 0;
    const T hi = static_cast<T>(clamp_max ? dt_max : 0.0);
#define HS_DECODE(NC)                                                                                            \
    decode<T, NC>(xbc, xbc_stride, dt, dt_stride, conv_w, conv_b, conv_state, A, Dskip, dt_bias, ssm_state, qsl, \
                  R, read_slot, write_slots, ws_stride, conv_dim, W, H, P, G, N, d_inner, act != 0, lo, clamp_max, hi, y)
    switch (N) {
        case 16: HS_DECODE(16); break;
        case 32: HS_DECODE(32); break;
        case 64: HS_DECODE(64); break;
        case 128: HS_DECODE(128); break;
        default: HS_DECODE(0);
    }
#undef HS_DECODE
    return 0;
}

}  // namespace

extern "C" {

#define HS_MAMBA_DECODE(NAME, T)                                                                                 \
    int NAME(const T* xbc, int64_t xbc_stride, const T* dt, int64_t dt_stride, const T* conv_w, const T* conv_b, \
             T* conv_state, int64_t num_conv_slots, const T* A, const T* Dskip, const T* dt_bias, T* ssm_state,  \
             int64_t num_ssm_slots, const int64_t* qsl, int64_t R, const int64_t* read_slot,                     \
             const int64_t* write_slots, int64_t ws_stride, int64_t conv_dim, int64_t W, int64_t H, int64_t P,   \
             int64_t G, int64_t N, int64_t d_inner, int act, double dt_min, double dt_max, T* y) {               \
        return run<T>(xbc, xbc_stride, dt, dt_stride, conv_w, conv_b, conv_state, num_conv_slots, A, Dskip,      \
                      dt_bias, ssm_state, num_ssm_slots, qsl, R, read_slot, write_slots, ws_stride, conv_dim, W, \
                      H, P, G, N, d_inner, act, dt_min, dt_max, y);                                               \
    }

HS_MAMBA_DECODE(hs_mamba_decode_f32, float)
HS_MAMBA_DECODE(hs_mamba_decode_f64, double)

#undef HS_MAMBA_DECODE

}  // extern "C"
