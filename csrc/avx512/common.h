// common.h — dtypes, scalar bf16/fp16 conversions, aligned buffers.
//
// Included by every ISA build of the kernel sources. Nothing in here may use an instruction
// beyond the baseline of the module it is compiled into (the compiler flags decide).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

// Each ISA build gets its own namespace: the three modules can live in one process without any
// symbol, type or pybind11 registration of one being taken for another's.
// FD_AVX512: this build runs the AVX-512 kernels (simd_avx512.h), natively (-mavx512f) or, in the
// test-only module _kernels_avx512emu, through SIMDe on an AVX2 CPU (simde_avx512.h).
#if defined(FD_SIMDE_AVX512)
#include "simde_avx512.h"
#define FD_AVX512 1
#define FD_NS fd_avx512emu
#elif defined(__AVX512F__)
#define FD_AVX512 1
#define FD_NS fd_avx512
#elif defined(__AVX2__)
#define FD_NS fd_avx2
#else
#define FD_NS fd_portable
#endif

namespace FD_NS {

// ----------------------------------------------------------------------------
// dtypes of the KV store and of the arrays crossing the Python boundary

// I8: the store's int8 KV (quant.h); never an array crossing the Python boundary
enum DType : int { F32 = 0, BF16 = 1, F16 = 2, I8 = 3 };

inline size_t dtype_size(int dt) { return dt == F32 ? 4 : dt == I8 ? 1 : 2; }

constexpr float LOG2E = 1.4426950408889634f;

// ----------------------------------------------------------------------------
// scalar conversions (round-to-nearest-even, NaN stays NaN)

static inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    // branchless so loops over it vectorize: NaN -> quiet NaN, else add the rounding bias
    uint32_t nan = ((u & 0x7fffffffu) > 0x7f800000u);
    uint32_t rne = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t qnan = (u >> 16) | 0x40u;
    return (uint16_t)(nan ? qnan : rne);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {                                  // zero or subnormal: m * 2^-24
        float f = (float)m * 5.9604644775390625e-8f;
        return bits_f32(f32_bits(f) | sign);
    }
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));  // inf / nan
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f);
    uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint16_t o;
    if (u >= (143u << 23)) {                       // >= 65536 (after rounding: overflow), inf, nan
        o = (u > 0x7f800000u) ? 0x7e00 : 0x7c00;
    } else if (u < (113u << 23)) {                 // result is fp16 subnormal or zero:
        // adding 0.5 shifts the mantissa into place and the FPU rounds to nearest even
        float r = bits_f32(u) + 0.5f;
        o = (uint16_t)(f32_bits(r) - f32_bits(0.5f));
    } else {                                       // normal: rebias exponent, round mantissa
        uint32_t odd = (u >> 13) & 1u;
        u += (uint32_t)((15 - 127) << 23) + 0xfffu + odd;
        o = (uint16_t)(u >> 13);
    }
    return (uint16_t)(o | (sign >> 16));
}

static inline float load_scalar(const void* p, size_t i, int dt) {
    if (dt == F32) return static_cast<const float*>(p)[i];
    uint16_t h = static_cast<const uint16_t*>(p)[i];
    return dt == BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// ----------------------------------------------------------------------------
// 64-byte aligned, grow-only scratch buffer (one per thread, reused across calls)

struct AlignedBuf {
    float* p = nullptr;
    size_t cap = 0;  // floats
    ~AlignedBuf() { std::free(p); }
    void release() {
        std::free(p);
        p = nullptr;
        cap = 0;
    }
    float* get(size_t n) {
        if (n > cap) {
            std::free(p);
            size_t bytes = ((n * sizeof(float)) + 63) & ~size_t(63);
            p = static_cast<float*>(std::aligned_alloc(64, bytes));
            if (!p) throw std::bad_alloc();
            cap = n;
        }
        return p;
    }
};

inline size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

// a feature of cpu_features() (microbench.cpp: the CPU has it and the OS saves its state), by name
bool cpu_has(const char* feature);
// AVX512-BF16 usable: cpuid leaf 7 subleaf 1 EAX bit 5, with the OS saving ZMM state
inline bool cpu_has_avx512bf16() { return cpu_has("avx512bf16"); }
// vdpbf16ps may run here: the CPU has it, or this is the SIMDe build (which emulates it anywhere)
inline bool bf16_dot_usable() {
#if defined(FD_SIMDE_AVX512)
    return true;
#else
    return cpu_has_avx512bf16();
#endif
}

// scores as AMX tile products (amx.h): off (the default until measured on AMX hardware), the
// instructions, or their emulation (tests); every build knows the modes, the avx512 ones run them
enum { AMX_OFF = 0, AMX_HW = 1, AMX_EMU = 2 };

}  // namespace FD_NS
