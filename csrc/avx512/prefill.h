// prefill.h — causal attention over one prompt (or prompt chunk) on the S-worker's CPU:
// bf16 q, k, v in, bf16 out, fp32 scores and softmax. AVX512-BF16 builds only.
//
// The prompt's K and V are laid out once in the store's page formats (simd.h: K runs of dim-pair
// words [Dw][PT]; V runs of token pairs, simd_avx512.h V_PAIRS), and every work item, one kv head
// and one block of query tokens, runs decode's page passes with the block's query heads stacked as
// its rows (row r = token i * g + head j of the group): one pass over a page serves tokens x g
// rows while the page sits in L1, which turns decode's matrix-vector passes into the prompt's
// matrix-matrix product without a kernel of its own.
//
// Causal mask: query token i sits at position p + i (p: the earlier chunks' keys). On a page its
// softmax sees the first nv = p + i + 1 - page_start keys (softmax_page zeroes the rest), and
// rows whose position is before the page are left out of it (they come first: rows follow tokens),
// so no row ever sees a page without a valid key.
//
// Precision: scores are fp32 sums of exact bf16 products (vdpbf16ps), the softmax is fp32 in
// base 2, the probabilities are rounded to bf16 for the PV products (as torch's CPU flash
// attention and FlashAttention round P) and l is the fp32 sum of the unrounded ones.
//
// Passes of one call:
//   1. pack: (kv head, page) items write K and V pages (tokens past the end zero)
//   2. attend: (kv head, query block) items, the longest (last) blocks first
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "common.h"
#include "pool.h"
#include "simd.h"

namespace FD_NS {

#if defined(FD_HAVE_DPBF16)

// ----------------------------------------------------------------------------
// geometry of one call

struct PromptArgs {
    const uint16_t *q, *k, *v;     // q [n][Hq][D] at token stride sq; k, v [p + n][Hkv][D] at sk, sv
    int64_t sq, sk, sv;            // token strides in elements (heads are D apart, dims contiguous)
    uint16_t* o;                   // [n][Hq][D], contiguous
    int n, p, Hq, Hkv, D;
    float sc;                      // scale * log2(e): scores in base-2 units
    int rows;                      // target rows (tokens x g) per attend item
};

struct PromptPlan {
    PromptArgs a;
    int g, Dw, npages, qb, nblocks;
    size_t page_words;             // one run (K or V) of one page: PT * D / 2 words
    uint32_t* pages;               // [Hkv][npages][K run | V run]

