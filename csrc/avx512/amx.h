// AMX attention: bf16 K with bf16 queries as tile products for the scores, and bf16 probabilities
// with V in token pairs for PV (Intel AMX-BF16: Sapphire Rapids and later).
//
// Scores. The K run's word rows are already the layout of an AMX B tile: word w of token t holds
// dims (2w, 2w+1), a word row holds PT = 32 tokens at a 128-byte stride, so 16 word rows x the
// first (or last) 16 tokens is a 16-row x 64-byte B tile straight from the page. The query rows of
// a work item (the g heads of a KV group, or of every member of a shared-prefix block stacked:
// members x g rows) are the A tile, up to 16 rows a tile product, and one tdpbf16ps adds 32 dims of
// all rows x 16 scores. Products of bf16 values are exact in fp32, so the result differs from the
// vdpbf16ps path only in the order of the fp32 sums (and denormal products flushed to zero, as
// vdpbf16ps does too). A row's scores never depend on the other rows of its tile.
//
// PV. V in token pairs (V_PAIRS, simd_avx512.h: word (s, d) = (V[2s][d], V[2s+1][d]), tiles of 64
// dims) is the layout of a B tile too: 16 pair rows x 16 dims, 64 bytes a row at the tile's width
// stride. The probabilities rounded to bf16 (as the AVX-512 pairs pass rounds them) are the A tile
// (rows x 32 tokens), the accumulators the C tiles (rows x 16 dims, loaded from and stored to acc,
// which the online softmax rescales between pages). Whole pages only: a page's last pair rows past
// its tokens may hold a reused page's old values, which a tile product would multiply by p = 0
// (NaN for an old inf), so a partial last page takes the AVX-512 pairs pass.
//
// Tiles (a fixed configuration per row count R <= 16, loaded at the start of each work item):
//   tmm0 A  q        [R][32 dims] bf16     64 B per row, row stride Dp * 2 bytes
//   tmm1 B  K words  [16 rows][16 tokens]  tokens 0-15 of 16 word rows, row stride PT * 4 bytes
//   tmm2 B  K words  [16 rows][16 tokens]  tokens 16-31
//   tmm3 C  scores / acc [R][16] fp32      tokens 0-15, or dims d..d+15
//   tmm4 C  scores / acc [R][16] fp32      tokens 16-31, or dims d+16..d+31
//   tmm5 A  p        [R][32 tokens] bf16   64 B per row
//   tmm6 B  V pairs  [16 pairs][16 dims]   dims d..d+15, row stride the pair tile's width * 4 bytes
//   tmm7 B  V pairs  [16 pairs][16 dims]   dims d+16..d+31
//
// Two implementations of the same tile operations, each one instruction (the addressing is
// shared, in scores_page_tiles and pv_page_tiles, so the emulation tests it for both):
//   AmxHw   the instructions (needs cpuid AMX-TILE + AMX-BF16, the OS's tile state in XCR0, and
//           Linux's per-process permission: arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA))
//   AmxEmu  plain C++ over thread-local tile registers, following the instructions' definition:
//           the test suite runs the AMX path's addressing on CPUs without AMX (FASTDECODE_AMX=emulate)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(FD_AVX512) && !defined(FD_SIMDE_AVX512) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace FD_NS {

// ============================================================================
// tile configuration (ldtilecfg's 64-byte operand, palette 1)
// ============================================================================

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};   // bytes per row of tile i
    uint8_t rows[16] = {};     // rows of tile i
};
static_assert(sizeof(TileConfig) == 64 && offsetof(TileConfig, colsb) == 16 && offsetof(TileConfig, rows) == 48,
              "ldtilecfg reads palette at byte 0, colsb at 16, rows at 48");

// R query rows a tile product (1..16): the A and C tiles R rows, the B tiles 16
static inline TileConfig attention_tile_config(int R) {
    TileConfig c;
    const uint8_t r[8] = {(uint8_t)R, 16, 16, (uint8_t)R, (uint8_t)R, (uint8_t)R, 16, 16};
    for (int i = 0; i < 8; ++i) {
        c.rows[i] = r[i];
        c.colsb[i] = 64;
    }
    return c;
}

// ============================================================================
// AmxHw: the instructions (the native AVX-512 build only)
// ============================================================================

