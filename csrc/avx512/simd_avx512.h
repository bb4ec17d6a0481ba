// simd_avx512.h — simd.h's functions for AVX-512, with the AVX512-BF16 scores and V pairs.
//
// Included by simd.h in the avx512 build and in the test-only avx512emu build, where SIMDe
// implements the _mm512_* intrinsics on an AVX2 CPU (simde_avx512.h, through common.h).
#pragma once

#ifndef FD_SIMD_H
#error "simd_avx512.h is included through simd.h"
#endif

#include <immintrin.h>

namespace FD_NS {

// ============================================================================
// AVX-512 (F, BW, VL, DQ): 16 fp32 lanes
// ============================================================================
#if defined(FD_SIMDE_AVX512)
#define FD_ISA_NAME "avx512emu"
#define FD_TARGET_BF16                  // SIMDe: plain code
#else
#define FD_ISA_NAME "avx512"
#define FD_TARGET_BF16 __attribute__((target("avx512bf16")))
#endif

// accumulator index of dim d: even/odd split inside every full 32-dim chunk of a bf16 V row
static inline int apos(int dt, int d, int Dp) {
    if (dt != BF16 || d >= Dp / 32 * 32) return d;
    int c = d & ~31, r = d & 31;
    return c + (r & 1) * 16 + (r >> 1);
}

// two fp32 vectors from 32 stored values (bf16: even/odd split; else natural halves)
template <int DT>
static inline void load32(const void* p, __m512& a, __m512& b) {
    if constexpr (DT == BF16) {
        __m512i x = _mm512_loadu_si512(p);
        a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
    } else if constexpr (DT == F16) {
        a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
        b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p + 1));
    } else {
        a = _mm512_loadu_ps(static_cast<const float*>(p));
        b = _mm512_loadu_ps(static_cast<const float*>(p) + 16);
    }
}

template <int DT>
static inline __m512 load16(const void* p) {  // natural order
    if constexpr (DT == BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    else if constexpr (DT == F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
    else return _mm512_loadu_ps(static_cast<const float*>(p));
}

// one K word-row of 16 tokens -> the fp32 vectors of its dims (2 for 16-bit dtypes, 1 for fp32)
template <int DT>
static inline void kword16(const char* p, __m512& x, __m512& y) {
    if constexpr (DT == BF16) {
        __m512i w = _mm512_loadu_si512(p);
        x = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));                                   // dim 2w
        y = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));  // dim 2w+1
    } else {  // F16: split the halves, then convert
        __m512i w = _mm512_loadu_si512(p);
        x = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w));
        y = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(w, 16)));
    }
}

// S[j][0:32] for GH heads; 4 accumulators per head keep enough FMA chains in flight
// pf: pf_lines cache lines (the next page's K run) prefetched a share per step
template <int DT, int GH>
static inline void scores_group(const void* K, int Dp, const float* q, float* S, const char* pf, int pf_lines) {
    const char* k = static_cast<const char*>(K);
    __m512 a0[GH], a1[GH], b0[GH], b1[GH];   // a: tokens 0-15, b: tokens 16-31; 0/1: two dims
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) a0[j] = a1[j] = b0[j] = b1[j] = _mm512_setzero_ps();
    // each step consumes 2 dims of 32 tokens = 128 bytes (bf16/fp16: 1 word-row, fp32: 2)
    for (int d = 0; d < Dp; d += 2) {
        const char* row = k + (size_t)d * PT * (DT == F32 ? 4 : 2);
        if (pf) prefetch_share(pf, pf_lines, d / 2, Dp / 2);
        __m512 xa, ya, xb, yb;
        if constexpr (DT == F32) {
            xa = _mm512_loadu_ps((const float*)row);
            xb = _mm512_loadu_ps((const float*)row + 16);
            ya = _mm512_loadu_ps((const float*)row + 32);
            yb = _mm512_loadu_ps((const float*)row + 48);
        } else {
            kword16<DT>(row, xa, ya);
            kword16<DT>(row + 64, xb, yb);
        }
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) {
            __m512 q0 = _mm512_set1_ps(q[(size_t)j * Dp + d]), q1 = _mm512_set1_ps(q[(size_t)j * Dp + d + 1]);
            a0[j] = _mm512_fmadd_ps(xa, q0, a0[j]);
            b0[j] = _mm512_fmadd_ps(xb, q0, b0[j]);
            a1[j] = _mm512_fmadd_ps(ya, q1, a1[j]);
            b1[j] = _mm512_fmadd_ps(yb, q1, b1[j]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) {
        _mm512_storeu_ps(S + (size_t)j * PT, _mm512_add_ps(a0[j], a1[j]));
        _mm512_storeu_ps(S + (size_t)j * PT + 16, _mm512_add_ps(b0[j], b1[j]));
    }
}

