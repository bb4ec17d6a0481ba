// kv_blob.h — one sequence's KV as a self-describing byte blob: its format, the export, the checks
// of an import.
//
// A stopped job saves its sequences' KV and a rerun loads it back instead of recomputing it
// (rworker/kvstore.py: export_seq / import_seq). A page's bytes already hold every detail of the
// layout (int8 scales, V tiles, token pairs: paging.h, quant.h, simd.h), so a blob is a header and
// the raw bytes of the sequence's live pages; an import copies them into pages of its own. The
// header's geometry must equal the importing store's: a blob is never converted.
//
// Format (little-endian header; the pages as they lie in memory):
//   0    "FDKV"                      magic
//   4    u32 version                 KV_BLOB_VERSION
//   8    u64 total bytes             the whole blob: a truncated one is refused
//   16   geometry (the layout signature, what an import compares, 36 + 4 L bytes):
//        u32 L, Hkv, D, Dp, dtype (0 fp32, 1 bf16, 2 fp16, 3 int8), i32 v_tile (int8: 0, its
//        pages have one layout), u32 PT (tokens per page), u64 page bytes, i32 window[L]
//   ..   per layer: i32 len (tokens), i32 dead (leading pages per head before its window)
//   ..   per layer, pages dead .. ceil(len / PT) - 1, each its Hkv heads in order, page bytes each
// A forked sequence's shared pages are written like its own: an import holds them privately.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "paging.h"

