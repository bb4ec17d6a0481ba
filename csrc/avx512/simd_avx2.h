// simd_avx2.h — simd.h's functions for AVX2 + FMA + F16C (CPUs without AVX-512).
//
// Included by simd.h in the avx2 build.
#pragma once

#ifndef FD_SIMD_H
#error "simd_avx2.h is included through simd.h"
#endif

#include <immintrin.h>

namespace FD_NS {

// ============================================================================
// AVX2 + FMA + F16C: 8 fp32 lanes; 32 tokens / 32 dims = 4 vectors
// ============================================================================
#define FD_ISA_NAME "avx2"

// bf16: each 16-value half splits into even (8) then odd (8)
static inline int split16(int r) { return (r & 16) + (r & 1) * 8 + ((r & 15) >> 1); }
static inline int apos(int dt, int d, int) { return dt == BF16 ? (d & ~31) + split16(d & 31) : d; }

template <int DT>
static inline void load16(const void* p, __m256& a, __m256& b) {  // 16 stored values -> 2 vectors
    if constexpr (DT == BF16) {
        __m256i x = _mm256_loadu_si256((const __m256i*)p);
        a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
    } else if constexpr (DT == F16) {
        a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
        b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p + 1));
    } else {
        a = _mm256_loadu_ps(static_cast<const float*>(p));
        b = _mm256_loadu_ps(static_cast<const float*>(p) + 8);
    }
}

// one K word-row of 8 tokens (32 bytes) -> x: dim 2w, y: dim 2w+1 (16-bit dtypes)
template <int DT>
static inline void kword8(const char* p, __m256& x, __m256& y) {
    __m256i w = _mm256_loadu_si256((const __m256i*)p);
    if constexpr (DT == BF16) {
        x = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        y = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
    } else {  // F16: gather the low / high halves of the 8 words, then convert
        const __m256i lo = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
        __m256i a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, lo), 0x08);
        __m256i b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_srli_epi32(w, 16), lo), 0x08);
        x = _mm256_cvtph_ps(_mm256_castsi256_si128(a));
        y = _mm256_cvtph_ps(_mm256_castsi256_si128(b));
    }
}

// S[j][0:32] for GH <= 2 heads, two dims per step (one word-row of 16-bit dtypes, two fp32
// rows), 4 vectors of 8 tokens. FMA latency is 4 cycles and Zen/Intel cores issue 2 per cycle,
// so >= 8 independent accumulators keep the pipes full: GH = 2 has 2 x 4; GH = 1 keeps the
// even- and odd-dim products apart (2 x 4) and adds them at the end.
// pf: pf_lines cache lines (the next page's K run) prefetched a share per step
template <int DT, int GH>
static inline void scores_group(const void* K, int Dp, const float* q, float* S, const char* pf, int pf_lines) {
    constexpr bool SPLIT = GH == 1;
    constexpr size_t step = DT == F32 ? 2 * PT * 4 : PT * 4;   // bytes per 2 dims
    const char* k = static_cast<const char*>(K);
    __m256 ax[GH][4], ay[SPLIT ? GH : 1][4];
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) ax[j][i] = _mm256_setzero_ps();
    if constexpr (SPLIT)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) ay[0][i] = _mm256_setzero_ps();
    for (int d = 0; d < Dp; d += 2) {
        const char* row = k + (size_t)(d / 2) * step;
        if (pf) prefetch_share(pf, pf_lines, d / 2, Dp / 2);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
            __m256 x, y;
            if constexpr (DT == F32) {
                x = _mm256_loadu_ps((const float*)row + 8 * i);          // dim d
                y = _mm256_loadu_ps((const float*)row + PT + 8 * i);     // dim d + 1
            } else {
                kword8<DT>(row + 32 * i, x, y);
            }
#pragma GCC unroll 8
            for (int j = 0; j < GH; ++j) {
                ax[j][i] = _mm256_fmadd_ps(x, _mm256_broadcast_ss(q + (size_t)j * Dp + d), ax[j][i]);
                if constexpr (SPLIT)
                    ay[j][i] = _mm256_fmadd_ps(y, _mm256_broadcast_ss(q + (size_t)j * Dp + d + 1), ay[j][i]);
                else
                    ax[j][i] = _mm256_fmadd_ps(y, _mm256_broadcast_ss(q + (size_t)j * Dp + d + 1), ax[j][i]);
            }
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
            __m256 s = ax[j][i];
            if constexpr (SPLIT) s = _mm256_add_ps(s, ay[j][i]);
            _mm256_storeu_ps(S + (size_t)j * PT + 8 * i, s);
        }
}

