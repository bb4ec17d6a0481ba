// simd_avx512_i8_passes.h — the AVX-512 int8 page passes, included once per dot-product build.
//
// No include guard: simd_avx512_i8.h includes it inside namespace i8_vnni and again inside
// i8_bw, each of which defines first
//   K_BIASED               the K sums carry 128 * sum(q) (vpdpbusd on the biased bytes)
//   QWord q_word(w)        one query word (4 int8 dims) prepared for dot_k
//   k_load(p)              64 bytes of a K run, as dot_k takes them
//   dot_k(acc, k, q)       acc + per 32-bit lane the 4-dim product of a K word and the query word
//   dot_pv(acc, p, v)      acc + per lane sum of 4 weight bytes (0..127) times 4 int8 V values
// Layout and arithmetic: quant.h.

// ============================================================================
// scores: S[j][t] = K[t] . (qh_j + ql_j / 254) * qs[j] * ksc[t] for GH heads over one page
// ============================================================================

// k: the K run [Dw][PT] words, ksc after it; qh, ql [GH][Dw] the query parts' words; qs [GH] query
// scale * the softmax scale; qz [GH][2] the parts' bias sums. Per head 4 accumulators of the hi
// part (2 token halves x even/odd words) and 2 of the lo part
template <int GH>
static inline void scores_group(const char* k, int Dw, const uint32_t* qh, const uint32_t* ql, const float* qs,
                                const int32_t* qz, float* S, const char* pf, int pf_lines) {
    __m512i a0[GH], b0[GH], a1[GH], b1[GH], la[GH], lb[GH];   // a: tokens 0-15, b: 16-31
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) a0[j] = b0[j] = a1[j] = b1[j] = la[j] = lb[j] = _mm512_setzero_si512();
    for (int w = 0; w < Dw; w += 2) {                  // Dw = Dp/4 is a multiple of 4
        const char* row = k + (size_t)w * PT * 4;      // 2 word rows = 256 bytes
        if (pf) prefetch_share(pf, pf_lines, w / 2, Dw / 2);
        const __m512i x0 = k_load(row), y0 = k_load(row + 64), x1 = k_load(row + 128), y1 = k_load(row + 192);
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) {
            const QWord h0 = q_word(qh[(size_t)j * Dw + w]), h1 = q_word(qh[(size_t)j * Dw + w + 1]);
            a0[j] = dot_k(a0[j], x0, h0);
            b0[j] = dot_k(b0[j], y0, h0);
            a1[j] = dot_k(a1[j], x1, h1);
            b1[j] = dot_k(b1[j], y1, h1);
            const QWord l0 = q_word(ql[(size_t)j * Dw + w]), l1 = q_word(ql[(size_t)j * Dw + w + 1]);
            la[j] = dot_k(dot_k(la[j], x0, l0), x1, l1);
            lb[j] = dot_k(dot_k(lb[j], y0, l0), y1, l1);
        }
    }
    const float* ksc = reinterpret_cast<const float*>(k + (size_t)Dw * PT * 4);
    const __m512 ka = _mm512_loadu_ps(ksc), kb = _mm512_loadu_ps(ksc + 16);
    const __m512 step = _mm512_set1_ps(1.f / (2 * I8_MAX));
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) {
        __m512i ia = _mm512_add_epi32(a0[j], a1[j]), ib = _mm512_add_epi32(b0[j], b1[j]), ja = la[j], jb = lb[j];
        if constexpr (K_BIASED) {
            const __m512i zh = _mm512_set1_epi32(qz[2 * j]), zl = _mm512_set1_epi32(qz[2 * j + 1]);
            ia = _mm512_sub_epi32(ia, zh);
            ib = _mm512_sub_epi32(ib, zh);
            ja = _mm512_sub_epi32(ja, zl);
            jb = _mm512_sub_epi32(jb, zl);
        }
        const __m512 s = _mm512_set1_ps(qs[j]);
        const __m512 da = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ja), step, _mm512_cvtepi32_ps(ia));
        const __m512 db = _mm512_fmadd_ps(_mm512_cvtepi32_ps(jb), step, _mm512_cvtepi32_ps(ib));
        _mm512_storeu_ps(S + (size_t)j * PT, _mm512_mul_ps(_mm512_mul_ps(da, s), ka));
        _mm512_storeu_ps(S + (size_t)j * PT + 16, _mm512_mul_ps(_mm512_mul_ps(db, s), kb));
    }
}

