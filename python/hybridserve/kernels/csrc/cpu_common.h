// Helpers shared by the CPU kernels (hybridserve.kernels.native).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace hs {

// One 64-byte vector (GCC's vector extension: kept in registers, unlike a small array).
template <typename T>
struct Vec {
    typedef T type __attribute__((vector_size(64)));
    static constexpr int lanes = 64 / static_cast<int>(sizeof(T));
    static inline type load(const T* p) {
        type v;
        std::memcpy(&v, p, sizeof(v));
        return v;
    }
    static inline void store(T* p, type v) { std::memcpy(p, &v, sizeof(v)); }
    static inline type zero() { return type{} * T(0); }
};

// exp's argument is capped so that no inf appears (the library is built with -ffast-math, which
// assumes none): below -80, silu is within 1e-33 of 0 either way.
template <typename T>
inline T silu(T v) {
    const T e = -v < T(80) ? -v : T(80);
    return v / (T(1) + std::exp(e));
}

#ifdef __AVX512F__

// acc[j] holds 16 partial sums of value j: returns the 16 sums, value j in lane j. A reduction
// tree of 15 shuffle-adds instead of 16 horizontal sums.
inline __m512 sum16(const __m512 (&acc)[16]) {
    // within each 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] for value pairs (a, b)
    __m512 s1[8];
    for (int j = 0; j < 8; ++j)
        s1[j] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * j], acc[2 * j + 1]),
                              _mm512_unpackhi_ps(acc[2 * j], acc[2 * j + 1]));
    // within each lane: the lane's sums of values 4m .. 4m + 3
    __m512 s2[4];
    for (int j = 0; j < 4; ++j) {
        const __m512d x = _mm512_castps_pd(s1[2 * j]), y = _mm512_castps_pd(s1[2 * j + 1]);
        s2[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // across lanes
    __m512 s3[2];
    for (int j = 0; j < 2; ++j)
        s3[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * j], s2[2 * j + 1], 0x88),
                              _mm512_shuffle_f32x4(s2[2 * j], s2[2 * j + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], 0x88), _mm512_shuffle_f32x4(s3[0], s3[1], 0xDD));
}

#endif

}  // namespace hs
