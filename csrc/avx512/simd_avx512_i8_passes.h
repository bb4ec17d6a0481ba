// simd_avx512_i8_passes.h — the AVX-512 int8 page passes, included once per dot-product build.
//
// No include guard: simd_avx512_i8.h includes it inside namespace i8_vnni and again inside
// i8_bw, each of which defines first
//   K_BIASED               the K sums carry 128 * sum(q) (vpdpbusd on the biased bytes)
//   QWord q_word(w)        one query word (4 int8 dims) prepared for dot_k
//   k_load(p)              64 bytes of a K run, as dot_k takes them
//   dot_k(acc, k, q)       acc + per 32-bit lane the 4-dim product of a K word and the query word
//   dot_pv(acc, p, v)      acc + per lane sum of 4 pq (0..127) times 4 int8 V values
// Layout and arithmetic: quant.h.

// ============================================================================
// scores: S[j][t] = (K . q_j) * qs[j] * ksc[t] for GH heads over one page
// ============================================================================

// k: the K run [Dw][PT] words, ksc after it; qw [GH][Dw] query words; qs [GH] query scale * the
// softmax scale; qz [GH] the bias sums. 4 accumulators per head (2 token halves x even/odd words)
template <int GH>
static inline void scores_group(const char* k, int Dw, const uint32_t* qw, const float* qs, const int32_t* qz,
                                float* S, const char* pf, int pf_lines) {
    __m512i a0[GH], b0[GH], a1[GH], b1[GH];     // a: tokens 0-15, b: 16-31; 0/1: even/odd word rows
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) a0[j] = b0[j] = a1[j] = b1[j] = _mm512_setzero_si512();
    for (int w = 0; w < Dw; w += 2) {                  // Dw = Dp/4 is a multiple of 4
        const char* row = k + (size_t)w * PT * 4;      // 2 word rows = 256 bytes
        if (pf) prefetch_share(pf, pf_lines, w / 2, Dw / 2);
        const __m512i x0 = k_load(row), y0 = k_load(row + 64), x1 = k_load(row + 128), y1 = k_load(row + 192);
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) {
            const QWord q0 = q_word(qw[(size_t)j * Dw + w]), q1 = q_word(qw[(size_t)j * Dw + w + 1]);
            a0[j] = dot_k(a0[j], x0, q0);
            b0[j] = dot_k(b0[j], y0, q0);
            a1[j] = dot_k(a1[j], x1, q1);
            b1[j] = dot_k(b1[j], y1, q1);
        }
    }
    const float* ksc = reinterpret_cast<const float*>(k + (size_t)Dw * PT * 4);
    const __m512 ka = _mm512_loadu_ps(ksc), kb = _mm512_loadu_ps(ksc + 16);
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) {
        __m512i ia = _mm512_add_epi32(a0[j], a1[j]), ib = _mm512_add_epi32(b0[j], b1[j]);
        if constexpr (K_BIASED) {
            ia = _mm512_sub_epi32(ia, _mm512_set1_epi32(qz[j]));
            ib = _mm512_sub_epi32(ib, _mm512_set1_epi32(qz[j]));
        }
        const __m512 s = _mm512_set1_ps(qs[j]);
        _mm512_storeu_ps(S + (size_t)j * PT, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ia), s), ka));
        _mm512_storeu_ps(S + (size_t)j * PT + 16, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(ib), s), kb));
    }
}

// pf: the next page; its K half is prefetched during this K pass (as the other dtypes do)
static inline void scores_page(const char* K, int Dp, const uint32_t* qw, const float* qs, const int32_t* qz, int g,
                               float* S, const char* pf) {
    const int Dw = Dp / 4;
    const int lines = (int)(i8_half_bytes(Dp) / 64);
    for_groups<4>(F32, g, [&](auto, auto GH, int j0) {
        scores_group<GH.value>(K, Dw, qw + (size_t)j0 * Dw, qs + j0, qz + j0, S + (size_t)j0 * PT,
                               j0 == 0 ? pf : nullptr, lines);
    });
}

// ============================================================================
// PV: acc[j][d] += psc_j * sum_t pq_j[t] vq[t][d] for GH heads over one page
// ============================================================================

// dims d0 .. d0 + 16*TC of nq 4-token words; pw [GH][PT/4] the heads' pq words, psc [GH]
template <int GH, int TC>
static inline void pv_pass(const char* V, int nq, int Dp, int d0, const uint32_t* pw, const float* psc, float* acc,
                           const char* pf, int pf_lines) {
    __m512i a[GH][TC];
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) a[j][c] = _mm512_setzero_si512();
    for (int s = 0; s < nq; ++s) {
        if (pf) prefetch_share(pf, pf_lines, s, nq);
        const char* row = V + ((size_t)s * Dp + d0) * 4;
        __m512i x[TC];
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) x[c] = _mm512_loadu_si512(row + 64 * c);
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) {
            const __m512i p = _mm512_set1_epi32((int)pw[(size_t)j * (PT / 4) + s]);
#pragma GCC unroll 8
            for (int c = 0; c < TC; ++c) a[j][c] = dot_pv(a[j][c], p, x[c]);
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) {
        const __m512 sc = _mm512_set1_ps(psc[j]);
        float* o = acc + (size_t)j * Dp + d0;
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c)
            _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[j][c]), sc, _mm512_loadu_ps(o + 16 * c)));
    }
}

template <int GH>
static inline void pv_group(const char* V, int nvalid, int Dp, const float* S, float* acc, const char* pf,
                            int pf_lines) {
    constexpr int TC = GH <= 2 ? 8 : GH <= 4 ? 4 : 2;     // int32 accumulators GH*TC <= 16
    // 1. each head's weights p * vsc as 4-token words of 7-bit pq, and their scale
    const float* vsc = reinterpret_cast<const float*>(V + (size_t)PT * Dp);
    alignas(64) uint32_t pw[GH][PT / 4];
    float psc[GH];
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) psc[j] = quant_p_words(S + (size_t)j * PT, vsc, nvalid, pw[j]);
    // 2. passes over 16*TC dims (then 16 at a time), the next V half prefetched a share of each
    const int nq = (nvalid + 3) / 4;
    auto first = [&](int d) { return d * pf_lines / Dp; };
    auto at = [&](int d) { return pf ? pf + 64 * (size_t)first(d) : nullptr; };
    int d = 0;
    for (; d + 16 * TC <= Dp; d += 16 * TC)
        pv_pass<GH, TC>(V, nq, Dp, d, &pw[0][0], psc, acc, at(d), first(d + 16 * TC) - first(d));
    for (; d < Dp; d += 16) pv_pass<GH, 1>(V, nq, Dp, d, &pw[0][0], psc, acc, at(d), first(d + 16) - first(d));
}

// pf: the next page (page_bytes: K half then V half); the first group's passes prefetch its V half
static inline void pv_page(const char* V, int nvalid, int Dp, const float* S, int g, float* acc, const char* pf,
                           size_t page_bytes) {
    const int lines = (int)(page_bytes / 2 / 64);
    const char* pv = pf ? pf + page_bytes / 2 : nullptr;
    for_groups<8>(F32, g, [&](auto, auto GH, int j0) {
        pv_group<GH.value>(V, nvalid, Dp, S + (size_t)j0 * PT, acc + (size_t)j0 * Dp, j0 == 0 ? pv : nullptr, lines);
    });
}
