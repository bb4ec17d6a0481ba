// simde_avx512.h — the AVX-512 kernels (simd_avx512.h) on a CPU without AVX-512, for tests only.
//
// The module rworker._kernels_avx512emu (built when SIMDe's headers are found, see setup.py) is
// compiled with AVX2 flags and FD_SIMDE_AVX512: SIMDe (libsimde-dev) implements the _mm512_*
// intrinsics with AVX2 and scalar code, so the AVX-512 kernels' logic (layout, masks, tails,
// dtype paths, the vdpbf16ps scores) runs and is tested on any x86 CPU. Its speed means
// nothing. Never chosen by rworker.isa's dispatch.
//
// SIMDe 0.7.4 lacks a few intrinsics the kernels use; they are defined below from SIMDe's
// 256-bit halves (hardware F16C for the fp16 conversions, so rounding is the instruction's).
#pragma once

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>
#include <cstring>

namespace fd_simde {

// ----------------------------------------------------------------------------
// 512 <-> two 256-bit halves

static inline void halves_ps(__m512 a, __m256& lo, __m256& hi) {
    alignas(64) float t[16];
    _mm512_store_ps(t, a);
    lo = _mm256_load_ps(t);
    hi = _mm256_load_ps(t + 8);
}

static inline __m512 join_ps(__m256 lo, __m256 hi) {
    alignas(64) float t[16];
    _mm256_store_ps(t, lo);
    _mm256_store_ps(t + 8, hi);
    return _mm512_load_ps(t);
}

// ----------------------------------------------------------------------------
// the missing intrinsics (same signatures and results as the AVX-512 instructions)

static inline __m512 cvtph_ps(__m256i h) {
    return join_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}

template <int ROUNDING>
static inline __m256i cvtps_ph(__m512 x) {
    __m256 lo, hi;
    halves_ps(x, lo, hi);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm256_cvtps_ph(lo, ROUNDING)), _mm256_cvtps_ph(hi, ROUNDING), 1);
}

static inline __m256i cvtepi32_epi16(__m512i x) {  // truncate each lane to its low 16 bits
    alignas(64) int32_t s[16];
    alignas(32) int16_t d[16];
    _mm512_store_si512(s, x);
    for (int i = 0; i < 16; ++i) d[i] = (int16_t)s[i];
    return _mm256_load_si256((const __m256i*)d);
}

static inline __m512i cvtepu16_epi32(__m256i x) {
    alignas(32) uint16_t s[16];
    alignas(64) int32_t d[16];
    _mm256_store_si256((__m256i*)s, x);
    for (int i = 0; i < 16; ++i) d[i] = s[i];
    return _mm512_load_si512(d);
}

static inline float cvtss_f32(__m512 x) {
    alignas(64) float t[16];
    _mm512_store_ps(t, x);
    return t[0];
}

static inline __m512 mask_loadu_ps(__m512 src, __mmask16 k, const void* p) {  // reads enabled lanes only
    alignas(64) float t[16];
    _mm512_store_ps(t, src);
    for (int i = 0; i < 16; ++i)
        if (k >> i & 1) std::memcpy(&t[i], static_cast<const char*>(p) + 4 * i, 4);
    return _mm512_load_ps(t);
}

// reductions in GCC's order: halves added until one lane is left
static inline float reduce_add_ps(__m512 x) {
    alignas(64) float t[16];
    _mm512_store_ps(t, x);
    for (int n = 8; n >= 1; n /= 2)
        for (int i = 0; i < n; ++i) t[i] = t[i] + t[i + n];
    return t[0];
}

static inline float reduce_max_ps(__m512 x) {
    alignas(64) float t[16];
    _mm512_store_ps(t, x);
    for (int n = 8; n >= 1; n /= 2)
        for (int i = 0; i < n; ++i) t[i] = t[i] > t[i + n] ? t[i] : t[i + n];
    return t[0];
}

static inline long long reduce_add_epi64(__m512i x) {
    alignas(64) uint64_t t[8];
    _mm512_store_si512(t, x);
    uint64_t s = 0;
    for (int i = 0; i < 8; ++i) s += t[i];
    return (long long)s;
}

static inline __m512 cvtepi32_ps(__m512i x) {
    alignas(64) int32_t s[16];
    alignas(64) float d[16];
    _mm512_store_si512(s, x);
    for (int i = 0; i < 16; ++i) d[i] = (float)s[i];
    return _mm512_load_ps(d);
}

// fp32 -> int32 by a 256-bit conversion on each half
template <__m256i (*CVT)(__m256)>
static inline __m512i halves_epi32(__m512 x) {
    __m256 lo, hi;
    halves_ps(x, lo, hi);
    alignas(64) int32_t d[16];
    _mm256_store_si256((__m256i*)d, CVT(lo));
    _mm256_store_si256((__m256i*)(d + 8), CVT(hi));
    return _mm512_load_si512(d);
}
static inline __m256i cvt_rne(__m256 x) { return _mm256_cvtps_epi32(x); }     // round to nearest even (MXCSR default)
static inline __m256i cvt_trunc(__m256 x) { return _mm256_cvttps_epi32(x); }  // truncate toward zero

// SIMDe 0.7.4 defines _mm512_madd_epi16 with the masked form's 4 arguments
static inline __m512i madd_epi16(__m512i a, __m512i b) {
    alignas(64) int16_t x[32], y[32];
    alignas(64) int32_t d[16];
    _mm512_store_si512(x, a);
    _mm512_store_si512(y, b);
    for (int i = 0; i < 16; ++i) d[i] = (int32_t)x[2 * i] * y[2 * i] + (int32_t)x[2 * i + 1] * y[2 * i + 1];
    return _mm512_load_si512(d);
}

}  // namespace fd_simde

#define _mm512_cvtph_ps(h) fd_simde::cvtph_ps(h)
#define _mm512_cvtepi32_ps(x) fd_simde::cvtepi32_ps(x)
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) fd_simde::madd_epi16(a, b)
#define _mm512_cvtps_epi32(x) fd_simde::halves_epi32<fd_simde::cvt_rne>(x)
#define _mm512_cvttps_epi32(x) fd_simde::halves_epi32<fd_simde::cvt_trunc>(x)
#define _mm512_cvtps_ph(x, r) fd_simde::cvtps_ph<(r)>(x)
#define _mm512_cvtepi32_epi16(x) fd_simde::cvtepi32_epi16(x)
#define _mm512_cvtepu16_epi32(x) fd_simde::cvtepu16_epi32(x)
#define _mm512_cvtss_f32(x) fd_simde::cvtss_f32(x)
#define _mm512_mask_loadu_ps(s, k, p) fd_simde::mask_loadu_ps(s, k, p)
#define _mm512_reduce_add_ps(x) fd_simde::reduce_add_ps(x)
#define _mm512_reduce_max_ps(x) fd_simde::reduce_max_ps(x)
#define _mm512_reduce_add_epi64(x) fd_simde::reduce_add_epi64(x)