// pf: the next page; its K run is prefetched during the first pass over this K run, its V run
// during this page's V pass (pv_page), one line or two per step, so misses stay in flight while
// the FMAs run (bench/kernel/CHANGELOG.md, version 10)

static inline void scores_page(int dt, const void* K, int Dp, const float* q, int g, float* S, const char* pf) {
    for_groups<4>(dt, g, [&](auto DT, auto GH, int j0) {
        scores_group<DT.value, GH.value>(K, Dp, q + (size_t)j0 * Dp, S + (size_t)j0 * PT, j0 == 0 ? pf : nullptr,
                                         k_run_lines(dt, Dp));
    });
}

// acc[j][d0 : d0+32*TC] += sum_{t < nvalid} p_j[t] V[t][...] for GH heads: TC chunks of 32 dims
// per pass, so one broadcast of p_j[t] feeds 2*TC FMAs and acc moves through memory once a page.
// v: dims d0.. of token 0; token t of chunk c at v + t*row + c*cstride (either V layout)
// pf: pf_lines cache lines prefetched a share per token
template <int DT, int GH, int TC>
static inline void pv_tile(const char* v, int nvalid, size_t row, size_t cstride, int d0, int Dp, const float* S,
                           float* acc, const char* pf, int pf_lines) {
    __m512 a[GH][2 * TC];
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < 2 * TC; ++c) a[j][c] = _mm512_loadu_ps(acc + (size_t)j * Dp + d0 + 16 * c);
    for (int t = 0; t < nvalid; ++t) {
        if (pf) prefetch_share(pf, pf_lines, t, nvalid);
        __m512 x[2 * TC];
#pragma GCC unroll 4
        for (int c = 0; c < TC; ++c) load32<DT>(v + t * row + c * cstride, x[2 * c], x[2 * c + 1]);
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) {
            __m512 p = _mm512_set1_ps(S[(size_t)j * PT + t]);
#pragma GCC unroll 8
            for (int c = 0; c < 2 * TC; ++c) a[j][c] = _mm512_fmadd_ps(x[c], p, a[j][c]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < 2 * TC; ++c) _mm512_storeu_ps(acc + (size_t)j * Dp + d0 + 16 * c, a[j][c]);
}

