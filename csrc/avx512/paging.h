// paging.h — the pages of one R-worker's KV store: arena, page lists, append, reserve, accounting.
//
// Layout. A page holds PT = 32 consecutive tokens of one (sequence, layer, kv-head):
//
//   page: [ K run: Dw words x PT tokens | V run: PT tokens x Dp dims ]   kv dtype, 64-B aligned
//   (the V run in tiles of V_TILE dims where the ISA's V pass wants them: simd.h; int8 pages
//   carry each run's per-token scales after it and hold V in 4-token words: quant.h)
//   AVX2 runs V in tiles of 16; AVX-512 token-major, or in tiles of 32 with FASTDECODE_VTILE=32
//
// (simd.h says why K is word-major). Pages come from an arena of big chunks that never move
// (hugepage-advised); freed pages go on a LIFO free list and are reused first. New pages of one
// append are taken head by head, so a prompt's pages of one head are consecutive in memory (one
// long stream for the hardware prefetcher), and a freed sequence returns its pages so that the
// next prompt gets them back in the same order. Appending a token writes one K column and one V
// row per head; nothing is ever copied to grow a sequence. `reserve` takes a sequence's pages for
// its whole reservation up front, so decode appends land in the same runs as its prompt. A
// sequence that outgrows its pages unreserved takes an extent (up to E pages per head, while the
// store keeps 1/8 of its capacity free): one run per E pages instead of one page per 32 decode
// steps from wherever the free list has one. Pages past a sequence's tokens and reservation are
// slack, given back (trimmed) when a call needs their room, so the capacity a caller counts in
// tokens (bytes_committed) is never short.
//
// Shared prefixes. `fork` makes a sequence whose first pages are another's (a shared system prompt,
// n samples of one prompt): the full pages are shared by pointer, a partial last page is copied, so
// an append never writes a shared page. A sequence's first `shared` pages per (layer, head) are
// refcounted (refs_: page -> holders); freeing a holder frees only what no other sequence reads.
// Every holder of a physical page at index j holds the same pages 0..j (a fork copies them all), so
// the attention groups sequences by the last shared page (attention.h: "Shared prefixes").
//
// Sliding windows. A layer with window W attends only its last W tokens (attention.h), so a page
// whose tokens are all before len - W is dead: an append that leaves a (sequence, layer) at len
// tokens gives its dead pages back to the arena (nullptr in Seq::pages, counted in Seq::dead), never
// takes a page that would be dead at once and skips the rows that land in one: a prefill of 8k
// tokens into a layer with W = 512 holds 16-17 pages per head of that layer, not 256. Page indices stay
// absolute (page p of a head is still pages[p * Hkv + h]); every walk (accounting, free, trim, runs)
// starts at the first live page. A reservation takes at most what the window keeps live. Prefix
// sharing is not offered with windows (fork refuses): a shared page would die for one holder only.
//
// Export / import. kv_blob.h writes a sequence's live pages as a blob from its Seq; `adopt` takes
// a checked blob's pages back as a new sequence's own (private, like an append's, no slack).
//
// Not thread-safe: the Store (kvstore.h) calls in under its mutex.
#pragma once

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "arena.h"
#include "common.h"
#include "pool.h"
#include "simd.h"

namespace FD_NS {

// ============================================================================
// Geometry: the shape of a store's pages, shared by its page table and its attention
// ============================================================================

struct Geometry {
    const int L_, Hkv_, D_, Dp_, dt_;
    const size_t isz_;
    const size_t half_bytes_;   // one head's K run (int8: and its scales); the V half is the same size
    const size_t page_bytes_;   // one head's K half + V half
    const int vtile_;           // V run layout: token-major (0) or tiles of this many dims (simd.h);
                                // int8 stores have their own (quant.h) and ignore it
    const std::vector<int32_t> win_;   // [L] sliding window per layer in tokens, 0: full attention

