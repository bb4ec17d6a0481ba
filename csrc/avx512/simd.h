// simd.h — the per-ISA building blocks of decode attention over one page: their contract.
//
// The kernel sources are compiled once per ISA; the compiler flags of each module decide which
// ISA header this one includes at its end (simd_avx512.h for FD_AVX512 from common.h,
// simd_avx2.h for __AVX2__, else simd_portable.h). Every ISA header implements the same
// functions with the same meaning; the paging and attention code (paging.h, attention.h) calls
// only these. Here: the contract, and what all ISAs share (PT, prefetch steps, scalar helpers).
//
// A page holds PT = 32 tokens of one (sequence, layer). Per KV head it has
//   K run  [Dw][PT] 32-bit words, Dw = Dp*itemsize/4: word w of token t holds dims (2w, 2w+1)
//                   for bf16/fp16, dim w for fp32. One vector load = 16 tokens of one word, so
//                   a K vector meets a broadcast q[d] of every query head of the group: one pass
//                   over K serves all g heads, with no horizontal sums, tokens in natural order
//   V run  [PT][Dp] token-major (V_TILE = 0), or [Dp/V_TILE][PT][V_TILE] in tiles of V_TILE dims
//          where the ISA's V pass reads one tile of all tokens at a time (a sequential stream):
//          acc[j][:] += p_j[t] * V[t][:]. When Dp is not a multiple of V_TILE the last tile is
//          narrower, [PT][Dp % V_TILE]. An ISA with a second layout under measurement names it
//          V_TILE_ALT; the store chooses per instance (FASTDECODE_VTILE) and tells pv_page.
// Dp = head_dim rounded up to 16; pad dims are zero in the store.
//
// bf16 -> fp32 is a 16-bit shift: a 32-bit word w holding two bf16 gives (w << 16) and
// (w & 0xffff0000), the even and odd dims. For V rows that permutes dims inside each group of
// 32 (16 with AVX2): the accumulators are kept in "acc" order (apos) and un-permuted on output.
//
//   scores_page(dt, K, Dp, q, g, S, pf)  S[j][t] = q_j . K[:, t] (q scaled, log2 units)
//   softmax_page(S, nvalid, m, l)        online softmax step on one head's 32 tokens; S <- p,
//                                        returns alpha (acc must be scaled by it). l: L_LANES
//                                        lane sums, l_total(l) their sum (no horizontal add per page).
//                                        A score of -inf (a token before a sliding window's start,
//                                        attention.h) gives p exactly 0, as does exp2_1(-inf)
//   softcap_page(S, g, cap)              S <- cap tanh(S / cap) on g heads' 32 scores (soft-capping,
//                                        cap in the scores' log2 units): AVX-512 and AVX2 by tanhv
//                                        (<= 3 ulp measured), portable by std::tanh
//   pv_page(dt, V, nvalid, Dp, S, g, acc, pf, pf_bytes, vtile)  acc[j][apos] += sum_t p_j[t] V[t][:]
//                                        vtile: the store's V layout (V_TILE or V_TILE_ALT)
//                                        pf: the next page (pf_bytes) to prefetch while this one
//                                        is computed (nullptr: none); each ISA issues it in one
//                                        of the two passes
//   scale_row(acc, alpha, Dp)            acc *= alpha
//   apos(dt, d, Dp)                      accumulator index of dim d
//   exp2_1(x)                            scalar 2^x computed exactly as the vector path does
//   store_row(src, sdt, dst, ddt, D, Dp) one row into the store with dtype conversion + zero pad
//
// Each ISA header also defines
//   FD_ISA_NAME                          the build's name (the module's ISA attribute)
//   V_TILE, V_TILE_ALT                   its default V layout and a second one (== V_TILE: none)
//   L_LANES                              lanes of softmax_page's l
// and the AVX-512 one, as FD_HAVE_DPBF16, the AVX512-BF16 paths (run only where cpuid has it;
// the SIMDe test build runs them on any CPU):
//   scores_page_dp(K, Dp, qw, sc, g, S, pf)   scores_page from bf16 query pairs qw, scaled by sc
//   V_PAIRS                              a third V layout: bf16 V in token pairs (opt-in)
//   pv_page_pairs(V, nvalid, Dp, S, g, acc, pf, pf_bytes)   pv_page for the V_PAIRS layout
//   pairs_in(blk, nr, vrun, s0, Dp)      rows into a V run of token pairs (the store's append)
//
// int8 stores (quant.h: the page format and the arithmetic), in each ISA's *_i8.h:
//   scores_page_i8(vnni, K, Dp, qh, ql, qs, qz, g, S, pf)   S[j][t] = (K[t] . (qh_j + ql_j / 254)) qs[j] ksc[t];
//                                        qh, ql [g][Dp/4] the query's two parts as words, qs their
//                                        scales (times scale*log2e), qz [g][2] their bias sums
//                                        (quant_query); vnni: the AVX512-VNNI build (AVX-512 only)
//   pv_page_i8(vnni, V, nvalid, Dp, S, g, acc, pf, page_bytes)   acc[j][d] += sum_t w_j[t] vq[t][d],
//                                        w = p * vsc in two 7-bit parts (quant_p); natural dim
//                                        order (apos is the identity for int8)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "common.h"