// TILED: the V run in tiles of 32 dims, [Dp/32][PT][32] (+ a 16-dim tile [PT][16] when
// Dp % 32 == 16), so a pass reads whole tiles, one sequential stream each; else token-major
// pf: pf_lines cache lines (the next page's V run); the pass over dims [d, e) prefetches lines
// [d, e) * pf_lines / Dp, spread over its tokens
template <int DT, int GH, bool TILED>
static inline void pv_group(const void* V, int nvalid, int Dp, const float* S, float* acc, const char* pf,
                            int pf_lines) {
    constexpr size_t esz = DT == F32 ? 4 : 2;
    constexpr int TC = GH <= 2 ? 4 : GH <= 4 ? 2 : 1;   // accumulators 2*TC*GH <= 16
    const char* v = static_cast<const char*>(V);
    const size_t row = TILED ? 32 * esz : (size_t)Dp * esz;         // token to token in one chunk
    constexpr size_t cstride = TILED ? PT * 32 * esz : 32 * esz;    // chunk to chunk of one token
    auto first = [&](int d) { return d * pf_lines / Dp; };
    auto at = [&](int d) { return pf ? pf + 64 * (size_t)first(d) : nullptr; };
    int d = 0;
    for (; d + 32 * TC <= Dp; d += 32 * TC)
        pv_tile<DT, GH, TC>(v + d / 32 * cstride, nvalid, row, cstride, d, Dp, S, acc, at(d), first(d + 32 * TC) - first(d));
    for (; d + 32 <= Dp; d += 32)
        pv_tile<DT, GH, 1>(v + d / 32 * cstride, nvalid, row, cstride, d, Dp, S, acc, at(d), first(d + 32) - first(d));
    if (d < Dp) {  // a 16-dim tail (Dp % 32 == 16), natural order
        if (pf) prefetch_lines(at(d), 0, 64 * (size_t)(pf_lines - first(d)));
        const char* vt = v + d / 32 * cstride;
        const size_t trow = TILED ? 16 * esz : row;
        __m512 a[GH];
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) a[j] = _mm512_loadu_ps(acc + (size_t)j * Dp + d);
        for (int t = 0; t < nvalid; ++t) {
            __m512 x = load16<DT>(vt + t * trow);
#pragma GCC unroll 8
            for (int j = 0; j < GH; ++j) a[j] = _mm512_fmadd_ps(x, _mm512_set1_ps(S[(size_t)j * PT + t]), a[j]);
        }
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) _mm512_storeu_ps(acc + (size_t)j * Dp + d, a[j]);
    }
}

// V run token-major by default; in tiles of 32 dims, [Dp/32][PT][32], as V_TILE_ALT
// (FASTDECODE_VTILE=32, and a candidate of the start-up tune). Tiles won 1.02-1.06x for bf16 KV on
// 2 Zen 5 cores when they came (version 9); on one core, the per-core-bound regime of the GPU box's
// Xeon, token-major won 1.04-1.22x on 8 of 12 shapes and lost 0.97x on SmolLM bf16, both with the
// spread prefetch (bench/kernel/CHANGELOG.md, version 17).
constexpr int V_TILE = 0;
constexpr int V_TILE_ALT = 32;

// pf: the next page (page_bytes: K run then V run); the first group's pass prefetches its V run
static inline void pv_page(int dt, const void* V, int nvalid, int Dp, const float* S, int g, float* acc,
                           const char* pf, size_t page_bytes, int vtile) {
    const int v_lines = (int)(page_bytes / 2 / 64);
    const char* pv = pf ? pf + page_bytes / 2 : nullptr;
    for_groups<8>(dt, g, [&](auto DT, auto GH, int j0) {
        const char* p = j0 == 0 ? pv : nullptr;
        if (vtile) pv_group<DT.value, GH.value, true>(V, nvalid, Dp, S + (size_t)j0 * PT, acc + (size_t)j0 * Dp, p, v_lines);
        else pv_group<DT.value, GH.value, false>(V, nvalid, Dp, S + (size_t)j0 * PT, acc + (size_t)j0 * Dp, p, v_lines);
    });
}

// ---- AVX512-BF16 scores: bf16 K with bf16 queries --------------------------------------
// When q arrives as bf16 (the S-worker ships bf16) every product q[d]*k[d] is exact in fp32, so
// vdpbf16ps (two products + add per lane) computes the same dot product as widening K and
// using FMAs, in 1 instruction per 32 values instead of 2 + 2/g. Not used for fp32 queries:
// rounding q to bf16 would lose precision. The module runs on AVX-512 CPUs without BF16, so
// these functions carry their own target attribute and run only if cpuid reports avx512bf16
// (the SIMDe test build runs them on any CPU).
#define FD_HAVE_DPBF16 1

