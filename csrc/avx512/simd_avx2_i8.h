// simd_avx2_i8.h — the int8 page passes for AVX2 (quant.h has the format and the arithmetic).
//
// 4-byte dot products by vpmaddubsw + vpmaddwd: the query's signs moved onto K (vpsignb) so the
// unsigned operand is |q|, and the weight parts are 7-bit: every int16 pair sum <= 2 * 127 * 127, exact. The
// integers equal the AVX-512 build's.
#pragma once

#ifndef FD_SIMD_H
#error "simd_avx2_i8.h is included through simd.h"
#endif

#include <immintrin.h>

namespace FD_NS {

static inline void hadamard(float* x, int n) { hadamard_stages(x, n, 1); }   // quant.h

static inline __m256i i8_pair_sums(__m256i x16) { return _mm256_madd_epi16(x16, _mm256_set1_epi16(1)); }

// ============================================================================
// scores: S[j][t] = K[t] . (qh + ql / 254) * qs * ksc[t], one head, 4 vectors of 8 tokens per part
// ============================================================================
static inline void scores_i8_head(const char* k, int Dw, const uint32_t* qh, const uint32_t* ql, float qs, float* S,
                                  const char* pf, int pf_lines) {
    __m256i a[4], b[4];        // hi and lo part sums, tokens 8c .. 8c+7
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[c] = b[c] = _mm256_setzero_si256();
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    for (int w = 0; w < Dw; ++w) {
        const char* row = k + (size_t)w * PT * 4;          // one word row: 128 bytes
        if (pf) prefetch_share(pf, pf_lines, w, Dw);
        const __m256i hb = _mm256_set1_epi32((int)qh[w]), ha = _mm256_abs_epi8(hb);
        const __m256i lb = _mm256_set1_epi32((int)ql[w]), la = _mm256_abs_epi8(lb);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
            const __m256i x = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(row + 32 * c)), bias);
            a[c] = _mm256_add_epi32(a[c], i8_pair_sums(_mm256_maddubs_epi16(ha, _mm256_sign_epi8(x, hb))));
            b[c] = _mm256_add_epi32(b[c], i8_pair_sums(_mm256_maddubs_epi16(la, _mm256_sign_epi8(x, lb))));
        }
    }
    const float* ksc = reinterpret_cast<const float*>(k + (size_t)Dw * PT * 4);
    const __m256 s = _mm256_set1_ps(qs), step = _mm256_set1_ps(1.f / (2 * I8_MAX));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
        const __m256 d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b[c]), step, _mm256_cvtepi32_ps(a[c]));
        _mm256_storeu_ps(S + 8 * c, _mm256_mul_ps(_mm256_mul_ps(d, s), _mm256_loadu_ps(ksc + 8 * c)));
    }
}

// vnni: ignored (no VNNI path in this build); qz unused: K is unbiased at the load
static inline void scores_page_i8(bool, const void* K, int Dp, const uint32_t* qh, const uint32_t* ql, const float* qs,
                                  const int32_t*, int g, float* S, const char* pf) {
    const int Dw = Dp / 4;
    const int lines = (int)(i8_half_bytes(Dp) / 64);
    for (int j = 0; j < g; ++j)
        scores_i8_head(static_cast<const char*>(K), Dw, qh + (size_t)j * Dw, ql + (size_t)j * Dw, qs[j],
                       S + (size_t)j * PT, j == 0 ? pf : nullptr, lines);
}

// ============================================================================
// PV: acc[j][d] += ps_j * sum_t (ph_j[t] + pl_j[t] / 127) vq[t][d], 8 dims x 4 tokens per vector
// ============================================================================
template <int GH, int TC>
static inline void pv_i8_pass(const char* V, int nq, int Dp, int d0, const uint32_t* ph, const uint32_t* pl,
                              const float* ps, float* acc, const char* pf, int pf_lines) {
    __m256i a[GH][TC], b[GH][TC];      // sums of the hi and the lo parts
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) a[j][c] = b[j][c] = _mm256_setzero_si256();
    for (int s = 0; s < nq; ++s) {
        if (pf) prefetch_share(pf, pf_lines, s, nq);
        const char* row = V + ((size_t)s * Dp + d0) * 4;
        __m256i x[TC];
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) x[c] = _mm256_loadu_si256((const __m256i*)(row + 32 * c));
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) {
            const __m256i h = _mm256_set1_epi32((int)ph[(size_t)j * (PT / 4) + s]);
            const __m256i l = _mm256_set1_epi32((int)pl[(size_t)j * (PT / 4) + s]);
#pragma GCC unroll 8
            for (int c = 0; c < TC; ++c) {
                a[j][c] = _mm256_add_epi32(a[j][c], i8_pair_sums(_mm256_maddubs_epi16(h, x[c])));
                b[j][c] = _mm256_add_epi32(b[j][c], i8_pair_sums(_mm256_maddubs_epi16(l, x[c])));
            }
        }
    }
    const __m256 step = _mm256_set1_ps(1.f / I8_MAX);
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) {
        const __m256 sc = _mm256_set1_ps(ps[j]);
        float* o = acc + (size_t)j * Dp + d0;
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) {
            const __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(b[j][c]), step, _mm256_cvtepi32_ps(a[j][c]));
            _mm256_storeu_ps(o + 8 * c, _mm256_fmadd_ps(sum, sc, _mm256_loadu_ps(o + 8 * c)));
        }
    }
}

template <int GH>
static inline void pv_i8_group(const char* V, int nvalid, int Dp, const float* S, float* acc, const char* pf,
                               int pf_lines) {
    constexpr int TC = GH == 1 ? 4 : 2;                   // int32 accumulators 2*GH*TC = 8
    const float* vsc = reinterpret_cast<const float*>(V + (size_t)PT * Dp);
    alignas(32) uint8_t ph[GH][PT], pl[GH][PT];
    float ps[GH];
#pragma GCC unroll 4
    for (int j = 0; j < GH; ++j) ps[j] = quant_p(S + (size_t)j * PT, vsc, nvalid, ph[j], pl[j]);
    const uint32_t* hw = reinterpret_cast<const uint32_t*>(&ph[0][0]);
    const uint32_t* lw = reinterpret_cast<const uint32_t*>(&pl[0][0]);
    const int nq = (nvalid + 3) / 4;
    auto first = [&](int d) { return d * pf_lines / Dp; };
    auto at = [&](int d) { return pf ? pf + 64 * (size_t)first(d) : nullptr; };
    int d = 0;
    for (; d + 8 * TC <= Dp; d += 8 * TC)
        pv_i8_pass<GH, TC>(V, nq, Dp, d, hw, lw, ps, acc, at(d), first(d + 8 * TC) - first(d));
    for (; d < Dp; d += 8) pv_i8_pass<GH, 1>(V, nq, Dp, d, hw, lw, ps, acc, at(d), first(d + 8) - first(d));
}

static inline void pv_page_i8(bool, const void* V, int nvalid, int Dp, const float* S, int g, float* acc,
                              const char* pf, size_t page_bytes) {
    const int lines = (int)(page_bytes / 2 / 64);
    const char* pv = pf ? pf + page_bytes / 2 : nullptr;
    for_groups<2>(F32, g, [&](auto, auto GH, int j0) {
        pv_i8_group<GH.value>(static_cast<const char*>(V), nvalid, Dp, S + (size_t)j0 * PT, acc + (size_t)j0 * Dp,
                              j0 == 0 ? pv : nullptr, lines);
    });
}

}  // namespace FD_NS
