// microbench.cpp — the CPU this module runs on: its features (cpuid) and its two rooflines.
//
// cpu_features says what the CPU has and the OS enables (rworker.isa picks a module by it, and
// cpu_has asks it); read_bandwidth and fma_rate measure the memory and multiply-add rooflines of
// attention (rworker/roofline.py). Plain C++: kernels.cpp binds them and releases the GIL.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "arena.h"
#include "common.h"
#include "microbench.h"
#include "pool.h"
#include "simd.h"

namespace FD_NS {

// ============================================================================
// CPU features (cpuid + xgetbv: what the CPU has AND the OS saves/restores)
// ============================================================================

std::vector<std::string> cpu_features() {
    std::vector<std::string> f;
#if defined(__x86_64__) || defined(__i386__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
    bool osxsave = (c >> 27) & 1;
    uint64_t xcr0 = 0;
    if (osxsave) {
        uint32_t lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((uint64_t)hi << 32) | lo;
    }
    const bool os_avx = (xcr0 & 0x6) == 0x6;         // XMM + YMM state
    const bool os_avx512 = (xcr0 & 0xe6) == 0xe6;    // + opmask, ZMM_Hi256, Hi16_ZMM
    if (d & (1u << 26)) f.push_back("sse2");
    if (os_avx && (c >> 28 & 1)) f.push_back("avx");
    if (os_avx && (c >> 12 & 1)) f.push_back("fma");
    if (os_avx && (c >> 29 & 1)) f.push_back("f16c");
    unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
    if (__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) {
        if (os_avx && (b7 >> 5 & 1)) f.push_back("avx2");
        if (os_avx512) {
            if (b7 >> 16 & 1) f.push_back("avx512f");
            if (b7 >> 17 & 1) f.push_back("avx512dq");
            if (b7 >> 30 & 1) f.push_back("avx512bw");
            if (b7 >> 31 & 1) f.push_back("avx512vl");
            if (c7 >> 11 & 1) f.push_back("avx512vnni");
        }
        unsigned a71 = 0, b71 = 0, c71 = 0, d71 = 0;
        if (a7 >= 1 && __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71) && os_avx512 && (a71 >> 5 & 1))
            f.push_back("avx512bf16");
        if ((xcr0 & (3ull << 17)) == (3ull << 17)) {   // the OS saves tile config + data
            if (d7 >> 24 & 1) f.push_back("amx-tile");
            if (d7 >> 22 & 1) f.push_back("amx-bf16");
            if (d7 >> 25 & 1) f.push_back("amx-int8");
        }
    }
#endif
    return f;
}

bool cpu_has(const char* feature) {
    for (auto& f : cpu_features())
        if (f == feature) return true;
    return false;
}

// ============================================================================
// read bandwidth: the same pool streams a buffer and sums it (the roofline of attention)
// ============================================================================

// plain streaming sum, hardware prefetch only (software prefetch made it slower on both hosts)
static uint64_t sum_bytes(const char* p, size_t n) {
#if defined(FD_AVX512)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_load_si512((const void*)(p + i)));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512((const void*)(p + i + 64)));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512((const void*)(p + i + 128)));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512((const void*)(p + i + 192)));
    }
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
#elif defined(__AVX2__)
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i*)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i*)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i*)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i*)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    alignas(32) uint64_t t[4];
    _mm256_store_si256((__m256i*)t, s);
    return t[0] + t[1] + t[2] + t[3];
#else
    const uint64_t* q = reinterpret_cast<const uint64_t*>(p);
    uint64_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t i = 0; i + 8 <= n / 8; i += 8)
        for (int u = 0; u < 8; ++u) s[u] += q[i + u];
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
#endif
}

// returns GB/s of each repetition
std::vector<double> read_bandwidth(size_t nbytes, int threads, int reps, std::vector<int> cpus) {
    const size_t slice = size_t(4) << 20;               // items of 4 MiB, handed out dynamically
    nbytes = std::max(slice, nbytes / slice * slice);
    Arena arena(nbytes);                                 // one hugepage-advised chunk
    char* buf = arena.get();
    Pool pool(threads, std::move(cpus), 50);
    std::vector<double> out;
    const int64_t items = (int64_t)(nbytes / slice);
    auto touch = [&](int64_t i, int64_t) { std::memset(buf + i * slice, 1, slice); };  // first touch by the readers
    pool.parallel_for(items, touch);
    std::vector<uint64_t> sink(items);
    auto read = [&](int64_t i, int64_t) { sink[i] = sum_bytes(buf + i * slice, slice); };
    for (int r = 0; r < reps; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        pool.parallel_for(items, read);
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        out.push_back((double)nbytes / s / 1e9);
    }
    volatile uint64_t keep = 0;
    for (auto x : sink) keep = keep + x;
    return out;
}

