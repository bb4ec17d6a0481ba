// attention.h — decode attention over a store's pages: work items, the per-item passes, the merge.
//
// Work items are (sequence, kv-head, chunk of CH = 512 tokens). One item streams its K/V runs
// once and serves all g = Hq/Hkv query heads of the group (GQA) with an online softmax in base 2,
// fp32 accumulators. Items of a multi-chunk sequence write partial (m, l, acc); the item that
// finishes last merges them in chunk order (log-sum-exp). Chunk boundaries depend only on the
// sequence length, and an item's arithmetic does not depend on which thread runs it, so a
// sequence's output is bitwise the same whatever the batch, the thread count or the history, unless
// it shares a prefix with other rows of the call (below): then it depends, by fp32 rounding, on who else does.
//
// Shared prefixes (paging.h: fork): rows of one call whose sequences hold the same last shared
// page form a group. An item (group, kv head, chunk of the shared pages, block of up to
// ROWS_PER_ITEM / g members) streams those pages from memory once and runs every member's heads
// over each page while it sits in L1: the bytes of a shared prefix are read once per group, not
// once per member. Each member's own pages are items of their own; all its partials merge in slot
// order. A row alone with its prefix in a call (or unshared) runs over all its pages as before:
// its output is bitwise what the unshared kernel gives.
//
// Variants (each off by default; off, the arithmetic is bit for bit what it was without them):
//   sliding window (per layer, paging.h): a row attends tokens [len - W, len). Its chunks start at
//     the window's first page (page-aligned, so the boundaries depend only on len and W) and the
//     tokens of that page before the start are masked (scores -inf: softmax_page makes them exactly
//     0 on every ISA). Windowed rows never run the shared-prefix path (a windowed store has no forks).
//   soft-capping (per store): scores s become cap tanh(s / cap) (softcap_page, simd.h), one pass
//     over the scores page after whichever scores pass ran (fp, bf16 dot products, AMX, int8),
//     before the window's mask.
//   sinks (per layer, one logit per query head, GPT-OSS style): the softmax runs over the scores and
//     one more column that adds 2^sink to the denominator and nothing to the numerator: at the
//     final normalisation of a lone chunk, or in the chunk merge, with the max taken over the
//     sink too so that a sink far above every score overflows nothing.
//
// The page passes themselves are simd.h's (one ISA header per build), the AMX scores amx.h's.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "paging.h"
#include "pool.h"
#include "simd.h"
#if defined(FD_HAVE_DPBF16)
#include "amx.h"
#include "amx_i8.h"
#endif

namespace FD_NS {

// Software prefetch of the next page while one is computed (simd.h): none, always, or only a
// page that lies apart from both its neighbours (a run of one). The hardware prefetcher follows a
// run by itself and cannot know where a scattered page is; a software prefetch at the head of a
// run lost a little there, as if it kept the hardware from training on it (bench/kernel/CHANGELOG.md, 15)
enum { PF_OFF = 0, PF_ALL = 1, PF_SCATTERED = 2 };

// an AMX A tile holds up to 16 query rows (amx.h): more take several tile products
constexpr int AMX_ROWS_MAX = 16;

// FASTDECODE_PREFETCH: 0 / off, 1 / on (the default), scattered
static inline int prefetch_mode_env() {
    const char* e = getenv("FASTDECODE_PREFETCH");
    if (!e) return PF_ALL;
    const std::string v(e);
    return v == "0" || v == "off" ? PF_OFF : v == "scattered" ? PF_SCATTERED : PF_ALL;
}

// ============================================================================
// Attention: one store's attention settings, its work list, the item passes
// ============================================================================

class Attention : protected Geometry {
public:
    static constexpr int P = PT;    // tokens per page
    static constexpr int CH = 512;  // tokens per split-KV chunk (a multiple of P)

    // ---- settings ---------------------------------------------------------------

