// amx_i8.h — int8 KV on the AMX tiles (AMX-INT8): the scores and PV of one int8 page for R query rows.
//
// The int8 page (quant.h) is already the tiles' layout, as the bf16 one is (amx.h):
//   K run  [Dp/4][PT] words of 4 dims (kq + 128): 16 word rows x 16 tokens is a B tile of unsigned
//          bytes, row stride PT * 4; the query parts (signed) are the A tiles, 64 dims a product:
//          tdpbsud adds sum (kq + 128) q over 64 dims for R rows x 16 tokens
//   V run  [PT/4][Dp] words of 4 tokens: the page's 8 quad rows x 16 dims is a B tile of signed
//          bytes, row stride Dp * 4; the page weights' 7-bit parts (unsigned, quant_p) the A tiles,
//          one row of PT bytes each: tdpbusd adds a whole page's tokens for R rows x 16 dims
// Every sum is the integer the AVX-512 passes (simd_avx512_i8_passes.h) compute, and the fp32
// epilogues here are theirs operation for operation, so the outputs equal the AVX-512 int8 path's
// bit for bit. Slots past a page's tokens keep old bytes (finite integers) and weigh 0: no masking.
//
// Tiles (int8_tile_config(R), loaded at the start of each work item):
//   tmm0 A  q hi     [R][64 dims] int8     row stride Dp bytes
//   tmm1 A  q lo     [R][64 dims] int8
//   tmm2 B  K words  [16 rows][16 tokens]  row stride PT * 4 bytes
//   tmm3 C  hi sums  [R][16] int32         scores: 16 tokens; PV: 16 dims
//   tmm4 C  lo sums  [R][16] int32
//   tmm5 A  w hi     [R][PT tokens] uint8  row stride PT bytes
//   tmm6 A  w lo     [R][PT tokens] uint8
//   tmm7 B  V quads  [PT/4 rows][16 dims]  row stride Dp * 4 bytes
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "amx.h"

namespace FD_NS {

static inline TileConfig int8_tile_config(int R) {
    TileConfig c;
    const uint8_t rows[8] = {(uint8_t)R, (uint8_t)R, 16, (uint8_t)R, (uint8_t)R, (uint8_t)R, (uint8_t)R, PT / 4};
    const uint16_t colsb[8] = {64, 64, 64, 64, 64, PT, PT, 64};
    for (int i = 0; i < 8; ++i) {
        c.rows[i] = rows[i];
        c.colsb[i] = colsb[i];
    }
    return c;
}

// ============================================================================
// scores: S[j][t] = (K[t] . qh_j + K[t] . ql_j / 254) * qs[j] * ksc[t], rows j < rows of R
// ============================================================================

// qh, ql [R][Dp] bytes: the rows' query parts; qs [R], qz [R][2] their scales and bias sums;
// S [R][PT] gets the scores (the hi sums pass through it as int32 first), lo [R][PT] int32 scratch;
// pf: the next page, whose K half is prefetched a share per 64 dims of the first token half
template <class Tiles>
static void scores_page_i8_tiles(const char* K, int Dp, const int8_t* qh, const int8_t* ql, const float* qs,
                                 const int32_t* qz, int rows, float* S, int32_t* lo, const char* pf) {
    const int steps = Dp / 64, lines = (int)(i8_half_bytes(Dp) / 64);
    constexpr size_t krow = PT * 4;
    int32_t* hi = reinterpret_cast<int32_t*>(S);
    // 1. integer sums, one token half (16 tokens) at a time: C tiles hi and lo
    for (int h = 0; h < 2; ++h) {
        Tiles::template zero_t<3>();
        Tiles::template zero_t<4>();
        for (int s = 0; s < steps; ++s) {
            if (pf && h == 0) prefetch_share(pf, lines, s, steps);
            Tiles::template load_t<0>(qh + (size_t)s * 64, (size_t)Dp);
            Tiles::template load_t<1>(ql + (size_t)s * 64, (size_t)Dp);
            Tiles::template load_t<2>(K + (size_t)s * 16 * krow + h * 64, krow);   // word rows 16s.., tokens 16h..
            Tiles::dot_k8();
        }
        Tiles::template store_t<3>(hi + 16 * h, krow);
        Tiles::template store_t<4>(lo + 16 * h, krow);
    }
    // 2. the AVX-512 passes' epilogue: bias sums off, the lo part in steps of 1/254, the scales
    const float* ksc = reinterpret_cast<const float*>(K + (size_t)Dp * PT);
    const __m512 ka = _mm512_loadu_ps(ksc), kb = _mm512_loadu_ps(ksc + 16);
    const __m512 step = _mm512_set1_ps(1.f / (2 * I8_MAX));
    for (int j = 0; j < rows; ++j) {
        const int32_t* hj = hi + (size_t)j * PT;
        const int32_t* lj = lo + (size_t)j * PT;
        const __m512i zh = _mm512_set1_epi32(qz[2 * j]), zl = _mm512_set1_epi32(qz[2 * j + 1]);
        const __m512i ia = _mm512_sub_epi32(_mm512_loadu_si512(hj), zh), ib = _mm512_sub_epi32(_mm512_loadu_si512(hj + 16), zh);
        const __m512i ja = _mm512_sub_epi32(_mm512_loadu_si512(lj), zl), jb = _mm512_sub_epi32(_mm512_loadu_si512(lj + 16), zl);
        const __m512 s = _mm512_set1_ps(qs[j]);
        const __m512 da = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ja), step, _mm512_cvtepi32_ps(ia));
        const __m512 db = _mm512_fmadd_ps(_mm512_cvtepi32_ps(jb), step, _mm512_cvtepi32_ps(ib));
        _mm512_storeu_ps(S + (size_t)j * PT, _mm512_mul_ps(_mm512_mul_ps(da, s), ka));
        _mm512_storeu_ps(S + (size_t)j * PT + 16, _mm512_mul_ps(_mm512_mul_ps(db, s), kb));
    }
}