template <int GH>
FD_TARGET_BF16 static void scores_group_dp(const char* k, int Dw, const uint32_t* qw, float sc, float* S,
                                          const char* pf, int pf_lines) {
    __m512 a0[GH], b0[GH], a1[GH], b1[GH];   // a: tokens 0-15, b: 16-31; 0/1: even/odd word rows
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) a0[j] = b0[j] = a1[j] = b1[j] = _mm512_setzero_ps();
    for (int w = 0; w < Dw; w += 2) {                  // Dw is even (Dp is a multiple of 16)
        const char* row = k + (size_t)w * PT * 4;    // 2 word rows = 256 bytes
        if (pf) prefetch_share(pf, pf_lines, w / 2, Dw / 2);
        __m512i x0 = _mm512_loadu_si512(row), y0 = _mm512_loadu_si512(row + 64);
        __m512i x1 = _mm512_loadu_si512(row + 128), y1 = _mm512_loadu_si512(row + 192);
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) {
            __m512i q0 = _mm512_set1_epi32((int)qw[(size_t)j * Dw + w]);
            __m512i q1 = _mm512_set1_epi32((int)qw[(size_t)j * Dw + w + 1]);
            a0[j] = _mm512_dpbf16_ps(a0[j], (__m512bh)x0, (__m512bh)q0);
            b0[j] = _mm512_dpbf16_ps(b0[j], (__m512bh)y0, (__m512bh)q0);
            a1[j] = _mm512_dpbf16_ps(a1[j], (__m512bh)x1, (__m512bh)q1);
            b1[j] = _mm512_dpbf16_ps(b1[j], (__m512bh)y1, (__m512bh)q1);
        }
    }
    const __m512 vs = _mm512_set1_ps(sc);
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) {
        _mm512_storeu_ps(S + (size_t)j * PT, _mm512_mul_ps(_mm512_add_ps(a0[j], a1[j]), vs));
        _mm512_storeu_ps(S + (size_t)j * PT + 16, _mm512_mul_ps(_mm512_add_ps(b0[j], b1[j]), vs));
    }
}

// qw [g][Dw]: query pairs as bf16 words (unscaled); S gets scores * sc
static inline void scores_page_dp(const void* K, int Dp, const uint32_t* qw, float sc, int g, float* S, const char* pf) {
    const int Dw = Dp / 2;
    for_groups<4>(BF16, g, [&](auto, auto GH, int j0) {
        scores_group_dp<GH.value>(static_cast<const char*>(K), Dw, qw + (size_t)j0 * Dw, sc, S + (size_t)j0 * PT,
                                  j0 == 0 ? pf : nullptr, k_run_lines(BF16, Dp));
    });
}

// ---- AVX512-BF16 PV: V in token pairs, probabilities rounded to bf16 --------------------
// V_PAIRS, a third V layout (bf16 KV on a CPU with AVX512-BF16 only): the V run as 32-bit words,
// word (s, d) = (V[2s][d], V[2s+1][d]), the even token in the low half, in tiles of 64 dims
// [Dp/64][PT/2][64] (+ a narrower last tile [PT/2][Dp % 64]) so that a pass over 64 dims reads one
// 4 KB block. With the page's probabilities rounded to bf16 pairs (p[2s], p[2s+1]), one vdpbf16ps
// adds both tokens' products for 16 dims: V needs no widening and the multiply-adds halve. The
// price is p rounded to bf16 (relative 2^-9 per weight, as FlashAttention rounds P for its PV
// product; l stays the fp32 sum), so this layout gives other bits than the others: opt-in
// (v_tile = V_PAIRS) for measurement (bench/kernel/CHANGELOG.md, version 16). The odd slot of an
// unfilled pair is written zero with the even token: a reused page's old values never meet a p of 0.
constexpr int V_PAIRS = -2;
constexpr int PAIR_TILE = 64;                                   // dims per tile
constexpr size_t PAIR_TILE_BYTES = (size_t)(PT / 2) * PAIR_TILE * 4;

// word index of (pair s, dim d) in a V run of Dp dims
static inline size_t pair_word(int s, int d, int Dp) {
    const int k = d / PAIR_TILE, w = std::min(PAIR_TILE, Dp - k * PAIR_TILE);
    return (size_t)k * (PT / 2) * PAIR_TILE + (size_t)s * w + (d - k * PAIR_TILE);
}

// 16 finite fp32 -> bf16 bits (round to nearest even) in the low half of each lane (store_row
// adds the NaN case)
static inline __m512i bf16_rne_bits(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    return _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
}

