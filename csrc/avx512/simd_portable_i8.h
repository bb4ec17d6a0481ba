// simd_portable_i8.h — the int8 page passes in plain C++ (quant.h has the format and arithmetic).
//
// The same integers as the vector builds, in int32 loops that -O3 vectorizes with the baseline.
#pragma once

#ifndef FD_SIMD_H
#error "simd_portable_i8.h is included through simd.h"
#endif

namespace FD_NS {

// S[j][t] = (K . q_j) * qs[j] * ksc[t]; vnni and qz unused (K unbiased here)
static inline void scores_page_i8(bool, const void* K, int Dp, const uint32_t* qw, const float* qs, const int32_t*,
                                  int g, float* S, const char* pf) {
    const uint8_t* k = static_cast<const uint8_t*>(K);
    const float* ksc = reinterpret_cast<const float*>(k + (size_t)PT * Dp);
    const int8_t* q = reinterpret_cast<const int8_t*>(qw);
    if (pf) prefetch_lines(pf, 0, i8_half_bytes(Dp));
    int32_t acc[PT];
    for (int j = 0; j < g; ++j) {
        const int8_t* qj = q + (size_t)j * Dp;
        for (int t = 0; t < PT; ++t) acc[t] = 0;
        for (int w = 0; w < Dp / 4; ++w) {
            const uint8_t* row = k + (size_t)w * PT * 4;
            for (int t = 0; t < PT; ++t)
                for (int b = 0; b < 4; ++b) acc[t] += ((int32_t)row[4 * t + b] - K_BIAS) * qj[4 * w + b];
        }
        for (int t = 0; t < PT; ++t) S[(size_t)j * PT + t] = (float)acc[t] * qs[j] * ksc[t];
    }
}

// acc[j][d] += psc_j * sum_t pq_j[t] vq[t][d]
static inline void pv_page_i8(bool, const void* V, int nvalid, int Dp, const float* S, int g, float* acc, const char*,
                              size_t) {
    const int8_t* v = static_cast<const int8_t*>(V);
    const float* vsc = reinterpret_cast<const float*>(static_cast<const char*>(V) + (size_t)PT * Dp);
    thread_local AlignedBuf ib;
    int32_t* ia = reinterpret_cast<int32_t*>(ib.get(Dp));
    const int nq = (nvalid + 3) / 4;
    for (int j = 0; j < g; ++j) {
        uint8_t pq[PT];
        const float psc = quant_p(S + (size_t)j * PT, vsc, nvalid, pq);
        for (int d = 0; d < Dp; ++d) ia[d] = 0;
        for (int s = 0; s < nq; ++s) {
            const int8_t* row = v + (size_t)s * Dp * 4;
            for (int d = 0; d < Dp; ++d)
                for (int b = 0; b < 4; ++b) ia[d] += (int32_t)pq[4 * s + b] * row[4 * d + b];
        }
        float* a = acc + (size_t)j * Dp;
        for (int d = 0; d < Dp; ++d) a[d] += (float)ia[d] * psc;
    }
}

}  // namespace FD_NS