    Geometry(int L, int Hkv, int D, int dtype, int vtile, std::vector<int32_t> windows = {})
        : L_(L), Hkv_(Hkv), D_(D), Dp_((int)round_up(D, 16)), dt_(dtype), isz_(dtype_size(dtype)),
          half_bytes_(dtype == I8 ? i8_half_bytes((int)round_up(D, 16)) : (size_t)PT * round_up(D, 16) * dtype_size(dtype)),
          page_bytes_(2 * half_bytes_), vtile_(vtile),
          win_(windows.empty() ? std::vector<int32_t>(std::max(L, 0), 0) : std::move(windows)) {
        if (L < 1 || Hkv < 1 || D < 1) throw std::invalid_argument("num_layers, num_kv_heads and head_dim must be >= 1");
        if (dtype != F32 && dtype != BF16 && dtype != F16 && dtype != I8) throw std::invalid_argument("bad kv dtype");
        if ((int)win_.size() != L)
            throw std::invalid_argument("windows: " + std::to_string(win_.size()) + " values for " + std::to_string(L) + " layers");
        for (int l = 0; l < L; ++l)
            if (win_[l] < 0)
                throw std::invalid_argument("windows: layer " + std::to_string(l) + " has window " + std::to_string(win_[l]) +
                                            ", must be >= 0 (0: full attention)");
    }

    // first token a layer holding len tokens attends (its window's start; 0 without a window)
    int64_t window_start(int l, int64_t len) const { return win_[l] > 0 && len > win_[l] ? len - win_[l] : 0; }
    // pages per head wholly before that start: dead (freed)
    size_t dead_pages(int l, int64_t len) const { return (size_t)(window_start(l, len) / PT); }
    // pages per head a window keeps live at most: W tokens straddle up to ceil((W - 1) / PT) + 1
    size_t window_pages(int l) const { return ((size_t)win_[l] + 2 * PT - 2) / PT; }
};

struct Seq {
    std::vector<int32_t> len;                // [L] tokens per layer
    std::vector<std::vector<char*>> pages;   // [L][npages * Hkv]: page p of head h at p * Hkv + h
    int32_t pending = 0;                     // rows of the append call in progress
    size_t reserved = 0;                     // pages per (layer, head) `reserve` asked for
    int32_t shared = 0;                      // leading pages per (layer, head) held by reference (refs_)
    std::vector<int32_t> dead;               // [L] leading pages per head freed (before the layer's
                                             // window): nullptr in pages
};

// ============================================================================
// PageTable: every sequence's pages, and the calls that take, fill and give them back
// ============================================================================

class PageTable : protected Geometry {
public:
    static constexpr int P = PT;    // tokens per page

    PageTable(const Geometry& geo, int64_t capacity_bytes)
        : Geometry(geo), capacity_(capacity_bytes), arena_(page_bytes_) {}

    const Geometry& geometry() const { return *this; }

    // the sequence `id`, or nullptr
    const Seq* find(int64_t id) const {
        auto it = seqs_.find(id);
        return it == seqs_.end() ? nullptr : &it->second;
    }
    void check_layer(int layer) const {
        if (layer < 0 || layer >= L_)
            throw std::invalid_argument("layer " + std::to_string(layer) + " out of range [0, " + std::to_string(L_) + ")");
    }

    // ---- accounting -------------------------------------------------------------
    size_t bytes_used() const { return used_pages_.load(std::memory_order_relaxed) * page_bytes_; }
    // pages holding tokens or reserved: bytes_used less the extents' slack (what a caller counts).
    // O(1): every call that changes a sequence's pages, length or reservation moves slack_pages_
    // by its own difference (the R-worker reports this after each decode step, where a walk over
    // every (sequence, layer) would cost time linear in the batch)
    size_t bytes_committed() const { return (arena_.pages_in_use() - slack_pages_) * page_bytes_; }
    // the same by walking every (sequence, layer): what the counter must equal (tests)
    size_t bytes_committed_walk() const {
        size_t pages = 0;
        for (auto& kv : seqs_)
            for (int l = 0; l < L_; ++l)
                pages += (keep_pages(kv.second, l, 0) - kv.second.shared - kv.second.dead[l]) * Hkv_;
        return (pages + refs_.size()) * page_bytes_;     // a shared page counts once
    }
    // pages held by >= 2 sequences, and the references to them beyond the first (pages a fork saved)
    size_t shared_pages() const { return shared_pages_; }
    size_t saved_pages() const { return saved_pages_; }
    size_t bytes_reserved() const { return arena_.bytes_reserved(); }
    int extent_pages() const { return extent_; }
    void set_extent_pages(int e) {
        if (e < 1) throw std::invalid_argument("extent_pages must be >= 1");
        extent_ = e;
    }
    // runs of consecutive pages over the kv heads of one (sequence, layer): Hkv when each head's
    // pages are one run (a test and bench probe of the layout)
    int64_t page_runs(int64_t id, int layer) const {
        check_layer(layer);
        const Seq* s = find(id);
        if (!s) return 0;
        const auto& pl = s->pages[layer];
        const size_t np = pl.size() / Hkv_, p0 = s->dead[layer];   // from the first live page
        int64_t runs = 0;
        for (int h = 0; h < Hkv_; ++h)
            for (size_t p = p0; p < np; ++p)
                runs += p == p0 || pl[p * Hkv_ + h] != pl[(p - 1) * Hkv_ + h] + page_bytes_;
        return runs;
    }
    int64_t num_seqs() const { return (int64_t)seqs_.size(); }
    int64_t num_tokens(int64_t id, int layer) const {
        check_layer(layer);
        const Seq* s = find(id);
        return s ? s->len[layer] : 0;
    }

