// Helpers shared by the CPU kernels (hybridserve.kernels.native).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace hs {

// The widest vector register the kernels are compiled for (-march=native), in bytes. A wider
// GCC vector than the machine's registers is split into several, and a loop that keeps a few of
// them live spills them to the stack on every iteration.
#if defined(__AVX512F__)
inline constexpr int kVecBytes = 64;
#elif defined(__AVX__)
inline constexpr int kVecBytes = 32;
#else
inline constexpr int kVecBytes = 16;
#endif

// One register's vector (GCC's vector extension: kept in registers, unlike a small array).
template <typename T>
struct Vec {
    typedef T type __attribute__((vector_size(kVecBytes)));
    static constexpr int lanes = kVecBytes / static_cast<int>(sizeof(T));
    static inline type load(const T* p) {
        type v;
        std::memcpy(&v, p, sizeof(v));
        return v;
    }
    static inline void store(T* p, type v) { std::memcpy(p, &v, sizeof(v)); }
    static inline type zero() { return type{} * T(0); }
};

// Whether v is a NaN, or finite, read from its bits: under -ffast-math the compiler assumes no
// NaN and no infinity, so `v != v`, std::isfinite and comparisons cannot tell (a comparison may
// even turn a NaN into a number).
inline bool is_nan(float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    return (u & 0x7fffffffu) > 0x7f800000u;
}
inline bool is_nan(double v) {
    uint64_t u;
    std::memcpy(&u, &v, sizeof(u));
    return (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
}
inline bool is_finite(float v) {
    uint32_t u;
    std::memcpy(&u, &v, sizeof(u));
    return (u & 0x7f800000u) != 0x7f800000u;
}
inline bool is_finite(double v) {
    uint64_t u;
    std::memcpy(&u, &v, sizeof(u));
    return (u & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

// bfloat16 storage (the upper half of a float32), for tensors the kernels read and write in
// bfloat16 while computing in float32.
struct bf16 {
    uint16_t bits;
};

// float8 storage of a KV cache narrower than the model (--kv-cache-dtype fp8_e4m3 / fp8_e5m2),
// read only: each of the 256 values is widened exactly through a table.
struct fp8e4m3 {
    uint8_t bits;
};
struct fp8e5m2 {
    uint8_t bits;
};

// The float of each byte, as torch's .to(torch.float32) of float8_e4m3fn (bias 7, subnormals,
// no infinities, S.1111.111 NaN) and float8_e5m2 (bias 15, IEEE-like: infinities and NaNs).
template <int kExpBits>
struct Fp8Table {
    float value[256];
    Fp8Table() {
        constexpr int man_bits = 7 - kExpBits;
        constexpr int bias = (1 << (kExpBits - 1)) - 1;
        constexpr int exp_max = (1 << kExpBits) - 1;
        for (int b = 0; b < 256; ++b) {
            const int sign = b >> 7, e = (b >> man_bits) & exp_max, m = b & ((1 << man_bits) - 1);
            float v;
            if (kExpBits == 4 && e == exp_max && m == (1 << man_bits) - 1) v = NAN;
            else if (kExpBits == 5 && e == exp_max) v = m == 0 ? INFINITY : NAN;
            else if (e == 0) v = std::ldexp(static_cast<float>(m), 1 - bias - man_bits);
            else v = std::ldexp(static_cast<float>(m + (1 << man_bits)), e - bias - man_bits);
            value[b] = sign ? -v : v;
        }
    }
};
// Built when the library is loaded (not on first use: a function-local static would put a guard
// check in front of every value a scalar loop widens).
inline const Fp8Table<4> kFp8E4M3Table{};
inline const Fp8Table<5> kFp8E5M2Table{};
inline const float* fp8_table(fp8e4m3) { return kFp8E4M3Table.value; }
inline const float* fp8_table(fp8e5m2) { return kFp8E5M2Table.value; }

template <typename S>
inline constexpr bool is_fp8 = std::is_same_v<S, fp8e4m3> || std::is_same_v<S, fp8e5m2>;

inline float widen(float v) { return v; }
inline double widen(double v) { return v; }
inline float widen(bf16 v) {
    const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}
inline float widen(fp8e4m3 v) { return fp8_table(v)[v.bits]; }
inline float widen(fp8e5m2 v) { return fp8_table(v)[v.bits]; }

// T -> storage type S; for bfloat16 round to nearest even, as torch's .to(torch.bfloat16) (NaN
// stays a quiet NaN).
template <typename S, typename T>
inline S narrow(T v) {
    if constexpr (std::is_same_v<S, bf16>) {
        const float f = static_cast<float>(v);
        uint32_t u;
        std::memcpy(&u, &f, sizeof(u));
        if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
        u += 0x7fffu + ((u >> 16) & 1u);
        return bf16{static_cast<uint16_t>(u >> 16)};
    } else {
        return static_cast<S>(v);
    }
}

// One vector of T from Vec<T>::lanes values of storage type S (S = T, or bfloat16 or float8 for
// float).
template <typename T, typename S>
inline typename Vec<T>::type load_as(const S* p) {
    if constexpr (std::is_same_v<S, T>) {
        return Vec<T>::load(p);
    } else if constexpr (is_fp8<S>) {
        static_assert(std::is_same_v<T, float>, "float8 is read as float");
        typename Vec<T>::type v;
#ifdef __AVX512F__
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m512 w = _mm512_i32gather_ps(idx, fp8_table(S{}), 4);
        std::memcpy(&v, &w, sizeof(v));
#else
        for (int i = 0; i < Vec<T>::lanes; ++i) v[i] = widen(p[i]);
#endif
        return v;
    } else {
        static_assert(std::is_same_v<T, float> && std::is_same_v<S, bf16>, "bf16 is read as float");
        typename Vec<T>::type v;
#ifdef __AVX512F__
        const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
        std::memcpy(&v, &w, sizeof(v));
#else
        for (int i = 0; i < Vec<T>::lanes; ++i) v[i] = widen(p[i]);
#endif
        return v;
    }
}

// Copies `bytes` bytes of a state into a pool slot the step has not read (a verify token's
// window slot; the final or emitted state of a prefill row too short for the transposed update):
// with non-temporal stores where the AVX-512 path applies,
// so the stores do not first read the slot's old lines from memory (which doubled the traffic of
// a verify step). Whoever calls it issues stream_fence() before the kernel returns.
inline void copy_to_unread_slot(void* dst, const void* src, size_t bytes) {
#ifdef __AVX512F__
    if (reinterpret_cast<uintptr_t>(dst) % 64 == 0 && bytes % 64 == 0) {
        char* d = static_cast<char*>(dst);
        const char* s = static_cast<const char*>(src);
        for (size_t off = 0; off < bytes; off += 64)
            _mm512_stream_si512(reinterpret_cast<__m512i*>(d + off), _mm512_loadu_si512(s + off));
        return;
    }
#endif
    std::memcpy(dst, src, bytes);
}

// Orders the non-temporal stores of copy_to_unread_slot before any later store of this thread
// (and so before the kernel's caller, or another thread, reads the slots).
inline void stream_fence() {
#ifdef __AVX512F__
    _mm_sfence();
#endif
}

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