    // checks that the geometry's V layout is one this build's V pass reads
    // softcap: the logit cap in natural units (0: none)
    Attention(const Geometry& geo, double scale, double softcap = 0.0)
        : Geometry(geo), scale_((float)scale), softcap_(softcap), softcap2_((float)(softcap * LOG2E)), sinks_(L_) {
        if (!(softcap >= 0.0) || std::isinf(softcap)) throw std::invalid_argument("softcap must be a finite number > 0 (0: none)");
#if defined(FD_HAVE_DPBF16)
        // FASTDECODE_DPBF16=0 keeps bf16 queries on the FMA path (for measurements)
        // (the SIMDe test build emulates the instruction, so it takes the path on any CPU)
        const bool has_dp = bf16_dot_usable();
        use_dp_ = has_dp && !(getenv("FASTDECODE_DPBF16") && std::string(getenv("FASTDECODE_DPBF16")) == "0");
        if (vtile_ == V_PAIRS && (dt_ != BF16 || !has_dp))
            throw std::invalid_argument("v_tile: token pairs (V_PAIRS) need bf16 KV and a CPU with AVX512-BF16");
        const bool pairs = vtile_ == V_PAIRS;
#else
        const bool pairs = false;
#endif
        if (vtile_ != V_TILE && vtile_ != V_TILE_ALT && !pairs) throw std::invalid_argument("v_tile: not a layout of this build");
#if defined(FD_AVX512)
        // int8 scores and PV by vpdpbusd where the CPU has AVX512-VNNI (FASTDECODE_VNNI=0: the
        // AVX-512BW build of the same passes, for measurements and tests; SIMDe emulates both)
#if defined(FD_SIMDE_AVX512)
        const bool has_vnni = true;
#else
        const bool has_vnni = cpu_has("avx512vnni");
#endif
        use_vnni_ = has_vnni && !(getenv("FASTDECODE_VNNI") && std::string(getenv("FASTDECODE_VNNI")) == "0");
#endif
        for (int d = 0; d < Dp_; ++d) apos_.push_back(pairs ? d : apos(dt_, d, Dp_));   // pairs: natural order
    }

    int amx() const { return amx_; }
    bool vnni() const { return use_vnni_; }
    // AMX tile products for the scores (amx.h): hardware where the CPU and the OS allow it, the
    // emulation (tests) in any build that has the AVX512-BF16 scores, or off
    void set_amx(int mode) {
        if (mode != AMX_OFF) {
#if defined(FD_HAVE_DPBF16)
            if (mode != AMX_EMU && mode != AMX_HW) throw std::invalid_argument("amx: bad mode");
            if (mode == AMX_HW && !amx_usable())
                throw std::invalid_argument("amx: this CPU has no AMX-BF16, or the kernel gave this process no tile state");
            if (!use_dp_) throw std::invalid_argument("amx: the AMX scores replace the AVX512-BF16 ones, which this store does not use");
#else
            throw std::invalid_argument("amx: the " FD_ISA_NAME " build has no AMX scores (the avx512 build has)");
#endif
        }
        amx_ = mode;
    }
    int prefetch() const { return prefetch_.load(std::memory_order_relaxed); }
    void set_prefetch(int mode) {
        if (mode != PF_OFF && mode != PF_ALL && mode != PF_SCATTERED) throw std::invalid_argument("bad prefetch mode");
        prefetch_.store(mode, std::memory_order_relaxed);
    }

    // q's head count against the store's (and the layer's sinks, when it has some)
    void check_heads(int Hq, int layer) const {
        if (Hq < Hkv_ || Hq % Hkv_ != 0)
            throw std::invalid_argument("q has " + std::to_string(Hq) + " heads, not a multiple of num_kv_heads=" +
                                        std::to_string(Hkv_));
        const auto& sk = sinks_[layer];
        if (!sk.empty() && (int)sk.size() != Hq)
            throw std::invalid_argument("layer " + std::to_string(layer) + " has sinks for " + std::to_string(sk.size()) +
                                        " query heads, q has " + std::to_string(Hq));
    }

    // ---- variants ---------------------------------------------------------------