    // ---- free -------------------------------------------------------------------
    bool free_seq(int64_t id) {
        auto it = seqs_.find(id);
        if (it == seqs_.end()) return false;
        // push in reverse allocation order (layer, head, page): pops then come out in order
        auto& pages = it->second.pages;
        const int64_t shared = it->second.shared;
        for (int l = 0; l < L_; ++l) slack_pages_ -= slack_of(it->second, l);
        for (int l = L_ - 1; l >= 0; --l) {
            const int64_t np = (int64_t)pages[l].size() / Hkv_, p0 = it->second.dead[l];   // dead: given back already
            for (int h = Hkv_ - 1; h >= 0; --h)
                for (int64_t p = np - 1; p >= p0; --p)
                    if (p >= shared || unref(pages[l][p * Hkv_ + h])) arena_.put(pages[l][p * Hkv_ + h]);
        }
        used_pages_.store(arena_.pages_in_use(), std::memory_order_relaxed);
        seqs_.erase(it);
        return true;
    }

    // ---- fork -------------------------------------------------------------------
    // New sequence dst holding src's first `tokens` tokens at every layer: the tokens / P full pages
    // shared (refcounted), the partial page's tokens copied into a page of its own. Returns false
    // (and does nothing) when the copied pages would pass the capacity.
    bool fork(int64_t src, int64_t dst, int64_t tokens) {
        auto si = seqs_.find(src);
        if (si == seqs_.end()) throw std::invalid_argument("fork: unknown source sequence " + std::to_string(src));
        if (seqs_.count(dst)) throw std::invalid_argument("fork: sequence " + std::to_string(dst) + " already exists");
        for (int l = 0; l < L_; ++l)
            if (win_[l] > 0)
                throw std::invalid_argument("fork: prefix sharing is not offered with sliding windows (layer " + std::to_string(l) +
                                            " has window " + std::to_string(win_[l]) + ")");
        if (tokens < 1)
            throw std::invalid_argument("fork of sequence " + std::to_string(src) + " into " + std::to_string(dst) +
                                        ": token count " + std::to_string(tokens) + " < 1");
        for (int l = 0; l < L_; ++l)
            if (si->second.len[l] < tokens)
                throw std::invalid_argument("fork: sequence " + std::to_string(src) + " holds " +
                                            std::to_string(si->second.len[l]) + " tokens at layer " + std::to_string(l) +
                                            ", fewer than the " + std::to_string(tokens) + " to share");
        const size_t k = (size_t)tokens / P;
        const bool partial = tokens % P != 0;
        if (partial && over_capacity((size_t)L_ * Hkv_)) trim_slack(-1);
        if (partial && over_capacity((size_t)L_ * Hkv_)) return false;
        Seq& a = seqs_.find(src)->second;        // (trim_slack leaves the map's nodes where they are)
        std::vector<int64_t> created;
        Seq& b = get_or_create(dst, created);
        for (int l = 0; l < L_; ++l) {
            auto& pa = a.pages[l];
            auto& pb = b.pages[l];
            pb.assign(pa.begin(), pa.begin() + k * Hkv_);
            for (size_t p = 0; p < k * Hkv_; ++p) ref(pa[p], p / Hkv_ < (size_t)a.shared);
            if (partial) {
                pb.resize((k + 1) * Hkv_);
                for (int h = 0; h < Hkv_; ++h) {
                    pb[k * Hkv_ + h] = arena_.get();
                    std::memcpy(pb[k * Hkv_ + h], pa[k * Hkv_ + h], page_bytes_);
                }
            }
            b.len[l] = (int32_t)tokens;
        }
        a.shared = std::max(a.shared, (int32_t)k);
        b.shared = (int32_t)k;
        used_pages_.store(arena_.pages_in_use(), std::memory_order_relaxed);
        return true;
    }