// p16 [R][PT] <- the first `rows` rows of S [rows][PT] rounded to bf16 (nearest even), the rows
// after them zero (an AMX block's padding, amx.h: its products add nothing)
static inline void probs_bf16(const float* S, int rows, int R, uint16_t* p16) {
    for (int j = 0; j < rows; ++j)
        for (int h = 0; h < PT; h += 16)
            _mm256_storeu_si256((__m256i*)(p16 + (size_t)j * PT + h),
                                _mm512_cvtepi32_epi16(bf16_rne_bits(_mm512_loadu_ps(S + (size_t)j * PT + h))));
    std::memset(p16 + (size_t)rows * PT, 0, sizeof(uint16_t) * PT * (R - rows));
}

// a[j][c] += the products of one pair's 16*TC dims (row) with head j's pair word pw[j * PT/2]
template <int GH, int TC>
FD_TARGET_BF16 static inline void pairs_step(const char* row, const uint32_t* pw, __m512 (&a)[GH][TC]) {
    __m512i x[TC];
#pragma GCC unroll 8
    for (int c = 0; c < TC; ++c) x[c] = _mm512_loadu_si512(row + 64 * c);
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) {
        __m512i b = _mm512_set1_epi32((int)pw[(size_t)j * (PT / 2)]);
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) a[j][c] = _mm512_dpbf16_ps(a[j][c], (__m512bh)x[c], (__m512bh)b);
    }
}

// acc[j][d0 : d0+16*TC] += sum_s (p_j[2s] V[2s][...] + p_j[2s+1] V[2s+1][...]) for GH heads.
// v: the words of dims d0.. of pair 0, pair s at v + s*stride (16*TC <= one tile: one stream).
// U accumulator sets take pairs in turn (summed at the end), so that GH*TC*U >= 8 chains hide
// the dot products' latency when few heads share a pass. pw [GH][PT/2]: probability pair words
template <int GH, int TC, int U>
FD_TARGET_BF16 static void pv_pairs_pass(const char* v, size_t stride, int npairs, int Dp, int d0, const uint32_t* pw,
                                         float* acc, const char* pf, int pf_lines) {
    __m512 a[U][GH][TC];
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) {
            a[0][j][c] = _mm512_loadu_ps(acc + (size_t)j * Dp + d0 + 16 * c);
#pragma GCC unroll 4
            for (int u = 1; u < U; ++u) a[u][j][c] = _mm512_setzero_ps();
        }
    int s = 0;
    for (; s + U <= npairs; s += U) {
        if (pf) prefetch_share(pf, pf_lines, s / U, (npairs + U - 1) / U);
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) pairs_step<GH, TC>(v + (size_t)(s + u) * stride, pw + s + u, a[u]);
    }
    for (; s < npairs; ++s) pairs_step<GH, TC>(v + (size_t)s * stride, pw + s, a[0]);
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) {
            __m512 t = a[0][j][c];
#pragma GCC unroll 4
            for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, a[u][j][c]);
            _mm512_storeu_ps(acc + (size_t)j * Dp + d0 + 16 * c, t);
        }
}

template <int GH>
static inline void pv_pairs_group(const char* V, int nvalid, int Dp, const float* S, float* acc, const char* pf,
                                  int pf_lines) {
    constexpr int TC = GH <= 4 ? 4 : 2;                  // 16*TC dims per pass: a tile or half of one
    constexpr int U = GH <= 2 ? 2 : 1;                   // chains GH*TC*U: 8-16
    // 1. p (zero past nvalid: softmax_page) -> bf16, 32 per head = 16 pair words
    alignas(64) uint16_t p16[GH][PT];
    probs_bf16(S, GH, GH, &p16[0][0]);
    const uint32_t* pw = reinterpret_cast<const uint32_t*>(&p16[0][0]);
    const int npairs = (nvalid + 1) / 2;
    // 2. passes over whole tiles (16*TC dims), then 16 dims at a time in the narrower last tile;
    //    the next V run prefetched a share of each pass
    auto first = [&](int d) { return d * pf_lines / Dp; };
    auto at = [&](int d) { return pf ? pf + 64 * (size_t)first(d) : nullptr; };
    const int full = Dp / PAIR_TILE * PAIR_TILE;
    int d = 0;
    for (; d + 16 * TC <= full; d += 16 * TC)
        pv_pairs_pass<GH, TC, U>(V + (size_t)pair_word(0, d, Dp) * 4, PAIR_TILE * 4, npairs, Dp, d, pw, acc, at(d),
                                 first(d + 16 * TC) - first(d));
    for (; d < Dp; d += 16) {
        const int w = std::min(PAIR_TILE, Dp - d / PAIR_TILE * PAIR_TILE);
        pv_pairs_pass<GH, 1, 2>(V + (size_t)pair_word(0, d, Dp) * 4, (size_t)w * 4, npairs, Dp, d, pw, acc, at(d),
                                first(d + 16) - first(d));
    }
}

