// SIMD helpers shared by the CPU kernels (hybridserve.kernels.native).
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

namespace hs {

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

}  // namespace hs
#endif