    // ---- adopt (an imported blob: kv_blob.h) -------------------------------------
    // New sequence `id` holding len[l] tokens of each layer l, its first dead[l] pages per head dead
    // (what the layer's window leaves: the caller checked), its live pages taken as an append takes
    // them (head by head) and filled from src: per layer, pages dead[l] .. ceil(len[l] / P) - 1, each
    // its Hkv heads in order. Private pages, no reservation, no slack. Returns false (and changes
    // nothing) past the capacity; gives back other sequences' slack only when that makes the room.
    bool adopt(int64_t id, const int32_t* len, const int32_t* dead, const char* src) {
        size_t new_pages = 0;
        for (int l = 0; l < L_; ++l) new_pages += (((size_t)len[l] + P - 1) / P - (size_t)dead[l]) * Hkv_;
        if (over_capacity(new_pages, slack_pages_)) return false;    // not even with every extent trimmed
        if (over_capacity(new_pages)) trim_slack(-1);
        std::vector<int64_t> created;
        Seq& s = get_or_create(id, created);
        for (int l = 0; l < L_; ++l) {
            auto& pl = s.pages[l];
            pl.assign((size_t)dead[l] * Hkv_, nullptr);
            grow_pages(pl, ((size_t)len[l] + P - 1) / P);
            for (size_t i = (size_t)dead[l] * Hkv_; i < pl.size(); ++i, src += page_bytes_) std::memcpy(pl[i], src, page_bytes_);
            s.len[l] = len[l];
            s.dead[l] = dead[l];
        }
        used_pages_.store(arena_.pages_in_use(), std::memory_order_relaxed);
        return true;
    }

    // ---- reserve ----------------------------------------------------------------
    // Pages for tokens[i] tokens of sequence ids[i] at every layer, taken now (creating the
    // sequence if new; pages already held count). A decode step's appends then land in pages
    // taken with the prompt's, so each (layer, head) stays one run in memory instead of a page
    // per 32 steps wherever the free list has one: scattered 8-16 KB pages streamed at 0.62-0.88x
    // the runs (bench/kernel/NOTES.md, "Page runs"). A windowed layer takes at most the pages its
    // window keeps live beyond the dead ones (keep_pages). Returns false (and takes nothing) past the capacity.
    bool reserve(int64_t n, const int64_t* ids, const int64_t* tokens) {
        auto target = [&](const Seq* s, int l, size_t need) {    // pages per head layer l holds for `need`
            return win_[l] > 0 ? std::min(need, (s ? (size_t)s->dead[l] : 0) + window_pages(l)) : need;
        };
        auto count_new = [&] {     // pages the reservations take beyond what their sequences hold
            size_t new_pages = 0;
            for (int64_t i = 0; i < n; ++i) {
                if (tokens[i] < 0) throw std::invalid_argument("reserve: negative token count for sequence " + std::to_string(ids[i]));
                const size_t need = ((size_t)tokens[i] + P - 1) / P;
                auto it = seqs_.find(ids[i]);
                const Seq* s = it == seqs_.end() ? nullptr : &it->second;
                for (int l = 0; l < L_; ++l) {
                    const size_t have = s ? s->pages[l].size() / Hkv_ : 0, want = target(s, l, need);
                    if (want > have) new_pages += (want - have) * Hkv_;
                }
            }
            return new_pages;
        };
        // the trim may give back the reserving sequences' own extent slack: count again after it
        if (over_capacity(count_new())) trim_slack(-1);
        if (over_capacity(count_new())) return false;
        std::vector<int64_t> created;
        for (int64_t i = 0; i < n; ++i) {
            Seq& s = get_or_create(ids[i], created);
            const size_t need = ((size_t)tokens[i] + P - 1) / P;
            for (int l = 0; l < L_; ++l) slack_pages_ -= slack_of(s, l);
            s.reserved = std::max(s.reserved, need);
            for (int l = 0; l < L_; ++l) {
                grow_pages(s.pages[l], target(&s, l, need));
                slack_pages_ += slack_of(s, l);
            }
        }
        used_pages_.store(arena_.pages_in_use(), std::memory_order_relaxed);
        return true;
    }

