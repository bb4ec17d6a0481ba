"""Shared by the KVStore tests: the ISA paths this host runs, stores on one path, a mirror of
what a store should hold, and the check of an output against the float64 numpy reference."""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from kernel_ref import as_f32, attention_ref, fp32_tolerance, quantize, tolerance  # noqa: E402

from rworker import KVStore  # noqa: E402
from rworker import isa as isa_mod  # noqa: E402

# every path this CPU runs, and the AVX-512 code emulated through SIMDe where it was built
# (rworker.isa.EMULATED: the AVX-512 branch's logic is then tested on CPUs without AVX-512 too)
# A build with a second V layout under measurement (V_TILE_ALT, simd.h) is tested in both:
# "<isa>+vt<N>" opens its stores with v_tile=N.
# The AMX tiles (csrc/avx512/amx.h, amx_i8.h: bf16 scores, PV with V pairs, int8): "<isa>+amx" opens
# its stores with amx="emulate" wherever the AVX512-BF16 scores run, "<isa>+amxhw" with the
# instructions on an AMX CPU.
BASE_ISAS = [i for i in isa_mod.available_isas() if i in ("portable", "avx2", "avx512")] + isa_mod.emulated_isas()
BF16_DOT_ISAS = [i for i in BASE_ISAS if i == "avx512emu" or (i == "avx512" and "avx512bf16" in isa_mod.cpu_features())]
ISAS = (BASE_ISAS + [f"{i}+vt{isa_mod.load(i).V_TILE_ALT}" for i in BASE_ISAS
                 if isa_mod.load(i).V_TILE_ALT != isa_mod.load(i).V_TILE]
        + [f"{i}+amx" for i in BF16_DOT_ISAS]
        + [f"{i}+amxhw" for i in BF16_DOT_ISAS if i == "avx512" and "amx-bf16" in isa_mod.cpu_features()])
DTYPES = ["fp32", "bf16", "fp16"]


def open_store(*args, isa: str, **kw) -> KVStore:
    """KVStore on one ISA path ("avx512emu", or "avx512emu+vt32" for its second V layout, 32-dim
    tiles, or "avx512+amx" for the emulated AMX scores, "avx512+amxhw" for the instructions)."""
    name, _, amx = isa.partition("+amx")        # "avx512+amxhw" -> "avx512", "hw"
    name, _, vt = name.partition("+vt")
    amx_mode = None if "+amx" not in isa else "on" if amx == "hw" else "emulate"
    kw.setdefault("v_tile", int(vt) if vt else None)
    return KVStore(*args, isa=name, amx=amx_mode, **kw)


def rand(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


class Mirror:
    """What a store should hold: per (seq, layer) the list of appended k, v rows (inputs as given)."""

    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, layer, ids, k, v):
        for i, s in enumerate(np.asarray(ids).tolist()):
            self.k.setdefault((s, layer), []).append(as_f32(k[i]))
            self.v.setdefault((s, layer), []).append(as_f32(v[i]))

    def kv(self, s, layer):
        return np.stack(self.k[(s, layer)]), np.stack(self.v[(s, layer)])

    def free(self, s):
        for key in [key for key in self.k if key[0] == s]:
            del self.k[key], self.v[key]


def check(store, mirror, layer, ids, q, o, kv_dtype):
    """o against the reference on stored values (fp32 tolerance) and on inputs (dtype tolerance)."""
    for i, s in enumerate(ids):
        k, v = mirror.kv(s, layer)
        kq, vq = quantize(k, kv_dtype), quantize(v, kv_dtype)
        qi = as_f32(q[i]).astype(np.float64)
        got = as_f32(o[i]).astype(np.float64)
        ref_q = attention_ref(qi, kq, vq, store.scale)
        extra = np.abs(ref_q) * 2.0**-8 if o.dtype == np.uint16 else 0.0     # bf16 output: one more rounding
        tol_q = fp32_tolerance(qi, kq, vq, store.scale)[:, None] + extra
        err = np.abs(got - ref_q)
        assert (err <= tol_q).all(), f"seq {s} len {len(k)}: max err {err.max():.3g} vs tol {tol_q.min():.3g} (stored values)"
        ref = attention_ref(qi, k.astype(np.float64), v.astype(np.float64), store.scale)
        tol = tolerance(qi, k, v, store.scale, kv_dtype)[:, None] + extra
        assert (np.abs(got - ref) <= tol).all(), f"seq {s}: err {np.abs(got - ref).max():.3g} > dtype tol"

