// quant.h — int8 KV: the page format, the quantizers of the append and of the query.
//
// An int8 store keeps K and V as 8-bit integers with one fp32 scale per (token, kv head), for K
// and for V. Per-token scales let an append quantize its rows alone: a token is never requantized
// when later tokens arrive, and the wire still carries the S-worker's fp32/bf16 rows. (Scales per
// page and channel, as KIVI keeps for keys, would need a page's tokens before its scales exist;
// bench/kernel/int8_granularity.py measured what they would buy on the embedded model's keys.)
//
// Page of one (sequence, layer, kv head), 2 * (PT*Dp + PT*4) bytes:
//   K run    [Dp/4][PT] words: word w of token t holds dims 4w..4w+3 as kq + 128 (uint8)
//   K scales [PT] fp32
//   V run    [PT/4][Dp] words: word (s, d) holds dim d of tokens 4s..4s+3 (int8)
//   V scales [PT] fp32
// x = scale * xq with xq = rint(x * 127 / amax) in [-127, 127], scale = amax / 127, amax the
// row's largest |x| (all zero: scale 0). K is stored biased (+128) so that the unsigned operand
// of vpdpbusd is K and the signed one the query: q . k = sum (kq + 128) q - 128 sum q, the second
// term once per query. V is stored 4 tokens to a word so that one vpdpbusd adds 4 tokens' products.
//
// The attention over an int8 page (the ISA headers' scores_page_i8 / pv_page_i8):
//   query  qq = rint(q * 127 / amax_q), once per (row, head) and call (quant_query)
//   scores s[t] = (sum_d qq[d] kq[t][d]) * (amax_q / 127) * ksc[t] * scale * log2(e): integer
//          dot products, exact in int32 (|sum| <= 256 * 127 * 127 * Dp / 4)
//   PV     w[t] = p[t] * vsc[t], pq = rint(w * 127 / max_t w) in [0, 127] per (page, head),
//          acc[d] += (max_t w / 127) * sum_t pq[t] vq[t][d]: integer again, 7-bit p so that the
//          AVX2 pair products (vpmaddubsw, saturating at 32767) stay exact: 2 * 127 * 127
// Every ISA computes the same integers; only the fp32 epilogues may round differently.
#pragma once

#ifndef FD_SIMD_H
#error "quant.h is included through simd.h (it needs PT)"
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace FD_NS {

constexpr int I8_MAX = 127;
constexpr int K_BIAS = 128;                      // stored K byte = kq + K_BIAS
constexpr size_t I8_SCALE_BYTES = (size_t)PT * 4;  // the scales after a K or V run

// bytes of one K or V half of an int8 page (run + scales)
inline size_t i8_half_bytes(int Dp) { return (size_t)PT * Dp + I8_SCALE_BYTES; }

// rint(x * inv) clamped to [-127, 127]; NaN -> 0 (the row's scale is NaN then, and so its output)
static inline int quant_one(float x, float inv) {
    float y = x * inv;
    if (!(y == y)) return 0;
    y = y > (float)I8_MAX ? (float)I8_MAX : y < -(float)I8_MAX ? -(float)I8_MAX : y;
    return (int)std::nearbyint(y);
}

// one row of D values (sdt F32 or BF16) -> Dp bytes (xq + bias, pad dims 0 + bias); its scale
static inline float quant_row(const void* src, int sdt, int D, int Dp, uint8_t* dst, int bias) {
    float amax = 0.f;
    bool finite = true;
    for (int i = 0; i < D; ++i) {
        const float a = std::fabs(load_scalar(src, i, sdt));
        finite &= a <= 3.4e38f;                            // false for inf and NaN
        amax = std::fmax(amax, a);
    }
    if (!finite) amax = NAN;                               // inf or NaN in the row: NaN out, as fp32 KV gives
    const float inv = amax > 0.f ? (float)I8_MAX / amax : 0.f;
    for (int i = 0; i < D; ++i) dst[i] = (uint8_t)(quant_one(load_scalar(src, i, sdt), inv) + bias);
    for (int i = D; i < Dp; ++i) dst[i] = (uint8_t)bias;
    return amax / (float)I8_MAX;
}

// a query row -> Dp int8 (as bytes of 32-bit words), its scale amax/127 and 128 * sum(qq) (the
// bias correction of the K bytes)
static inline void quant_query(const void* src, int qdt, int D, int Dp, int8_t* dst, float& scale, int32_t& bias_sum) {
    scale = quant_row(src, qdt, D, Dp, reinterpret_cast<uint8_t*>(dst), 0);
    int32_t s = 0;
    for (int i = 0; i < Dp; ++i) s += dst[i];
    bias_sum = K_BIAS * s;
}

// V run of 4-token words: rows s0 .. s0+nr-1 of blk [nr][Dp] (int8) into byte (t % 4) of word
// (t / 4, d). Slots past a page's tokens keep old bytes: their pq is 0, so they add nothing.
static inline void quads_in(const uint8_t* blk, int64_t nr, uint8_t* vrun, int s0, int Dp) {
    for (int64_t r = 0; r < nr; ++r) {
        const int t = s0 + (int)r;
        uint8_t* base = vrun + (size_t)(t >> 2) * Dp * 4 + (t & 3);
        const uint8_t* row = blk + (size_t)r * Dp;
        for (int d = 0; d < Dp; ++d) base[(size_t)d * 4] = row[d];
    }
}

// one head's page weights for the int8 PV: w[t] = p[t] * vsc[t] (t < nvalid, else 0) -> pq [PT]
// in [0, 127]; returns the scale max(w) / 127 (0: the page adds nothing). Written so that -O3
// vectorizes it; the AVX-512 build has its own (simd_avx512_i8.h), equal in every bit.
static inline float quant_p(const float* p, const float* vsc, int nvalid, uint8_t* pq) {
    float w[PT];
    float wmax = 0.f;
    bool finite = true;
    for (int t = 0; t < PT; ++t) {
        w[t] = t < nvalid ? p[t] * vsc[t] : 0.f;
        finite &= w[t] <= 3.4e38f;
        wmax = std::fmax(wmax, w[t]);
    }
    const float inv = wmax > 0.f ? (float)I8_MAX / wmax : 0.f;
    for (int t = 0; t < PT; ++t) pq[t] = (uint8_t)quant_one(w[t], inv);
    return finite ? wmax / (float)I8_MAX : NAN;          // a NaN scale (NaN input rows): NaN out
}

}  // namespace FD_NS