    double softcap() const { return softcap_; }
    // the sinks of `layer` (natural-log logits, one per query head), or none (n = 0)
    void set_sinks(int layer, const float* sinks, int n) {
        if (layer < 0 || layer >= L_)
            throw std::invalid_argument("layer " + std::to_string(layer) + " out of range [0, " + std::to_string(L_) + ")");
        std::vector<float> s2(n);
        for (int j = 0; j < n; ++j) {
            if (!std::isfinite(sinks[j]))
                throw std::invalid_argument("sinks of layer " + std::to_string(layer) + ": head " + std::to_string(j) + " is not finite");
            s2[j] = sinks[j] * LOG2E;     // the kernel's log2 units
        }
        sinks_[layer] = std::move(s2);
    }

    // ---- one call: the work list, run on the pool -------------------------------

    // q [n][Hq][D] (qdt F32 or BF16) -> out [n][Hq][D] (odt F32 or BF16), over all stored tokens
    // of the sequences ids[0..n) at `layer`, on the pool's threads
    void run(const PageTable& pages, Pool& pool, int layer, int64_t n, const int64_t* ids, const void* q, int qdt,
             int Hq, void* out, int odt) {
        pages.check_layer(layer);
        check_heads(Hq, layer);
        if (n == 0) return;
        const int g = Hq / Hkv_;
        const bool dp = use_dp_ && dt_ == BF16 && qdt == BF16;
        // AMX where the tiles fit: bf16 in 32-dim steps, int8 in 64-dim steps on AMX-INT8 (each item
        // then takes it when it has 2 query rows or more: one row would fill 1/16 of every tile
        // product, for the cost of a full one)
#if defined(FD_HAVE_DPBF16)
        const bool i8_tiles = Dp_ % 64 == 0 && (amx_ == AMX_EMU || amx_int8_usable());
        const int amx = (dt_ == I8 ? i8_tiles : dp && Dp_ % 32 == 0) ? amx_ : AMX_OFF;
#else
        const int amx = AMX_OFF;
#endif
        const int32_t W = win_[layer];
        Call C{layer, g, Hq, dp, amx, sinks_[layer].empty() ? nullptr : sinks_[layer].data(), q, qdt, out, odt, {}};
        C.seqs.resize(n);

        // 1. resolve sequences; rows holding the same last shared page form a group (paging.h: fork)
        groups_.clear();
        group_of_.clear();
        std::vector<int32_t>& lone = lone_;
        lone.clear();
        for (int64_t i = 0; i < n; ++i) {
            const Seq* s = pages.find(ids[i]);
            if (!s) throw std::invalid_argument("unknown sequence id " + std::to_string(ids[i]));
            if (s->len[layer] == 0)
                throw std::invalid_argument("sequence " + std::to_string(ids[i]) + " has no tokens at layer " +
                                            std::to_string(layer));
            C.seqs[i] = s;
            if (s->shared == 0 || W > 0) { lone.push_back((int32_t)i); continue; }
            const char* key = s->pages[layer][(size_t)(s->shared - 1) * Hkv_];
            auto it = group_of_.emplace(key, (int32_t)groups_.size());
            if (it.second) groups_.emplace_back();
            groups_[it.first->second].push_back((int32_t)i);
        }

        // 2. the work list: per group, items over the shared pages for blocks of members, then
        //    every row's own chunks; per (row, head) its partials' first slot and merge counter
        items_.clear();
        rows_.clear();
        part_.assign((size_t)n * Hkv_, -1);
        nchunks_.assign(n, 0);
        int64_t nparts = 0;
        auto own_chunks = [&](int32_t i, int32_t from, int32_t first_slot) {    // tokens from .. len-1
            const int32_t len = C.seqs[i]->len[layer], r0 = (int32_t)rows_.size();
            rows_.push_back(i);
            const int32_t nc = (len - from + CH - 1) / CH;
            nchunks_[i] = first_slot + nc;
            const bool alone = nchunks_[i] == 1 && first_slot == 0;
            for (int h = 0; h < Hkv_; ++h) {
                if (!alone) part_[(size_t)i * Hkv_ + h] = nparts, nparts += nchunks_[i];
                for (int32_t c = 0; c < nc; ++c)
                    items_.push_back({r0, 1, h, from + c * CH, std::min(len, from + (c + 1) * CH), alone ? -1 : first_slot + c});
            }
        };
        const int32_t block = std::max(1, ROWS_PER_ITEM / g);    // members per shared-page item
        for (auto& grp : groups_) {
            if (grp.size() == 1) { lone.push_back(grp[0]); continue; }
            const int32_t shared_tokens = C.seqs[grp[0]]->shared * P, ncs = (shared_tokens + CH - 1) / CH;
            const int32_t r0 = (int32_t)rows_.size();
            rows_.insert(rows_.end(), grp.begin(), grp.end());
            for (int32_t b = 0; b < (int32_t)grp.size(); b += block)
                for (int h = 0; h < Hkv_; ++h)
                    for (int32_t c = 0; c < ncs; ++c)
                        items_.push_back({r0 + b, std::min(block, (int32_t)grp.size() - b), h, c * CH,
                                          std::min(shared_tokens, (c + 1) * CH), c});
            // slots: the shared chunks first, then the member's own (rows_ gets each member again)
            for (int32_t i : grp) own_chunks(i, shared_tokens, ncs);
        }
        for (int32_t i : lone)      // a window's rows from its first page (run_item masks the tokens before it)
            own_chunks(i, (int32_t)(window_start(layer, C.seqs[i]->len[layer]) / P * P), 0);

        // partial slot: [g][Dp] acc, then g m, then g l
        part_stride_ = (size_t)g * Dp_ + 2 * (size_t)g;
        if (nparts) parts_.get((size_t)nparts * part_stride_);
        const size_t ncounters = (size_t)n * Hkv_;
        if (ncounters > ncounters_cap_) {
            counters_.reset(new std::atomic<int>[ncounters]);
            ncounters_cap_ = ncounters;
        }
        for (size_t c = 0; c < ncounters; ++c) counters_[c].store(0, std::memory_order_relaxed);

        // 3. run (longest items are already bounded by CH, so plain dynamic order balances)
        auto body = [&](int64_t w, int64_t next) { run_item(C, items_[w], next < 0 ? nullptr : &items_[next]); };
        pool.parallel_for((int64_t)items_.size(), body);
    }

private:
    // query rows a shared-page item serves at most (ROWS_PER_ITEM / g members): its page stays in
    // L1 while each member's heads run over it, and an item's scratch stays within L2
    static constexpr int ROWS_PER_ITEM = 64;

