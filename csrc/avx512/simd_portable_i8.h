// simd_portable_i8.h — the int8 page passes in plain C++ (quant.h has the format and arithmetic).
//
// The same integers as the vector builds, in int32 loops that -O3 vectorizes with the baseline.
#pragma once

#ifndef FD_SIMD_H
#error "simd_portable_i8.h is included through simd.h"
#endif

namespace FD_NS {

static inline void hadamard(float* x, int n) { hadamard_stages(x, n, 1); }   // quant.h

// S[j][t] = K[t] . (qh_j + ql_j / 254) * qs[j] * ksc[t]; vnni and qz unused (K unbiased here)
static inline void scores_page_i8(bool, const void* K, int Dp, const uint32_t* qh, const uint32_t* ql, const float* qs,
                                  const int32_t*, int g, float* S, const char* pf) {
    const uint8_t* k = static_cast<const uint8_t*>(K);
    const float* ksc = reinterpret_cast<const float*>(k + (size_t)PT * Dp);
    if (pf) prefetch_lines(pf, 0, i8_half_bytes(Dp));
    int32_t ah[PT], al[PT];
    for (int j = 0; j < g; ++j) {
        const int8_t* hj = reinterpret_cast<const int8_t*>(qh) + (size_t)j * Dp;
        const int8_t* lj = reinterpret_cast<const int8_t*>(ql) + (size_t)j * Dp;
        for (int t = 0; t < PT; ++t) ah[t] = al[t] = 0;
        for (int w = 0; w < Dp / 4; ++w) {
            const uint8_t* row = k + (size_t)w * PT * 4;
            for (int t = 0; t < PT; ++t)
                for (int b = 0; b < 4; ++b) {
                    const int32_t x = (int32_t)row[4 * t + b] - K_BIAS;
                    ah[t] += x * hj[4 * w + b];
                    al[t] += x * lj[4 * w + b];
                }
        }
        for (int t = 0; t < PT; ++t)
            S[(size_t)j * PT + t] = ((float)ah[t] + (float)al[t] * (1.f / (2 * I8_MAX))) * qs[j] * ksc[t];
    }
}

// acc[j][d] += ps_j * sum_t (ph_j[t] + pl_j[t] / 127) vq[t][d]
static inline void pv_page_i8(bool, const void* V, int nvalid, int Dp, const float* S, int g, float* acc, const char*,
                              size_t) {
    const int8_t* v = static_cast<const int8_t*>(V);
    const float* vsc = reinterpret_cast<const float*>(static_cast<const char*>(V) + (size_t)PT * Dp);
    thread_local AlignedBuf ib;
    int32_t* ih = reinterpret_cast<int32_t*>(ib.get(2 * (size_t)Dp));
    int32_t* il = ih + Dp;
    const int nq = (nvalid + 3) / 4;
    for (int j = 0; j < g; ++j) {
        uint8_t ph[PT], pl[PT];
        const float ps = quant_p(S + (size_t)j * PT, vsc, nvalid, ph, pl);
        for (int d = 0; d < Dp; ++d) ih[d] = il[d] = 0;
        for (int s = 0; s < nq; ++s) {
            const int8_t* row = v + (size_t)s * Dp * 4;
            for (int d = 0; d < Dp; ++d)
                for (int b = 0; b < 4; ++b) {
                    ih[d] += (int32_t)ph[4 * s + b] * row[4 * d + b];
                    il[d] += (int32_t)pl[4 * s + b] * row[4 * d + b];
                }
        }
        float* a = acc + (size_t)j * Dp;
        for (int d = 0; d < Dp; ++d) a[d] += ((float)ih[d] + (float)il[d] * (1.f / I8_MAX)) * ps;
    }
}

}  // namespace FD_NS