// pf: the next page; its K half is prefetched during this K pass (as the other dtypes do)
static inline void scores_page(const char* K, int Dp, const uint32_t* qh, const uint32_t* ql, const float* qs,
                               const int32_t* qz, int g, float* S, const char* pf) {
    const int Dw = Dp / 4;
    const int lines = (int)(i8_half_bytes(Dp) / 64);
    // 2 heads per pass: 6 accumulators a head, and at 3 or 4 heads GCC spilled them every step
    for_groups<2>(F32, g, [&](auto, auto GH, int j0) {
        scores_group<GH.value>(K, Dw, qh + (size_t)j0 * Dw, ql + (size_t)j0 * Dw, qs + j0, qz + 2 * j0,
                               S + (size_t)j0 * PT, j0 == 0 ? pf : nullptr, lines);
    });
}

// ============================================================================
// PV: acc[j][d] += ps_j * sum_t (ph_j[t] + pl_j[t] / 127) vq[t][d] for GH heads over one page
// ============================================================================

// dims d0 .. d0 + 16*TC of nq 4-token words; ph, pl [GH][PT/4] the heads' weight parts as words,
// ps [GH] their scales
template <int GH, int TC>
static inline void pv_pass(const char* V, int nq, int Dp, int d0, const uint32_t* ph, const uint32_t* pl,
                           const float* ps, float* acc, const char* pf, int pf_lines) {
    __m512i a[GH][TC], b[GH][TC];     // sums of the hi and the lo parts
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j)
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) a[j][c] = b[j][c] = _mm512_setzero_si512();
    for (int s = 0; s < nq; ++s) {
        if (pf) prefetch_share(pf, pf_lines, s, nq);
        const char* row = V + ((size_t)s * Dp + d0) * 4;
        __m512i x[TC];
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) x[c] = _mm512_loadu_si512(row + 64 * c);
#pragma GCC unroll 8
        for (int j = 0; j < GH; ++j) {
            const __m512i h = _mm512_set1_epi32((int)ph[(size_t)j * (PT / 4) + s]);
            const __m512i l = _mm512_set1_epi32((int)pl[(size_t)j * (PT / 4) + s]);
#pragma GCC unroll 8
            for (int c = 0; c < TC; ++c) {
                a[j][c] = dot_pv(a[j][c], h, x[c]);
                b[j][c] = dot_pv(b[j][c], l, x[c]);
            }
        }
    }
    const __m512 step = _mm512_set1_ps(1.f / I8_MAX);
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) {
        const __m512 sc = _mm512_set1_ps(ps[j]);
        float* o = acc + (size_t)j * Dp + d0;
#pragma GCC unroll 8
        for (int c = 0; c < TC; ++c) {
            const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b[j][c]), step, _mm512_cvtepi32_ps(a[j][c]));
            _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(sum, sc, _mm512_loadu_ps(o + 16 * c)));
        }
    }
}

template <int GH>
static inline void pv_group(const char* V, int nvalid, int Dp, const float* S, float* acc, const char* pf,
                            int pf_lines) {
    constexpr int TC = GH == 1 ? 8 : GH == 2 ? 4 : 2;     // int32 accumulators 2*GH*TC <= 16 (GH <= 4)
    // 1. each head's weights p * vsc as 4-token words of two 7-bit parts, and their scale
    const float* vsc = reinterpret_cast<const float*>(V + (size_t)PT * Dp);
    alignas(64) uint32_t ph[GH][PT / 4], pl[GH][PT / 4];
    float ps[GH];
#pragma GCC unroll 8
    for (int j = 0; j < GH; ++j) ps[j] = quant_p_words(S + (size_t)j * PT, vsc, nvalid, ph[j], pl[j]);
    // 2. passes over 16*TC dims (then 16 at a time), the next V half prefetched a share of each
    const int nq = (nvalid + 3) / 4;
    auto first = [&](int d) { return d * pf_lines / Dp; };
    auto at = [&](int d) { return pf ? pf + 64 * (size_t)first(d) : nullptr; };
    int d = 0;
    for (; d + 16 * TC <= Dp; d += 16 * TC)
        pv_pass<GH, TC>(V, nq, Dp, d, &ph[0][0], &pl[0][0], ps, acc, at(d), first(d + 16 * TC) - first(d));
    for (; d < Dp; d += 16)
        pv_pass<GH, 1>(V, nq, Dp, d, &ph[0][0], &pl[0][0], ps, acc, at(d), first(d + 16) - first(d));
}

// pf: the next page (page_bytes: K half then V half); the first group's passes prefetch its V half
static inline void pv_page(const char* V, int nvalid, int Dp, const float* S, int g, float* acc, const char* pf,
                           size_t page_bytes) {
    const int lines = (int)(page_bytes / 2 / 64);
    const char* pv = pf ? pf + page_bytes / 2 : nullptr;
    for_groups<4>(F32, g, [&](auto, auto GH, int j0) {
        pv_group<GH.value>(V, nvalid, Dp, S + (size_t)j0 * PT, acc + (size_t)j0 * Dp, j0 == 0 ? pv : nullptr, lines);
    });
}