    // ---- append -----------------------------------------------------------------
    // rows i = 0..n-1 in order: token (k[i], v[i]) [Hkv][D] goes to the end of sequence ids[i].
    // Returns false (and stores nothing) when the pages it needs would pass the capacity.
    // A large append copies on the pool's threads.
    bool append(Pool& pool, int layer, int64_t n, const int64_t* ids, const void* k, const void* v, int sdt) {
        check_layer(layer);
        if (n == 0) return true;

        // 1. resolve rows -> sequences, count rows per sequence (consecutive ids share a lookup)
        std::vector<int64_t> created;
        rows_.resize(n);
        touched_.clear();
        Seq* last = nullptr;
        bool interleaved = false;     // some sequence's rows come in several runs (step 4)
        for (int64_t i = 0; i < n; ++i) {
            Seq* s = (i > 0 && ids[i] == ids[i - 1]) ? last : &get_or_create(ids[i], created);
            interleaved |= s != last && s->pending > 0;
            if (s->pending++ == 0) touched_.push_back(s);
            rows_[i].seq = s;
            last = s;
        }

        // 2. capacity: count the new pages (one per head per 32 tokens) before touching anything
        //    (a reserved sequence may already hold them; none before a window's start), less the
        //    pages the new lengths leave dead before a window (given back in 3)
        size_t new_pages = 0, freed = 0;
        for (Seq* s : touched_) {
            const size_t have = s->pages[layer].size() / Hkv_, nlen = (size_t)s->len[layer] + s->pending;
            const size_t need = (nlen + P - 1) / P, nd = dead_pages(layer, (int64_t)nlen);
            if (need > std::max(have, nd)) new_pages += (need - std::max(have, nd)) * Hkv_;
            if (std::min(have, nd) > (size_t)s->dead[layer]) freed += (std::min(have, nd) - s->dead[layer]) * Hkv_;
        }
        if (over_capacity(new_pages, freed)) trim_slack(layer);     // other sequences' extents make room
        if (over_capacity(new_pages, freed)) {
            for (Seq* s : touched_) s->pending = 0;
            for (int64_t id : created) seqs_.erase(id);
            return false;
        }

        // 3. give back the pages the new lengths leave before a window; allocate pages head by head
        //    (a prompt's pages of one head end up consecutive), a whole extent for a sequence that
        //    outgrows its pages while 1/8 of the capacity stays free after it; then give each row
        //    its page index and slot (serial, cheap): none for a row in a dead page (not copied)
        size_t hard_left = new_pages;
        const size_t ext = (size_t)extent_ - 1;
        const size_t room = capacity_ > 0 ? (size_t)capacity_ / page_bytes_ * 7 / 8 : SIZE_MAX;
        for (Seq* s : touched_) {
            auto& pl = s->pages[layer];
            const size_t nlen = (size_t)s->len[layer] + s->pending, need = (nlen + P - 1) / P;
            slack_pages_ -= slack_of(*s, layer);    // added back below, with the new length
            drop_dead(*s, layer, dead_pages(layer, (int64_t)nlen));
            const size_t have = pl.size() / Hkv_;
            if (need > have) {
                hard_left -= (need - have) * Hkv_;
                const bool fits = arena_.pages_in_use() + (need - have + ext) * Hkv_ + hard_left <= room;
                grow_pages(pl, need + (fits ? ext : 0));
            }
            s->pending = 0;
        }
        for (int64_t i = 0; i < n; ++i) {
            Seq* s = rows_[i].seq;
            int32_t pos = s->len[layer]++;
            rows_[i].pages = pos / P < s->dead[layer] ? nullptr : s->pages[layer].data() + (size_t)(pos / P) * Hkv_;
            rows_[i].slot = pos % P;
        }
        for (Seq* s : touched_) slack_pages_ += slack_of(*s, layer);
        used_pages_.store(arena_.pages_in_use(), std::memory_order_relaxed);

        // 4. copy + convert. A task is (page, kv head): every segment (run of rows landing in one
        //    page) of that page, in row order, so no two threads write the same cache lines, nor
        //    the same word of a V run in token pairs (two tokens per word). A call that interleaves
        //    sequences' rows gives a page several segments. K rows are converted into a [rows][Dp]
        //    block and written transposed by 32-bit words (2 dims of 16-bit dtypes); V rows in
        //    place. Rows of dead pages (before a window) form segments of their own, skipped.
        segs_.clear();
        for (int64_t i = 0; i < n; ++i)
            if (i == 0 || rows_[i].pages != rows_[i - 1].pages) segs_.push_back(i);
        segs_.push_back(n);
        const int64_t ntasks = group_segments(interleaved);
        const size_t sisz = dtype_size(sdt);
        const size_t src_row = (size_t)Hkv_ * D_ * sisz;
        auto copy_seg = [&](int64_t si, int h) {
            const int64_t i0 = segs_[si], nr = segs_[si + 1] - i0;    // nr <= P rows, slots s0..
            if (!rows_[i0].pages) return;
            const int s0 = rows_[i0].slot;
            char* krun = rows_[i0].pages[h];
            char* vrun = krun + half_bytes_;
            const char* ksrc = static_cast<const char*>(k) + (size_t)i0 * src_row + (size_t)h * D_ * sisz;
            const char* vsrc = static_cast<const char*>(v) + (size_t)i0 * src_row + (size_t)h * D_ * sisz;
            thread_local AlignedBuf tmpb;
            char* tmp = reinterpret_cast<char*>(tmpb.get((size_t)P * Dp_));   // [nr][Dp] in kv dtype
            if (dt_ == I8) {
                quantize_in(ksrc, vsrc, src_row, sdt, nr, reinterpret_cast<uint8_t*>(tmp), krun, vrun, s0);
                return;
            }
            for (int64_t r = 0; r < nr; ++r) {
                if (vtile_ == 0) store_row(vsrc + r * src_row, sdt, vrun + (size_t)(s0 + r) * Dp_ * isz_, dt_, D_, Dp_);
                store_row(ksrc + r * src_row, sdt, tmp + (size_t)r * Dp_ * isz_, dt_, D_, Dp_);
            }
            transpose_in(tmp, nr, krun, s0);
            if (vtile_ != 0) {
                for (int64_t r = 0; r < nr; ++r)
                    store_row(vsrc + r * src_row, sdt, tmp + (size_t)r * Dp_ * isz_, dt_, D_, Dp_);
#if defined(FD_HAVE_DPBF16)
                if (vtile_ == V_PAIRS) pairs_in(reinterpret_cast<const uint16_t*>(tmp), nr, reinterpret_cast<uint16_t*>(vrun), s0, Dp_);
                else
#endif
                    tile_in(tmp, nr, vrun, s0);
            }
        };
        auto copy_task = [&](int64_t task, int64_t) {
            const int64_t t = task / Hkv_;
            for (int64_t j = task_at_[t]; j < task_at_[t + 1]; ++j) copy_seg(task_segs_[j], (int)(task % Hkv_));
        };
        const int64_t ntask = ntasks * Hkv_;
        if ((size_t)n * Hkv_ * D_ >= (size_t)1 << 16 && pool.size() > 1 && ntask > 1) pool.parallel_for(ntask, copy_task);
        else for (int64_t t = 0; t < ntask; ++t) copy_task(t, -1);
        return true;
    }

private:
    // ---- page lists: create, grow, capacity, slack ------------------------------