    uint32_t* k_run(int h, int pg) const { return pages + ((size_t)h * npages + pg) * 2 * page_words; }
    uint32_t* v_run(int h, int pg) const { return k_run(h, pg) + page_words; }
};

// ============================================================================
// pass 1: pack one (kv head, page)
// ============================================================================

static void pack_page(const PromptPlan& P, int h, int pg) {
    const PromptArgs& a = P.a;
    const int t_all = a.p + a.n, t0 = pg * PT, nt = std::min(PT, t_all - t0);
    uint32_t *kw = P.k_run(h, pg), *vw = P.v_run(h, pg);
    // K: word w of token t = dims (2w, 2w+1)
    for (int t = 0; t < PT; ++t) {
        const uint32_t* src = t < nt ? reinterpret_cast<const uint32_t*>(a.k + (size_t)(t0 + t) * a.sk + (size_t)h * a.D)
                                     : nullptr;
        for (int w = 0; w < P.Dw; ++w) kw[(size_t)w * PT + t] = src ? src[w] : 0u;
    }
    // V: word (s, d) = (V[2s][d], V[2s + 1][d]), the even token in the low half
    for (int s = 0; s < PT / 2; ++s) {
        const int te = 2 * s, to = 2 * s + 1;
        const uint16_t* ve = te < nt ? a.v + (size_t)(t0 + te) * a.sv + (size_t)h * a.D : nullptr;
        const uint16_t* vo = to < nt ? a.v + (size_t)(t0 + to) * a.sv + (size_t)h * a.D : nullptr;
        for (int d = 0; d < a.D; ++d)
            vw[pair_word(s, d, a.D)] = (ve ? (uint32_t)ve[d] : 0u) | (vo ? (uint32_t)vo[d] << 16 : 0u);
    }
}

// ============================================================================
// pass 2: one (kv head, block of query tokens)
// ============================================================================

struct PromptScratch {
    AlignedBuf qw, S, acc, ml;     // reused by the thread across items and calls
};

static void attend_block(const PromptPlan& P, int h, int blk, PromptScratch& sc) {
    const PromptArgs& a = P.a;
    const int g = P.g, Dw = P.Dw, D = a.D;
    const int i_lo = blk * P.qb, i_hi = std::min(a.n, i_lo + P.qb), R = (i_hi - i_lo) * g;
    // rows: r = (i - i_lo) * g + j, query head h * g + j of token i
    uint32_t* qw = reinterpret_cast<uint32_t*>(sc.qw.get((size_t)R * Dw));      // [R][Dw]
    float* S = sc.S.get((size_t)R * PT);                                         // [R][PT]
    float* acc = sc.acc.get((size_t)R * D);                                      // [R][D]
    float* ml = sc.ml.get((size_t)R * (1 + L_LANES));                            // [R][m | l lanes]

    // 1. the block's query pair words, running max and sums, accumulators
    for (int r = 0; r < R; ++r) {
        const int i = i_lo + r / g, j = r % g;
        std::memcpy(qw + (size_t)r * Dw, a.q + (size_t)i * a.sq + (size_t)(h * g + j) * D, (size_t)D * 2);
        ml[(size_t)r * (1 + L_LANES)] = -INFINITY;
        std::fill(ml + (size_t)r * (1 + L_LANES) + 1, ml + (size_t)(r + 1) * (1 + L_LANES), 0.f);
    }
    std::fill(acc, acc + (size_t)R * D, 0.f);

    // 2. pages up to the block's last position; rows before a page's start skip it
    const int t_all = a.p + a.n, last = (a.p + i_hi - 1) / PT;
    for (int pg = 0; pg <= last; ++pg) {
        const int t0 = pg * PT, nvalid = std::min(PT, t_all - t0);
        const int r0 = (std::max(i_lo, t0 - a.p) - i_lo) * g, nr = R - r0;
        scores_page_dp(P.k_run(h, pg), D, qw + (size_t)r0 * Dw, a.sc, nr, S + (size_t)r0 * PT, nullptr);
        for (int r = r0; r < R; ++r) {
            const int nv = std::min(nvalid, a.p + i_lo + r / g + 1 - t0);
            float* mlr = ml + (size_t)r * (1 + L_LANES);
            const float alpha = softmax_page(S + (size_t)r * PT, nv, mlr[0], mlr + 1);
            if (alpha != 1.f) scale_row(acc + (size_t)r * D, alpha, D);
        }
        pv_page_pairs(P.v_run(h, pg), nvalid, D, S + (size_t)r0 * PT, nr, acc + (size_t)r0 * D, nullptr, 0);
    }

    // 3. normalise into o
    for (int r = 0; r < R; ++r) {
        const int i = i_lo + r / g, j = r % g;
        const float inv_l = 1.f / l_total(ml + (size_t)r * (1 + L_LANES) + 1);
        uint16_t* dst = a.o + ((size_t)i * a.Hq + (size_t)(h * g + j)) * D;
        const float* src = acc + (size_t)r * D;
        for (int d = 0; d < D; ++d) dst[d] = f32_to_bf16(src[d] * inv_l);
    }
}

// ============================================================================
// the call
// ============================================================================

// the packed pages of a call are kept for the next one up to this size (short prompts: no allocation)
constexpr size_t PROMPT_PAGES_KEPT_BYTES = size_t(32) << 20;

// threads: the pool's size (kept between calls; a new size rebuilds it)
static Pool& prompt_pool(int threads) {
    static std::unique_ptr<Pool> pool;
    if (!pool || pool->size() != std::max(1, threads)) pool = std::make_unique<Pool>(threads, std::vector<int>{}, 50);
    return *pool;
}

static void prompt_attention(const PromptArgs& args, int threads) {
    static std::mutex one_call;                     // the pool and its scratch serve one call at a time
    std::lock_guard<std::mutex> lock(one_call);
    PromptPlan P;
    P.a = args;
    P.g = args.Hq / args.Hkv;
    P.Dw = args.D / 2;
    P.npages = (args.p + args.n + PT - 1) / PT;
    P.qb = std::max(1, args.rows / P.g);
    P.nblocks = (args.n + P.qb - 1) / P.qb;
    P.page_words = (size_t)PT * args.D / 2;
    static AlignedBuf page_buf;
    P.pages = reinterpret_cast<uint32_t*>(page_buf.get((size_t)args.Hkv * P.npages * 2 * P.page_words));

    Pool& pool = prompt_pool(threads);
    pool.run((int64_t)args.Hkv * P.npages, [](void* ctx, int64_t item, int64_t) {
        const PromptPlan& P = *static_cast<const PromptPlan*>(ctx);
        pack_page(P, (int)(item % P.a.Hkv), (int)(item / P.a.Hkv));
    }, &P);
    pool.run((int64_t)args.Hkv * P.nblocks, [](void* ctx, int64_t item, int64_t) {
        const PromptPlan& P = *static_cast<const PromptPlan*>(ctx);
        thread_local PromptScratch scratch;                         // the pool's threads live on
        const int blk = P.nblocks - 1 - (int)(item / P.a.Hkv);      // the longest blocks first
        attend_block(P, (int)(item % P.a.Hkv), blk, scratch);
    }, &P);
    // a long prompt's copy of its K/V is not kept for the next call (it would hold the
    // largest prompt's K/V until the process ends)
    if (page_buf.cap * sizeof(float) > PROMPT_PAGES_KEPT_BYTES) page_buf.release();
}

#endif  // FD_HAVE_DPBF16

}  // namespace FD_NS