// pf: the next page (page_bytes: K run then V run); the first group's passes prefetch its V run
static inline void pv_page_pairs(const void* V, int nvalid, int Dp, const float* S, int g, float* acc,
                                 const char* pf, size_t page_bytes) {
    const int v_lines = (int)(page_bytes / 2 / 64);
    const char* pv = pf ? pf + page_bytes / 2 : nullptr;
    for_groups<8>(BF16, g, [&](auto, auto GH, int j0) {
        pv_pairs_group<GH.value>(static_cast<const char*>(V), nvalid, Dp, S + (size_t)j0 * PT, acc + (size_t)j0 * Dp,
                                 j0 == 0 ? pv : nullptr, v_lines);
    });
}

// V run of pair words: rows s0 .. s0+nr-1 (bf16 [nr][Dp]) into their halves; an even slot also
// zeroes its odd half (filled when that token comes)
static inline void pairs_in(const uint16_t* blk, int64_t nr, uint16_t* vrun, int s0, int Dp) {
    uint32_t* words = reinterpret_cast<uint32_t*>(vrun);
    auto one = [&](int64_t r) {
        const int t = s0 + (int)r;
        for (int d = 0; d < Dp; ++d) {
            uint32_t& w = words[pair_word(t >> 1, d, Dp)];
            const uint32_t x = blk[(size_t)r * Dp + d];
            w = t & 1 ? (w & 0xffffu) | (x << 16) : x;
        }
    };
    int64_t r = 0;
    if (s0 & 1) one(r++);
    for (; r + 1 < nr; r += 2) {      // a whole pair: 16 dims of both tokens per store
        const uint16_t* a = blk + (size_t)r * Dp;
        const int s = (s0 + (int)r) >> 1;
        for (int d = 0; d < Dp; d += 16) {
            __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + d)));
            __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + Dp + d)));
            _mm512_storeu_si512(words + pair_word(s, d, Dp), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
    if (r < nr) one(r);
}

// 2^x for x <= 0 (softmax arguments): 2^round(x) * poly(frac), degree-7 Taylor, rel err < 1e-8
static inline __m512 exp2v(__m512 x) {
    // -inf -> 2^-200 -> 0 after scalef; NaN stays NaN (maxps returns its second operand if either is NaN)
    x = _mm512_max_ps(_mm512_set1_ps(-200.f), x);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(EXP2_POLY[7]);
#pragma GCC unroll 7
    for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP2_POLY[i]));
    return _mm512_scalef_ps(p, n);
}

static inline float exp2_1(float x) { return _mm512_cvtss_f32(exp2v(_mm512_set1_ps(x))); }

// Online softmax over one head's 32 tokens. The running max is only reduced when some score
// passes it (after the first pages of a sequence, rarely), and l is kept in 16 lanes: the common
// page costs no horizontal reduction and no scalar chain. Skipping the max reduction changes no bit
// (mn == m either way); the lane sums change the order l is added in (bench/kernel/CHANGELOG.md, 11).
constexpr int L_LANES = 16;
static inline float l_total(const float* l) { return _mm512_reduce_add_ps(_mm512_loadu_ps(l)); }