#if defined(FD_AVX512) && !defined(FD_SIMDE_AVX512)
#define FD_HAVE_AMX_HW 1
#define FD_TARGET_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#define FD_TARGET_AMX8 __attribute__((target("amx-tile,amx-int8")))
#define FD_TARGET_TILE __attribute__((target("amx-tile")))

struct AmxHw {
    FD_TARGET_AMX static void config(const TileConfig& c) { _tile_loadconfig(&c); }
    FD_TARGET_AMX static void release() { _tile_release(); }
    FD_TARGET_AMX static void dot() {   // C0 += A . B0, C1 += A . B1
        _tile_dpbf16ps(3, 0, 1);
        _tile_dpbf16ps(4, 0, 2);
    }
    FD_TARGET_AMX static void dot_pv() {   // C0 += P . V0, C1 += P . V1
        _tile_dpbf16ps(3, 5, 6);
        _tile_dpbf16ps(4, 5, 7);
    }
    // a tile's load, store and zero by number; GCC's tile intrinsics spell the register from the
    // literal argument, hence one branch per tile
#define FD_TILE_BY_NUMBER(T, OP) \
    if constexpr (T == 0) { OP(0); } else if constexpr (T == 1) { OP(1); } else if constexpr (T == 2) { OP(2); } \
    else if constexpr (T == 3) { OP(3); } else if constexpr (T == 4) { OP(4); } else if constexpr (T == 5) { OP(5); } \
    else if constexpr (T == 6) { OP(6); } else { static_assert(T == 7, "tiles 0..7"); OP(7); }
#define FD_TILE_LOAD(i) _tile_loadd(i, p, stride)
#define FD_TILE_STORE(i) _tile_stored(i, p, stride)
#define FD_TILE_ZERO(i) _tile_zero(i)
    template <int T> FD_TARGET_TILE static void load_t(const void* p, size_t stride) { FD_TILE_BY_NUMBER(T, FD_TILE_LOAD) }
    template <int T> FD_TARGET_TILE static void store_t(void* p, size_t stride) { FD_TILE_BY_NUMBER(T, FD_TILE_STORE) }
    template <int T> FD_TARGET_TILE static void zero_t() { FD_TILE_BY_NUMBER(T, FD_TILE_ZERO) }
#undef FD_TILE_LOAD
#undef FD_TILE_STORE
#undef FD_TILE_ZERO
#undef FD_TILE_BY_NUMBER
    FD_TARGET_AMX8 static void dot_k8() {   // int8 scores: hi += qh . K, lo += ql . K (signed q, unsigned K)
        _tile_dpbsud(3, 0, 2);
        _tile_dpbsud(4, 1, 2);
    }
    FD_TARGET_AMX8 static void dot_pv8() {  // int8 PV: hi += wh . V, lo += wl . V (unsigned w, signed V)
        _tile_dpbusd(3, 5, 7);
        _tile_dpbusd(4, 6, 7);
    }
};

// Linux hands out the 8 KB tile state only on request, once per process (kernel 5.16+); a tile
// instruction without it faults. Asked on first use; false if the CPU (cpuid AMX-TILE and AMX-BF16,
// XCR0's tile bits: cpu_features) or the kernel says no.
static inline bool amx_usable() {
    static const bool ok = [] {
        if (!cpu_has("amx-tile") || !cpu_has("amx-bf16")) return false;
#if defined(__linux__)
        constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
        return false;
#endif
    }();
    return ok;
}
// and AMX-INT8 for the int8 KV passes (every AMX CPU so far has it beside AMX-BF16)
static inline bool amx_int8_usable() {
    static const bool ok = amx_usable() && cpu_has("amx-int8");
    return ok;
}
#else
static inline bool amx_usable() { return false; }
static inline bool amx_int8_usable() { return false; }
#endif

// ============================================================================
// AmxEmu: the same operations in plain C++ (tests on CPUs without AMX)
// ============================================================================