    Seq& get_or_create(int64_t id, std::vector<int64_t>& created) {
        auto it = seqs_.find(id);
        if (it != seqs_.end()) return it->second;
        Seq& s = seqs_[id];
        s.len.assign(L_, 0);
        s.dead.assign(L_, 0);
        s.pages.resize(L_);
        created.push_back(id);
        return s;
    }

    // pages[l] of one sequence up to `need` pages per head, head by head: the new pages of one
    // head are consecutive in memory when the arena hands out consecutive pages
    void grow_pages(std::vector<char*>& pl, size_t need) {
        const size_t have = pl.size() / Hkv_;
        if (need <= have) return;
        pl.resize(need * Hkv_);
        for (int h = 0; h < Hkv_; ++h)
            for (size_t p = have; p < need; ++p) pl[p * Hkv_ + h] = arena_.get();
    }

    // append's copy tasks: task_segs_[task_at_[t] .. task_at_[t + 1]) the segments (segs_) of task
    // t's page in row order; one segment per task unless the call interleaves sequences
    int64_t group_segments(bool interleaved) {
        const int64_t nseg = (int64_t)segs_.size() - 1;
        task_segs_.resize(nseg);
        task_at_.resize(nseg + 1);
        if (!interleaved) {
            for (int64_t j = 0; j <= nseg; ++j) task_at_[j] = j;
            for (int64_t j = 0; j < nseg; ++j) task_segs_[j] = j;
            return nseg;
        }
        page_task_.clear();
        seg_task_.resize(nseg);
        std::fill(task_at_.begin(), task_at_.end(), 0);
        int64_t ntasks = 0;
        for (int64_t j = 0; j < nseg; ++j) {
            auto it = page_task_.emplace(rows_[segs_[j]].pages, ntasks);
            ntasks += it.second;
            ++task_at_[(seg_task_[j] = it.first->second) + 1];
        }
        for (int64_t t = 0; t < ntasks; ++t) task_at_[t + 1] += task_at_[t];   // counting sort, stable
        std::vector<int64_t> fill(task_at_.begin(), task_at_.begin() + ntasks);
        for (int64_t j = 0; j < nseg; ++j) task_segs_[fill[seg_task_[j]]++] = j;
        return ntasks;
    }

