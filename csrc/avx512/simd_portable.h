// simd_portable.h — simd.h's functions in plain C++ (any CPU; the fallback build).
//
// Included by simd.h in the portable build.
#pragma once

#ifndef FD_SIMD_H
#error "simd_portable.h is included through simd.h"
#endif

namespace FD_NS {

// ============================================================================
// portable: plain C++, baseline ISA only (SSE2 on x86-64); inner loops over 32 tokens or over
// dims are written so -O3 vectorizes them with whatever the baseline offers. No intrinsics.
// ============================================================================
#define FD_ISA_NAME "portable"

static inline int apos(int, int d, int) { return d; }

template <int DT>
static inline float ld(const void* p, size_t i) {
    if constexpr (DT == BF16) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    else if constexpr (DT == F16) return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    else return static_cast<const float*>(p)[i];
}

template <int DT>
static inline void scores_t(const void* K, int Dp, const float* q, int g, float* S, const char* pf) {
    constexpr int dpr = DT == F32 ? 1 : 2;   // dims per 32-bit word
    const uint32_t* k = static_cast<const uint32_t*>(K);
    for (int i = 0; i < g * PT; ++i) S[i] = 0.f;
    float x[PT], y[PT];
    for (int d = 0; d < Dp; d += dpr) {
        const uint32_t* row = k + (size_t)(d / dpr) * PT;
        if (pf) prefetch_lines(pf, 2 * (size_t)(d / dpr) * PT * 4, 2 * (size_t)(d / dpr + 1) * PT * 4);
        for (int t = 0; t < PT; ++t) {
            if constexpr (DT == F32) x[t] = bits_f32(row[t]);
            else if constexpr (DT == BF16) { x[t] = bits_f32(row[t] << 16); y[t] = bits_f32(row[t] & 0xffff0000u); }
            else { x[t] = f16_to_f32((uint16_t)row[t]); y[t] = f16_to_f32((uint16_t)(row[t] >> 16)); }
        }
        for (int j = 0; j < g; ++j) {
            float* s = S + (size_t)j * PT;
            const float q0 = q[(size_t)j * Dp + d];
            for (int t = 0; t < PT; ++t) s[t] += q0 * x[t];
            if constexpr (dpr == 2) {
                const float q1 = q[(size_t)j * Dp + d + 1];
                for (int t = 0; t < PT; ++t) s[t] += q1 * y[t];
            }
        }
    }
}

static inline void scores_page(int dt, const void* K, int Dp, const float* q, int g, float* S, const char* pf) {
    if (dt == BF16) scores_t<BF16>(K, Dp, q, g, S, pf);
    else if (dt == F16) scores_t<F16>(K, Dp, q, g, S, pf);
    else scores_t<F32>(K, Dp, q, g, S, pf);
}

template <int DT>
static inline void pv_t(const void* V, int nvalid, int Dp, const float* S, int g, float* acc, float* v) {
    for (int t = 0; t < nvalid; ++t) {
        for (int d = 0; d < Dp; ++d) v[d] = ld<DT>(V, (size_t)t * Dp + d);
        for (int j = 0; j < g; ++j) {
            const float p = S[(size_t)j * PT + t];
            float* a = acc + (size_t)j * Dp;
            for (int d = 0; d < Dp; ++d) a[d] += p * v[d];
        }
    }
}

// V run token-major, [PT][Dp]; the next page is prefetched during the K pass (scores_page)
constexpr int V_TILE = 0;
constexpr int V_TILE_ALT = V_TILE;   // one layout only

static inline void pv_page(int dt, const void* V, int nvalid, int Dp, const float* S, int g, float* acc, const char*,
                           size_t, int) {
    thread_local AlignedBuf vb;
    float* v = vb.get(Dp);
    if (dt == BF16) pv_t<BF16>(V, nvalid, Dp, S, g, acc, v);
    else if (dt == F16) pv_t<F16>(V, nvalid, Dp, S, g, acc, v);
    else pv_t<F32>(V, nvalid, Dp, S, g, acc, v);
}

static inline float exp2_1(float x) { return std::exp2(x); }

constexpr int L_LANES = 1;
static inline float l_total(const float* l) { return l[0]; }

static inline float softmax_page(float* s, int nvalid, float& m, float* l) {
    float bm = -INFINITY;
    for (int t = 0; t < nvalid; ++t) bm = std::fmax(bm, s[t]);
    float mn = std::fmax(m, bm);
    float sum = 0.f;
    for (int t = 0; t < PT; ++t) {
        s[t] = (t < nvalid) ? std::exp2(s[t] - mn) : 0.f;
        sum += s[t];
    }
    float alpha = (mn == m) ? 1.f : std::exp2(m - mn);
    l[0] = l[0] * alpha + sum;
    m = mn;
    return alpha;
}

// the logit soft-cap: libm's tanh, element by element (exact to its ulp or so; the portable build
// is the reference path, not the fast one)
static inline void softcap_page(float* S, int g, float cap) {
    const float inv = 1.f / cap;
    for (int i = 0; i < g * PT; ++i) S[i] = cap * std::tanh(S[i] * inv);
}

static inline void scale_row(float* acc, float alpha, int Dp) {
    for (int d = 0; d < Dp; ++d) acc[d] *= alpha;
}

static inline void store_row(const void* src, int sdt, void* dst, int ddt, int D, int Dp) {
    store_row_scalar(src, sdt, dst, ddt, D, Dp);
}

}  // namespace FD_NS
