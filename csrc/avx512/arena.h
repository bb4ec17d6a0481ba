// arena.h — memory for pages: big chunks that never move, carved into equal pages, reused LIFO.
//
// The store's pages (paging.h) come from here, and so does read_bandwidth's buffer
// (microbench.cpp): the roofline streams memory mapped as the pages are (hugepage-advised).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <utility>
#include <vector>

#if defined(__linux__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

#include "common.h"

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

}  // namespace FD_NS