namespace FD_NS {

constexpr int PT = 32;  // tokens per page (and per softmax block)

// tanh(y) / y on |y| < 0.5 as a polynomial in y^2: Taylor coefficients of tanh to y^15 (the series
// alternates: the first term left out, 6404582/10854718875 y^17, is < 1e-8 |y| there). The AVX
// tanhv take it below 0.5 and (1 - e) / (1 + e), e = 2^(-2 log2(e) |y|), above (no cancellation)
constexpr float TANH_POLY[8] = {1.0f, -3.3333333333333333e-01f, 1.3333333333333333e-01f, -5.3968253968253968e-02f,
                                2.1869488536155203e-02f, -8.8632355299021966e-03f, 3.5921280365724810e-03f,
                                -1.4558343870513183e-03f};

// 2^r on [-0.5, 0.5]: Taylor coefficients ln2^k / k!, k = 0..7 (relative error < 1e-8)
constexpr float EXP2_POLY[8] = {1.0f, 6.9314718055994531e-01f, 2.4022650695910071e-01f, 5.5504108664821580e-02f,
                                9.6181291076284772e-03f, 1.3333558146428443e-03f, 1.5403530393381606e-04f,
                                1.5252733804059840e-05f};

// Software prefetch of the NEXT page while this one is computed. AVX-512 and AVX2 prefetch the
// next K run a line or two per K word row of the scores pass and the next V run a line or two
// per token of the V pass, so the prefetches spread over both passes; the portable scores loop
// walks the next page's K+V runs (contiguous) at twice the pace of this K run. Measured against
// a burst of 256 prefetches at each page start (which queues on the L1 miss buffers), the whole
// next page during the K pass (AVX-512 up to version 9), 2 or 3 pages ahead, L2-only hints,
// prefetching only pages that do not follow in memory, and none: bench/kernel/CHANGELOG.md.
static inline void prefetch_lines(const char* p, size_t from, size_t to) {
    for (size_t o = from; o < to; o += 64) __builtin_prefetch(p + o, 0, 3);
}

// cache lines of one K run (= one V run) of a page
static inline int k_run_lines(int dt, int Dp) { return (int)(PT * Dp * dtype_size(dt) / 64); }

// step i of n: the share [i*per, (i+1)*per) of `lines` cache lines at p, per = ceil(lines / n)
static inline void prefetch_share(const char* p, int lines, int i, int n) {
    const int per = (lines + n - 1) / n;
    for (int u = i * per, e = std::min(lines, (i + 1) * per); u < e; ++u) __builtin_prefetch(p + 64 * (size_t)u, 0, 3);
}

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

// final normalisation; acc is in accumulator order, pos[d] maps dim -> accumulator index
static inline void out_row(const float* acc, const int* pos, float inv_l, int D, void* dst, int odt) {
    if (odt == F32) {
        float* o = static_cast<float*>(dst);
        for (int i = 0; i < D; ++i) o[i] = acc[pos[i]] * inv_l;
    } else {
        uint16_t* o = static_cast<uint16_t*>(dst);
        for (int i = 0; i < D; ++i) o[i] = f32_to_bf16(acc[pos[i]] * inv_l);
    }
}

// Dispatch a runtime (dtype, group size) to a template instantiation. F(DT, GH) must be a
// generic lambda-like functor taking std::integral_constant arguments.
template <int DT, int MAXG, class F>
static inline void with_group(int gh, F&& f) {
    switch (gh) {
        case 1: f(std::integral_constant<int, DT>(), std::integral_constant<int, 1>()); break;
        case 2: if constexpr (MAXG >= 2) f(std::integral_constant<int, DT>(), std::integral_constant<int, 2>()); break;
        case 3: if constexpr (MAXG >= 3) f(std::integral_constant<int, DT>(), std::integral_constant<int, 3>()); break;
        case 4: if constexpr (MAXG >= 4) f(std::integral_constant<int, DT>(), std::integral_constant<int, 4>()); break;
        case 5: if constexpr (MAXG >= 5) f(std::integral_constant<int, DT>(), std::integral_constant<int, 5>()); break;
        case 6: if constexpr (MAXG >= 6) f(std::integral_constant<int, DT>(), std::integral_constant<int, 6>()); break;
        case 7: if constexpr (MAXG >= 7) f(std::integral_constant<int, DT>(), std::integral_constant<int, 7>()); break;
        case 8: if constexpr (MAXG >= 8) f(std::integral_constant<int, DT>(), std::integral_constant<int, 8>()); break;
        default: break;
    }
}

template <int MAXG, class F>
static inline void for_groups(int dt, int g, F&& f) {
    // heads in groups of at most MAXG (the register budget), each group one template call
    for (int j0 = 0; j0 < g; j0 += MAXG) {
        int gh = g - j0 < MAXG ? g - j0 : MAXG;
        auto call = [&](auto DT, auto GH) { f(DT, GH, j0); };
        if (dt == BF16) with_group<BF16, MAXG>(gh, call);
        else if (dt == F16) with_group<F16, MAXG>(gh, call);
        else with_group<F32, MAXG>(gh, call);
    }
}

}  // namespace FD_NS

// one ISA header: the functions of the contract above for this build
#define FD_SIMD_H 1   // the ISA headers check that they come through here
#include "quant.h"
#if defined(FD_AVX512)
#include "simd_avx512.h"
#include "simd_avx512_i8.h"
#elif defined(__AVX2__)
#include "simd_avx2.h"
#include "simd_avx2_i8.h"
#else
#include "simd_portable.h"
#include "simd_portable_i8.h"
#endif
