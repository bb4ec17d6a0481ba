// simd.h — the per-ISA building blocks of decode attention.
//
// kernels.cpp is compiled once per ISA; the compiler flags of each module define which branch
// below exists in it (__AVX512F__, __AVX2__ or neither). Every branch implements the same
// functions with the same meaning; the attention driver in attention.h calls only these.
//
// Shapes: a block is BT = 16 tokens. Rows have Dp elements (head_dim rounded up to 16, the pad
// is zero in the store), so no vector loop ever needs a tail.
//
//   cvt_rows(src, dt, nrows, Dp, dst)     KV rows of dtype dt -> fp32 [16][Dp], rows >= nrows zeroed
//   scores16(q, K, Dp, s)                 s[t] = q . K[t]               (q already scaled)
//   softmax16(s, nvalid, m, l)            online softmax step in base 2; s <- p; returns alpha
//   scale_row(acc, alpha, Dp)             acc *= alpha
//   pv16(p, V, Dp, acc)                   acc += sum_t p[t] * V[t]
//   exp2_1(x)                             scalar 2^x computed exactly as the vector path does
//   store_row(src, sdt, dst, ddt, D, Dp)  one row into the store with dtype conversion + zero pad
//   q_row(src, sdt, D, Dp, scale, dst)    one query row -> fp32 * scale, zero pad
//   out_row(acc, inv_l, D, dst, odt)      final normalisation, fp32 or bf16 out
#pragma once

#include <cmath>
#include <cstring>

#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace FD_NS {

constexpr int BT = 16;  // tokens per block (one AVX-512 vector of scores)

// ============================================================================
// shared scalar helpers
// ============================================================================

static inline void store_row_scalar(const void* src, int sdt, void* dst, int ddt, int D, int Dp) {
    if (ddt == F32) {
        float* d = static_cast<float*>(dst);
        if (sdt == F32) std::memcpy(d, src, (size_t)D * 4);
        else for (int i = 0; i < D; ++i) d[i] = bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
        for (int i = D; i < Dp; ++i) d[i] = 0.f;
        return;
    }
    uint16_t* d = static_cast<uint16_t*>(dst);
    if (ddt == BF16) {
        if (sdt == BF16) std::memcpy(d, src, (size_t)D * 2);
        else for (int i = 0; i < D; ++i) d[i] = f32_to_bf16(static_cast<const float*>(src)[i]);
    } else {  // F16
        for (int i = 0; i < D; ++i) d[i] = f32_to_f16(load_scalar(src, i, sdt));
    }
    for (int i = D; i < Dp; ++i) d[i] = 0;
}

static inline void q_row(const void* src, int sdt, int D, int Dp, float scale, float* dst) {
    for (int i = 0; i < D; ++i) dst[i] = load_scalar(src, i, sdt) * scale;
    for (int i = D; i < Dp; ++i) dst[i] = 0.f;
}

static inline void out_row(const float* acc, float inv_l, int D, void* dst, int odt) {
    if (odt == F32) {
        float* o = static_cast<float*>(dst);
        for (int i = 0; i < D; ++i) o[i] = acc[i] * inv_l;
    } else {
        uint16_t* o = static_cast<uint16_t*>(dst);
        for (int i = 0; i < D; ++i) o[i] = f32_to_bf16(acc[i] * inv_l);
    }
}

#if defined(__AVX512F__)
// ============================================================================
// AVX-512 (F, BW, VL, DQ): 16 fp32 lanes
// ============================================================================
#define FD_ISA_NAME "avx512"

static inline void cvt_rows(const void* src, int dt, int nrows, int Dp, float* dst) {
    const size_t n = (size_t)nrows * Dp;
    if (dt == BF16) {
        // bf16 -> fp32 is exact: widen to 32 bits and shift into the high half
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (size_t i = 0; i < n; i += 16) {
            __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(s + i)));
            _mm512_store_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
        }
    } else if (dt == F16) {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (size_t i = 0; i < n; i += 16)
            _mm512_store_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + i))));
    } else {
        std::memcpy(dst, src, n * 4);
    }
    for (size_t i = n; i < (size_t)BT * Dp; i += 16) _mm512_store_ps(dst + i, _mm512_setzero_ps());
}

