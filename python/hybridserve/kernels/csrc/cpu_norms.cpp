// RMSNorm and the Mamba2 mixer's grouped gated RMSNorm on the CPU (hybridserve.kernels.native),
// one pass per row instead of the half-dozen tensor ops of model/layers/norm.py:
//   rms_norm:        out = w * x / sqrt(mean(x^2) + eps)
//   gated_rms_norm:  h = y * silu(z); out = w * h / sqrt(mean over the group(h^2) + eps), the mean
//                    taken over groups of group_size channels
// x, y, z, out: [rows, d] with row strides (unit stride inside a row); w: [d]. Float32 and float64
// (the dtype norm.py computes in for those inputs).

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace {

template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* w, T* out, int64_t out_stride, int64_t rows, int64_t d,
              T eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * x_stride;
        T* o = out + r * out_stride;
        T ss = 0;
        for (int64_t c = 0; c < d; ++c) ss += xr[c] * xr[c];
        const T inv = T(1) / std::sqrt(ss / static_cast<T>(d) + eps);
        for (int64_t c = 0; c < d; ++c) o[c] = w[c] * (xr[c] * inv);
    }
}

template <typename T>
void gated_rms_norm(const T* y, int64_t y_stride, const T* z, int64_t z_stride, const T* w, T* out,
                    int64_t out_stride, int64_t rows, int64_t d, int64_t group_size, T eps) {
    std::vector<T> h(static_cast<size_t>(d));
    for (int64_t r = 0; r < rows; ++r) {
        const T* yr = y + r * y_stride;
        const T* zr = z + r * z_stride;
        T* o = out + r * out_stride;
        for (int64_t c = 0; c < d; ++c) h[static_cast<size_t>(c)] = yr[c] * hs::silu(zr[c]);
        for (int64_t g0 = 0; g0 < d; g0 += group_size) {
            const T* hg = h.data() + g0;
            T ss = 0;
            for (int64_t c = 0; c < group_size; ++c) ss += hg[c] * hg[c];
            const T inv = T(1) / std::sqrt(ss / static_cast<T>(group_size) + eps);
            for (int64_t c = 0; c < group_size; ++c) o[g0 + c] = w[g0 + c] * (hg[c] * inv);
        }
    }
}

}  // namespace

extern "C" {

#define HS_NORMS(SUF, T)                                                                                          \
    int hs_rms_norm_##SUF(const T* x, int64_t x_stride, const T* w, T* out, int64_t out_stride, int64_t rows,     \
                          int64_t d, double eps) {                                                                \
        if (rows < 0 || d <= 0) return 1;                                                                         \
        rms_norm<T>(x, x_stride, w, out, out_stride, rows, d, static_cast<T>(eps));                               \
        return 0;                                                                                                 \
    }                                                                                                             \
    int hs_gated_rms_norm_##SUF(const T* y, int64_t y_stride, const T* z, int64_t z_stride, const T* w, T* out,   \
                                int64_t out_stride, int64_t rows, int64_t d, int64_t group_size, double eps) {    \
        if (rows < 0 || d <= 0 || group_size <= 0 || d % group_size != 0) return 1;                               \
        try {                                                                                                     \
            gated_rms_norm<T>(y, y_stride, z, z_stride, w, out, out_stride, rows, d, group_size,                  \
                              static_cast<T>(eps));                                                               \
        } catch (...) { /* the row buffer could not be allocated */                                             \
            return 4;                                                                                             \
        }                                                                                                         \
        return 0;                                                                                                 \
    }

HS_NORMS(f32, float)
HS_NORMS(f64, double)

#undef HS_NORMS

}  // extern "C"