    // the pages of (s, layer) before page `nd` given back (a window's start passed them), pushed so
    // that the free list hands them out again in order; pl grows to nd with nullptr for pages never held
    void drop_dead(Seq& s, int layer, size_t nd) {
        auto& pl = s.pages[layer];
        const size_t have = pl.size() / Hkv_, d0 = (size_t)s.dead[layer];
        if (nd <= d0) return;
        for (int h = Hkv_ - 1; h >= 0; --h)
            for (size_t p = std::min(have, nd); p-- > d0;) {
                arena_.put(pl[p * Hkv_ + h]);
                pl[p * Hkv_ + h] = nullptr;
            }
        if (have < nd) pl.resize(nd * Hkv_, nullptr);
        s.dead[layer] = (int32_t)nd;
    }

    // one more holder of page p (`held`: p is already counted in refs_, else it had one holder)
    void ref(char* p, bool held) {
        int32_t& n = refs_[p];
        if (!held) n = 1;
        if (++n == 2) ++shared_pages_;
        ++saved_pages_;
    }
    // one holder fewer of shared page p; true when it had no other (the caller frees it)
    bool unref(char* p) {
        auto it = refs_.find(p);
        if (--it->second == 0) {
            refs_.erase(it);
            return true;
        }
        --saved_pages_;
        if (it->second == 1) --shared_pages_;
        return false;
    }

    // would new_pages more (and `freed` given back first) pass the capacity
    bool over_capacity(size_t new_pages, size_t freed = 0) const {
        return capacity_ > 0 && (arena_.pages_in_use() - freed + new_pages) * page_bytes_ > (size_t)capacity_;
    }

    // pages per head one (sequence, layer) must keep (dead ones included, from index 0): its tokens
    // (with `extra` rows about to land) or its reservation, whichever is more, a windowed layer's
    // reservation capped at what its window keeps live; what it holds beyond is extent slack
    size_t keep_pages(const Seq& s, int l, int32_t extra) const {
        const size_t have = s.pages[l].size() / Hkv_;
        const size_t res = win_[l] > 0 ? std::min(s.reserved, (size_t)s.dead[l] + window_pages(l)) : s.reserved;
        return std::min(have, std::max(res, ((size_t)s.len[l] + extra + P - 1) / P));
    }
    // pages (all heads) one (sequence, layer) holds beyond keep_pages: its share of slack_pages_
    size_t slack_of(const Seq& s, int l) const { return (s.pages[l].size() / Hkv_ - keep_pages(s, l, 0)) * Hkv_; }

    // give back every sequence's extent slack (the pending rows of `layer` are kept), each
    // (layer, head) tail pushed so that the free list hands it out again in order
    void trim_slack(int layer) {
        for (auto& kv : seqs_) {
            Seq& s = kv.second;
            for (int l = L_ - 1; l >= 0; --l) {
                auto& pl = s.pages[l];
                const size_t have = pl.size() / Hkv_;
                const size_t keep = keep_pages(s, l, l == layer ? s.pending : 0);
                if (keep == have) continue;
                for (int h = Hkv_ - 1; h >= 0; --h)
                    for (size_t p = have; p-- > keep;) arena_.put(pl[p * Hkv_ + h]);
                pl.resize(keep * Hkv_);
            }
        }
        // what is left is the pending rows' pages of `layer` (slack until their lengths land)
        slack_pages_ = 0;
        if (layer >= 0)
            for (auto& kv : seqs_) slack_pages_ += slack_of(kv.second, layer);
        used_pages_.store(arena_.pages_in_use(), std::memory_order_relaxed);
    }