// ============================================================================
// multiply-add throughput of one core (the compute roofline of attention, rworker/roofline.py)
// ============================================================================
// 10 independent accumulator chains (enough for 2 pipes of latency 4; 16 ymm registers hold them
// without spills) of one instruction kind, on the calling thread; returns
// instructions per ns. The empty asm after each round keeps every accumulator live in a register
// (no stores) and stops the compiler folding the chains. "zmm": 512-bit FMA, "ymm": 256-bit FMA,
// "zmm_dpbf16": vdpbf16ps (the bf16 dot-product scores). Not in the SIMDe build, whose "zmm" is
// emulated: it has no hardware rate to measure.

// FD_TIME_CHAINS(V, init, STEP): sets `rate` to STEP(a) per ns over 10 chains a0..a9 of type V:
// a short calibration run, then one run sized to `seconds`. No call inside a timed loop (a call
// clobbers every vector register, and the compiler then kept the chains in memory); a macro, not
// a function, so that each caller's target attributes (vdpbf16ps) cover the loop.
#define FD_CHAIN_LOOP(V, init, STEP, iters)                                                     \
    {                                                                                           \
        V a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, a6 = init, a7 = init, \
          a8 = init, a9 = init;                                                                 \
        for (int64_t i = 0; i < iters; ++i) {                                                   \
            a0 = STEP(a0); a1 = STEP(a1); a2 = STEP(a2); a3 = STEP(a3); a4 = STEP(a4);          \
            a5 = STEP(a5); a6 = STEP(a6); a7 = STEP(a7); a8 = STEP(a8); a9 = STEP(a9);          \
            __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5),   \
                             "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9));                           \
        }                                                                                       \
        __asm__ volatile("" ::"x"(a0), "x"(a9));                                                \
    }
#define FD_TIME_CHAINS(V, init, STEP)                                                           \
    {                                                                                           \
        int64_t iters = 1 << 18;                                                                \
        for (int pass = 0; pass < 2; ++pass) {                                                  \
            const auto t0 = std::chrono::steady_clock::now();                                   \
            FD_CHAIN_LOOP(V, init, STEP, iters)                                                 \
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); \
            rate = 10.0 * (double)iters / s / 1e9;                                              \
            iters = std::max<int64_t>(iters, (int64_t)(seconds * 1e9 * rate / 10.0));           \
        }                                                                                       \
    }

// FMA of one register width: W::V, W::set1, W::fma
template <class W>
static double fma_rate_of(double seconds) {
    const typename W::V x = W::set1(0.999f), y = W::set1(1e-4f);
    double rate = 0;
#define FD_STEP(a) W::fma(a, x, y)
    FD_TIME_CHAINS(typename W::V, W::set1(0.5f), FD_STEP)
#undef FD_STEP
    return rate;
}

#if defined(__AVX2__) && defined(__FMA__)
struct Ymm {
    using V = __m256;
    static V set1(float v) { return _mm256_set1_ps(v); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif
#if defined(FD_AVX512) && !defined(FD_SIMDE_AVX512)
struct Zmm {
    using V = __m512;
    static V set1(float v) { return _mm512_set1_ps(v); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};
#if defined(FD_HAVE_DPBF16)
FD_TARGET_BF16 static double zmm_dpbf16_rate(double seconds) {
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3c003c00);
    double rate = 0;
#define FD_STEP(a) _mm512_dpbf16_ps(a, x, y)
    FD_TIME_CHAINS(__m512, _mm512_set1_ps(0.5f), FD_STEP)
#undef FD_STEP
    return rate;
}
#endif
#endif

double fma_rate(const std::string& kind, double seconds) {
    if (!(seconds > 0 && seconds <= 10)) throw std::invalid_argument("fma_rate: seconds must be in (0, 10]");
#if defined(FD_AVX512) && !defined(FD_SIMDE_AVX512)
    if (kind == "zmm") return fma_rate_of<Zmm>(seconds);
#if defined(FD_HAVE_DPBF16)
    if (kind == "zmm_dpbf16" && cpu_has_avx512bf16()) return zmm_dpbf16_rate(seconds);
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (kind == "ymm") return fma_rate_of<Ymm>(seconds);
#endif
    throw std::invalid_argument("fma_rate: '" + kind + "' is not measurable in the " FD_ISA_NAME " build on this CPU");
}

}  // namespace FD_NS