namespace FD_NS {

constexpr uint32_t KV_BLOB_VERSION = 1;
constexpr size_t KV_BLOB_SIG_AT = 16;      // offset of the geometry (layout signature) in a blob

// ---- little-endian fields ----------------------------------------------------

struct BlobOut {
    char* p;
    void u32(uint32_t v) {
        for (int i = 0; i < 4; ++i) *p++ = (char)(v >> (8 * i));
    }
    void u64(uint64_t v) {
        u32((uint32_t)v);
        u32((uint32_t)(v >> 32));
    }
};

struct BlobIn {
    const char* b;
    size_t n, at;
    uint32_t u32() {
        // past the end: the total-size check caught a blob short of its header already, except one
        // cut inside the first 16 bytes
        if (at + 4 > n) throw std::invalid_argument("KV blob truncated: " + std::to_string(n) + " bytes, its header alone is longer");
        uint32_t v = 0;
        for (int i = 0; i < 4; ++i) v |= (uint32_t)(uint8_t)b[at + i] << (8 * i);
        at += 4;
        return v;
    }
    uint64_t u64() {
        uint64_t lo = u32();
        return lo | (uint64_t)u32() << 32;
    }
};

inline const char* kv_dtype_name(int dt) { return dt == F32 ? "fp32" : dt == BF16 ? "bf16" : dt == F16 ? "fp16" : "int8"; }

// ---- sizes ---------------------------------------------------------------------

inline size_t kv_blob_sig_bytes(const Geometry& g) { return 36 + 4 * (size_t)g.L_; }
inline size_t kv_blob_header_bytes(const Geometry& g) { return KV_BLOB_SIG_AT + kv_blob_sig_bytes(g) + 8 * (size_t)g.L_; }
// live pages per head of one layer holding len tokens, dead of them dead
inline size_t kv_blob_live(int32_t len, int32_t dead) { return ((size_t)len + PT - 1) / PT - (size_t)dead; }

inline size_t kv_blob_size(const Geometry& g, const Seq& s) {
    size_t pages = 0;
    for (int l = 0; l < g.L_; ++l) pages += kv_blob_live(s.len[l], s.dead[l]) * g.Hkv_;
    return kv_blob_header_bytes(g) + pages * g.page_bytes_;
}

// ---- export --------------------------------------------------------------------

inline void kv_blob_put_signature(const Geometry& g, BlobOut& w) {
    for (int v : {g.L_, g.Hkv_, g.D_, g.Dp_, g.dt_}) w.u32((uint32_t)v);
    w.u32((uint32_t)(g.dt_ == I8 ? 0 : g.vtile_));     // int8 pages ignore the V layout: one format
    w.u32((uint32_t)PT);
    w.u64(g.page_bytes_);
    for (int32_t win : g.win_) w.u32((uint32_t)win);
}

inline std::string kv_blob_signature(const Geometry& g) {
    std::string sig(kv_blob_sig_bytes(g), '\0');
    BlobOut w{&sig[0]};
    kv_blob_put_signature(g, w);
    return sig;
}

// the blob of s into dst (kv_blob_size bytes)
inline void kv_blob_write(const Geometry& g, const Seq& s, char* dst) {
    BlobOut w{dst};
    std::memcpy(w.p, "FDKV", 4);
    w.p += 4;
    w.u32(KV_BLOB_VERSION);
    w.u64(kv_blob_size(g, s));
    kv_blob_put_signature(g, w);
    for (int l = 0; l < g.L_; ++l) {
        w.u32((uint32_t)s.len[l]);
        w.u32((uint32_t)s.dead[l]);
    }
    for (int l = 0; l < g.L_; ++l) {
        const size_t p0 = (size_t)s.dead[l] * g.Hkv_, p1 = p0 + kv_blob_live(s.len[l], s.dead[l]) * g.Hkv_;
        for (size_t i = p0; i < p1; ++i, w.p += g.page_bytes_) std::memcpy(w.p, s.pages[l][i], g.page_bytes_);
    }
}

// ---- import: the checks ----------------------------------------------------------

struct KVBlobHead {
    std::vector<int32_t> len, dead;   // [L]
    const char* pages;                // the live pages, in the blob's order
};

// the header of blob [n bytes], checked against this store's geometry g; std::invalid_argument
// naming what differs (the field, the blob's value and the store's)
inline KVBlobHead kv_blob_read(const Geometry& g, const char* blob, size_t n) {
    // 1. magic, version, total size: a foreign, newer or truncated blob is refused before its fields are read
    if (n < 4 || std::memcmp(blob, "FDKV", 4) != 0)
        throw std::invalid_argument(n < 4 ? "KV blob truncated: " + std::to_string(n) + " bytes"
                                          : std::string("not a KV blob: it does not start with \"FDKV\""));
    BlobIn r{blob, n, 4};
    const uint32_t version = r.u32();
    if (version != KV_BLOB_VERSION)
        throw std::invalid_argument("KV blob format version " + std::to_string(version) + ", this build reads version " +
                                    std::to_string(KV_BLOB_VERSION));
    const uint64_t total = r.u64();
    if (total != n)
        throw std::invalid_argument(n < total ? "KV blob truncated: " + std::to_string(n) + " bytes of the " + std::to_string(total) +
                                                    " its header gives"
                                              : "KV blob has " + std::to_string(n - total) + " bytes past the " +
                                                    std::to_string(total) + " its header gives");

    // 2. geometry, field by field against this store's (the layout signature)
    auto same = [](const std::string& field, int64_t blob_v, int64_t store_v, const std::string& bs, const std::string& ss) {
        if (blob_v != store_v) throw std::invalid_argument("KV blob's " + field + " is " + bs + ", this store's " + ss);
    };
    auto same_n = [&](const std::string& field, int64_t blob_v, int64_t store_v) {
        same(field, blob_v, store_v, std::to_string(blob_v), std::to_string(store_v));
    };
    same_n("num_layers", (int32_t)r.u32(), g.L_);
    same_n("num_kv_heads", (int32_t)r.u32(), g.Hkv_);
    same_n("head_dim", (int32_t)r.u32(), g.D_);
    same_n("padded head_dim", (int32_t)r.u32(), g.Dp_);
    const uint32_t dt = r.u32();
    same("kv dtype", dt, g.dt_, dt <= I8 ? kv_dtype_name((int)dt) : "code " + std::to_string(dt), kv_dtype_name(g.dt_));
    same_n("v_tile", (int32_t)r.u32(), g.dt_ == I8 ? 0 : g.vtile_);
    same_n("page tokens", r.u32(), PT);
    same_n("page bytes", (int64_t)r.u64(), (int64_t)g.page_bytes_);
    for (int l = 0; l < g.L_; ++l) same_n("window of layer " + std::to_string(l), (int32_t)r.u32(), g.win_[l]);

    // 3. lengths: a layer's dead pages are those its window leaves (the store's invariant), and the
    //    live pages they leave fill the rest of the blob exactly
    KVBlobHead h{std::vector<int32_t>(g.L_), std::vector<int32_t>(g.L_), nullptr};
    size_t pages = 0;
    for (int l = 0; l < g.L_; ++l) {
        h.len[l] = (int32_t)r.u32();
        h.dead[l] = (int32_t)r.u32();
        if (h.len[l] < 0 || (size_t)h.dead[l] != g.dead_pages(l, h.len[l]))
            throw std::invalid_argument("KV blob malformed: layer " + std::to_string(l) + " holds " + std::to_string(h.len[l]) +
                                        " tokens with " + std::to_string(h.dead[l]) + " dead pages per head");
        pages += kv_blob_live(h.len[l], h.dead[l]) * g.Hkv_;
    }
    if (pages * g.page_bytes_ != n - r.at)
        throw std::invalid_argument("KV blob malformed: its layer lengths take " + std::to_string(pages * g.page_bytes_) +
                                    " bytes of pages, it holds " + std::to_string(n - r.at));
    h.pages = blob + r.at;
    return h;
}

}  // namespace FD_NS
