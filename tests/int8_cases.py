"""Shared by the int8 KV store tests (tests/test_int8_kernel*.py): the paths this host runs, an int8
store on one path, random K/V data, ragged appends, and a ragged batch whose every sequence is
checked against the bounds of tests/int8_ref.py.

Paths: every ISA this host runs (rworker.isa), the AVX-512 builds with FASTDECODE_VNNI on and off
(set before the store is created: the flag is read then); the SIMDe emulation only on small cases.
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from int8_ref import F32, check_seq  # noqa: E402
from kvstore_cases import BASE_ISAS  # noqa: E402

from rworker import isa as isa_mod  # noqa: E402
from rworker.kvstore import KVStore  # noqa: E402

HAS_VNNI = "avx512vnni" in isa_mod.cpu_features()


def _paths(isas):
    """(isa, vnni) pairs: the AVX-512 builds (native and SIMDe) with vpdpbusd and without."""
    out = []
    for i in isas:
        if i == "avx512":
            out += ([("avx512", True)] if HAS_VNNI else []) + [("avx512", False)]
        elif i == "avx512emu":
            out += [("avx512emu", True), ("avx512emu", False)]     # SIMDe emulates VNNI anywhere
        else:
            out.append((i, None))
    return out


NATIVE = [i for i in BASE_ISAS if i != "avx512emu"]
EMU = [i for i in BASE_ISAS if i == "avx512emu"]
PATHS = _paths(NATIVE)
EMU_PATHS = _paths(EMU)
ALL_PATHS = PATHS + EMU_PATHS


def path_id(p):
    isa, vnni = p
    return isa if vnni is None else f"{isa}-{'vnni' if vnni else 'bw'}"


def open_i8(monkeypatch, path, num_layers, Hkv, D, threads=2):
    """An int8 store on one path; FASTDECODE_VNNI set for the AVX-512 builds, unset otherwise."""
    isa, vnni = path
    if vnni is None:
        monkeypatch.delenv("FASTDECODE_VNNI", raising=False)
    else:
        monkeypatch.setenv("FASTDECODE_VNNI", "1" if vnni else "0")
    st = KVStore(num_layers, Hkv, D, "int8", threads=threads, isa=isa)
    assert st.isa == isa and st.kv_dtype == "int8"
    assert st.vnni == bool(vnni), f"{path_id(path)}: store.vnni = {st.vnni}"
    return st


# ---------------------------------------------------------------------------------------------
# data and ragged appends


def make_kv(rng, T, Hkv, D, kind):
    """gaussian: N(0, 1). outliers: per-token magnitudes spread over ~e^{+-1.5}, a few key channels
    8x larger (as real keys have), V per token spread too: the per-token scales then differ."""
    k = rng.standard_normal((T, Hkv, D)).astype(F32)
    v = rng.standard_normal((T, Hkv, D)).astype(F32)
    if kind == "outliers":
        k *= np.exp(rng.uniform(-1.5, 1.5, (T, Hkv, 1))).astype(F32)
        k[:, :, rng.choice(D, 3, replace=False)] *= F32(8)
        v *= np.exp(rng.uniform(-1.5, 1.5, (T, Hkv, 1))).astype(F32)
    return k, v


def append_ragged(st, layer, data, rng, max_chunk):
    """Append data {seq: (k, v)} in rounds; each round takes a random number of each sequence's next
    rows (first round up to all of them: a prefill), rows of the sequences interleaved at random in
    one call (a sequence's own rows stay in order): partial pages are continued by later calls."""
    pos = {s: 0 for s in data}
    first = True
    while any(pos[s] < len(data[s][0]) for s in data):
        take = {}
        for s, (k, _) in data.items():
            left = len(k) - pos[s]
            if left:
                hi = left if first else min(left, max_chunk)
                take[s] = int(rng.integers(1, hi + 1)) if rng.random() < 0.9 else 0
        first = False
        lab = np.concatenate([np.full(n, s, np.int64) for s, n in take.items()] + [np.zeros(0, np.int64)])
        if lab.size == 0:
            continue
        rng.shuffle(lab)
        k0 = next(iter(data.values()))[0]
        kc = np.empty((lab.size,) + k0.shape[1:], k0.dtype)
        vc = np.empty_like(kc)
        for s, n in take.items():
            kc[lab == s] = data[s][0][pos[s]:pos[s] + n]
            vc[lab == s] = data[s][1][pos[s]:pos[s] + n]
            pos[s] += n
        st.append(layer, lab, kc, vc)


def run_case(st, rng, lengths, g, kind, qscale, label, max_chunk=40):
    """Ragged batch: one sequence per length, appended in rounds at layer 1 (layer 0 holds other
    data), attended in one call in shuffled order; every sequence checked against the bounds."""
    Hkv, D = st.num_kv_heads, st.head_dim
    data = {100 + i: make_kv(rng, T, Hkv, D, kind) for i, T in enumerate(lengths)}
    append_ragged(st, 1, data, rng, max_chunk)
    other = {s: tuple(3 * x for x in make_kv(rng, min(len(kv[0]), 40), Hkv, D, "gaussian")) for s, kv in data.items()}
    append_ragged(st, 0, other, rng, max_chunk)
    for s, (k, _) in data.items():
        assert st.num_tokens(s, layer=1) == len(k)
    ids = np.array(list(data), np.int64)
    rng.shuffle(ids)
    q = (rng.standard_normal((len(ids), Hkv * g, D)) * qscale).astype(F32)
    o = st.attend(1, ids, q)
    stats = []
    for i, s in enumerate(ids.tolist()):
        check_seq(o[i], q[i], *data[s], st, f"{label} seq len {len(data[s][0])}", stats)
    return stats