static inline float softmax_page(float* S, int nvalid, float& m, float* l) {
    const __mmask16 ka = (__mmask16)((1u << (nvalid < 16 ? nvalid : 16)) - 1u);
    const __mmask16 kb = (__mmask16)((1u << (nvalid > 16 ? nvalid - 16 : 0)) - 1u);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __m512 x = _mm512_mask_loadu_ps(ninf, ka, S), y = _mm512_mask_loadu_ps(ninf, kb, S + 16);
    __m512 vm = _mm512_set1_ps(m), lv = _mm512_loadu_ps(l);
    float alpha = 1.f;
    if (_mm512_cmp_ps_mask(x, vm, _CMP_GT_OQ) | _mm512_cmp_ps_mask(y, vm, _CMP_GT_OQ)) {
        const float mn = std::fmax(m, _mm512_reduce_max_ps(_mm512_max_ps(x, y)));
        alpha = exp2_1(m - mn);
        lv = _mm512_mul_ps(lv, _mm512_set1_ps(alpha));
        m = mn;
        vm = _mm512_set1_ps(mn);
    }
    __m512 px = _mm512_maskz_mov_ps(ka, exp2v(_mm512_sub_ps(x, vm)));
    __m512 py = _mm512_maskz_mov_ps(kb, exp2v(_mm512_sub_ps(y, vm)));
    _mm512_storeu_ps(S, px);
    _mm512_storeu_ps(S + 16, py);
    _mm512_storeu_ps(l, _mm512_add_ps(lv, _mm512_add_ps(px, py)));
    return alpha;
}

// tanh (simd.h: TANH_POLY below |y| = 0.5, (1 - e) / (1 + e) above; e saturates at 0 -> 1).
// Measured against float64 over |x / cap| in 2^-20 .. 40: |error| <= 3 ulp of cap tanh(x / cap), the
// rounding of x / cap included (relative < 2.4e-7; tests/test_attn_variants.py asserts 4 ulp)
static inline __m512 tanhv(__m512 y) {
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 ay = _mm512_abs_ps(y);
    const __m512 e = exp2v(_mm512_mul_ps(ay, _mm512_set1_ps(-2.f * LOG2E)));
    const __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 y2 = _mm512_mul_ps(ay, ay);
    __m512 p = _mm512_set1_ps(TANH_POLY[7]);
#pragma GCC unroll 7
    for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, y2, _mm512_set1_ps(TANH_POLY[i]));
    const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(ay, _mm512_set1_ps(0.5f), _CMP_LT_OQ), big, _mm512_mul_ps(ay, p));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

static inline void softcap_page(float* S, int g, float cap) {
    const __m512 c = _mm512_set1_ps(cap), inv = _mm512_set1_ps(1.f / cap);
    for (int i = 0; i < g * PT; i += 16)
        _mm512_storeu_ps(S + i, _mm512_mul_ps(c, tanhv(_mm512_mul_ps(_mm512_loadu_ps(S + i), inv))));
}

static inline void scale_row(float* acc, float alpha, int Dp) {
    __m512 a = _mm512_set1_ps(alpha);
    for (int d = 0; d < Dp; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(a, _mm512_loadu_ps(acc + d)));
}

static inline void store_row(const void* src, int sdt, void* dst, int ddt, int D, int Dp) {
    if (D % 16 != 0 || (ddt != F32 && sdt == ddt) || (ddt == F32 && sdt == F32)) {
        store_row_scalar(src, sdt, dst, ddt, D, Dp);
        return;
    }
    for (int i = 0; i < D; i += 16) {
        __m512 x;
        if (sdt == F32) x = _mm512_loadu_ps(static_cast<const float*>(src) + i);
        else x = load16<BF16>(static_cast<const uint16_t*>(src) + i);
        if (ddt == F32) {
            _mm512_storeu_ps(static_cast<float*>(dst) + i, x);
        } else if (ddt == F16) {
            _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(dst) + i),
                                _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        } else {  // BF16, round to nearest even; NaN -> quiet NaN
            __m512i r = bf16_rne_bits(x);
            __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(_mm512_castps_si512(x), 16), _mm512_set1_epi32(0x40));
            _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(dst) + i), _mm512_cvtepi32_epi16(r));
        }
    }
    if (ddt == F32) for (int i = D; i < Dp; ++i) static_cast<float*>(dst)[i] = 0.f;
    else for (int i = D; i < Dp; ++i) static_cast<uint16_t*>(dst)[i] = 0;
}

}  // namespace FD_NS