struct AmxEmu {
    struct Regs {
        TileConfig cfg;
        alignas(64) uint8_t t[8][16][64];
    };
    static Regs& regs() {
        thread_local Regs r;
        return r;
    }
    static void config(const TileConfig& c) {
        regs().cfg = c;
        std::memset(regs().t, 0, sizeof(regs().t));
    }
    static void release() { regs().cfg = TileConfig{}; }
    static void load(int i, const void* p, size_t stride) {
        auto& r = regs();
        for (int row = 0; row < r.cfg.rows[i]; ++row)
            std::memcpy(r.t[i][row], static_cast<const char*>(p) + row * stride, r.cfg.colsb[i]);
    }
    static void store(int i, void* p, size_t stride) {
        auto& r = regs();
        for (int row = 0; row < r.cfg.rows[i]; ++row)
            std::memcpy(static_cast<char*>(p) + row * stride, r.t[i][row], r.cfg.colsb[i]);
    }
    static float bf16_at(const uint8_t* row, int k) {
        uint16_t h;
        std::memcpy(&h, row + 2 * k, 2);
        uint32_t u = (uint32_t)h << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    // tdpbf16ps c += a . b: c[m][n] += a[m][2k] b[k][2n] + a[m][2k+1] b[k][2n+1], k along a's row
    static void dpbf16(int ci, int ai, int bi) {
        auto& r = regs();
        for (int m = 0; m < r.cfg.rows[ci]; ++m) {
            float c[16];
            std::memcpy(c, r.t[ci][m], 64);
            for (int k = 0; k < r.cfg.colsb[ai] / 4; ++k)
                for (int n = 0; n < r.cfg.colsb[ci] / 4; ++n) {
                    c[n] += bf16_at(r.t[ai][m], 2 * k) * bf16_at(r.t[bi][k], 2 * n);
                    c[n] += bf16_at(r.t[ai][m], 2 * k + 1) * bf16_at(r.t[bi][k], 2 * n + 1);
                }
            std::memcpy(r.t[ci][m], c, 64);
        }
    }
    static void dot() {
        dpbf16(3, 0, 1);
        dpbf16(4, 0, 2);
    }
    static void dot_pv() {
        dpbf16(3, 5, 6);
        dpbf16(4, 5, 7);
    }
    template <int T> static void load_t(const void* p, size_t stride) { load(T, p, stride); }
    template <int T> static void store_t(void* p, size_t stride) { store(T, p, stride); }
    template <int T> static void zero_t() { std::memset(regs().t[T], 0, sizeof(regs().t[T])); }
    // tdpb[s|u][s|u]d c += a . b: c[m][n] += sum_i a[m][4k+i] b[k][4n+i] over k along a's row, int32
    template <bool A_SIGNED, bool B_SIGNED>
    static void dp_i8(int ci, int ai, int bi) {
        auto& r = regs();
        auto at = [](const uint8_t* row, int i, bool sgn) { return sgn ? (int32_t)(int8_t)row[i] : (int32_t)row[i]; };
        for (int m = 0; m < r.cfg.rows[ci]; ++m) {
            int32_t c[16];
            std::memcpy(c, r.t[ci][m], 64);
            for (int k = 0; k < r.cfg.colsb[ai] / 4; ++k)
                for (int n = 0; n < r.cfg.colsb[ci] / 4; ++n)
                    for (int i = 0; i < 4; ++i) c[n] += at(r.t[ai][m], 4 * k + i, A_SIGNED) * at(r.t[bi][k], 4 * n + i, B_SIGNED);
            std::memcpy(r.t[ci][m], c, 64);
        }
    }
    static void dot_k8() {
        dp_i8<true, false>(3, 0, 2);
        dp_i8<true, false>(4, 1, 2);
    }
    static void dot_pv8() {
        dp_i8<false, true>(3, 5, 7);
        dp_i8<false, true>(4, 6, 7);
    }
};

// ============================================================================
// scores of one page for R query rows (R <= 16, Dp % 32 == 0)
// ============================================================================

// the tile operations of Tiles (AmxHw or AmxEmu) configured for g = R rows by the caller;
// qw [g][Dp/2] words: the rows' queries as bf16 pairs; S [g][PT] gets scores * sc;
// pf: the next page, whose K run is prefetched a share per 32 dims
template <class Tiles>
static void scores_page_tiles(const char* K, int Dp, const uint32_t* qw, float sc, int g, float* S, const char* pf) {
    const int steps = Dp / 32;                       // 32 dims = 16 word rows per tile product
    const int lines = k_run_lines(BF16, Dp);
    constexpr size_t krow = PT * 4;                  // bytes from one K word row to the next
    Tiles::template zero_t<3>();
    Tiles::template zero_t<4>();
    for (int s = 0; s < steps; ++s) {
        if (pf) prefetch_share(pf, lines, s, steps);
        const char* k = K + (size_t)s * 16 * krow;      // word rows 16s .. 16s+15
        Tiles::template load_t<0>(qw + (size_t)s * 16, (size_t)Dp * 2);   // g query rows, dims 32s .. 32s+31
        Tiles::template load_t<1>(k, krow);                              // tokens 0-15
        Tiles::template load_t<2>(k + 64, krow);                         // tokens 16-31
        Tiles::dot();
    }
    Tiles::template store_t<3>(S, krow);                // S [g][PT]: a row of PT floats = krow bytes
    Tiles::template store_t<4>(S + 16, krow);
    const __m512 vs = _mm512_set1_ps(sc);
    for (int j = 0; j < g; ++j) {
        float* Sj = S + (size_t)j * PT;
        _mm512_storeu_ps(Sj, _mm512_mul_ps(_mm512_loadu_ps(Sj), vs));
        _mm512_storeu_ps(Sj + 16, _mm512_mul_ps(_mm512_loadu_ps(Sj + 16), vs));
    }
}

// ============================================================================
// PV of one whole page for R query rows, V in token pairs (R <= 16, Dp % 32 == 0)
// ============================================================================

// acc [R][Dp] += p V: p16 [R][PT] the rows' probabilities as bf16 (a row of PT = one A tile row),
// V the page's V run in pair tiles; pf: the next page's V run, prefetched a share per 32 dims
template <class Tiles>
static void pv_page_tiles(const char* V, int Dp, const uint16_t* p16, float* acc, const char* pf, int pf_lines) {
    const int steps = Dp / 32;
    const size_t arow = (size_t)Dp * 4;                 // bytes from one accumulator row to the next
    Tiles::template load_t<5>(p16, PT * 2);
    for (int s = 0; s < steps; ++s) {
        if (pf) prefetch_share(pf, pf_lines, s, steps);
        const int d = 32 * s;                           // dims d .. d+31: one pair tile's width apart
        const size_t vrow = (size_t)std::min(PAIR_TILE, Dp - d / PAIR_TILE * PAIR_TILE) * 4;
        Tiles::template load_t<3>(acc + d, arow);
        Tiles::template load_t<4>(acc + d + 16, arow);
        Tiles::template load_t<6>(V + pair_word(0, d, Dp) * 4, vrow);
        Tiles::template load_t<7>(V + pair_word(0, d + 16, Dp) * 4, vrow);
        Tiles::dot_pv();
        Tiles::template store_t<3>(acc + d, arow);
        Tiles::template store_t<4>(acc + d + 16, arow);
    }
}

// ============================================================================
// by mode (AMX_HW, AMX_EMU): what a work item of the attention driver calls
// ============================================================================

// the calling thread's tiles for R rows a tile product, before the item's first page (another
// library in the process may have configured them otherwise since the last item)
static inline void amx_begin(int mode, int R) {
#if defined(FD_HAVE_AMX_HW)
    if (mode == AMX_HW) return AmxHw::config(attention_tile_config(R));
#endif
    AmxEmu::config(attention_tile_config(R));
}

// after the item's last page: tile state back to init (cheaper context switches)
static inline void amx_end(int mode) {
#if defined(FD_HAVE_AMX_HW)
    if (mode == AMX_HW) return AmxHw::release();
#endif
    AmxEmu::release();
}

static inline void scores_page_amx(int mode, const char* K, int Dp, const uint32_t* qw, float sc, int g, float* S,
                                   const char* pf) {
#if defined(FD_HAVE_AMX_HW)
    if (mode == AMX_HW) return scores_page_tiles<AmxHw>(K, Dp, qw, sc, g, S, pf);
#endif
    scores_page_tiles<AmxEmu>(K, Dp, qw, sc, g, S, pf);
}

static inline void pv_page_amx(int mode, const char* V, int Dp, const uint16_t* p16, float* acc, const char* pf,
                               int pf_lines) {
#if defined(FD_HAVE_AMX_HW)
    if (mode == AMX_HW) return pv_page_tiles<AmxHw>(V, Dp, p16, acc, pf, pf_lines);
#endif
    pv_page_tiles<AmxEmu>(V, Dp, p16, acc, pf, pf_lines);
}

}  // namespace FD_NS