    // ---- rows into the runs of a page -------------------------------------------

    // K run [Dw][P] words: columns s0 .. s0+nr-1 <- rows of blk [nr][Dw] (Dw = Dp*isz/4 words)
    void transpose_in(const char* blk, int64_t nr, char* krun, int s0) const {
        const int Dw = (int)(Dp_ * isz_ / 4);
        const uint32_t* b = reinterpret_cast<const uint32_t*>(blk);
        uint32_t* kr = reinterpret_cast<uint32_t*>(krun) + s0;
        for (int w = 0; w < Dw; ++w) {
            uint32_t* line = kr + (size_t)w * P;
            for (int64_t r = 0; r < nr; ++r) line[r] = b[(size_t)r * Dw + w];
        }
    }

    // int8 (quant.h): rows s0 .. s0+nr-1 quantized, K turned and biased into its word-major run, V into
    // 4-token words, each row's scale after its run; blk: [nr][Dp] bytes of scratch
    void quantize_in(const char* ksrc, const char* vsrc, size_t src_row, int sdt, int64_t nr, uint8_t* blk,
                     char* krun, char* vrun, int s0) const {
        float* ksc = reinterpret_cast<float*>(krun + (size_t)P * Dp_);
        float* vsc = reinterpret_cast<float*>(vrun + (size_t)P * Dp_);
        thread_local AlignedBuf xb;
        float* x = xb.get(Dp_);
        for (int64_t r = 0; r < nr; ++r) ksc[s0 + r] = quant_key(ksrc + r * src_row, sdt, D_, Dp_, blk + (size_t)r * Dp_, x);
        transpose_in(reinterpret_cast<const char*>(blk), nr, krun, s0);
        for (int64_t r = 0; r < nr; ++r) vsc[s0 + r] = quant_value(vsrc + r * src_row, sdt, D_, Dp_, blk + (size_t)r * Dp_, x);
        quads_in(blk, nr, reinterpret_cast<uint8_t*>(vrun), s0, Dp_);
    }

    // V run [Dp/vt][P][vt] (+ [P][Dp % vt] last), vt = vtile_: rows s0 .. s0+nr-1 <- rows of blk [nr][Dp]
    void tile_in(const char* blk, int64_t nr, char* vrun, int s0) const {
        const size_t row = (size_t)Dp_ * isz_;
        for (int d0 = 0; d0 < Dp_; d0 += vtile_) {
            const size_t width = (size_t)std::min(vtile_, Dp_ - d0) * isz_;    // bytes of this tile per token
            char* dst = vrun + (size_t)d0 * P * isz_ + s0 * width;
            for (int64_t r = 0; r < nr; ++r) std::memcpy(dst + r * width, blk + r * row + d0 * isz_, width);
        }
    }

    // ---- state ------------------------------------------------------------------

    const int64_t capacity_;
    // pages per head a sequence takes when it outgrows its pages unreserved (FASTDECODE_EXTENT_PAGES)
    int extent_ = getenv("FASTDECODE_EXTENT_PAGES") ? std::max(1, atoi(getenv("FASTDECODE_EXTENT_PAGES"))) : 8;
    Arena arena_;
    std::atomic<size_t> used_pages_{0};
    size_t slack_pages_ = 0;    // sum of slack_of over every (sequence, layer)
    std::unordered_map<int64_t, Seq> seqs_;
    std::unordered_map<const char*, int32_t> refs_;   // shared page -> holders (pages below some Seq::shared)
    size_t shared_pages_ = 0;   // pages in refs_ with >= 2 holders
    size_t saved_pages_ = 0;    // sum over refs_ of holders - 1

    // per-call scratch, reused
    struct RowDst { Seq* seq; char* const* pages; int slot; };   // pages: the Hkv pages of its slot
    std::vector<RowDst> rows_;
    std::vector<int64_t> segs_;
    std::vector<int64_t> task_segs_, task_at_, seg_task_;           // copy tasks (group_segments)
    std::unordered_map<char* const*, int64_t> page_task_;
    std::vector<Seq*> touched_;
};

}  // namespace FD_NS