    struct Item {
        int32_t r0, nr;   // batch rows rows_[r0 .. r0 + nr): one, or a block of a group's members
        int32_t h;        // kv head
        int32_t t0, t1;   // tokens t0 .. t1-1, in the pages of rows_[r0]'s sequence (shared by all nr)
        int32_t slot;     // this chunk's partial slot per row, or -1: the row's only chunk (written out)
    };

    struct Call {
        int layer, g, Hq;
        bool dp;          // bf16 dot-product path (bf16 q, bf16 K, CPU has AVX512-BF16)
        int amx;          // AMX tile products (AMX_HW / AMX_EMU, amx.h) or AMX_OFF: the scores, and
                          // PV where V is in token pairs
        const float* sinks;   // [Hq] the layer's sinks in log2 units, or nullptr
        const void* q;
        int qdt;
        void* out;
        int odt;
        std::vector<const Seq*> seqs;
    };

    // ---- one work item: (rows, kv head, chunk) ----------------------------------

    // page i of head h of s follows neither `prev` (the page computed now) nor precedes its own
    // next page in memory: a run of one, which no hardware prefetcher can see coming
    bool isolated(const Seq& s, int layer, size_t i, int h, const char* prev) const {
        const auto& pl = s.pages[layer];
        const char* p = pl[i * Hkv_ + h];
        if (p == prev + page_bytes_) return false;
        return (i + 1) * Hkv_ >= pl.size() || pl[(i + 1) * Hkv_ + h] != p + page_bytes_;
    }