// ============================================================================
// PV: acc[j][d] += ps_j * sum_t (wh_j[t] + wl_j[t] / 127) vq[t][d], rows j < rows of R
// ============================================================================

// S [rows][PT] the rows' probabilities; w [2][R][PT] bytes and sums [2][R][16] int32 scratch;
// pf: the next page's V half, prefetched a share per 16 dims
template <class Tiles>
static void pv_page_i8_tiles(const char* V, int nvalid, int Dp, const float* S, int rows, int R, float* acc,
                             uint8_t* w, int32_t* sums, const char* pf, int pf_lines) {
    // 1. each row's page weights p * vsc as two 7-bit parts and their scale (the AVX-512 pass's)
    const float* vsc = reinterpret_cast<const float*>(V + (size_t)PT * Dp);
    uint8_t *wh = w, *wl = w + (size_t)R * PT;
    float ps[16];
    for (int j = 0; j < rows; ++j)
        ps[j] = quant_p_words(S + (size_t)j * PT, vsc, nvalid, reinterpret_cast<uint32_t*>(wh + (size_t)j * PT),
                              reinterpret_cast<uint32_t*>(wl + (size_t)j * PT));
    std::memset(wh + (size_t)rows * PT, 0, (size_t)(R - rows) * PT);
    std::memset(wl + (size_t)rows * PT, 0, (size_t)(R - rows) * PT);
    Tiles::template load_t<5>(wh, PT);
    Tiles::template load_t<6>(wl, PT);
    // 2. per 16 dims: the page's tokens in one tile product per part, then the pass's epilogue
    const int steps = Dp / 16;
    const __m512 step = _mm512_set1_ps(1.f / I8_MAX);
    for (int s = 0; s < steps; ++s) {
        if (pf) prefetch_share(pf, pf_lines, s, steps);
        const int d = 16 * s;
        Tiles::template zero_t<3>();
        Tiles::template zero_t<4>();
        Tiles::template load_t<7>(V + (size_t)d * 4, (size_t)Dp * 4);
        Tiles::dot_pv8();
        Tiles::template store_t<3>(sums, 64);
        Tiles::template store_t<4>(sums + (size_t)R * 16, 64);
        for (int j = 0; j < rows; ++j) {
            const __m512 a = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + (size_t)j * 16));
            const __m512 b = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + (size_t)(R + j) * 16));
            float* o = acc + (size_t)j * Dp + d;
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_fmadd_ps(b, step, a), _mm512_set1_ps(ps[j]), _mm512_loadu_ps(o)));
        }
    }
}

// ============================================================================
// by mode (AMX_HW, AMX_EMU)
// ============================================================================

static inline void amx_begin_i8(int mode, int R) {
#if defined(FD_HAVE_AMX_HW)
    if (mode == AMX_HW) return AmxHw::config(int8_tile_config(R));
#endif
    AmxEmu::config(int8_tile_config(R));
}

static inline void scores_page_i8_amx(int mode, const char* K, int Dp, const int8_t* qh, const int8_t* ql, const float* qs,
                                      const int32_t* qz, int rows, float* S, int32_t* lo, const char* pf) {
#if defined(FD_HAVE_AMX_HW)
    if (mode == AMX_HW) return scores_page_i8_tiles<AmxHw>(K, Dp, qh, ql, qs, qz, rows, S, lo, pf);
#endif
    scores_page_i8_tiles<AmxEmu>(K, Dp, qh, ql, qs, qz, rows, S, lo, pf);
}

static inline void pv_page_i8_amx(int mode, const char* V, int nvalid, int Dp, const float* S, int rows, int R, float* acc,
                                  uint8_t* w, int32_t* sums, const char* pf, int pf_lines) {
#if defined(FD_HAVE_AMX_HW)
    if (mode == AMX_HW) return pv_page_i8_tiles<AmxHw>(V, nvalid, Dp, S, rows, R, acc, w, sums, pf, pf_lines);
#endif
    pv_page_i8_tiles<AmxEmu>(V, nvalid, Dp, S, rows, R, acc, w, sums, pf, pf_lines);
}

}  // namespace FD_NS
