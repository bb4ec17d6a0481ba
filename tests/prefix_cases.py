"""Shared by tests/test_prefix_store.py: the paths, a pair of stores that hold the same tokens per
sequence (one through KVStore.fork, one with every sequence's own copy), the comparison of their
outputs and the checks against the float64 references, and a model of who holds which page.

Tolerance of shared against unshared: both stores run the same page passes over the same stored
K/V (the unshared store holds a copy of every page) with the same queries, so every token's score
is the same number; what differs is where a sequence's tokens are cut into partials (the shared
pages as one run of 512-token chunks and a member's own pages as the next, against chunks of 512
from token 0), hence the running maximum subtracted before exp2 and the order in which the sums
are added and merged. Each moves a weight p_t / l by a few units of fp32 roundoff u (exp2 of an
argument |s - m| of at most a few tens in log2 units; sums whose relative error grows with log2 of
their length), and the output, a convex combination of V rows, by a few tens of u * max|v|. The
bound is SHARE_ULPS = 128 u * max|v| per query head: ~10x the largest difference measured on any
path here (random data, queries scaled up to 4x), and below what one token more or less moves the
output of the longest sequence tested (test_the_tolerance_sees_one_token).
int8 KV: the same integers in both (per-token scales, the query quantized once per row), but the
page weights are quantized per partial from p_t / max p of the page, computed from a different
running maximum: a weight within fp32 rounding of a rounding tie rounds either way, one low-part
step (the page's largest weight / 127^2) apart. The bound adds INT8_FLIPS = 16 such steps of the
sequence's largest softmax weight (float64, from the appended values); measured: 1/40 of it.
V in token pairs (v_tile = V_PAIRS): the probabilities are rounded to bf16 relative to each
partial's maximum, so that layout gets 2 u_bf16 * max|v| more (tests/test_v_pairs.py: pairs_bound).
"""
from __future__ import annotations

import os
import sys
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from int8_ref import check_seq  # noqa: E402
from kernel_ref import UNIT_ROUNDOFF, as_f32, attention_ref, f32_to_bf16_bits, fp32_tolerance, quantize  # noqa: E402
from kvstore_cases import ISAS, check, open_store, rand  # noqa: E402

from rworker.kvstore import V_PAIRS  # noqa: E402

PT = 32                    # tokens per page (paging.h)
ROWS_PER_ITEM = 64         # query rows of one shared-page item: blocks of 64 // g members (attention.h)
SHARE_ULPS = 128
INT8_FLIPS = 16

# every path of tests/kvstore_cases.py (ISA builds, second V layouts, AMX emulated and on the
# instructions), and V in token pairs where the build and CPU have them; the SIMDe build is slow:
# EMU gets a few small cases
FAST = [p for p in ISAS if not p.startswith("avx512emu")]
EMU = [p for p in ISAS if p.startswith("avx512emu")]
PAIRS = [f"{i}+pairs" for i in ("avx512", "avx512emu") if i in ISAS
         and open_store(1, 1, 64, "bf16", threads=1, isa=i).has_v_pairs]
# V pairs under the AMX tiles (scores and PV): emulated, and on the instructions where they run
PAIRS += [f"{p}+pairs" for p in ISAS if "+amx" in p and f"{p.split('+')[0]}+pairs" in PAIRS]
FAST_PAIRS = [p for p in PAIRS if not p.startswith("avx512emu")]


def open_path(L, Hkv, D, kv_dtype, path, **kw):
    """A store on one path of FAST/EMU/PAIRS ("avx512+pairs": bf16 V in token pairs; "avx512+amx+pairs":
    the same under the emulated AMX tiles)."""
    if path.endswith("+pairs"):
        return open_store(L, Hkv, D, kv_dtype, isa=path[:-len("+pairs")], v_tile=V_PAIRS, **kw)
    return open_store(L, Hkv, D, kv_dtype, isa=path, **kw)


def ok_for(path, kv_dtype):
    """Paths that mean something for this KV dtype: int8 ignores V layouts and runs the AMX tiles
    (amx_i8.h), the rest of AMX needs bf16 KV, V pairs need bf16 KV."""
    if kv_dtype == "int8":
        return "+" not in path or ("+amx" in path and "+pairs" not in path)
    return ("+amx" not in path and "+pairs" not in path) or kv_dtype == "bf16"