// S[j][0:32] for 4 heads, one half page (16 tokens, 2 vectors) per pass: 4 x 2 accumulators,
// so each K word is loaded and decoded once for all 4 heads, where two 2-head passes read the
// whole K run twice: fp32 K (16 KB per page at D = 128, past half of a 32 KB L1 with its V run)
// streams 1.10x faster, bf16 about the same. pf as in scores_group, shared over both halves.
template <int DT>
static inline void scores_quad(const void* K, int Dp, const float* q, float* S, const char* pf, int pf_lines) {
    constexpr size_t step = DT == F32 ? 2 * PT * 4 : PT * 4;   // bytes per 2 dims
    const char* k = static_cast<const char*>(K);
    const int rows = Dp / 2;
    for (int h = 0; h < 2; ++h) {
        __m256 a[4][2];
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) a[j][0] = a[j][1] = _mm256_setzero_ps();
        for (int d = 0; d < Dp; d += 2) {
            const char* row = k + (size_t)(d / 2) * step;
            if (pf) prefetch_share(pf, pf_lines, h * rows + d / 2, 2 * rows);
            __m256 x[2], y[2];
#pragma GCC unroll 2
            for (int i = 0; i < 2; ++i) {
                if constexpr (DT == F32) {
                    x[i] = _mm256_loadu_ps((const float*)row + 16 * h + 8 * i);
                    y[i] = _mm256_loadu_ps((const float*)row + PT + 16 * h + 8 * i);
                } else {
                    kword8<DT>(row + 64 * h + 32 * i, x[i], y[i]);
                }
            }
#pragma GCC unroll 4
            for (int j = 0; j < 4; ++j) {
                const __m256 qx = _mm256_broadcast_ss(q + (size_t)j * Dp + d);
                const __m256 qy = _mm256_broadcast_ss(q + (size_t)j * Dp + d + 1);
#pragma GCC unroll 2
                for (int i = 0; i < 2; ++i) a[j][i] = _mm256_fmadd_ps(y[i], qy, _mm256_fmadd_ps(x[i], qx, a[j][i]));
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j)
#pragma GCC unroll 2
            for (int i = 0; i < 2; ++i) _mm256_storeu_ps(S + (size_t)j * PT + 16 * h + 8 * i, a[j][i]);
    }
}

// Heads in passes of 4 (scores_quad), the rest in passes of 1-2 (scores_group).
// pf: the next page; its K run is prefetched during the first pass over this K run, its V run
// during this V pass (pv_page). Spread over both passes, one line or two per step, the misses
// stay in flight while the FMAs run: 1.04-1.24x the speed of version 6, which issued the whole
// page as a slice per tile pass of the V pass (bench/kernel/CHANGELOG.md, versions 7 and 8).
static inline void scores_page(int dt, const void* K, int Dp, const float* q, int g, float* S, const char* pf) {
    const int k_lines = k_run_lines(dt, Dp);
    const int gq = g / 4 * 4;
    for (int j0 = 0; j0 < gq; j0 += 4) {
        const char* p = j0 == 0 ? pf : nullptr;
        const float* qj = q + (size_t)j0 * Dp;
        float* Sj = S + (size_t)j0 * PT;
        if (dt == BF16) scores_quad<BF16>(K, Dp, qj, Sj, p, k_lines);
        else if (dt == F16) scores_quad<F16>(K, Dp, qj, Sj, p, k_lines);
        else scores_quad<F32>(K, Dp, qj, Sj, p, k_lines);
    }
    for_groups<2>(dt, g - gq, [&](auto DT, auto GH, int j0) {
        scores_group<DT.value, GH.value>(K, Dp, q + (size_t)(gq + j0) * Dp, S + (size_t)(gq + j0) * PT,
                                         gq + j0 == 0 ? pf : nullptr, k_lines);
    });
}

