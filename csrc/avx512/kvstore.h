// kvstore.h — the Store: one R-worker's paged KV store and decode attention over it, thread-safe.
//
// A facade over the two halves, which share the page geometry: the page table (paging.h:
// layout, arena, append, reserve, extents, accounting) and the attention (attention.h: work
// items, the per-item passes, the chunk merge). The Store owns both and the thread pool, and
// serializes every call on one mutex; a sequence's KV leaves and enters as a blob (kv_blob.h).
// kernels.cpp binds it to Python. The attention variants
// (attention.h): sliding windows per layer and the logit cap are fixed at construction, a layer's
// sinks set by set_sinks.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attention.h"
#include "common.h"
#include "kv_blob.h"
#include "paging.h"
#include "pool.h"
#include "simd.h"

namespace FD_NS {

class Store {
public:
    static constexpr int P = PageTable::P;     // tokens per page
    static constexpr int CH = Attention::CH;   // tokens per split-KV chunk (a multiple of P)

    // windows: [L] sliding window per layer (0: full; empty: all full); softcap: logit cap (0: none)
    Store(int L, int Hkv, int D, int dtype, double scale, int64_t capacity_bytes, int threads,
          std::vector<int> cpus, int spin_us, int vtile = V_TILE, std::vector<int32_t> windows = {}, double softcap = 0.0)
        : cpus_(std::move(cpus)), spin_us_(spin_us),
          pages_(Geometry(L, Hkv, D, dtype, vtile, std::move(windows)), capacity_bytes),
          attn_(pages_.geometry(), scale, softcap), pool_(new Pool(threads, cpus_, spin_us)) {}

    // ---- settings ---------------------------------------------------------------
    int v_tile() const { return pages_.geometry().vtile_; }
    int amx() const { return attn_.amx(); }
    bool vnni() const { return attn_.vnni(); }
    void set_amx(int mode) {
        std::lock_guard<std::mutex> lk(mu_);
        attn_.set_amx(mode);
    }
    int prefetch() const { return attn_.prefetch(); }
    void set_prefetch(int mode) {
        std::lock_guard<std::mutex> lk(mu_);     // not while an attend reads it
        attn_.set_prefetch(mode);
    }
    int threads() const { return pool_->size(); }
    void set_threads(int n) {
        std::lock_guard<std::mutex> lk(mu_);
        pool_.reset(new Pool(n, cpus_, spin_us_));
    }
    std::vector<int32_t> windows() const { return pages_.geometry().win_; }
    double softcap() const { return attn_.softcap(); }
    void set_sinks(int layer, const float* sinks, int n) {
        std::lock_guard<std::mutex> lk(mu_);     // not while an attend reads them
        attn_.set_sinks(layer, sinks, n);
    }
    int extent_pages() const { return pages_.extent_pages(); }
    void set_extent_pages(int e) {
        std::lock_guard<std::mutex> lk(mu_);
        pages_.set_extent_pages(e);
    }

    // ---- geometry / accounting (paging.h) ---------------------------------------
    size_t page_bytes() const { return pages_.geometry().page_bytes_; }
    size_t bytes_used() const { return pages_.bytes_used(); }
    size_t bytes_reserved() const { return pages_.bytes_reserved(); }
    size_t bytes_committed() {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.bytes_committed();
    }
    size_t bytes_committed_walk() {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.bytes_committed_walk();
    }
    int64_t page_runs(int64_t id, int layer) {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.page_runs(id, layer);
    }
    int64_t num_seqs() {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.num_seqs();
    }
    int64_t num_tokens(int64_t id, int layer) {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.num_tokens(id, layer);
    }

    // ---- data -------------------------------------------------------------------
    bool free_seq(int64_t id) {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.free_seq(id);
    }
    bool fork(int64_t src, int64_t dst, int64_t tokens) {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.fork(src, dst, tokens);
    }
    size_t shared_pages() {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.shared_pages();
    }
    size_t saved_pages() {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.saved_pages();
    }
    bool reserve(int64_t n, const int64_t* ids, const int64_t* tokens) {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.reserve(n, ids, tokens);
    }
    bool append(int layer, int64_t n, const int64_t* ids, const void* k, const void* v, int sdt) {
        std::lock_guard<std::mutex> lk(mu_);
        return pages_.append(*pool_, layer, n, ids, k, v, sdt);
    }
    // q [n][Hq][D] (qdt F32 or BF16) -> out [n][Hq][D] (odt F32 or BF16), over all stored tokens.
    void attend(int layer, int64_t n, const int64_t* ids, const void* q, int qdt, int Hq, void* out, int odt) {
        std::lock_guard<std::mutex> lk(mu_);
        attn_.run(pages_, *pool_, layer, n, ids, q, qdt, Hq, out, odt);
    }
    // fused decode step: append one token per sequence, then attend. false = capacity (nothing done)
    bool append_attend(int layer, int64_t n, const int64_t* ids, const void* q, int qdt, int Hq,
                       const void* k, const void* v, int kvdt, void* out, int odt) {
        std::lock_guard<std::mutex> lk(mu_);
        pages_.check_layer(layer);
        attn_.check_heads(Hq, layer);      // before the append: an error stores nothing
        if (!pages_.append(*pool_, layer, n, ids, k, v, kvdt)) return false;
        attn_.run(pages_, *pool_, layer, n, ids, q, qdt, Hq, out, odt);
        return true;
    }

    // ---- one sequence's KV as a blob (kv_blob.h) --------------------------------
    // bytes of sequence id's blob, 0 when the store does not hold it; written to dst when cap is
    // exactly that (the caller sizes dst by a first call, then calls again: the sequence may have
    // changed between the two)
    size_t export_seq(int64_t id, char* dst, size_t cap) {
        std::lock_guard<std::mutex> lk(mu_);
        const Seq* s = pages_.find(id);
        if (!s) return 0;
        const size_t n = kv_blob_size(pages_.geometry(), *s);
        if (dst && cap == n) kv_blob_write(pages_.geometry(), *s, dst);
        return n;
    }
    // new sequence id holding blob's KV; false past the capacity (nothing stored). Throws
    // std::invalid_argument for a held id and a blob this store cannot take (kv_blob_read)
    bool import_seq(int64_t id, const char* blob, size_t n) {
        std::lock_guard<std::mutex> lk(mu_);
        if (pages_.find(id)) throw std::invalid_argument("import_seq: sequence " + std::to_string(id) + " is already held by this store");
        const KVBlobHead h = kv_blob_read(pages_.geometry(), blob, n);
        return pages_.adopt(id, h.len.data(), h.dead.data(), h.pages);
    }
    std::string layout_signature() const { return kv_blob_signature(pages_.geometry()); }

    Pool& pool() { return *pool_; }

private:
    const std::vector<int> cpus_;
    const int spin_us_;
    std::mutex mu_;
    PageTable pages_;     // state guarded by mu_
    Attention attn_;
    std::unique_ptr<Pool> pool_;
};

}  // namespace FD_NS
