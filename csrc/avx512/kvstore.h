// kvstore.h — the paged KV store of one R-worker and decode attention over it.
//
// Layout. A page holds PT = 32 consecutive tokens of one (sequence, layer, kv-head):
//
//   page: [ K run: Dw words x PT tokens | V run: PT tokens x Dp dims ]   kv dtype, 64-B aligned
//   (the V run in tiles of V_TILE dims where the ISA's V pass wants them: simd.h)
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
// Attention. Work items are (sequence, kv-head, chunk of CH = 512 tokens). One item streams its
// K/V runs once and serves all g = Hq/Hkv query heads of the group (GQA) with an online softmax
// in base 2, fp32 accumulators. Items of a multi-chunk sequence write partial (m, l, acc); the
// item that finishes last merges them in chunk order (log-sum-exp). Chunk boundaries depend only
// on the sequence length, and an item's arithmetic does not depend on which thread runs it, so
// a sequence's output is bitwise the same whatever the batch, the thread count or the history.
#pragma once

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#if defined(__linux__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

#include "common.h"
#include "pool.h"
#include "simd.h"
#if defined(FD_HAVE_DPBF16)
#include "amx.h"
#endif

namespace FD_NS {

// ============================================================================
// Arena: big chunks carved into equal pages; a LIFO free list of returned pages
// ============================================================================

class Arena {
public:
    explicit Arena(size_t page_bytes) : page_bytes_(page_bytes) {
        // chunks of >= 64 MiB (and whole pages): few system calls, 2 MiB hugepages inside
        size_t per = std::max<size_t>(1, (size_t(64) << 20) / page_bytes_);
        chunk_pages_ = per;
    }
    ~Arena() {
        for (auto& c : chunks_) release(c.first, c.second);
    }
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;

    char* get() {
        if (!free_.empty()) {
            char* p = free_.back();
            free_.pop_back();
            ++in_use_;
            return p;
        }
        if (next_ == end_) grow();
        char* p = next_;
        next_ += page_bytes_;
        ++in_use_;
        return p;
    }
    void put(char* p) {
        free_.push_back(p);
        --in_use_;
    }
    size_t pages_in_use() const { return in_use_; }
    size_t bytes_reserved() const { return reserved_.load(std::memory_order_relaxed); }

private:
    void grow() {
        size_t bytes = chunk_pages_ * page_bytes_;
        char* p = nullptr;
#if defined(__linux__) || defined(__APPLE__)
        // over-map by 2 MiB so the chunk can start on a hugepage boundary
        const size_t huge = size_t(2) << 20;
        size_t len = bytes + huge;
        void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) throw std::bad_alloc();
        uintptr_t a = ((uintptr_t)m + huge - 1) & ~(uintptr_t)(huge - 1);
        p = (char*)a;
#if defined(MADV_HUGEPAGE)
        madvise(p, bytes, MADV_HUGEPAGE);
#endif
        chunks_.push_back({(char*)m, len});
#else
        p = static_cast<char*>(std::aligned_alloc(64, bytes));
        if (!p) throw std::bad_alloc();
        chunks_.push_back({p, 0});
#endif
        next_ = p;
        end_ = p + bytes;
        reserved_.fetch_add(bytes, std::memory_order_relaxed);
    }
    static void release(char* p, size_t len) {
#if defined(__linux__) || defined(__APPLE__)
        munmap(p, len);
#else
        (void)len;
        std::free(p);
#endif
    }

    const size_t page_bytes_;
    size_t chunk_pages_;
    std::vector<std::pair<char*, size_t>> chunks_;
    char* next_ = nullptr;
    char* end_ = nullptr;
    std::vector<char*> free_;
    size_t in_use_ = 0;
    std::atomic<size_t> reserved_{0};
};

// ============================================================================
// Store
// ============================================================================

// Software prefetch of the next page while one is computed (simd.h): none, always, or only a
// page that lies apart from both its neighbours (a run of one). The hardware prefetcher follows a
// run by itself and cannot know where a scattered page is; a software prefetch at the head of a
// run lost a little there, as if it kept the hardware from training on it (bench/KERNEL_NOTES.md, 15)
enum { PF_OFF = 0, PF_ALL = 1, PF_SCATTERED = 2 };

