// kernels.cpp — Python bindings of the R-worker KV store and decode attention.
//
// Compiled three times by setup.py (portable / avx2 / avx512 flags), each time with
// microbench.cpp (bound here too), into rworker._kernels_<isa>; FD_MODULE_NAME names the module,
// the compiler flags pick simd.h's ISA header. rworker/isa.py imports a module only after
// checking the CPU (and OS) support its instructions: no SIGILL.
//
// Every call that touches KV data releases the GIL. Shapes and dtypes are checked here, before
// any work, and raise ValueError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "kvstore.h"
#include "microbench.h"
#include "prefill.h"

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
            std::vector<int> cpus, int spin_us, int vtile, std::vector<int32_t> windows, double softcap)
        : L(L_), Hkv(Hkv_), D(D_), dtype(parse_dtype(dts)),
          st(L_, Hkv_, D_, parse_dtype(dts), scale, capacity, threads, std::move(cpus), spin_us, vtile, std::move(windows),
             softcap) {}

    static int parse_dtype(const std::string& s) {
        if (s == "fp32" || s == "float32") return F32;
        if (s == "bf16" || s == "bfloat16") return BF16;
        if (s == "fp16" || s == "float16") return F16;
        if (s == "int8") return I8;
        throw py::value_error("kv_dtype must be 'bf16', 'fp16', 'fp32' or 'int8', got '" + s + "'");
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

    // the blob written straight into a bytes object, the GIL released for the copy: sized by a first
    // call, written by a second (again if the sequence changed between them)
    py::bytes export_seq(int64_t id) {
        for (size_t need = st.export_seq(id, nullptr, 0);;) {
            if (need == 0) throw py::key_error("export_seq: sequence " + std::to_string(id) + " is not held by this store");
            auto out = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, (Py_ssize_t)need));
            if (!out) throw py::error_already_set();      // MemoryError
            char* dst = PyBytes_AS_STRING(out.ptr());     // a new object no one else sees yet
            size_t got;
            {
                py::gil_scoped_release nogil;
                got = st.export_seq(id, dst, need);
            }
            if (got == need) return out;
            need = got;
        }
    }

    // blob: any object with a contiguous buffer (bytes, bytearray, memoryview of a mapped file)
    bool import_seq(int64_t id, const py::object& blob) {
        Py_buffer view;
        if (PyObject_GetBuffer(blob.ptr(), &view, PyBUF_SIMPLE) != 0) throw py::error_already_set();
        std::unique_ptr<Py_buffer, void (*)(Py_buffer*)> hold(&view, PyBuffer_Release);
        const char* p = static_cast<const char*>(view.buf);
        const size_t n = (size_t)view.len;
        py::gil_scoped_release nogil;
        return st.import_seq(id, p, n);
    }
};

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
        .def(py::init<int, int, int, const std::string&, double, int64_t, int, std::vector<int>, int, int,
                      std::vector<int32_t>, double>(),
             py::arg("num_layers"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("kv_dtype"), py::arg("scale"),
             py::arg("capacity_bytes"), py::arg("threads"), py::arg("cpus"), py::arg("spin_us"),
             py::arg("v_tile") = V_TILE, py::arg("windows") = std::vector<int32_t>{}, py::arg("softcap") = 0.0,
             "windows: sliding window per layer (0: full attention; empty: all full); softcap: logit cap (0: none)")
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
        .def("fork", [](PyStore& s, int64_t src, int64_t dst, int64_t tokens) { return s.st.fork(src, dst, tokens); },
             "new sequence dst sharing src's first `tokens` tokens (full pages by reference); False past the capacity")
        .def("set_sinks",
             [](PyStore& s, int layer, py::array_t<float, py::array::c_style | py::array::forcecast> sinks) {
                 if (sinks.ndim() != 1) throw py::value_error("sinks must be 1-D [num query heads]");
                 s.st.set_sinks(layer, sinks.data(), (int)sinks.shape(0));
             },
             "the layer's sinks (natural-log logits, one per query head; empty: none)")
        .def_property_readonly("windows", [](PyStore& s) { return s.st.windows(); })
        .def_property_readonly("softcap", [](PyStore& s) { return s.st.softcap(); })
        .def("shared_pages", [](PyStore& s) { return s.st.shared_pages(); }, "pages held by >= 2 sequences")
        .def("saved_pages", [](PyStore& s) { return s.st.saved_pages(); }, "references to shared pages beyond the first")
        .def("free", [](PyStore& s, int64_t id) { return s.st.free_seq(id); })
        .def("export_seq", &PyStore::export_seq, "the sequence's KV over every layer as a blob (kv_blob.h); KeyError if not held")
        .def("import_seq", &PyStore::import_seq,
             "new sequence holding a blob's KV; False past the capacity (nothing stored); ValueError for a held id "
             "or a blob of another format or geometry")
        .def("layout_signature", [](PyStore& s) { return py::bytes(s.st.layout_signature()); },
             "the geometry part of this store's blob header (what import_seq compares)")
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
        .def_property_readonly("vnni", [](PyStore& s) { return s.st.vnni(); },
                               "int8 passes by vpdpbusd (AVX512-VNNI); False: vpmaddubsw (or plain C++)")
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

    m.def(
        "softcap_values",
        [](py::array_t<float, py::array::c_style | py::array::forcecast> x, float cap) {
            // simd.h's softcap_page on any array (tests of its error bound)
            if (!(cap > 0)) throw py::value_error("cap must be > 0");
            const size_t n = (size_t)x.size();
            std::vector<float> buf((n + PT - 1) / PT * PT, 0.f);
            std::copy(x.data(), x.data() + n, buf.begin());
            softcap_page(buf.data(), (int)(buf.size() / PT), cap);
            py::array_t<float> out(n);
            std::copy(buf.begin(), buf.begin() + n, out.mutable_data());
            return out;
        },
        py::arg("x"), py::arg("cap"), "cap * tanh(x / cap) elementwise, as the kernel's soft-cap pass computes it");
    m.def(
        "prompt_attention",
        [](uintptr_t q, int64_t sq, uintptr_t k, int64_t sk, uintptr_t v, int64_t sv, uintptr_t o, int n, int p, int Hq,
           int Hkv, int D, double scale, int threads, int rows) {
            // raw addresses of bf16 tensors (the S-worker's torch tensors; prompt_attention.py checks
            // their dtype, device and strides): no copy and no numpy bf16 needed
#if defined(FD_HAVE_DPBF16)
            if (!bf16_dot_usable()) return false;
            if (n < 0 || p < 0 || Hkv < 1 || Hq % Hkv != 0 || D < 16 || D % 16 != 0 || rows < 1)
                throw py::value_error("prompt_attention: n, p >= 0, Hq a multiple of Hkv, D a multiple of 16, rows >= 1");
            if (n == 0) return true;
            PromptArgs a{reinterpret_cast<const uint16_t*>(q), reinterpret_cast<const uint16_t*>(k),
                         reinterpret_cast<const uint16_t*>(v), sq, sk, sv, reinterpret_cast<uint16_t*>(o),
                         n, p, Hq, Hkv, D, (float)(scale * LOG2E), rows};
            py::gil_scoped_release nogil;
            prompt_attention(a, threads);
            return true;
#else
            (void)q, (void)sq, (void)k, (void)sk, (void)v, (void)sv, (void)o, (void)n, (void)p, (void)Hq, (void)Hkv,
                (void)D, (void)scale, (void)threads, (void)rows;
            return false;
#endif
        },
        py::arg("q"), py::arg("q_stride"), py::arg("k"), py::arg("k_stride"), py::arg("v"), py::arg("v_stride"),
        py::arg("out"), py::arg("n"), py::arg("p"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("scale"), py::arg("threads"), py::arg("rows") = 48,
        "causal attention of n bf16 query tokens (at positions p..p+n-1) over p+n keys into out [n, Hq, D] "
        "(prefill.h); False where this build or CPU has no AVX512-BF16 (nothing written)");
    m.def("cpu_features", &cpu_features, "x86 features usable here (CPU has them and the OS enabled their state)");
    m.def(
        "read_bandwidth",
        [](size_t nbytes, int threads, int reps, std::vector<int> cpus) {
            py::gil_scoped_release nogil;
            return read_bandwidth(nbytes, threads, reps, std::move(cpus));
        },
        py::arg("nbytes"), py::arg("threads"), py::arg("reps"), py::arg("cpus") = std::vector<int>{},
        "stream-read nbytes with the kernel thread pool; GB/s per repetition");
    m.def(
        "fma_rate",
        [](const std::string& kind, double seconds) {
            py::gil_scoped_release nogil;
            return fma_rate(kind, seconds);
        },
        py::arg("kind"), py::arg("seconds") = 0.2,
        "multiply-adds of one kind (zmm, ymm, zmm_dpbf16) per ns on the calling thread, 10 independent chains");
}