// V run in tiles of 16 dims, [Dp/16][PT][16]: a pass over a tile reads one sequential stream.
// (Token-major rows made the pass read 32 B of every 256-B row, a pattern the hardware
// prefetchers did not follow: bench/kernel/CHANGELOG.md, version 6.)
constexpr int V_TILE = 16;

// acc[j][16 ti .. 16 (ti + TC)) += sum_t p_j[t] V[t][...] for GH heads over TC tiles: 2 TC GH
// accumulators (8 at GH <= 4), each broadcast of p_j[t] feeds 2 TC FMAs.
// pf: pf_lines cache lines prefetched a share per token
template <int DT, int GH, int TC>
static inline void pv_tiles(const char* v, int nvalid, int ti, int Dp, const float* S, float* acc, const char* pf,
                            int pf_lines) {
    constexpr size_t tile_row = 16 * (DT == F32 ? 4 : 2);
    constexpr size_t tile_bytes = PT * tile_row;
    __m256 a[GH][2 * TC];
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < 2 * TC; ++c) a[j][c] = _mm256_loadu_ps(acc + (size_t)j * Dp + 16 * ti + 8 * c);
    const char* base = v + (size_t)ti * tile_bytes;
    for (int t = 0; t < nvalid; ++t) {
        if (pf) prefetch_share(pf, pf_lines, t, nvalid);
        __m256 x[2 * TC];
#pragma GCC unroll 4
        for (int c = 0; c < TC; ++c) load16<DT>(base + c * tile_bytes + t * tile_row, x[2 * c], x[2 * c + 1]);
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) {
            __m256 p = _mm256_broadcast_ss(S + (size_t)j * PT + t);
#pragma GCC unroll 8
            for (int c = 0; c < 2 * TC; ++c) a[j][c] = _mm256_fmadd_ps(x[c], p, a[j][c]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < 2 * TC; ++c) _mm256_storeu_ps(acc + (size_t)j * Dp + 16 * ti + 8 * c, a[j][c]);
}

// pf: pf_lines cache lines (the next page's V run); a pass over tiles [ti, ti + tc) prefetches
// lines [ti, ti + tc) * pf_lines / ntiles, spread over its tokens
template <int DT, int GH>
static inline void pv_group(const void* V, int nvalid, int Dp, const float* S, float* acc, const char* pf,
                            int pf_lines) {
    constexpr int TC = GH == 1 ? 4 : GH == 2 ? 2 : 1;
    const char* v = static_cast<const char*>(V);
    const int ntiles = Dp / 16;
    auto first = [&](int ti) { return ti * pf_lines / ntiles; };
    auto at = [&](int ti) { return pf ? pf + 64 * (size_t)first(ti) : nullptr; };
    int ti = 0;
    for (; ti + TC <= ntiles; ti += TC) pv_tiles<DT, GH, TC>(v, nvalid, ti, Dp, S, acc, at(ti), first(ti + TC) - first(ti));
    for (; ti < ntiles; ++ti) pv_tiles<DT, GH, 1>(v, nvalid, ti, Dp, S, acc, at(ti), first(ti + 1) - first(ti));
}

constexpr int V_TILE_ALT = V_TILE;   // one layout only

// pf: the next page (page_bytes: K run then V run); this pass prefetches its V run
static inline void pv_page(int dt, const void* V, int nvalid, int Dp, const float* S, int g, float* acc,
                           const char* pf, size_t page_bytes, int) {
    const int v_lines = (int)(page_bytes / 2 / 64);
    const char* pv = pf ? pf + page_bytes / 2 : nullptr;
    for_groups<4>(dt, g, [&](auto DT, auto GH, int j0) {
        pv_group<DT.value, GH.value>(V, nvalid, Dp, S + (size_t)j0 * PT, acc + (size_t)j0 * Dp, j0 == 0 ? pv : nullptr,
                                     v_lines);
    });
}

