// kernels.cpp — Python bindings of the R-worker KV store and decode attention.
//
// Compiled three times by setup.py (portable / avx2 / avx512 flags) into rworker._kernels_<isa>;
// FD_MODULE_NAME names the module, the compiler flags pick simd.h's ISA header. rworker/isa.py
// imports a module only after checking the CPU (and OS) support its instructions: no SIGILL.
//
// Every call that touches KV data releases the GIL. Shapes and dtypes are checked here, before
// any work, and raise ValueError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "kvstore.h"

#ifndef FD_MODULE_NAME
#define FD_MODULE_NAME _kernels
#endif

namespace py = pybind11;

namespace FD_NS {

// ============================================================================
// argument checks
// ============================================================================

// float32 -> F32, uint16 (raw bf16 bits, as the S-worker ships them) -> BF16
static int io_dtype(const py::array& a, const char* what) {
    py::dtype dt = a.dtype();
    bool native = dt.attr("isnative").cast<bool>();
    if (native && dt.kind() == 'f' && dt.itemsize() == 4) return F32;
    if (native && dt.kind() == 'u' && dt.itemsize() == 2) return BF16;
    throw py::value_error(std::string(what) + " must be float32 or uint16 (bf16 bits), got " +
                          py::str(dt).cast<std::string>());
}

static void need_contiguous(const py::array& a, const char* what) {
    if (!(a.flags() & py::array::c_style)) throw py::value_error(std::string(what) + " must be C-contiguous");
}

static std::string shape_str(const py::array& a) {
    std::string s = "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
    return s + (a.ndim() == 1 ? ",)" : ")");
}

static const int64_t* ids_ptr(const py::array& ids) {
    py::dtype dt = ids.dtype();
    if (ids.ndim() != 1 || dt.kind() != 'i' || dt.itemsize() != 8 || !dt.attr("isnative").cast<bool>())
        throw py::value_error("seq_ids must be a 1-d int64 array, got " + py::str(dt).cast<std::string>() + " " + shape_str(ids));
    need_contiguous(ids, "seq_ids");
    return static_cast<const int64_t*>(ids.data());
}

// x must be [n, H, D] (H == heads unless heads < 0: any multiple checked later)
static void need_shape(const py::array& x, const char* what, py::ssize_t n, py::ssize_t heads, py::ssize_t D) {
    bool ok = x.ndim() == 3 && x.shape(0) == n && x.shape(2) == D && (heads < 0 || x.shape(1) == heads);
    if (!ok) {
        std::string want = "(" + std::to_string(n) + ", " + (heads < 0 ? std::string("Hq") : std::to_string(heads)) + ", " +
                           std::to_string(D) + ")";
        throw py::value_error(std::string(what) + " has shape " + shape_str(x) + ", expected " + want);
    }
    need_contiguous(x, what);
}

// ============================================================================
// Python-facing store
// ============================================================================

struct PyStore {
    int L, Hkv, D, dtype;
    Store st;

    PyStore(int L_, int Hkv_, int D_, const std::string& dts, double scale, int64_t capacity, int threads,
            std::vector<int> cpus, int spin_us, int vtile)
        : L(L_), Hkv(Hkv_), D(D_), dtype(parse_dtype(dts)),
          st(L_, Hkv_, D_, parse_dtype(dts), scale, capacity, threads, std::move(cpus), spin_us, vtile) {}

    static int parse_dtype(const std::string& s) {
        if (s == "fp32" || s == "float32") return F32;
        if (s == "bf16" || s == "bfloat16") return BF16;
        if (s == "fp16" || s == "float16") return F16;
        throw py::value_error("kv_dtype must be 'bf16', 'fp16' or 'fp32', got '" + s + "'");
    }

    bool append(int layer, const py::array& ids, const py::array& k, const py::array& v) {
        const int64_t* idp = ids_ptr(ids);
        const int64_t n = ids.shape(0);
        need_shape(k, "k", n, Hkv, D);
        need_shape(v, "v", n, Hkv, D);
        int kdt = io_dtype(k, "k"), vdt = io_dtype(v, "v");
        if (kdt != vdt) throw py::value_error("k and v must have the same dtype");
        const void *kp = k.data(), *vp = v.data();
        py::gil_scoped_release nogil;
        return st.append(layer, n, idp, kp, vp, kdt);
    }