// an AMX A tile holds up to 16 query heads (amx.h)
constexpr int AMX_ROWS_MAX = 16;

// FASTDECODE_PREFETCH: 0 / off, 1 / on (the default), scattered
static inline int prefetch_mode_env() {
    const char* e = getenv("FASTDECODE_PREFETCH");
    if (!e) return PF_ALL;
    const std::string v(e);
    return v == "0" || v == "off" ? PF_OFF : v == "scattered" ? PF_SCATTERED : PF_ALL;
}

struct Seq {
    std::vector<int32_t> len;                // [L] tokens per layer
    std::vector<std::vector<char*>> pages;   // [L][npages * Hkv]: page p of head h at p * Hkv + h
    int32_t pending = 0;                     // rows of the append call in progress
    size_t reserved = 0;                     // pages per (layer, head) `reserve` asked for
};

class Store {
public:
    static constexpr int P = PT;    // tokens per page
    static constexpr int CH = 512;  // tokens per split-KV chunk (a multiple of P)

    Store(int L, int Hkv, int D, int dtype, double scale, int64_t capacity_bytes, int threads,
          std::vector<int> cpus, int spin_us, int vtile = V_TILE)
        : L_(L), Hkv_(Hkv), D_(D), Dp_((int)round_up(D, 16)), dt_(dtype), isz_(dtype_size(dtype)),
          scale_((float)scale), capacity_(capacity_bytes), cpus_(std::move(cpus)), spin_us_(spin_us),
          page_bytes_(2 * (size_t)P * round_up(D, 16) * dtype_size(dtype)), arena_(page_bytes_),
          pool_(new Pool(threads, cpus_, spin_us)) {
        if (L < 1 || Hkv < 1 || D < 1) throw std::invalid_argument("num_layers, num_kv_heads and head_dim must be >= 1");
        if (dtype != F32 && dtype != BF16 && dtype != F16) throw std::invalid_argument("bad kv dtype");
        vtile_ = vtile;
#if defined(FD_HAVE_DPBF16)
        // FASTDECODE_DPBF16=0 keeps bf16 queries on the FMA path (for measurements)
        // (the SIMDe test build emulates the instruction, so it takes the path on any CPU)
#if defined(FD_SIMDE_AVX512)
        const bool has_dp = true;
#else
        const bool has_dp = cpu_has_avx512bf16();
#endif
        use_dp_ = has_dp && !(getenv("FASTDECODE_DPBF16") && std::string(getenv("FASTDECODE_DPBF16")) == "0");
        if (vtile == V_PAIRS && (dtype != BF16 || !has_dp))
            throw std::invalid_argument("v_tile: token pairs (V_PAIRS) need bf16 KV and a CPU with AVX512-BF16");
        const bool pairs = vtile == V_PAIRS;
#else
        const bool pairs = false;
#endif
        if (vtile != V_TILE && vtile != V_TILE_ALT && !pairs) throw std::invalid_argument("v_tile: not a layout of this build");
        for (int d = 0; d < Dp_; ++d) apos_.push_back(pairs ? d : apos(dt_, d, Dp_));   // pairs: natural order
    }