// lane t of the result = horizontal sum of a[t]; 45 shuffles/adds for 16 vectors
static inline __m512 transpose_sum16(__m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)   // per 128-bit lane: [a0 a1 a0 a1] partial pairs
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i) { // per 128-bit lane: [t0 t1 t2 t3] of that quarter
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)   // fold quarters: [t0-3 (q0+q1), t0-3 (q2+q3), t4-7 ..., t4-7 ...]
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

static inline void scores16(const float* q, const float* K, int Dp, float* s) {
    __m512 a[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
    for (int d = 0; d < Dp; d += 16) {
        __m512 qv = _mm512_loadu_ps(q + d);
#pragma GCC unroll 16
        for (int t = 0; t < 16; ++t) a[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(K + (size_t)t * Dp + d), a[t]);
    }
    _mm512_storeu_ps(s, transpose_sum16(a));
}

// 2^x for x <= 0 (softmax arguments): 2^round(x) * poly(frac), degree-7 Taylor, rel err < 1e-8
static inline __m512 exp2v(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));  // -inf -> 2^-200 -> 0 after scalef
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5252733804059840e-05f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline float exp2_1(float x) { return _mm512_cvtss_f32(exp2v(_mm512_set1_ps(x))); }

static inline float softmax16(float* s, int nvalid, float& m, float& l) {
    const __mmask16 valid = (__mmask16)((1u << nvalid) - 1u);
    __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, s);
    float mn = std::fmax(m, _mm512_reduce_max_ps(x));
    __m512 p = _mm512_maskz_mov_ps(valid, exp2v(_mm512_sub_ps(x, _mm512_set1_ps(mn))));
    _mm512_storeu_ps(s, p);
    float alpha = (mn == m) ? 1.f : exp2_1(m - mn);
    l = l * alpha + _mm512_reduce_add_ps(p);
    m = mn;
    return alpha;
}

static inline void scale_row(float* acc, float alpha, int Dp) {
    __m512 a = _mm512_set1_ps(alpha);
    for (int d = 0; d < Dp; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(a, _mm512_loadu_ps(acc + d)));
}

// R register tiles of 16 floats each: acc[0:16R] += sum_t p[t] V[t][0:16R]
template <int R>
static inline void pv_tile(const float* p, const float* V, int Dp, float* acc) {
    __m512 c[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) c[r] = _mm512_loadu_ps(acc + 16 * r);
#pragma GCC unroll 4
    for (int t = 0; t < 16; ++t) {
        __m512 pt = _mm512_set1_ps(p[t]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) c[r] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(V + (size_t)t * Dp + 16 * r), c[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + 16 * r, c[r]);
}

static inline void pv16(const float* p, const float* V, int Dp, float* acc) {
    int d = 0;
    for (; d + 128 <= Dp; d += 128) pv_tile<8>(p, V + d, Dp, acc + d);
    switch ((Dp - d) / 16) {
        case 7: pv_tile<7>(p, V + d, Dp, acc + d); break;
        case 6: pv_tile<6>(p, V + d, Dp, acc + d); break;
        case 5: pv_tile<5>(p, V + d, Dp, acc + d); break;
        case 4: pv_tile<4>(p, V + d, Dp, acc + d); break;
        case 3: pv_tile<3>(p, V + d, Dp, acc + d); break;
        case 2: pv_tile<2>(p, V + d, Dp, acc + d); break;
        case 1: pv_tile<1>(p, V + d, Dp, acc + d); break;
        default: break;
    }
}

static inline void store_row(const void* src, int sdt, void* dst, int ddt, int D, int Dp) {
    if (D % 16 != 0 || (ddt != F32 && sdt == ddt) || (ddt == F32 && sdt == F32)) {
        store_row_scalar(src, sdt, dst, ddt, D, Dp);
        return;
    }
    for (int i = 0; i < D; i += 16) {
        __m512 x;
        if (sdt == F32) x = _mm512_loadu_ps(static_cast<const float*>(src) + i);
        else x = _mm512_castsi512_ps(_mm512_slli_epi32(
                 _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(src) + i))), 16));
        if (ddt == F32) {
            _mm512_storeu_ps(static_cast<float*>(dst) + i, x);
        } else if (ddt == F16) {
            _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(dst) + i),
                                _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {  // BF16, round to nearest even; NaN -> quiet NaN
            __m512i u = _mm512_castps_si512(x);
            __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                            _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
            __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
            __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
            _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(dst) + i), _mm512_cvtepi32_epi16(r));
        }
    }
    if (ddt == F32) for (int i = D; i < Dp; ++i) static_cast<float*>(dst)[i] = 0.f;
    else for (int i = D; i < Dp; ++i) static_cast<uint16_t*>(dst)[i] = 0;
}

