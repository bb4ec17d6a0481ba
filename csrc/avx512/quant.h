// quant.h — int8 KV: the page format, the quantizers of the append and of the query.
//
// An int8 store keeps K and V as 8-bit integers with one fp32 scale per (token, kv head), for K
// and for V. Per-token scales let an append quantize its rows alone: a token is never requantized
// when later tokens arrive, and the wire still carries the S-worker's fp32/bf16 rows. (Scales per
// page and channel would need a page's tokens before its scales exist;
// bench/kernel/int8_granularity.py measured what they would buy on the embedded model's keys.)
//
// Page of one (sequence, layer, kv head), 2 * (PT*Dp + PT*4) bytes:
//   K run    [Dp/4][PT] words: word w of token t holds dims 4w..4w+3 as kq + 128 (uint8)
//   K scales [PT] fp32
//   V run    [PT/4][Dp] words: word (s, d) holds dim d of tokens 4s..4s+3 (int8)
//   V scales [PT] fp32
// x = scale * xq with xq = rint(x * 127 / amax) in [-127, 127], scale = amax / 127, amax the
// row's largest |x| (all zero: scale 0). K rows are stored turned by a Hadamard rotation (hadamard
// below; queries turn the same way, so scores are unchanged): per-token scales then lose little to
// the keys' outlier channels. K is stored biased (+128) so that the unsigned operand
// of vpdpbusd is K and the signed one the query: q . k = sum (kq + 128) q - 128 sum q, the second
// term once per query. V is stored 4 tokens to a word so that one vpdpbusd adds 4 tokens' products.
//
// The attention over an int8 page (the ISA headers' scores_page_i8 / pv_page_i8):
//   query  q = sq * (qh + ql / 254), two int8 parts, once per (row, head) and call (quant_query)
//   scores s[t] = (K[t] . qh + K[t] . ql / 254) * sq * ksc[t] * scale * log2(e): two integer dot
//          products per K word, exact in int32 (|sum| <= 255 * 127 * Dp)
//   PV     w[t] = p[t] * vsc[t] = ps * (ph[t] + pl[t] / 127) per (page, head), ph and pl in
//          [0, 127] (quant_p); acc[d] += ps * (sum_t ph[t] vq[t][d] + sum_t pl[t] vq[t][d] / 127):
//          integer again, 7-bit parts so that the AVX2 pair products (vpmaddubsw, saturating at
//          32767) stay exact: 2 * 127 * 127
// Why two parts each: on the embedded model's K/V/q (bench/kernel/int8_granularity.py) a query in
// one int8 part erred about as much as per-token int8 keys (relative error of the output 1.6% and
// 1.9%), page weights in one 7-bit part 0.8%; with the keys rotated and both in two parts, the
// kernel's arithmetic errs 1.1% where all in one part erred 1.6% (2.8% unrotated). The residual
// parts cost one more integer dot product each and leave the error to K and V.
// Every ISA computes the same integers; only the fp32 epilogues may round differently.
#pragma once

#ifndef FD_SIMD_H
#error "quant.h is included through simd.h (it needs PT)"
#endif

#include <algorithm>
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

// rint(x * inv) clamped to [-127, 127]; NaN -> 0 (the row's scale is NaN then, and so its output).
// Selects, not branches, so that loops over it vectorize.
static inline int quant_one(float x, float inv) {
    float y = x * inv;
    y = y == y ? y : 0.f;
    y = y > (float)I8_MAX ? (float)I8_MAX : y;
    y = y < -(float)I8_MAX ? -(float)I8_MAX : y;
    return (int)std::nearbyint(y);
}

// one row of D values (sdt F32 or BF16) -> x [Dp] floats, pad dims 0
static inline void load_row(const void* src, int sdt, int D, int Dp, float* x) {
    for (int i = 0; i < D; ++i) x[i] = load_scalar(src, i, sdt);
    for (int i = D; i < Dp; ++i) x[i] = 0.f;
}

// x [n] <- blocks of B dims each times the orthonormal Hadamard matrix H_B / sqrt(B), B the largest
// power of two dividing n, at most 128 (n is a multiple of 16). Keys and queries both turn, so
// q . k is unchanged, while a few large channels (the keys' outliers) spread over all B dims and
// a per-token scale no longer has to span them.
static inline int hadamard_block(int n) { return std::min(n & -n, 128); }

// the butterflies y[j] = a + c, y[j + h] = a - c of stages h = h0, 2 h0, .. < B, then the norm
static inline void hadamard_stages(float* x, int n, int h0) {
    const int B = hadamard_block(n);
    const float norm = 1.f / std::sqrt((float)B);
    for (int b0 = 0; b0 < n; b0 += B) {
        float* y = x + b0;
        for (int h = h0; h < B; h *= 2)
            for (int i = 0; i < B; i += 2 * h)
                for (int j = i; j < i + h; ++j) {
                    const float a = y[j], c = y[j + h];
                    y[j] = a + c;
                    y[j + h] = a - c;
                }
        for (int i = 0; i < B; ++i) y[i] *= norm;
    }
}

