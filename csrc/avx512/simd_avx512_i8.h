// simd_avx512_i8.h — the int8 page passes for AVX-512 (quant.h has the format and the arithmetic).
//
// Two builds of the same passes (simd_avx512_i8_passes.h), each with its own 4-byte dot product:
//   vnni: vpdpbusd (AVX512-VNNI: Cascade Lake, Ice Lake, Zen 4 and later): K bytes x query bytes
//         into int32 in one instruction; compiled for that target, run only where cpuid has it
//   bw:   AVX-512BW without VNNI (Skylake-SP): vpmaddubsw + vpmaddwd, the query's signs moved onto
//         K so that the unsigned operand is |q| (2 * 127 * 127 fits the int16 pair sum)
// Both give the same integers. Attention picks vnni where the CPU has it (FASTDECODE_VNNI=0 keeps
// bw, for measurements and tests); the SIMDe test build emulates both on any CPU.
#pragma once

#ifndef FD_SIMD_H
#error "simd_avx512_i8.h is included through simd.h"
#endif

#include <immintrin.h>

namespace FD_NS {

// quant.h's rotation: stages 1, 2, 4, 8 inside each 16-float vector (the partner lane i ^ h, an add
// and a masked subtract: lanes with bit h set take partner - self), the rest as quant.h has them
static inline void hadamard(float* x, int n) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask16 upper[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        for (int s = 0; s < 4; ++s) {
            const __m512 p = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(1 << s)), v);
            v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), upper[s], p, v);
        }
        _mm512_storeu_ps(x + i, v);
    }
    hadamard_stages(x, n, 16);
}

// the page weights of one head as 8 words of 4 tokens' hi parts and 8 of their lo parts (quant_p,
// in intrinsics, the same bits)
static inline float quant_p_words(const float* p, const float* vsc, int nvalid, uint32_t* ph, uint32_t* pl) {
    const __mmask16 ka = (__mmask16)((1u << (nvalid < 16 ? nvalid : 16)) - 1u);
    const __mmask16 kb = (__mmask16)((1u << (nvalid > 16 ? nvalid - 16 : 0)) - 1u);
    const __m512 w[2] = {_mm512_maskz_mul_ps(ka, _mm512_loadu_ps(p), _mm512_loadu_ps(vsc)),
                         _mm512_maskz_mul_ps(kb, _mm512_loadu_ps(p + 16), _mm512_loadu_ps(vsc + 16))};
    const __m512 big = _mm512_set1_ps(3.4e38f), zero = _mm512_setzero_ps(), lim = _mm512_set1_ps((float)I8_MAX);
    const bool finite = !(_mm512_cmp_ps_mask(w[0], big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(w[1], big, _CMP_NLE_UQ));
    const float wmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(w[0], zero), _mm512_max_ps(w[1], zero)));
    const __m512 inv = _mm512_set1_ps(wmax > 0.f ? (float)I8_MAX / wmax : 0.f);
    for (int i = 0; i < 2; ++i) {
        // NaN lanes (non-finite w) -> 0, as quant_p
        __m512 y = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(w[i], w[i], _CMP_ORD_Q), _mm512_mul_ps(w[i], inv));
        y = _mm512_min_ps(y, lim);
        const __m512i hi = _mm512_cvttps_epi32(y);                  // floor: y >= 0
        const __m512 h = _mm512_cvtepi32_ps(hi);
        const __m512i l = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(y, h), lim));
        _mm_storeu_si128((__m128i*)(ph + 4 * i), _mm512_cvtsepi32_epi8(hi));
        _mm_storeu_si128((__m128i*)(pl + 4 * i), _mm512_cvtsepi32_epi8(l));
    }
    return finite ? wmax / (float)I8_MAX : NAN;
}

// ---- vnni -------------------------------------------------------------------------------
#if !defined(FD_SIMDE_AVX512)
#pragma GCC push_options
#pragma GCC target("avx512vnni")
#endif
namespace i8_vnni {
constexpr bool K_BIASED = true;        // the sums include 128 * sum(q): subtract qz
struct QWord { __m512i b; };
static inline QWord q_word(uint32_t w) { return {_mm512_set1_epi32((int)w)}; }
static inline __m512i k_load(const char* p) { return _mm512_loadu_si512(p); }
// acc + sum of 4 (K byte) * (q byte) per 32-bit lane
static inline __m512i dot_k(__m512i acc, __m512i k, const QWord& q) { return _mm512_dpbusd_epi32(acc, k, q.b); }
// acc + sum of 4 pq (unsigned) * V (signed) per lane
static inline __m512i dot_pv(__m512i acc, __m512i p, __m512i v) { return _mm512_dpbusd_epi32(acc, p, v); }
#include "simd_avx512_i8_passes.h"
}  // namespace i8_vnni
#if !defined(FD_SIMDE_AVX512)
#pragma GCC pop_options
#endif

// ---- bw (no VNNI) -----------------------------------------------------------------------
namespace i8_bw {
constexpr bool K_BIASED = false;       // the bias is removed at the load: exact sum kq * q
struct QWord { __m512i a; __mmask64 neg; };   // |q| bytes, and the bytes where q < 0
static inline QWord q_word(uint32_t w) {
    const __m512i b = _mm512_set1_epi32((int)w);
    return {_mm512_abs_epi8(b), _mm512_movepi8_mask(b)};
}
static inline __m512i k_load(const char* p) {           // kq + 128 -> kq
    return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8((char)0x80));
}
static inline __m512i pair_sums(__m512i x16) { return _mm512_madd_epi16(x16, _mm512_set1_epi16(1)); }
static inline __m512i dot_k(__m512i acc, __m512i k, const QWord& q) {
    const __m512i ks = _mm512_mask_sub_epi8(k, q.neg, _mm512_setzero_si512(), k);     // k * sign(q)
    return _mm512_add_epi32(acc, pair_sums(_mm512_maddubs_epi16(q.a, ks)));
}
static inline __m512i dot_pv(__m512i acc, __m512i p, __m512i v) {
    return _mm512_add_epi32(acc, pair_sums(_mm512_maddubs_epi16(p, v)));
}
#include "simd_avx512_i8_passes.h"
}  // namespace i8_bw

// the contract's entry points (simd.h): vnni picks the build
static inline void scores_page_i8(bool vnni, const void* K, int Dp, const uint32_t* qh, const uint32_t* ql,
                                  const float* qs, const int32_t* qz, int g, float* S, const char* pf) {
    if (vnni) i8_vnni::scores_page(static_cast<const char*>(K), Dp, qh, ql, qs, qz, g, S, pf);
    else i8_bw::scores_page(static_cast<const char*>(K), Dp, qh, ql, qs, qz, g, S, pf);
}

static inline void pv_page_i8(bool vnni, const void* V, int nvalid, int Dp, const float* S, int g, float* acc,
                              const char* pf, size_t page_bytes) {
    if (vnni) i8_vnni::pv_page(static_cast<const char*>(V), nvalid, Dp, S, g, acc, pf, page_bytes);
    else i8_bw::pv_page(static_cast<const char*>(V), nvalid, Dp, S, g, acc, pf, page_bytes);
}

}  // namespace FD_NS