    int check_out(const py::array& out, int64_t n, py::ssize_t Hq) {
        need_shape(out, "out", n, Hq, D);
        if (!out.writeable()) throw py::value_error("out must be writeable");
        return io_dtype(out, "out");
    }

    void attend(int layer, const py::array& ids, const py::array& q, py::array& out) {
        const int64_t* idp = ids_ptr(ids);
        const int64_t n = ids.shape(0);
        need_shape(q, "q", n, -1, D);
        int qdt = io_dtype(q, "q");
        const int Hq = (int)q.shape(1);
        int odt = check_out(out, n, Hq);
        const void* qp = q.data();
        void* op = out.mutable_data();
        py::gil_scoped_release nogil;
        st.attend(layer, n, idp, qp, qdt, Hq, op, odt);
    }

    bool append_attend(int layer, const py::array& ids, const py::array& q, const py::array& k, const py::array& v,
                       py::array& out) {
        const int64_t* idp = ids_ptr(ids);
        const int64_t n = ids.shape(0);
        need_shape(q, "q", n, -1, D);
        need_shape(k, "k", n, Hkv, D);
        need_shape(v, "v", n, Hkv, D);
        int qdt = io_dtype(q, "q"), kdt = io_dtype(k, "k"), vdt = io_dtype(v, "v");
        if (kdt != vdt) throw py::value_error("k and v must have the same dtype");
        const int Hq = (int)q.shape(1);
        int odt = check_out(out, n, Hq);
        const void *qp = q.data(), *kp = k.data(), *vp = v.data();
        void* op = out.mutable_data();
        py::gil_scoped_release nogil;
        return st.append_attend(layer, n, idp, qp, qdt, Hq, kp, vp, kdt, op, odt);
    }
};

// ============================================================================
// CPU features (cpuid + xgetbv: what the CPU has AND the OS saves/restores)
// ============================================================================

static std::vector<std::string> cpu_features() {
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
static std::vector<double> read_bandwidth(size_t nbytes, int threads, int reps, std::vector<int> cpus) {
    const size_t slice = size_t(4) << 20;               // items of 4 MiB, handed out dynamically
    nbytes = std::max(slice, nbytes / slice * slice);
    Arena arena(nbytes);                                 // one hugepage-advised chunk
    char* buf = arena.get();
    Pool pool(threads, std::move(cpus), 50);
    std::vector<double> out;
    {
        py::gil_scoped_release nogil;
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
    }
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

static double fma_rate(const std::string& kind, double seconds) {
    if (!(seconds > 0 && seconds <= 10)) throw std::invalid_argument("fma_rate: seconds must be in (0, 10]");
#if defined(FD_AVX512) && !defined(FD_SIMDE_AVX512)
    if (kind == "zmm") { py::gil_scoped_release nogil; return fma_rate_of<Zmm>(seconds); }
#if defined(FD_HAVE_DPBF16)
    if (kind == "zmm_dpbf16" && cpu_has_avx512bf16()) { py::gil_scoped_release nogil; return zmm_dpbf16_rate(seconds); }
#endif
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (kind == "ymm") { py::gil_scoped_release nogil; return fma_rate_of<Ymm>(seconds); }
#endif
    throw std::invalid_argument("fma_rate: '" + kind + "' is not measurable in the " FD_ISA_NAME " build on this CPU");
}

}  // namespace FD_NS

using namespace FD_NS;

// ============================================================================
// module
// ============================================================================

PYBIND11_MODULE(FD_MODULE_NAME, m) {
    m.doc() = "fastdecode R-worker KV store and decode attention (" FD_ISA_NAME " build)";
    m.attr("ISA") = FD_ISA_NAME;
    m.attr("PAGE_TOKENS") = Store::P;
    m.attr("CHUNK_TOKENS") = Store::CH;
    m.attr("V_TILE") = V_TILE;            // the V layout a store gets by default (simd.h)
    m.attr("V_TILE_ALT") = V_TILE_ALT;    // a second layout under measurement (== V_TILE: none)
#if defined(FD_HAVE_DPBF16)
    m.attr("V_PAIRS") = V_PAIRS;          // bf16 KV in token pairs, bf16 probabilities (simd_avx512.h; opt-in)
#endif

    py::class_<PyStore>(m, "Store", py::module_local())
        .def(py::init<int, int, int, const std::string&, double, int64_t, int, std::vector<int>, int, int>(),
             py::arg("num_layers"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("kv_dtype"), py::arg("scale"),
             py::arg("capacity_bytes"), py::arg("threads"), py::arg("cpus"), py::arg("spin_us"),
             py::arg("v_tile") = V_TILE)
        .def("append", &PyStore::append, "append rows; False if the capacity would be passed (nothing stored)")
        .def("attend", &PyStore::attend)
        .def("append_attend", &PyStore::append_attend)
        .def("reserve",
             [](PyStore& s, py::array_t<int64_t, py::array::c_style | py::array::forcecast> ids,
                py::array_t<int64_t, py::array::c_style | py::array::forcecast> tokens) {
                 if (ids.ndim() != 1 || tokens.ndim() != 1 || ids.shape(0) != tokens.shape(0))
                     throw std::invalid_argument("reserve: ids and tokens must be 1-D of equal length");
                 py::gil_scoped_release nogil;
                 return s.st.reserve(ids.shape(0), ids.data(), tokens.data());
             },
             "take the pages for tokens[i] tokens of sequence ids[i] at every layer now; False past the capacity")
        .def("free", [](PyStore& s, int64_t id) { return s.st.free_seq(id); })
        .def("num_tokens", [](PyStore& s, int64_t id, int layer) { return s.st.num_tokens(id, layer); })
        .def("num_seqs", [](PyStore& s) { return s.st.num_seqs(); })
        .def("bytes_used", [](PyStore& s) { return s.st.bytes_used(); })
        .def("bytes_reserved", [](PyStore& s) { return s.st.bytes_reserved(); })
        .def("bytes_committed", [](PyStore& s) { return s.st.bytes_committed(); })
        .def("bytes_committed_walk", [](PyStore& s) { return s.st.bytes_committed_walk(); },
             "bytes_committed recounted by walking every (sequence, layer): the counter's check")
        .def("page_runs", [](PyStore& s, int64_t id, int layer) { return s.st.page_runs(id, layer); })
        .def_property(
            "extent_pages", [](PyStore& s) { return s.st.extent_pages(); },
            [](PyStore& s, int e) { s.st.set_extent_pages(e); })
        .def_property_readonly("page_bytes", [](PyStore& s) { return s.st.page_bytes(); })
        .def_property_readonly("v_tile", [](PyStore& s) { return s.st.v_tile(); })
        .def_property(
            "amx", [](PyStore& s) { return s.st.amx(); },
            [](PyStore& s, int mode) {
                py::gil_scoped_release nogil;
                s.st.set_amx(mode);
            },
            "scores as AMX tile products: 0 off, 1 the instructions, 2 their emulation (tests)")
        .def_property(
            "prefetch", [](PyStore& s) { return s.st.prefetch(); },
            [](PyStore& s, int mode) {
                py::gil_scoped_release nogil;
                s.st.set_prefetch(mode);
            })
        .def_property(
            "threads", [](PyStore& s) { return s.st.threads(); },
            [](PyStore& s, int n) {
                py::gil_scoped_release nogil;
                s.st.set_threads(n);
            });

    m.def("cpu_features", &cpu_features, "x86 features usable here (CPU has them and the OS enabled their state)");
    m.def("read_bandwidth", &read_bandwidth, py::arg("nbytes"), py::arg("threads"), py::arg("reps"),
          py::arg("cpus") = std::vector<int>{}, "stream-read nbytes with the kernel thread pool; GB/s per repetition");
    m.def("fma_rate", &fma_rate, py::arg("kind"), py::arg("seconds") = 0.2,
          "multiply-adds of one kind (zmm, ymm, zmm_dpbf16) per ns on the calling thread, 10 independent chains");
}