    // the AMX tiles where the call has them and the item 2 query rows or more; the AVX-512 passes
    // as their own instantiation (the tiles' blocking and padding compiled out of it)
    void run_item(const Call& C, const Item& it, const Item* next) const {
        if (C.amx != AMX_OFF && it.nr * C.g >= 2) run_item_as<true>(C, it, next);
        else run_item_as<false>(C, it, next);
    }

    template <bool AMX>
    void run_item_as(const Call& C, const Item& it, const Item* next) const {
        const int g = C.g, G = it.nr * g, Dp = Dp_, D = D_;   // G query rows: nr rows x g heads
        const Seq& s = *C.seqs[rows_[it.r0]];
        const int32_t t0 = it.t0, t1 = it.t1;
        const int32_t lo = (int32_t)window_start(C.layer, s.len[C.layer]);   // tokens before it are masked
        // AMX: the G rows (a shared-prefix block's members stacked) in nb tile products of R rows,
        // padded to Gp = nb * R rows of zero queries and probabilities
        [[maybe_unused]] const int amx = AMX ? C.amx : AMX_OFF;
        const int nb = AMX ? (G + AMX_ROWS_MAX - 1) / AMX_ROWS_MAX : 1, R = AMX ? (G + nb - 1) / nb : G, Gp = nb * R;

        // scratch: qf [Gp][Dp] | acc [Gp][Dp] | S [Gp][PT] | m [Gp] | l [Gp][L_LANES] | qw [Gp][Dp/2]
        //          words | qs [Gp] | qz [Gp][2] | p16 [R][PT] bf16 | i32 [R][PT] (int8: qw holds the
        //          query's hi parts [Gp][Dp/4] then its lo parts, qs their scales, qz their bias sums:
        //          quant.h; on the tiles p16 holds the page weights' parts, i32 the tiles' sums)
        thread_local AlignedBuf buf;
        float* qf = buf.get((size_t)2 * Gp * Dp + (size_t)Gp * PT + (size_t)Gp * (4 + L_LANES) + (size_t)Gp * Dp / 2 +
                            (size_t)R * PT / 2 + (AMX ? (size_t)R * PT : 0) + 64);
        float* acc = qf + (size_t)Gp * Dp;
        float* S = acc + (size_t)Gp * Dp;
        float* m = S + (size_t)Gp * PT;
        float* l = m + Gp;
        uint32_t* qw = reinterpret_cast<uint32_t*>(l + (size_t)Gp * L_LANES);
        float* qs = reinterpret_cast<float*>(qw + (size_t)Gp * Dp / 2);
        int32_t* qz = reinterpret_cast<int32_t*>(qs + Gp);
        [[maybe_unused]] uint16_t* p16 = reinterpret_cast<uint16_t*>(qz + 2 * (size_t)Gp);
        [[maybe_unused]] int32_t* i32 = reinterpret_cast<int32_t*>(p16 + (size_t)R * PT);
        const size_t lo_words = (size_t)Gp * Dp / 4;     // int8: where the query's lo parts start in qw
        auto l_of = [&](int j) { return l + (size_t)j * L_LANES; };   // row j's lane sums
        const bool i8 = dt_ == I8;

        // 1. queries of these rows' head group: fp32 pre-scaled so scores are in log2 units, or
        //    (bf16 q and bf16 K on a CPU with AVX512-BF16) the raw bf16 pairs, scaled after the dot
        //    product, or (int8 K) int8 with their scales (quant.h)
        const size_t qisz = dtype_size(C.qdt);
        const float sc = scale_ * LOG2E;
        for (int j = 0; j < G; ++j) {
            const int32_t row = rows_[it.r0 + j / g];
            const char* qj = static_cast<const char*>(C.q) + ((size_t)row * C.Hq + (size_t)it.h * g + j % g) * D * qisz;
            if (i8) {
                quant_query(qj, C.qdt, D, Dp, reinterpret_cast<int8_t*>(qw + (size_t)j * Dp / 4),
                            reinterpret_cast<int8_t*>(qw + lo_words + (size_t)j * Dp / 4), qs[j], qz + 2 * j,
                            acc + (size_t)j * Dp);       // the accumulator row as scratch (zeroed below)
                qs[j] *= sc;
            } else if (C.dp) {
                uint16_t* h = reinterpret_cast<uint16_t*>(qw + (size_t)j * Dp / 2);
                std::memcpy(h, qj, (size_t)D * 2);
                for (int d = D; d < Dp; ++d) h[d] = 0;
            } else {
                q_row(qj, C.qdt, D, Dp, sc, qf + (size_t)j * Dp);
            }
            std::memset(acc + (size_t)j * Dp, 0, sizeof(float) * Dp);
            m[j] = -INFINITY;
            std::fill(l_of(j), l_of(j + 1), 0.f);
        }
        for (int j = G; j < Gp; ++j) {     // AMX padding rows: zero queries, accumulators written, never read
            if (i8) {
                std::memset(qw + (size_t)j * Dp / 4, 0, Dp);
                std::memset(qw + lo_words + (size_t)j * Dp / 4, 0, Dp);
            } else {
                std::memset(qw + (size_t)j * Dp / 2, 0, sizeof(uint32_t) * Dp / 2);
            }
            std::memset(acc + (size_t)j * Dp, 0, sizeof(float) * Dp);
        }

        // 2. stream the chunk page by page (AMX: this thread's tiles configured for R rows first)
#if defined(FD_HAVE_DPBF16)
        if constexpr (AMX) i8 ? amx_begin_i8(amx, R) : amx_begin(amx, R);
#endif
        const int pf_mode = prefetch_.load(std::memory_order_relaxed);
        const auto& pages = s.pages[C.layer];
        const int32_t plast = (t1 - 1) / P;
        for (int32_t tb = t0; tb < t1; tb += P) {
            const int nvalid = std::min(P, t1 - tb);
            const int32_t pi = tb / P;
            const char* kr = pages[(size_t)pi * Hkv_ + it.h];
            const char* vr = kr + half_bytes_;

            // 2a. what to prefetch while this page is computed: the next page of this item, or
            //     the first page of the item this thread runs next (simd.h: "Software prefetch");
            //     PF_SCATTERED only a page apart from both neighbours (isolated)
            const char* pf = nullptr;
            if (pf_mode != PF_OFF && (pi < plast || next)) {
                const Seq& ns = pi < plast ? s : *C.seqs[rows_[next->r0]];
                const int nh = pi < plast ? it.h : next->h;
                const size_t ni = pi < plast ? (size_t)pi + 1 : (size_t)(next->t0 / P);
                if (pf_mode == PF_ALL || isolated(ns, C.layer, ni, nh, kr)) pf = ns.pages[C.layer][ni * Hkv_ + nh];
            }
            // 2b. scores of every query row: one pass over the K run (read from memory once; the
            //     passes take the rows in register blocks, the run staying in L1 between them)
#if defined(FD_HAVE_DPBF16)
            if (AMX && i8) {
                const int8_t* qb = reinterpret_cast<const int8_t*>(qw);
                for (int b = 0; b < nb; ++b)      // R rows per tile product (K's tiles from L1 after the first)
                    scores_page_i8_amx(amx, kr, Dp, qb + (size_t)b * R * Dp, qb + lo_words * 4 + (size_t)b * R * Dp,
                                       qs + b * R, qz + 2 * b * R, std::min(R, G - b * R), S + (size_t)b * R * PT, i32,
                                       b ? nullptr : pf);
            }
            else
#endif
            if (i8) scores_page_i8(use_vnni_, kr, Dp, qw, qw + lo_words, qs, qz, G, S, pf);
            else
#if defined(FD_HAVE_DPBF16)
            if (AMX) {
                for (int b = 0; b < nb; ++b)      // R rows per tile product (K's tiles from L1 after the first)
                    scores_page_amx(amx, kr, Dp, qw + (size_t)b * R * Dp / 2, sc, R, S + (size_t)b * R * PT, b ? nullptr : pf);
            }
            else if (C.dp) scores_page_dp(kr, Dp, qw, sc, G, S, pf);
            else
#endif
                scores_page(dt_, kr, Dp, qf, G, S, pf);
            // 2c. the variants: soft-capped scores; a window's first page masked before its start
            if (softcap2_ > 0.f) softcap_page(S, G, softcap2_);
            if (tb < lo)
                for (int j = 0; j < G; ++j) std::fill(S + (size_t)j * PT, S + (size_t)j * PT + (lo - tb), -INFINITY);
            // 2d. online softmax; rescale the accumulators when the running max moves
            for (int j = 0; j < G; ++j) {
                float alpha = softmax_page(S + (size_t)j * PT, nvalid, m[j], l_of(j));
                if (alpha != 1.f) scale_row(acc + (size_t)j * Dp, alpha, Dp);
            }
            // 2e. acc += p V: one pass over the V run (AMX: int8 pages, whole pages of V in token pairs)
#if defined(FD_HAVE_DPBF16)
            if (AMX && i8) {
                for (int b = 0; b < nb; ++b)
                    pv_page_i8_amx(amx, vr, nvalid, Dp, S + (size_t)b * R * PT, std::min(R, G - b * R), R,
                                   acc + (size_t)b * R * Dp, reinterpret_cast<uint8_t*>(p16), i32,
                                   pf && !b ? pf + half_bytes_ : nullptr, (int)(half_bytes_ / 64));
            }
            else
#endif
            if (i8) pv_page_i8(use_vnni_, vr, nvalid, Dp, S, G, acc, pf, page_bytes_);
            else
#if defined(FD_HAVE_DPBF16)
            if (AMX && vtile_ == V_PAIRS && nvalid == P) {
                for (int b = 0; b < nb; ++b) {
                    probs_bf16(S + (size_t)b * R * PT, std::min(R, G - b * R), R, p16);
                    pv_page_amx(amx, vr, Dp, p16, acc + (size_t)b * R * Dp, pf && !b ? pf + half_bytes_ : nullptr,
                                (int)(half_bytes_ / 64));
                }
            }
            else if (vtile_ == V_PAIRS) pv_page_pairs(vr, nvalid, Dp, S, G, acc, pf, page_bytes_);
            else
#endif
                pv_page(dt_, vr, nvalid, Dp, S, G, acc, pf, page_bytes_, vtile_);
        }

#if defined(FD_HAVE_DPBF16)
        if constexpr (AMX) amx_end(amx);
#endif

        // 3. a row's only chunk: normalise and write; else publish each row's partial, and the
        //    item that completes a row's partials merges them (after all are published: the merge
        //    takes the accumulators as scratch)
        const size_t oisz = dtype_size(C.odt);
        auto obase = [&](int32_t row) {
            return static_cast<char*>(C.out) + ((size_t)row * C.Hq + (size_t)it.h * g) * D * oisz;
        };
        const float* sinks = C.sinks ? C.sinks + (size_t)it.h * g : nullptr;    // this head group's
        if (it.slot < 0) {
            for (int j = 0; j < g; ++j)
                out_row(acc + (size_t)j * Dp, apos_.data(), inv_denominator(m[j], l_total(l_of(j)), sinks ? sinks + j : nullptr),
                        D, obase(rows_[it.r0]) + (size_t)j * D * oisz, C.odt);
            return;
        }
        int32_t done[ROWS_PER_ITEM];
        int ndone = 0;
        for (int r = 0; r < it.nr; ++r) {
            const int32_t row = rows_[it.r0 + r];
            const size_t ph = (size_t)row * Hkv_ + it.h;
            float* slot = parts_.p + (size_t)(part_[ph] + it.slot) * part_stride_;
            std::memcpy(slot, acc + (size_t)r * g * Dp, sizeof(float) * g * Dp);
            std::memcpy(slot + (size_t)g * Dp, m + (size_t)r * g, sizeof(float) * g);
            for (int j = 0; j < g; ++j) slot[(size_t)g * Dp + g + j] = l_total(l_of(r * g + j));
            if (counters_[ph].fetch_add(1, std::memory_order_acq_rel) == nchunks_[row] - 1) done[ndone++] = row;
        }
        for (int r = 0; r < ndone; ++r)
            merge(part_[(size_t)done[r] * Hkv_ + it.h], nchunks_[done[r]], g, obase(done[r]), C.odt, acc, sinks);
    }