// each ISA's i8 header defines hadamard(x, n): the same butterflies in the same order (so the same
// bits), the first stages inside vectors where it can
static inline void hadamard(float* x, int n);

// x [Dp] -> Dp bytes xq + bias; its scale amax / 127 (NaN where x has inf or NaN: NaN out, as
// fp32 KV gives)
// largest |x[i]| by the bits: for |x| the integer order is the float order, and inf/NaN sort
// above every finite value (0x7f800000 and up), so one integer max (which vectorizes, where a
// float max with NaN semantics does not) gives both the max and whether the row is finite
static inline uint32_t abs_max_bits(const float* x, int n) {
    uint32_t m = 0;
    for (int i = 0; i < n; ++i) {
        const uint32_t b = f32_bits(x[i]) & 0x7fffffffu;
        m = b > m ? b : m;
    }
    return m;
}

static inline float quant_floats(const float* x, int Dp, uint8_t* dst, int bias) {
    const uint32_t m = abs_max_bits(x, Dp);
    const float amax = bits_f32(m);
    const float inv = amax > 0.f && m < 0x7f800000u ? (float)I8_MAX / amax : 0.f;
    for (int i = 0; i < Dp; ++i) dst[i] = (uint8_t)(quant_one(x[i], inv) + bias);
    return m < 0x7f800000u ? amax / (float)I8_MAX : NAN;
}

// a K row: turned (hadamard), then quantized biased; a V row: quantized as it is. x: [Dp] scratch
static inline float quant_key(const void* src, int sdt, int D, int Dp, uint8_t* dst, float* x) {
    load_row(src, sdt, D, Dp, x);
    hadamard(x, Dp);
    return quant_floats(x, Dp, dst, K_BIAS);
}
static inline float quant_value(const void* src, int sdt, int D, int Dp, uint8_t* dst, float* x) {
    load_row(src, sdt, D, Dp, x);
    return quant_floats(x, Dp, dst, 0);
}

// a query row, turned as the keys are, -> two int8 parts, q = scale * (hi + lo / 254): hi =
// rint(q * 127 / amax), lo the residual (|q / scale - hi| <= 1/2) in steps of 1/254, so the scores
// see a ~15-bit query for a second integer dot product; bias_sums[0..1] = 128 * sum(hi),
// 128 * sum(lo) (the K bias). x: [Dp] scratch
static inline void quant_query(const void* src, int qdt, int D, int Dp, int8_t* hi, int8_t* lo, float& scale,
                               int32_t* bias_sums, float* x) {
    load_row(src, qdt, D, Dp, x);
    hadamard(x, Dp);
    const uint32_t m = abs_max_bits(x, Dp);
    const float amax = m < 0x7f800000u ? bits_f32(m) : 0.f;       // a non-finite query: defined ints,
    const float inv = amax > 0.f ? (float)I8_MAX / amax : 0.f;
    int32_t sh = 0, sl = 0;
    for (int i = 0; i < Dp; ++i) {
        const int h = quant_one(x[i], inv);
        const int l = quant_one(x[i] * inv - (float)h, (float)(2 * I8_MAX));
        hi[i] = (int8_t)h;
        lo[i] = (int8_t)l;
        sh += h;
        sl += l;
    }
    scale = m < 0x7f800000u ? amax / (float)I8_MAX : NAN;         // and a NaN output, as fp32 KV gives
    bias_sums[0] = K_BIAS * sh;
    bias_sums[1] = K_BIAS * sl;
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

// one head's page weights for the int8 PV: w[t] = p[t] * vsc[t] (t < nvalid, else 0) as two 7-bit
// parts, w = scale * (hi + lo / 127): hi = floor(w / scale), lo = rint((w / scale - hi) * 127), both
// in [0, 127] (unsigned, as vpdpbusd's first operand wants; 7 bits for vpmaddubsw), ~14 bits in
// all; returns scale = max(w) / 127 (0: the page adds nothing). Written so that -O3 vectorizes it;
// the AVX-512 build has its own (simd_avx512_i8.h), equal in every bit.
static inline float quant_p(const float* p, const float* vsc, int nvalid, uint8_t* hi, uint8_t* lo) {
    float w[PT];
    float wmax = 0.f;
    bool finite = true;
    for (int t = 0; t < PT; ++t) {
        w[t] = t < nvalid ? p[t] * vsc[t] : 0.f;
        finite &= w[t] <= 3.4e38f;
        wmax = std::fmax(wmax, w[t]);
    }
    const float inv = wmax > 0.f ? (float)I8_MAX / wmax : 0.f;
    for (int t = 0; t < PT; ++t) {
        float y = w[t] * inv;
        y = y == y ? std::fmin(y, (float)I8_MAX) : 0.f;
        const float h = std::floor(y);
        hi[t] = (uint8_t)(int)h;
        lo[t] = (uint8_t)(int)std::nearbyint((y - h) * (float)I8_MAX);
    }
    return finite ? wmax / (float)I8_MAX : NAN;          // a NaN scale (NaN input rows): NaN out
}

}  // namespace FD_NS