// 2^x for x <= 0; -inf -> exactly 0 (a token masked before a sliding window's start: the clamp
// alone would give 2^-126), finite x bit for bit as before that case was added
static inline __m256 exp2v(__m256 x) {
    const __m256 minf = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-126.f), x);  // keeps 2^n a normal float; NaN stays NaN (second operand)
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(EXP2_POLY[7]);
#pragma GCC unroll 7
    for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP2_POLY[i]));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(minf, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
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

// as simd_avx512.h: the max reduced only when a score passes it, l in 8 lanes
constexpr int L_LANES = 8;
static inline float l_total(const float* l) { return hsum8(_mm256_loadu_ps(l)); }

static inline float softmax_page(float* S, int nvalid, float& m, float* l) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 k[4], x[4];
    for (int i = 0; i < 4; ++i) {  // lanes of tokens < nvalid
        k[i] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nvalid - 8 * i), lane));
        x[i] = _mm256_blendv_ps(ninf, _mm256_loadu_ps(S + 8 * i), k[i]);
    }
    const __m256 xmax = _mm256_max_ps(_mm256_max_ps(x[0], x[1]), _mm256_max_ps(x[2], x[3]));
    __m256 vm = _mm256_set1_ps(m), lv = _mm256_loadu_ps(l);
    float alpha = 1.f;
    if (_mm256_movemask_ps(_mm256_cmp_ps(xmax, vm, _CMP_GT_OQ))) {
        const float mn = std::fmax(m, hmax8(xmax));
        alpha = exp2_1(m - mn);
        lv = _mm256_mul_ps(lv, _mm256_set1_ps(alpha));
        m = mn;
        vm = _mm256_set1_ps(mn);
    }
    for (int i = 0; i < 4; ++i) {
        __m256 p = _mm256_and_ps(k[i], exp2v(_mm256_sub_ps(x[i], vm)));
        _mm256_storeu_ps(S + 8 * i, p);
        lv = _mm256_add_ps(lv, p);
    }
    _mm256_storeu_ps(l, lv);
    return alpha;
}

// tanh (simd.h: TANH_POLY below |y| = 0.5, (1 - e) / (1 + e) above; e saturates at 2^-126 -> 1).
// Measured against float64 over |x / cap| in 2^-20 .. 40: |error| <= 3 ulp of cap tanh(x / cap), the
// rounding of x / cap included (relative < 2.4e-7; tests/test_attn_variants.py asserts 4 ulp)
static inline __m256 tanhv(__m256 y) {
    const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
    const __m256 ay = _mm256_andnot_ps(sign, y);
    const __m256 e = exp2v(_mm256_mul_ps(ay, _mm256_set1_ps(-2.f * LOG2E)));
    const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 y2 = _mm256_mul_ps(ay, ay);
    __m256 p = _mm256_set1_ps(TANH_POLY[7]);
#pragma GCC unroll 7
    for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, y2, _mm256_set1_ps(TANH_POLY[i]));
    const __m256 t = _mm256_blendv_ps(big, _mm256_mul_ps(ay, p), _mm256_cmp_ps(ay, _mm256_set1_ps(0.5f), _CMP_LT_OQ));
    return _mm256_or_ps(t, _mm256_and_ps(sign, y));
}

static inline void softcap_page(float* S, int g, float cap) {
    const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.f / cap);
    for (int i = 0; i < g * PT; i += 8)
        _mm256_storeu_ps(S + i, _mm256_mul_ps(c, tanhv(_mm256_mul_ps(_mm256_loadu_ps(S + i), inv))));
}

static inline void scale_row(float* acc, float alpha, int Dp) {
    __m256 a = _mm256_set1_ps(alpha);
    for (int d = 0; d < Dp; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(a, _mm256_loadu_ps(acc + d)));
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

}  // namespace FD_NS