    int v_tile() const { return vtile_; }
    int amx() const { return amx_; }
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
        std::lock_guard<std::mutex> lk(mu_);
        amx_ = mode;
    }
    int prefetch() const { return prefetch_.load(std::memory_order_relaxed); }
    void set_prefetch(int mode) {
        if (mode != PF_OFF && mode != PF_ALL && mode != PF_SCATTERED) throw std::invalid_argument("bad prefetch mode");
        std::lock_guard<std::mutex> lk(mu_);     // not while an attend reads it
        prefetch_.store(mode, std::memory_order_relaxed);
    }

    // ---- geometry / accounting ------------------------------------------------
    int threads() const { return pool_->size(); }
    void set_threads(int n) {
        std::lock_guard<std::mutex> lk(mu_);
        pool_.reset(new Pool(n, cpus_, spin_us_));
    }
    size_t page_bytes() const { return page_bytes_; }
    size_t bytes_used() const { return used_pages_.load(std::memory_order_relaxed) * page_bytes_; }
    // pages holding tokens or reserved: bytes_used less the extents' slack (what a caller counts).
    // O(1): every call that changes a sequence's pages, length or reservation moves slack_pages_
    // by its own difference (the R-worker reports this after each decode step, where a walk over
    // every (sequence, layer) would cost time linear in the batch)
    size_t bytes_committed() {
        std::lock_guard<std::mutex> lk(mu_);
        return (arena_.pages_in_use() - slack_pages_) * page_bytes_;
    }
    // the same by walking every (sequence, layer): what the counter must equal (tests)
    size_t bytes_committed_walk() {
        std::lock_guard<std::mutex> lk(mu_);
        size_t pages = 0;
        for (auto& kv : seqs_)
            for (int l = 0; l < L_; ++l) pages += keep_pages(kv.second, l, 0) * Hkv_;
        return pages * page_bytes_;
    }
    int extent_pages() const { return extent_; }
    void set_extent_pages(int e) {
        if (e < 1) throw std::invalid_argument("extent_pages must be >= 1");
        std::lock_guard<std::mutex> lk(mu_);
        extent_ = e;
    }
    // runs of consecutive pages over the kv heads of one (sequence, layer): Hkv when each head's
    // pages are one run (a test and bench probe of the layout)
    int64_t page_runs(int64_t id, int layer) {
        std::lock_guard<std::mutex> lk(mu_);
        check_layer(layer);
        auto it = seqs_.find(id);
        if (it == seqs_.end()) return 0;
        const auto& pl = it->second.pages[layer];
        const size_t np = pl.size() / Hkv_;
        int64_t runs = 0;
        for (int h = 0; h < Hkv_; ++h)
            for (size_t p = 0; p < np; ++p)
                runs += p == 0 || pl[p * Hkv_ + h] != pl[(p - 1) * Hkv_ + h] + page_bytes_;
        return runs;
    }
    size_t bytes_reserved() const { return arena_.bytes_reserved(); }
    int64_t num_seqs() {
        std::lock_guard<std::mutex> lk(mu_);
        return (int64_t)seqs_.size();
    }

    int64_t num_tokens(int64_t id, int layer) {
        std::lock_guard<std::mutex> lk(mu_);
        check_layer(layer);
        auto it = seqs_.find(id);
        return it == seqs_.end() ? 0 : it->second.len[layer];
    }

    bool free_seq(int64_t id) {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = seqs_.find(id);
        if (it == seqs_.end()) return false;
        // push in reverse allocation order (layer, head, page): pops then come out in order
        auto& pages = it->second.pages;
        for (int l = 0; l < L_; ++l) slack_pages_ -= slack_of(it->second, l);
        for (int l = L_ - 1; l >= 0; --l) {
            const int64_t np = (int64_t)pages[l].size() / Hkv_;
            for (int h = Hkv_ - 1; h >= 0; --h)
                for (int64_t p = np - 1; p >= 0; --p) arena_.put(pages[l][p * Hkv_ + h]);
        }
        used_pages_.store(arena_.pages_in_use(), std::memory_order_relaxed);
        seqs_.erase(it);
        return true;
    }

    // ---- reserve ------------------------------------------------------------
    // Pages for tokens[i] tokens of sequence ids[i] at every layer, taken now (creating the
    // sequence if new; pages already held count). A decode step's appends then land in pages
    // taken with the prompt's, so each (layer, head) stays one run in memory instead of a page
    // per 32 steps wherever the free list has one: scattered 8-16 KB pages streamed at 0.62-0.88x
    // the runs (bench/KERNEL_NOTES.md, "Page runs"). Returns false (and takes nothing) past the capacity.
    bool reserve(int64_t n, const int64_t* ids, const int64_t* tokens) {
        std::lock_guard<std::mutex> lk(mu_);
        size_t new_pages = 0;
        for (int64_t i = 0; i < n; ++i) {
            if (tokens[i] < 0) throw std::invalid_argument("reserve: negative token count for sequence " + std::to_string(ids[i]));
            const size_t need = ((size_t)tokens[i] + P - 1) / P;
            auto it = seqs_.find(ids[i]);
            for (int l = 0; l < L_; ++l) {
                const size_t have = it == seqs_.end() ? 0 : it->second.pages[l].size() / Hkv_;
                if (need > have) new_pages += (need - have) * Hkv_;
            }
        }
        if (over_capacity(new_pages)) trim_slack(-1);
        if (over_capacity(new_pages)) return false;
        std::vector<int64_t> created;
        for (int64_t i = 0; i < n; ++i) {
            Seq& s = get_or_create(ids[i], created);
            const size_t need = ((size_t)tokens[i] + P - 1) / P;
            for (int l = 0; l < L_; ++l) slack_pages_ -= slack_of(s, l);
            s.reserved = std::max(s.reserved, need);
            for (int l = 0; l < L_; ++l) {
                grow_pages(s.pages[l], need);
                slack_pages_ += slack_of(s, l);
            }
        }
        used_pages_.store(arena_.pages_in_use(), std::memory_order_relaxed);
        return true;
    }

    // ---- append -------------------------------------------------------------
    // rows i = 0..n-1 in order: token (k[i], v[i]) [Hkv][D] goes to the end of sequence ids[i].
    // Returns false (and stores nothing) when the pages it needs would pass the capacity.
    bool append(int layer, int64_t n, const int64_t* ids, const void* k, const void* v, int sdt) {
        std::lock_guard<std::mutex> lk(mu_);
        return append_locked(layer, n, ids, k, v, sdt);
    }

    // ---- attend -------------------------------------------------------------
    // q [n][Hq][D] (sdt F32 or BF16) -> out [n][Hq][D] (odt F32 or BF16), over all stored tokens.
    void attend(int layer, int64_t n, const int64_t* ids, const void* q, int qdt, int Hq, void* out, int odt) {
        std::lock_guard<std::mutex> lk(mu_);
        attend_locked(layer, n, ids, q, qdt, Hq, out, odt);
    }

    // fused decode step: append one token per sequence, then attend. false = capacity (nothing done)
    bool append_attend(int layer, int64_t n, const int64_t* ids, const void* q, int qdt, int Hq,
                       const void* k, const void* v, int kvdt, void* out, int odt) {
        std::lock_guard<std::mutex> lk(mu_);
        check_layer(layer);
        check_heads(Hq);
        if (!append_locked(layer, n, ids, k, v, kvdt)) return false;
        attend_locked(layer, n, ids, q, qdt, Hq, out, odt);
        return true;
    }

    Pool& pool() { return *pool_; }