#elif defined(__AVX2__)
// ============================================================================
// AVX2 + FMA + F16C: 8 fp32 lanes; a 16-token block is two groups of 8
// ============================================================================
#define FD_ISA_NAME "avx2"

static inline void cvt_rows(const void* src, int dt, int nrows, int Dp, float* dst) {
    const size_t n = (size_t)nrows * Dp;
    if (dt == BF16) {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (size_t i = 0; i < n; i += 8) {
            __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s + i)));
            _mm256_store_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        }
    } else if (dt == F16) {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (size_t i = 0; i < n; i += 8) _mm256_store_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
    } else {
        std::memcpy(dst, src, n * 4);
    }
    for (size_t i = n; i < (size_t)BT * Dp; i += 8) _mm256_store_ps(dst + i, _mm256_setzero_ps());
}

// lane t of the result = horizontal sum of a[t], 8 vectors
static inline __m256 transpose_sum8(__m256 a[8]) {
    __m256 b[4], c[2];
    for (int i = 0; i < 4; ++i)
        b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
        __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
        c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}

static inline void scores16(const float* q, const float* K, int Dp, float* s) {
    for (int half = 0; half < 2; ++half) {
        const float* Kh = K + (size_t)half * 8 * Dp;
        __m256 a[8];
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
        for (int d = 0; d < Dp; d += 8) {
            __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
            for (int t = 0; t < 8; ++t) a[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(Kh + (size_t)t * Dp + d), a[t]);
        }
        _mm256_storeu_ps(s + 8 * half, transpose_sum8(a));
    }
}

static inline __m256 exp2v(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));  // keeps 2^n a normal float
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(1.5252733804059840e-05f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.5403530393381606e-04f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3333558146428443e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.6181291076284772e-03f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.5504108664821580e-02f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.4022650695910071e-01f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.9314718055994531e-01f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float exp2_1(float x) { return _mm256_cvtss_f32(exp2v(_mm256_set1_ps(x))); }

static inline float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

static inline float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

static inline __m256 lane_mask(int nvalid) {  // lanes [0, nvalid) all-ones
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nvalid), idx));
}

static inline float softmax16(float* s, int nvalid, float& m, float& l) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 k0 = lane_mask(nvalid), k1 = lane_mask(nvalid - 8);
    __m256 x0 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s), k0);
    __m256 x1 = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + 8), k1);
    float mn = std::fmax(m, hmax8(_mm256_max_ps(x0, x1)));
    __m256 vm = _mm256_set1_ps(mn);
    __m256 p0 = _mm256_and_ps(k0, exp2v(_mm256_sub_ps(x0, vm)));
    __m256 p1 = _mm256_and_ps(k1, exp2v(_mm256_sub_ps(x1, vm)));
    _mm256_storeu_ps(s, p0);
    _mm256_storeu_ps(s + 8, p1);
    float alpha = (mn == m) ? 1.f : exp2_1(m - mn);
    l = l * alpha + hsum8(_mm256_add_ps(p0, p1));
    m = mn;
    return alpha;
}

static inline void scale_row(float* acc, float alpha, int Dp) {
    __m256 a = _mm256_set1_ps(alpha);
    for (int d = 0; d < Dp; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(a, _mm256_loadu_ps(acc + d)));
}

template <int R>
static inline void pv_tile(const float* p, const float* V, int Dp, float* acc) {
    __m256 c[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) c[r] = _mm256_loadu_ps(acc + 8 * r);
#pragma GCC unroll 4
    for (int t = 0; t < 16; ++t) {
        __m256 pt = _mm256_broadcast_ss(p + t);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) c[r] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(V + (size_t)t * Dp + 8 * r), c[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + 8 * r, c[r]);
}