    // 1 / the softmax denominator of a row with running max m and sum l; with a sink (log2 units)
    // its column joins the sum: everything scaled by 2^-M, M = max(m, sink), so that a sink far
    // above every score overflows nothing (the returned factor multiplies acc, which is scaled by 2^-m)
    static float inv_denominator(float m, float l, const float* sink) {
        if (!sink) return 1.f / l;
        const float M = std::fmax(m, *sink), f = exp2_1(m - M);
        return f / (l * f + exp2_1(*sink - M));
    }

    // ---- the chunk merge --------------------------------------------------------

    // log-sum-exp merge of nc partials in slot order (base 2), the first at slot `part`; acc is
    // scratch [g][Dp]; sinks: the g heads' sinks (log2 units), whose column joins the max and the sum
    void merge(int64_t part, int32_t nc, int g, char* obase, int odt, float* acc, const float* sinks) const {
        const int Dp = Dp_;
        const size_t oisz = dtype_size(odt);
        const float* first = parts_.p + (size_t)part * part_stride_;
        for (int j = 0; j < g; ++j) {
            float M = -INFINITY;
            for (int c = 0; c < nc; ++c) M = std::fmax(M, first[c * part_stride_ + (size_t)g * Dp + j]);
            if (sinks) M = std::fmax(M, sinks[j]);
            float* a = acc + (size_t)j * Dp;
            std::memset(a, 0, sizeof(float) * Dp);
            float lsum = 0.f;
            for (int c = 0; c < nc; ++c) {
                const float* sl = first + c * part_stride_;
                float w = exp2_1(sl[(size_t)g * Dp + j] - M);
                lsum += w * sl[(size_t)g * Dp + g + j];
                const float* pa = sl + (size_t)j * Dp;
                for (int d = 0; d < Dp; ++d) a[d] += w * pa[d];
            }
            if (sinks) lsum += exp2_1(sinks[j] - M);
            out_row(a, apos_.data(), 1.f / lsum, D_, obase + (size_t)j * D_ * oisz, odt);
        }
    }