class Twin:
    """Two stores on one path: `shared` made with fork, `plain` holding every sequence's tokens as
    its own copy (appended); kv(s, layer) mirrors what both hold (the mirror of kvstore_cases.check).
    Keyword arguments (capacity_bytes) go to `shared` only."""

    def __init__(self, path, L, Hkv, D, kv_dtype, seed, threads=2, **kw):
        self.L, self.Hkv, self.D, self.kv_dtype, self.path = L, Hkv, D, kv_dtype, path
        self.shared = open_path(L, Hkv, D, kv_dtype, path, threads=threads, **kw)
        self.plain = open_path(L, Hkv, D, kv_dtype, path, threads=threads)
        self.rng = np.random.default_rng(seed)
        self.k, self.v = {}, {}           # (seq, layer) -> float32 [T, Hkv, D] (the appended values)

    def kv(self, s, layer):
        return self.k[(s, layer)], self.v[(s, layer)]

    def _append(self, stores, s, layer, k, v):
        for st in stores:
            st.append(layer, np.full(len(k), s, np.int64), k, v)
        old = self.k.get((s, layer), np.zeros((0, self.Hkv, self.D), np.float32))
        self.k[(s, layer)] = np.concatenate([old, k])
        self.v[(s, layer)] = np.concatenate([self.v.get((s, layer), old[:0]), v])

    def grow(self, s, T):
        """T new random tokens of sequence s (new or not) at every layer, in both stores."""
        if T == 0:
            return
        for layer in range(self.L):
            k, v = rand(self.rng, (T, self.Hkv, self.D)), rand(self.rng, (T, self.Hkv, self.D))
            self._append((self.shared, self.plain), s, layer, k, v)

    def fork(self, src, dst, tokens):
        """dst shares src's first `tokens` tokens in `shared`; `plain` gets them appended as dst's own."""
        self.shared.fork(src, dst, tokens)
        for layer in range(self.L):
            k, v = self.kv(src, layer)
            self._append((self.plain,), dst, layer, k[:tokens], v[:tokens])

    def free(self, s):
        a, b = self.shared.free(s), self.plain.free(s)
        assert a and b, f"free({s}): shared {a}, plain {b}"
        for layer in range(self.L):           # (a sequence that only reserved has no tokens)
            self.k.pop((s, layer), None)
            self.v.pop((s, layer), None)

    def step(self, ids, g, label):
        """A decode step of the sequences ids (one new token each, every layer) through
        append_attend on both stores, compared as in compare()."""
        for layer in range(self.L):
            q = self.query(len(ids), g)
            k, v = rand(self.rng, (len(ids), self.Hkv, self.D)), rand(self.rng, (len(ids), self.Hkv, self.D))
            o = self.shared.append_attend(layer, ids, q, k, v)
            p = self.plain.append_attend(layer, ids, q, k, v)
            for i, s in enumerate(ids):
                self._append((), s, layer, k[i:i + 1], v[i:i + 1])
            self.assert_close(layer, ids, q, o, p, f"{label} layer {layer}")

    def family(self, donor, members, prefix, fork_at, tails):
        """A donor of `prefix` tokens and members forked from it at `fork_at`, member i then
        growing by tails[i] tokens of its own. Returns the members' ids."""
        self.grow(donor, prefix)
        for m, t in zip(members, tails):
            self.fork(donor, m, fork_at)
            self.grow(m, t)
        return list(members)

    def query(self, n, g, bf16=False, scale=1.0):
        q = rand(self.rng, (n, self.Hkv * g, self.D), scale)
        return f32_to_bf16_bits(q) if bf16 else q

    def attend(self, layer, ids, q):
        """(shared output, plain output) of one call with these ids (in this order)."""
        ids = np.asarray(ids, np.int64)
        return self.shared.attend(layer, ids, q), self.plain.attend(layer, ids, q)

    def tol(self, s, layer, qi):
        """Bound on |shared - plain| for sequence s, query qi [Hq, D] (module docstring) -> [Hq, 1]."""
        k, v = (x.astype(np.float64) for x in self.kv(s, layer))
        g = qi.shape[0] // self.Hkv
        vmax = np.repeat(np.abs(v).max(axis=(0, 2)), g)
        u = SHARE_ULPS * UNIT_ROUNDOFF["fp32"]
        if self.path.endswith("+pairs"):
            u += 2 * UNIT_ROUNDOFF["bf16"]
        if self.kv_dtype == "int8":         # INT8_FLIPS low-part steps of the largest weight
            sc = np.einsum("hd,thd->ht", as_f32(qi).astype(np.float64), np.repeat(k, g, axis=1)) * self.shared.scale
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            u = u + INT8_FLIPS * (p.max(axis=1) / p.sum(axis=1)) / 127**2
        return (u * vmax)[:, None]

    def compare(self, layer, ids, q, label, reference=True):
        """One call on both stores: shared within tol of plain for every row, both finite; and the
        shared output against the float64 references (kvstore_cases.check, int8_ref.check_seq):
        every row, none (reference=False) or the rows of the ids in `reference`. Returns the
        shared output."""
        ids = [int(i) for i in ids]
        o, p = self.attend(layer, ids, q)
        self.assert_close(layer, ids, q, o, p, label)
        if reference is not False:
            rows = [i for i, s in enumerate(ids) if reference is True or s in reference]
            self.check_reference(layer, [ids[i] for i in rows], q[rows], o[rows], label)
        return o

    def assert_close(self, layer, ids, q, o, p, label):
        assert np.isfinite(o).all() and np.isfinite(p).all(), f"{label}: non-finite output"
        for i, s in enumerate(ids):
            err, tol = np.abs(o[i].astype(np.float64) - p[i]), self.tol(s, layer, q[i])
            assert (err <= tol).all(), (f"{label}: seq {s} ({len(self.k[(s, layer)])} tokens) layer {layer}: "
                                        f"|shared - plain| {err.max():.3g} > {tol.min():.3g} (worst x{(err / tol).max():.3g})")

    def check_reference(self, layer, ids, q, o, label):
        if self.kv_dtype == "int8":
            for i, s in enumerate(ids):
                check_seq(o[i], as_f32(q[i]), *self.kv(s, layer), self.shared, f"{label}: seq {s}")
        elif self.path.endswith("+pairs"):
            for i, s in enumerate(ids):     # tests/test_v_pairs.py: pairs_bound, on the stored values
                k, v = (quantize(x, "bf16") for x in self.kv(s, layer))
                qi = as_f32(q[i]).astype(np.float64)
                ref = attention_ref(qi, k, v, self.shared.scale)
                vmax = np.repeat(np.abs(v).max(axis=(0, 2)), len(qi) // self.Hkv)
                tol = fp32_tolerance(qi, k, v, self.shared.scale) + UNIT_ROUNDOFF["bf16"] * vmax
                assert (np.abs(o[i] - ref) <= tol[:, None]).all(), f"{label}: seq {s} vs the float64 reference"
        else:
            check(self.shared, self, layer, ids, q, o, self.kv_dtype)


class PageModel:
    """Who holds which page: per sequence its tokens, its reservation (pages per head) and a page
    id per page index, the same at every layer and kv head (a fork shares all of them alike): the
    tokens // PT first of a fork are its source's, a partial last page a new one (a copy)."""

    def __init__(self):
        self.seqs: dict[int, dict] = {}
        self._last = 0

    def _new_page(self):
        self._last += 1
        return self._last

    def _seq(self, s):
        return self.seqs.setdefault(s, {"len": 0, "pages": [], "reserved": 0})

    def grow(self, s, n):
        q = self._seq(s)
        q["len"] += n
        while len(q["pages"]) * PT < q["len"]:
            q["pages"].append(self._new_page())

    def fork(self, src, dst, tokens):
        a = self.seqs[src]
        tail = [self._new_page()] if tokens % PT else []
        self.seqs[dst] = {"len": tokens, "pages": a["pages"][:tokens // PT] + tail, "reserved": 0}

    def reserve(self, s, tokens):
        q = self._seq(s)
        q["reserved"] = max(q["reserved"], -(-tokens // PT))

    def free(self, s):
        del self.seqs[s]

    def expected(self, store):
        """(sharing_stats, bytes_committed) the store must report."""
        per = store.num_layers * store.num_kv_heads
        holders = Counter(p for q in self.seqs.values() for p in q["pages"])
        shared = [n for n in holders.values() if n >= 2]
        reserved = sum(max(0, q["reserved"] - len(q["pages"])) for q in self.seqs.values())
        stats = {"shared_pages": len(shared) * per, "shared_page_refs": sum(shared) * per,
                 "bytes_saved": (sum(shared) - len(shared)) * per * store.page_bytes}
        return stats, (len(holders) + reserved) * per * store.page_bytes