static inline void pv16(const float* p, const float* V, int Dp, float* acc) {
    int d = 0;
    for (; d + 64 <= Dp; d += 64) pv_tile<8>(p, V + d, Dp, acc + d);
    switch ((Dp - d) / 8) {
        case 7: pv_tile<7>(p, V + d, Dp, acc + d); break;
        case 6: pv_tile<6>(p, V + d, Dp, acc + d); break;
        case 5: pv_tile<5>(p, V + d, Dp, acc + d); break;
        case 4: pv_tile<4>(p, V + d, Dp, acc + d); break;
        case 3: pv_tile<3>(p, V + d, Dp, acc + d); break;
        case 2: pv_tile<2>(p, V + d, Dp, acc + d); break;
        case 1: pv_tile<1>(p, V + d, Dp, acc + d); break;
        default: break;
    }
}

static inline void store_row(const void* src, int sdt, void* dst, int ddt, int D, int Dp) {
    if (ddt == F16 && D % 8 == 0) {
        for (int i = 0; i < D; i += 8) {
            __m256 x;
            if (sdt == F32) x = _mm256_loadu_ps(static_cast<const float*>(src) + i);
            else x = _mm256_castsi256_ps(_mm256_slli_epi32(
                     _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(static_cast<const uint16_t*>(src) + i))), 16));
            _mm_storeu_si128((__m128i*)(static_cast<uint16_t*>(dst) + i),
                             _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
        for (int i = D; i < Dp; ++i) static_cast<uint16_t*>(dst)[i] = 0;
        return;
    }
    store_row_scalar(src, sdt, dst, ddt, D, Dp);  // the bf16 loops vectorize with -mavx2
}

#else
// ============================================================================
// portable: plain C++, baseline ISA only (SSE2 on x86-64); loops written so -O3 vectorizes
// them with whatever the baseline offers. No intrinsics.
// ============================================================================
#define FD_ISA_NAME "portable"

static inline void cvt_rows(const void* src, int dt, int nrows, int Dp, float* dst) {
    const size_t n = (size_t)nrows * Dp;
    if (dt == BF16) {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
    } else if (dt == F16) {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
    } else {
        std::memcpy(dst, src, n * 4);
    }
    for (size_t i = n; i < (size_t)BT * Dp; ++i) dst[i] = 0.f;
}

static inline float dot8(const float* a, const float* b, int Dp) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // 8 independent partial sums (vectorizable)
    for (int d = 0; d < Dp; d += 8)
        for (int u = 0; u < 8; ++u) acc[u] += a[d + u] * b[d + u];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static inline void scores16(const float* q, const float* K, int Dp, float* s) {
    for (int t = 0; t < 16; ++t) s[t] = dot8(q, K + (size_t)t * Dp, Dp);
}

static inline float exp2_1(float x) { return std::exp2(x); }

static inline float softmax16(float* s, int nvalid, float& m, float& l) {
    float bm = -INFINITY;
    for (int t = 0; t < nvalid; ++t) bm = std::fmax(bm, s[t]);
    float mn = std::fmax(m, bm);
    float sum = 0.f;
    for (int t = 0; t < 16; ++t) {
        s[t] = (t < nvalid) ? std::exp2(s[t] - mn) : 0.f;
        sum += s[t];
    }
    float alpha = (mn == m) ? 1.f : std::exp2(m - mn);
    l = l * alpha + sum;
    m = mn;
    return alpha;
}

static inline void scale_row(float* acc, float alpha, int Dp) {
    for (int d = 0; d < Dp; ++d) acc[d] *= alpha;
}

static inline void pv16(const float* p, const float* V, int Dp, float* acc) {
    for (int t = 0; t < 16; ++t) {
        const float pt = p[t];
        const float* v = V + (size_t)t * Dp;
        for (int d = 0; d < Dp; ++d) acc[d] += pt * v[d];
    }
}

static inline void store_row(const void* src, int sdt, void* dst, int ddt, int D, int Dp) {
    store_row_scalar(src, sdt, dst, ddt, D, Dp);
}

#endif

}  // namespace FD_NS