    // ---- state ------------------------------------------------------------------

    const float scale_;
    const double softcap_;    // logit cap in natural units, 0: none
    const float softcap2_;    // the same in the scores' log2 units (cap * log2 e)
    std::vector<std::vector<float>> sinks_;   // [L] per layer: [Hq] sinks in log2 units, or empty
    // software prefetch of the next page (PF_*): FASTDECODE_PREFETCH, default on; set_prefetch (the
    // R-worker's start-up tune, rworker/tune.py) picks per host, since it pays on some and not others
    std::atomic<int> prefetch_{prefetch_mode_env()};
    std::vector<int> apos_;   // [Dp] accumulator index of each dim
    bool use_dp_ = false;     // AVX512-BF16 present (and allowed): bf16-q scores by vdpbf16ps
    bool use_vnni_ = false;   // AVX512-VNNI present (and allowed): int8 passes by vpdpbusd
    int amx_ = AMX_OFF;  // bf16-q scores as AMX tile products: AMX_HW, AMX_EMU (amx.h) or off

    // per-call scratch, reused
    std::vector<Item> items_;
    std::vector<int32_t> rows_;        // batch rows in item order: each group's members, then every row alone
    std::vector<int64_t> part_;        // [n][Hkv] first partial slot of (row, head), -1: written directly
    std::vector<int32_t> nchunks_;     // [n] partials each row merges
    std::vector<std::vector<int32_t>> groups_;            // rows of each shared prefix
    std::unordered_map<const char*, int32_t> group_of_;   // last shared page -> group
    std::vector<int32_t> lone_;        // rows outside any group of >= 2
    AlignedBuf parts_;
    size_t part_stride_ = 0;
    std::unique_ptr<std::atomic<int>[]> counters_;        // [n][Hkv] partials published
    size_t ncounters_cap_ = 0;
};

}  // namespace FD_NS
