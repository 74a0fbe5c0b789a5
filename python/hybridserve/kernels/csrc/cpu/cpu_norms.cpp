// RMSNorm and the Mamba2 mixer's grouped gated RMSNorm on the CPU (hybridserve.kernels.native),
// one pass per row instead of the half-dozen tensor ops of model/layers/norm.py:
//   rms_norm:        out = w * x / sqrt(mean(x^2) + eps)
//   gated_rms_norm:  h = y * silu(z); out = w * h / sqrt(mean over the group(h^2) + eps), the mean
//                    taken over groups of group_size channels
// x, y, z, out: [rows, d] with row strides (unit stride inside a row); w: [d]. Float32 and float64
// (the dtype norm.py computes in for those inputs), and bfloat16 rows with float32 weights
// (computed in float32, as norm.py does, and rounded once).

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

// The arithmetic of one row, shared by every storage type: a bfloat16 row is widened into float
// buffers first, so its result is exactly the float32 kernel's on the widened values, rounded
// once. Not inlined, so that both callers run the same instructions.
template <typename T>
__attribute__((noinline)) void rms_norm_row(const T* x, const T* w, T* o, int64_t d, T eps) {
    T ss = 0;
    for (int64_t c = 0; c < d; ++c) ss += x[c] * x[c];
    const T inv = T(1) / std::sqrt(ss / static_cast<T>(d) + eps);
    for (int64_t c = 0; c < d; ++c) o[c] = w[c] * (x[c] * inv);
}

// h = y * silu(z), normalised over groups of group_size channels
template <typename T>
__attribute__((noinline)) void gated_rms_norm_row(const T* y, const T* z, const T* w, T* h, T* o, int64_t d,
                                                  int64_t group_size, T eps) {
    for (int64_t c = 0; c < d; ++c) h[c] = y[c] * hs::silu(z[c]);
    for (int64_t g0 = 0; g0 < d; g0 += group_size) {
        const T* hg = h + g0;
        T ss = 0;
        for (int64_t c = 0; c < group_size; ++c) ss += hg[c] * hg[c];
        const T inv = T(1) / std::sqrt(ss / static_cast<T>(group_size) + eps);
        for (int64_t c = 0; c < group_size; ++c) o[g0 + c] = w[g0 + c] * (hg[c] * inv);
    }
}

// Row r of a [rows, d] tensor of storage type S, as T: the row itself where S is T, else its
// widened copy in buf.
template <typename T, typename S>
inline const T* row_as(const S* p, T* buf, int64_t d) {
    if constexpr (std::is_same_v<S, T>) {
        (void)buf, (void)d;
        return p;
    } else {
        for (int64_t c = 0; c < d; ++c) buf[c] = hs::widen(p[c]);
        return buf;
    }
}

// A row computed in T into buf, stored as S (a bfloat16 row rounded once).
template <typename T, typename S>
inline void store_row(const T* buf, S* p, int64_t d) {
    for (int64_t c = 0; c < d; ++c) p[c] = hs::narrow<S>(buf[c]);
}

// x, out in S; w in T (the caller widens the weights once)
template <typename T, typename S>
void rms_norm(const S* x, int64_t x_stride, const T* w, S* out, int64_t out_stride, int64_t rows, int64_t d,
              T eps) {
    constexpr bool same = std::is_same_v<S, T>;
    std::vector<T> xbuf(same ? 0 : static_cast<size_t>(d)), obuf(same ? 0 : static_cast<size_t>(d));
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = row_as<T>(x + r * x_stride, xbuf.data(), d);
        if constexpr (same) {
            rms_norm_row<T>(xr, w, out + r * out_stride, d, eps);
        } else {
            rms_norm_row<T>(xr, w, obuf.data(), d, eps);
            store_row(obuf.data(), out + r * out_stride, d);
        }
    }
}

template <typename T, typename S>
void gated_rms_norm(const S* y, int64_t y_stride, const S* z, int64_t z_stride, const T* w, S* out,
                    int64_t out_stride, int64_t rows, int64_t d, int64_t group_size, T eps) {
    constexpr bool same = std::is_same_v<S, T>;
    const size_t n = same ? 0 : static_cast<size_t>(d);
    std::vector<T> h(static_cast<size_t>(d)), ybuf(n), zbuf(n), obuf(n);
    for (int64_t r = 0; r < rows; ++r) {
        const T* yr = row_as<T>(y + r * y_stride, ybuf.data(), d);
        const T* zr = row_as<T>(z + r * z_stride, zbuf.data(), d);
        if constexpr (same) {
            gated_rms_norm_row<T>(yr, zr, w, h.data(), out + r * out_stride, d, group_size, eps);
        } else {
            gated_rms_norm_row<T>(yr, zr, w, h.data(), obuf.data(), d, group_size, eps);
            store_row(obuf.data(), out + r * out_stride, d);
        }
    }
}

}  // namespace

extern "C" {

// Return codes: 0 ok, 1 bad shapes, 4 out of memory (a row buffer could not be allocated).
#define HS_NORMS(SUF, T, S)                                                                                       \
    int hs_rms_norm_##SUF(const S* x, int64_t x_stride, const T* w, S* out, int64_t out_stride, int64_t rows,     \
                          int64_t d, double eps) {                                                                \
        if (rows < 0 || d <= 0) return 1;                                                                         \
        try {                                                                                                     \
            rms_norm<T, S>(x, x_stride, w, out, out_stride, rows, d, static_cast<T>(eps));                        \
        } catch (...) {                                                                                           \
            return 4;                                                                                             \
        }                                                                                                         \
        return 0;                                                                                                 \
    }                                                                                                             \
    int hs_gated_rms_norm_##SUF(const S* y, int64_t y_stride, const S* z, int64_t z_stride, const T* w, S* out,   \
                                int64_t out_stride, int64_t rows, int64_t d, int64_t group_size, double eps) {    \
        if (rows < 0 || d <= 0 || group_size <= 0 || d % group_size != 0) return 1;                               \
        try {                                                                                                     \
            gated_rms_norm<T, S>(y, y_stride, z, z_stride, w, out, out_stride, rows, d, group_size,               \
                                 static_cast<T>(eps));                                                            \
        } catch (...) {                                                                                           \
            return 4;                                                                                             \
        }                                                                                                         \
        return 0;                                                                                                 \
    }

HS_NORMS(f32, float, float)
HS_NORMS(f64, double, double)
HS_NORMS(bf16, float, hs::bf16)

#undef HS_NORMS

}  // extern "C"