private:
    void check_layer(int layer) const {
        if (layer < 0 || layer >= L_)
            throw std::invalid_argument("layer " + std::to_string(layer) + " out of range [0, " + std::to_string(L_) + ")");
    }
    void check_heads(int Hq) const {
        if (Hq < Hkv_ || Hq % Hkv_ != 0)
            throw std::invalid_argument("q has " + std::to_string(Hq) + " heads, not a multiple of num_kv_heads=" +
                                        std::to_string(Hkv_));
    }

    Seq& get_or_create(int64_t id, std::vector<int64_t>& created) {
        auto it = seqs_.find(id);
        if (it != seqs_.end()) return it->second;
        Seq& s = seqs_[id];
        s.len.assign(L_, 0);
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

    bool over_capacity(size_t new_pages) const {
        return capacity_ > 0 && (arena_.pages_in_use() + new_pages) * page_bytes_ > (size_t)capacity_;
    }

    // pages per head one (sequence, layer) must keep: its tokens (with `extra` rows about to
    // land) or its reservation, whichever is more; what it holds beyond is extent slack
    size_t keep_pages(const Seq& s, int l, int32_t extra) const {
        const size_t have = s.pages[l].size() / Hkv_;
        return std::min(have, std::max(s.reserved, ((size_t)s.len[l] + extra + P - 1) / P));
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

    bool append_locked(int layer, int64_t n, const int64_t* ids, const void* k, const void* v, int sdt) {
        check_layer(layer);
        if (n == 0) return true;

        // 1. resolve rows -> sequences, count rows per sequence (consecutive ids share a lookup)
        std::vector<int64_t> created;
        rows_.resize(n);
        touched_.clear();
        Seq* last = nullptr;
        for (int64_t i = 0; i < n; ++i) {
            Seq* s = (i > 0 && ids[i] == ids[i - 1]) ? last : &get_or_create(ids[i], created);
            if (s->pending++ == 0) touched_.push_back(s);
            rows_[i].seq = s;
            last = s;
        }

        // 2. capacity: count the new pages (one per head per 32 tokens) before touching anything
        //    (a reserved sequence may already hold them)
        size_t new_pages = 0;
        for (Seq* s : touched_) {
            size_t have = s->pages[layer].size() / Hkv_;
            size_t need = ((size_t)s->len[layer] + s->pending + P - 1) / P;
            if (need > have) new_pages += (need - have) * Hkv_;
        }
        if (over_capacity(new_pages)) trim_slack(layer);     // other sequences' extents make room
        if (over_capacity(new_pages)) {
            for (Seq* s : touched_) s->pending = 0;
            for (int64_t id : created) seqs_.erase(id);
            return false;
        }

        // 3. allocate pages head by head (a prompt's pages of one head end up consecutive), a
        //    whole extent for a sequence that outgrows its pages while 1/8 of the capacity stays
        //    free after it; then give each row its page index and slot (serial, cheap)
        size_t hard_left = new_pages;
        const size_t ext = (size_t)extent_ - 1;
        const size_t room = capacity_ > 0 ? (size_t)capacity_ / page_bytes_ * 7 / 8 : SIZE_MAX;
        for (Seq* s : touched_) {
            auto& pl = s->pages[layer];
            const size_t have = pl.size() / Hkv_;
            const size_t need = ((size_t)s->len[layer] + s->pending + P - 1) / P;
            slack_pages_ -= slack_of(*s, layer);    // added back below, with the new length
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
            rows_[i].pages = s->pages[layer].data() + (size_t)(pos / P) * Hkv_;
            rows_[i].slot = pos % P;
        }
        for (Seq* s : touched_) slack_pages_ += slack_of(*s, layer);
        used_pages_.store(arena_.pages_in_use(), std::memory_order_relaxed);

        // 4. copy + convert. A task is (run of rows landing in one page, kv head): no two threads
        //    write the same cache lines. K rows are converted into a [rows][Dp] block and
        //    written transposed by 32-bit words (2 dims of 16-bit dtypes); V rows in place.
        segs_.clear();
        for (int64_t i = 0; i < n; ++i)
            if (i == 0 || rows_[i].pages != rows_[i - 1].pages) segs_.push_back(i);
        segs_.push_back(n);
        const size_t sisz = dtype_size(sdt);
        const size_t src_row = (size_t)Hkv_ * D_ * sisz;
        const int64_t nseg = (int64_t)segs_.size() - 1;
        auto copy_task = [&](int64_t task, int64_t) {
            const int64_t si = task / Hkv_;
            const int h = (int)(task % Hkv_);
            const int64_t i0 = segs_[si], nr = segs_[si + 1] - i0;    // nr <= P rows, slots s0..
            const int s0 = rows_[i0].slot;
            char* krun = rows_[i0].pages[h];
            char* vrun = krun + (size_t)P * Dp_ * isz_;
            const char* ksrc = static_cast<const char*>(k) + (size_t)i0 * src_row + (size_t)h * D_ * sisz;
            const char* vsrc = static_cast<const char*>(v) + (size_t)i0 * src_row + (size_t)h * D_ * sisz;
            thread_local AlignedBuf tmpb;
            char* tmp = reinterpret_cast<char*>(tmpb.get((size_t)P * Dp_));   // [nr][Dp] in kv dtype
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
        const int64_t ntask = nseg * Hkv_;
        if ((size_t)n * Hkv_ * D_ >= (size_t)1 << 16 && pool_->size() > 1 && ntask > 1) pool_->parallel_for(ntask, copy_task);
        else for (int64_t t = 0; t < ntask; ++t) copy_task(t, -1);
        return true;
    }

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

    // V run [Dp/vt][P][vt] (+ [P][Dp % vt] last), vt = vtile_: rows s0 .. s0+nr-1 <- rows of blk [nr][Dp]
    void tile_in(const char* blk, int64_t nr, char* vrun, int s0) const {
        const size_t row = (size_t)Dp_ * isz_;
        for (int d0 = 0; d0 < Dp_; d0 += vtile_) {
            const size_t width = (size_t)std::min(vtile_, Dp_ - d0) * isz_;    // bytes of this tile per token
            char* dst = vrun + (size_t)d0 * P * isz_ + s0 * width;
            for (int64_t r = 0; r < nr; ++r) std::memcpy(dst + r * width, blk + r * row + d0 * isz_, width);
        }
    }

    // ---- attention driver ------------------------------------------------------
    struct Item {
        int32_t i, h, c, nc;   // batch row, kv head, chunk, chunks of this sequence
        int64_t part;          // first partial slot of this (row, head) if nc > 1, else -1
        int64_t counter;       // index of the merge counter if nc > 1
    };

    struct Call {
        int layer, g, Hq;
        bool dp;          // bf16 dot-product path (bf16 q, bf16 K, CPU has AVX512-BF16)
        int amx;          // scores as AMX tile products (AMX_HW / AMX_EMU, amx.h) or AMX_OFF
        const void* q;
        int qdt;
        void* out;
        int odt;
        std::vector<Seq*> seqs;
    };

    void attend_locked(int layer, int64_t n, const int64_t* ids, const void* q, int qdt, int Hq, void* out, int odt) {
        check_layer(layer);
        check_heads(Hq);
        if (n == 0) return;
        const int g = Hq / Hkv_;
        const bool dp = use_dp_ && dt_ == BF16 && qdt == BF16;
        // AMX where the tiles fit: 32-dim steps, 2..16 heads per group (one head would fill 1/16
        // of every tile product, for the cost of a full one: MHA stays on vdpbf16ps)
        const int amx = dp && Dp_ % 32 == 0 && g >= 2 && g <= AMX_ROWS_MAX ? amx_ : AMX_OFF;
        Call C{layer, g, Hq, dp, amx, q, qdt, out, odt, {}};
        C.seqs.resize(n);

        // 1. resolve sequences and build the work list
        items_.clear();
        int64_t nparts = 0, ncounters = 0;
        for (int64_t i = 0; i < n; ++i) {
            auto it = seqs_.find(ids[i]);
            if (it == seqs_.end()) throw std::invalid_argument("unknown sequence id " + std::to_string(ids[i]));
            Seq* s = &it->second;
            int32_t len = s->len[layer];
            if (len == 0)
                throw std::invalid_argument("sequence " + std::to_string(ids[i]) + " has no tokens at layer " +
                                            std::to_string(layer));
            C.seqs[i] = s;
            int32_t nc = (len + CH - 1) / CH;
            for (int h = 0; h < Hkv_; ++h) {
                int64_t part = nc > 1 ? nparts : -1, ctr = nc > 1 ? ncounters++ : -1;
                if (nc > 1) nparts += nc;
                for (int c = 0; c < nc; ++c) items_.push_back({(int32_t)i, h, c, nc, part, ctr});
            }
        }
        // partial slot: [g][Dp] acc, then g m, then g l
        part_stride_ = (size_t)g * Dp_ + 2 * (size_t)g;
        if (nparts) parts_.get((size_t)nparts * part_stride_);
        if (ncounters > (int64_t)ncounters_cap_) {
            counters_.reset(new std::atomic<int>[ncounters]);
            ncounters_cap_ = ncounters;
        }
        for (int64_t c = 0; c < ncounters; ++c) counters_[c].store(0, std::memory_order_relaxed);

        // 2. run (longest items are already bounded by CH, so plain dynamic order balances)
        auto body = [&](int64_t w, int64_t next) { run_item(C, items_[w], next < 0 ? nullptr : &items_[next]); };
        pool_->parallel_for((int64_t)items_.size(), body);
    }

    // page i of head h of s follows neither `prev` (the page computed now) nor precedes its own
    // next page in memory: a run of one, which no hardware prefetcher can see coming
    bool isolated(const Seq& s, int layer, size_t i, int h, const char* prev) const {
        const auto& pl = s.pages[layer];
        const char* p = pl[i * Hkv_ + h];
        if (p == prev + page_bytes_) return false;
        return (i + 1) * Hkv_ >= pl.size() || pl[(i + 1) * Hkv_ + h] != p + page_bytes_;
    }

    void run_item(const Call& C, const Item& it, const Item* next) const {
        const int g = C.g, Dp = Dp_, D = D_;
        const Seq& s = *C.seqs[it.i];
        const int32_t len = s.len[C.layer];
        const int32_t t0 = it.c * CH, t1 = std::min(len, t0 + CH);

        // scratch: qf [g][Dp] | acc [g][Dp] | S [g][PT] | m [g] | l [g][L_LANES] | qw [g][Dp/2] words
        thread_local AlignedBuf buf;
        float* qf = buf.get((size_t)2 * g * Dp + (size_t)g * PT + (size_t)g * (1 + L_LANES) + (size_t)g * Dp / 2 + 64);
        float* acc = qf + (size_t)g * Dp;
        float* S = acc + (size_t)g * Dp;
        float* m = S + (size_t)g * PT;
        float* l = m + g;
        uint32_t* qw = reinterpret_cast<uint32_t*>(l + (size_t)g * L_LANES);
        auto l_of = [&](int j) { return l + (size_t)j * L_LANES; };   // head j's lane sums

        // 1. queries of this group: fp32 pre-scaled so scores are in log2 units, or (bf16 q and
        //    bf16 K on a CPU with AVX512-BF16) the raw bf16 pairs, scaled after the dot product
        const size_t qisz = dtype_size(C.qdt);
        const char* qbase = static_cast<const char*>(C.q) + ((size_t)it.i * C.Hq + (size_t)it.h * g) * D * qisz;
        const float sc = scale_ * LOG2E;
        for (int j = 0; j < g; ++j) {
            const char* qj = qbase + (size_t)j * D * qisz;
            if (C.dp) {
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

        // 2. stream the chunk page by page (AMX: this thread's tiles configured for g rows first)
#if defined(FD_HAVE_DPBF16)
        if (C.amx) amx_begin(C.amx, g);
#endif
        const int pf_mode = prefetch_.load(std::memory_order_relaxed);
        const size_t run_bytes = (size_t)P * Dp * isz_;
        const auto& pages = s.pages[C.layer];
        const int32_t plast = (t1 - 1) / P;
        for (int32_t tb = t0; tb < t1; tb += P) {
            const int nvalid = std::min(P, t1 - tb);
            const int32_t pi = tb / P;
            const char* kr = pages[(size_t)pi * Hkv_ + it.h];
            const char* vr = kr + run_bytes;

            // 2a. what to prefetch while this page is computed: the next page of this item, or
            //     the first page of the item this thread runs next (simd.h: "Software prefetch");
            //     PF_SCATTERED only a page apart from both neighbours (isolated)
            const char* pf = nullptr;
            if (pf_mode != PF_OFF && (pi < plast || next)) {
                const Seq& ns = pi < plast ? s : *C.seqs[next->i];
                const int nh = pi < plast ? it.h : next->h;
                const size_t ni = pi < plast ? (size_t)pi + 1 : (size_t)(next->c * CH / P);
                if (pf_mode == PF_ALL || isolated(ns, C.layer, ni, nh, kr)) pf = ns.pages[C.layer][ni * Hkv_ + nh];
            }
            // 2b. scores of every query head of the group: one pass over the K run
#if defined(FD_HAVE_DPBF16)
            if (C.amx) scores_page_amx(C.amx, kr, Dp, qw, sc, g, S, pf);
            else if (C.dp) scores_page_dp(kr, Dp, qw, sc, g, S, pf);
            else
#endif
                scores_page(dt_, kr, Dp, qf, g, S, pf);
            // 2c. online softmax; rescale the accumulators when the running max moves
            for (int j = 0; j < g; ++j) {
                float alpha = softmax_page(S + (size_t)j * PT, nvalid, m[j], l_of(j));
                if (alpha != 1.f) scale_row(acc + (size_t)j * Dp, alpha, Dp);
            }
            // 2d. acc += p V: one pass over the V run
#if defined(FD_HAVE_DPBF16)
            if (vtile_ == V_PAIRS) pv_page_pairs(vr, nvalid, Dp, S, g, acc, pf, page_bytes_);
            else
#endif
                pv_page(dt_, vr, nvalid, Dp, S, g, acc, pf, page_bytes_, vtile_);
        }

#if defined(FD_HAVE_DPBF16)
        if (C.amx) amx_end(C.amx);
#endif

        // 3. single chunk: normalise and write; else publish the partial, last one merges
        const size_t oisz = dtype_size(C.odt);
        char* obase = static_cast<char*>(C.out) + ((size_t)it.i * C.Hq + (size_t)it.h * g) * D * oisz;
        if (it.nc == 1) {
            for (int j = 0; j < g; ++j)
                out_row(acc + (size_t)j * Dp, apos_.data(), 1.f / l_total(l_of(j)), D, obase + (size_t)j * D * oisz, C.odt);
            return;
        }
        float* slot = parts_.p + (size_t)(it.part + it.c) * part_stride_;
        std::memcpy(slot, acc, sizeof(float) * g * Dp);
        std::memcpy(slot + (size_t)g * Dp, m, sizeof(float) * g);
        for (int j = 0; j < g; ++j) slot[(size_t)g * Dp + g + j] = l_total(l_of(j));
        if (counters_[it.counter].fetch_add(1, std::memory_order_acq_rel) != it.nc - 1) return;
        merge(it, g, obase, C.odt, acc);
    }

    // log-sum-exp merge of nc partials in chunk order (base 2); acc is scratch [g][Dp]
    void merge(const Item& it, int g, char* obase, int odt, float* acc) const {
        const int Dp = Dp_;
        const size_t oisz = dtype_size(odt);
        const float* first = parts_.p + (size_t)it.part * part_stride_;
        for (int j = 0; j < g; ++j) {
            float M = -INFINITY;
            for (int c = 0; c < it.nc; ++c) M = std::fmax(M, first[c * part_stride_ + (size_t)g * Dp + j]);
            float* a = acc + (size_t)j * Dp;
            std::memset(a, 0, sizeof(float) * Dp);
            float lsum = 0.f;
            for (int c = 0; c < it.nc; ++c) {
                const float* sl = first + c * part_stride_;
                float w = exp2_1(sl[(size_t)g * Dp + j] - M);
                lsum += w * sl[(size_t)g * Dp + g + j];
                const float* pa = sl + (size_t)j * Dp;
                for (int d = 0; d < Dp; ++d) a[d] += w * pa[d];
            }
            out_row(a, apos_.data(), 1.f / lsum, D_, obase + (size_t)j * D_ * oisz, odt);
        }
    }

    // geometry
    const int L_, Hkv_, D_, Dp_, dt_;
    const size_t isz_;
    const float scale_;
    const int64_t capacity_;
    const std::vector<int> cpus_;
    const int spin_us_;
    const size_t page_bytes_;   // one head's K run + V run

    // software prefetch of the next page (PF_*): FASTDECODE_PREFETCH, default on; set_prefetch (the
    // R-worker's start-up tune, rworker/tune.py) picks per host, since it pays on some and not others
    std::atomic<int> prefetch_{prefetch_mode_env()};
    std::vector<int> apos_;   // [Dp] accumulator index of each dim
    bool use_dp_ = false;     // AVX512-BF16 present (and allowed): bf16-q scores by vdpbf16ps
    int amx_ = AMX_OFF;  // bf16-q scores as AMX tile products: AMX_HW, AMX_EMU (amx.h) or off
    int vtile_ = V_TILE;      // V run layout: token-major (0) or tiles of this many dims (simd.h)
    // pages per head a sequence takes when it outgrows its pages unreserved (FASTDECODE_EXTENT_PAGES)
    int extent_ = getenv("FASTDECODE_EXTENT_PAGES") ? std::max(1, atoi(getenv("FASTDECODE_EXTENT_PAGES"))) : 8;
    // state (guarded by mu_)
    std::mutex mu_;
    Arena arena_;
    std::atomic<size_t> used_pages_{0};
    size_t slack_pages_ = 0;    // sum of slack_of over every (sequence, layer)
    std::unordered_map<int64_t, Seq> seqs_;
    std::unique_ptr<Pool> pool_;

    // per-call scratch, reused
    struct RowDst { Seq* seq; char* const* pages; int slot; };   // pages: the Hkv pages of its slot
    std::vector<RowDst> rows_;
    std::vector<int64_t> segs_;
    std::vector<Seq*> touched_;
    std::vector<Item> items_;
    AlignedBuf parts_;
    size_t part_stride_ = 0;
    std::unique_ptr<std::atomic<int>[]> counters_;
    size_t ncounters_cap_ = 0;
};

}  // namespace FD_NS
