"""The attention variants of the KV store's kernel (csrc/avx512/attention.h): sliding windows per
layer, logit soft-capping, attention sinks, each alone and all together, against the float64 numpy
reference (tests/kernel_ref.py) with the existing tolerances plus the variants' own terms.

Paths: every ISA build here (kvstore_cases.ISAS: the second V layouts, the AMX scores emulated and,
on an AMX CPU, on the instructions), V pairs where they run, int8 KV on the int8 paths (VNNI on and
off) against the bound of tests/int8_ref.py, refitted to a window's pages, the cap and the sinks.
Lengths and windows cut pages every way: windows shorter than, longer than and equal to the
sequence, starts in the middle of a page, W = 1, multi-chunk lengths with W > 512, ragged batches.
Also: masked tokens weigh exactly 0 (AVX2's exp2 of -inf), the bits without a variant in effect,
the soft-cap's tanh error bound on every build, and the errors.
"""
from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from int8_cases import EMU_PATHS, PATHS, path_id  # noqa: E402
from int8_ref import F32, PT, QSTEP, _bound, hadamard, pad, quant_query, quant_rows, rot_err  # noqa: E402
from kernel_ref import UNIT_ROUNDOFF, attention_ref, fp32_tolerance, quantize, tolerance  # noqa: E402
from kvstore_cases import BASE_ISAS, BF16_DOT_ISAS, ISAS, open_store  # noqa: E402

from rworker import KVStore  # noqa: E402
from rworker import isa as isa_mod  # noqa: E402
from rworker.kvstore import V_PAIRS  # noqa: E402

WINDOWS = (1, 32, 45, 100, 600, 0)          # one per layer of the test stores; 0: a full layer beside them
LENS = (1, 20, 32, 45, 64, 77, 100, 130, 700, 1100)
EMU_LENS = (1, 32, 45, 100, 560)            # the SIMDe build is slow: fewer tokens, still two chunks
HKV, G, D = 2, 4, 64                        # GQA 4 (the AMX scores run), D a multiple of 32
CAP = 4.0
VARIANTS = ("window", "softcap", "sinks", "all")
PAIR_ISAS = [i for i in BASE_ISAS if KVStore(1, 1, 64, "bf16", threads=1, isa=i).has_v_pairs]


def settings(variant, rng, Hq):
    """(windows, softcap, sinks) of a variant; the sinks span ordinary logits, one far above every
    score (that head's output ~ 0) and one far below (no effect)."""
    win = WINDOWS if variant in ("window", "all") else None
    cap = CAP if variant in ("softcap", "all") else None
    sinks = None
    if variant in ("sinks", "all"):
        sinks = rng.normal(0.0, 2.0, Hq).astype(np.float32)
        sinks[1:3] = (80.0, -80.0)[:Hq - 1]
    return win, cap, sinks


def fill(stores, rng, lens, layers, kind=np.float32, sid0=0):
    """Ragged appends: every layer gets each sequence's rows in rounds of random blocks, the
    sequences of a round interleaved in one call; the same K/V at every layer. {sid: (k, v)}."""
    Hkv, D_ = stores[0].num_kv_heads, stores[0].head_dim
    data = {sid0 + i: (rng.standard_normal((T, Hkv, D_)).astype(F32), rng.standard_normal((T, Hkv, D_)).astype(F32))
            for i, T in enumerate(lens)}
    pos = dict.fromkeys(data, 0)
    while any(pos[s] < len(data[s][0]) for s in data):
        take = {s: min(len(data[s][0]) - pos[s], int(rng.integers(1, 300))) for s in data}
        lab = np.concatenate([np.full(n, s, np.int64) for s, n in take.items()])
        rng.shuffle(lab)
        kc, vc = np.empty((lab.size, Hkv, D_), F32), np.empty((lab.size, Hkv, D_), F32)
        for s, n in take.items():
            kc[lab == s], vc[lab == s] = data[s][0][pos[s]:pos[s] + n], data[s][1][pos[s]:pos[s] + n]
            pos[s] += n
        if kind is np.uint16:
            kc, vc = to_bf16(kc), to_bf16(vc)
        for st in stores:
            for layer in layers:
                st.append(layer, lab, kc, vc)
    if kind is np.uint16:       # what the store was given, as float32
        data = {s: (from_bf16(to_bf16(k)), from_bf16(to_bf16(v))) for s, (k, v) in data.items()}
    return data


def to_bf16(x):
    return (np.ascontiguousarray(x, F32).view(np.uint32) >> 16).astype(np.uint16)   # truncation: exact values


def from_bf16(b):
    return (b.astype(np.uint32) << 16).view(F32)


def window_lo(st, layer, T):
    W = st.windows[layer]
    return max(0, T - W) if W else 0


def check_rows(st, data, layer, ids, q, o, pairs=False):
    """Each row against the reference over its window's tokens: on the stored values (fp32
    tolerance) and on the inputs (the dtype's); V pairs round the probabilities to bf16 besides."""
    sinks, g = st.sinks(layer), q.shape[1] // st.num_kv_heads
    qf = from_bf16(q) if q.dtype == np.uint16 else q
    for i, s in enumerate(ids):
        k, v = data[s]
        lo = window_lo(st, layer, len(k))
        k, v = k[lo:], v[lo:]
        kq, vq = quantize(k, st.kv_dtype), quantize(v, st.kv_dtype)
        qi = qf[i].astype(np.float64)
        extra = UNIT_ROUNDOFF["bf16"] * np.repeat(np.abs(vq).max(axis=(0, 2)), g)[:, None] if pairs else 0.0
        ref = attention_ref(qi, kq, vq, st.scale, st.softcap, sinks)
        tol = fp32_tolerance(qi, kq, vq, st.scale, st.softcap, sinks)[:, None] + extra
        err = np.abs(o[i] - ref)
        assert (err <= tol).all(), f"layer {layer} seq {s} len {len(data[s][0])}: err {err.max():.3g} (stored values)"
        ref = attention_ref(qi, k.astype(np.float64), v.astype(np.float64), st.scale, st.softcap, sinks)
        tol = tolerance(qi, k, v, st.scale, st.kv_dtype, st.softcap, sinks)[:, None] + extra
        assert (np.abs(o[i] - ref) <= tol).all(), f"layer {layer} seq {s}: err {np.abs(o[i] - ref).max():.3g} (inputs)"


def attend_all(st, rng, data, layers, qdt=np.float32, g=G):
    """Every layer: all sequences in one call, shuffled. [(layer, ids, q, o)]."""
    out = []
    for layer in layers:
        ids = np.array(sorted(data), np.int64)
        rng.shuffle(ids)
        q = (rng.standard_normal((len(ids), st.num_kv_heads * g, st.head_dim)) * 3).astype(F32)   # the cap bites
        if qdt is np.uint16:
            q = to_bf16(q)
        out.append((layer, ids, q, st.attend(layer, ids, q)))
    return out


def float_cases():
    """(path, kv dtype): every path on the float dtypes it runs; AMX and V pairs on bf16 only."""
    out = [(p, dt) for p in ISAS for dt in ("fp32", "bf16", "fp16") if "+amx" not in p or dt == "bf16"]
    return out + [(f"{p}+pairs", "bf16") for p in PAIR_ISAS + [p for p in ISAS if "+amx" in p and p.split("+")[0] in PAIR_ISAS]]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("path,kv_dtype", float_cases(), ids=lambda x: x if isinstance(x, str) else None)
def test_variants_match_the_reference(path, kv_dtype, variant):
    rng = np.random.default_rng(zlib.crc32(f"{path} {kv_dtype} {variant}".encode()))
    Hq = HKV * G
    win, cap, sinks = settings(variant, rng, Hq)
    name, pairs = path.removesuffix("+pairs"), path.endswith("+pairs")
    L = len(WINDOWS)
    kw = {"threads": 2, "windows": win, "softcap": cap}
    st = open_store(L, HKV, D, kv_dtype, isa=name, **({"v_tile": V_PAIRS} if pairs else {}), **kw)
    if sinks is not None:
        for layer in range(L):
            st.set_sinks(layer, sinks)
    emu = "emu" in path
    layers = range(L) if not emu else (0, 2, 4, 5)
    bf16_io = "+amx" in path or (kv_dtype == "bf16" and name in BF16_DOT_ISAS)
    data = fill([st], rng, EMU_LENS if emu else LENS, layers, np.uint16 if bf16_io else np.float32)
    for layer, ids, q, o in attend_all(st, rng, data, layers, np.uint16 if bf16_io else np.float32):
        check_rows(st, data, layer, ids, q, o, pairs)
        if sinks is not None:
            assert np.abs(o[:, 1]).max() < 1e-20           # a sink far above every score takes all the weight


@pytest.mark.parametrize("shape", [(1, 1, 80), (1, 16, 128), (3, 2, 48)], ids=lambda s: "Hkv{}-g{}-D{}".format(*s))
@pytest.mark.parametrize("path", [p for p in ISAS if "emu" not in p])
def test_all_variants_on_other_shapes(path, shape):
    """MHA with padded dims, GQA 16 (the largest AMX tile), three kv heads: bf16 KV, all variants."""
    Hkv, g, D_ = shape
    rng = np.random.default_rng(zlib.crc32(f"{path} {shape}".encode()))
    win, cap, sinks = settings("all", rng, Hkv * g)
    st = open_store(len(WINDOWS), Hkv, D_, "bf16", isa=path, threads=2, windows=win, softcap=cap)
    for layer in range(len(WINDOWS)):
        st.set_sinks(layer, sinks)
    layers = (0, 2, 4, 5)
    data = fill([st], rng, LENS, layers, np.uint16)
    for layer, ids, q, o in attend_all(st, rng, data, layers, np.uint16, g):
        check_rows(st, data, layer, ids, q, o)


# ---------------------------------------------------------------------------------------------
# int8 KV: the bound of tests/int8_ref.py (its reference 2, the dequantized keys and values)


def i8_check(o, q, k, v, st, lo, label):
    """Reference (2) of int8_ref over the window's pages: the tokens from the window's first page,
    those before its start at -inf (weight 0, as the kernel masks them); the cap moves no score
    error up (Lipschitz 1) and adds its tanh's; a sink is one more token of value 0 and no V
    error, in a page of its own (so the page-weight term sees only the kernel's pages)."""
    c, cap, sinks = st.scale, st.softcap, st.sinks(1)
    a = lo // PT * PT
    k, v = np.asarray(k[a:], F32), np.asarray(v[a:], F32)
    Hq, T, Dp = q.shape[0], k.shape[0], -(-D // 16) * 16
    kq, sk = quant_rows(hadamard(pad(k, Dp)))
    vq, sv = quant_rows(v)
    khat, vhat = kq * sk[..., None], vq * sv[..., None]
    _, sq = quant_query(q, Dp)
    qrot, rho_q = hadamard(pad(q, Dp), np.float64), rot_err(pad(q, Dp))
    kh1 = np.abs(khat).sum(axis=2)
    npad = -(-T // PT) * PT - T + (1 if sinks is not None else 0)
    for j in range(Hq):
        h = j // G
        s2 = c * (khat[:, h] @ qrot[j])
        E2 = c * (sq[j] * (QSTEP + 3e-5) + rho_q[j]) * kh1[:, h]
        E2 = E2 + 1e-6 * (np.abs(s2) + np.abs(s2).max() + 2 * E2.max() + 16)
        if cap is not None:
            s2, E2 = cap * np.tanh(s2 / cap), E2 + 16 * 2.0**-24 * cap
        s2[:lo - a], E2[:lo - a] = -np.inf, 0.0
        vals, svh, vqh = vhat[:, h], sv[:, h], vq[:, h]
        if npad:                # pad the last page; the sink (if any) opens a page of its own
            s2 = np.concatenate([s2, np.full(npad, -np.inf)])
            E2 = np.concatenate([E2, np.zeros(npad)])
            if sinks is not None:
                s2[-1], E2[-1] = sinks[j], 1e-6 * (abs(float(sinks[j])) + 16)
            vals, vqh = np.concatenate([vals, np.zeros((npad, D))]), np.concatenate([vqh, np.zeros((npad, D))])
            svh = np.concatenate([svh, np.zeros(npad)])
        ref, B = _bound(s2, E2, vals, svh, vqh, float(np.abs(v[:, h]).max()), False)
        err = np.abs(np.asarray(o[j], np.float64) - ref)
        assert (err <= B).all(), f"{label} head {j}: err {err.max():.3g}, worst ratio {(err / B).max():.3g}"


@pytest.mark.parametrize("variant", ("window", "all"))
@pytest.mark.parametrize("path", PATHS + EMU_PATHS, ids=path_id)
def test_int8_variants_within_the_int8_bound(monkeypatch, path, variant):
    isa, vnni = path
    if vnni is None:
        monkeypatch.delenv("FASTDECODE_VNNI", raising=False)
    else:
        monkeypatch.setenv("FASTDECODE_VNNI", "1" if vnni else "0")
    rng = np.random.default_rng(7 + len(variant))
    _, cap, sinks = settings(variant, rng, HKV * G)
    lens = (1, 45, 77, 130, 700) if isa != "avx512emu" else (45, 77, 560)
    for W in (45, 600):
        st = KVStore(2, HKV, D, "int8", threads=2, isa=isa, windows=(0, W), softcap=cap)
        assert st.vnni == bool(vnni)
        if sinks is not None:
            st.set_sinks(1, sinks)
        data = fill([st], rng, lens, (1,))
        for layer, ids, q, o in attend_all(st, rng, data, (1,)):
            for i, s in enumerate(ids.tolist()):
                k, v = data[s]
                i8_check(o[i], q[i], k, v, st, window_lo(st, 1, len(k)), f"{path_id(path)} W={W} len {len(k)}")


# ---------------------------------------------------------------------------------------------
# exactness: masked tokens, bits without a variant in effect, determinism


@pytest.mark.parametrize("isa", BASE_ISAS)
def test_tokens_before_the_window_weigh_exactly_nothing(isa):
    """The tokens of the window's first page before its start hold V = 3e38 and keys that would
    score highest: any weight above 0 (AVX2's clamped exp2 gave 2^-126) would show."""
    rng = np.random.default_rng(11)
    st = KVStore(1, HKV, D, "fp32", threads=2, isa=isa, windows=(40,))
    T = 110                                                   # window [70, 110): page 2 from 64, 6 masked
    k, v = rng.standard_normal((T, HKV, D)).astype(F32), rng.standard_normal((T, HKV, D)).astype(F32)
    q = rng.standard_normal((1, HKV * G, D)).astype(F32)
    k[64:70] = np.repeat(q[0].reshape(HKV, G, D).mean(axis=1)[None] * 4, 6, axis=0)
    v[64:70] = 3e38
    st.append(0, [0] * T, k, v)
    o = st.attend(0, [0], q)
    assert np.isfinite(o).all()
    ref = attention_ref(q[0], k[70:].astype(np.float64), v[70:].astype(np.float64), st.scale)
    assert (np.abs(o[0] - ref) <= fp32_tolerance(q[0], k[70:], v[70:], st.scale)[:, None]).all()


@pytest.mark.parametrize("isa", BASE_ISAS)
def test_variants_not_in_effect_give_the_plain_bits(isa):
    """A window at least as long as the sequence, and sinks far below every score, change no bit;
    a windowed row's output is the same alone and in any batch, with any thread count."""
    rng = np.random.default_rng(13)
    plain = KVStore(1, HKV, D, "bf16", threads=2, isa=isa)
    long_win = KVStore(1, HKV, D, "bf16", threads=2, isa=isa, windows=(700,))
    data = fill([plain, long_win], rng, (1, 33, 600, 700), (0,))
    ids = list(data)
    q = (rng.standard_normal((len(ids), HKV * G, D)) * 3).astype(F32)
    base = plain.attend(0, ids, q)
    assert np.array_equal(base, long_win.attend(0, ids, q))
    plain.set_sinks(0, np.full(HKV * G, -1e4, np.float32))
    assert np.array_equal(base, plain.attend(0, ids, q))
    short = [KVStore(1, HKV, D, "bf16", threads=t, isa=isa, windows=(100,)) for t in (1, 2)]
    fill(short, np.random.default_rng(1), (1, 33, 600, 700, 1300), (0,))
    batch = short[1].attend(0, ids, q)
    for i, s in enumerate(ids):
        assert np.array_equal(short[0].attend(0, [s], q[i:i + 1])[0], batch[i])


@pytest.mark.parametrize("isa", BASE_ISAS)
def test_softcap_tanh_within_its_bound(isa):
    """simd.h's softcap_page against float64: |cap tanh(x/cap) - ref| <= 4 ulp of the result plus
    the rounding of x/cap (AVX-512 and AVX2 approximate tanh; portable calls std::tanh)."""
    mod = isa_mod.load(isa)
    mag = np.geomspace(2.0**-20, 40.0, 200001)
    for cap in (1.0, 5.770780, 72.13475):                     # caps of 4, 50 in log2 units too
        x = (np.concatenate([mag, -mag, [0.0, 1e3, -1e3, np.inf, -np.inf]]) * cap).astype(F32)
        got = mod.softcap_values(x, cap).astype(np.float64)
        ref = cap * np.tanh(x.astype(np.float64) / cap)
        tol = 4 * np.spacing(np.abs(ref).astype(F32)).astype(np.float64) + 2.0**-24 * np.abs(x.astype(np.float64))
        err = np.abs(got - ref)
        assert (err <= tol).all(), f"cap {cap}: worst err/tol {(err / tol).max():.3g} at x={x[np.argmax(err / tol)]}"
        assert got[-5] == 0.0 and np.all(np.abs(got[-4:]) <= F32(cap))


# ---------------------------------------------------------------------------------------------
# errors


def test_bad_settings_are_value_errors_naming_the_input():
    with pytest.raises(ValueError, match="layer 1 has window -3"):
        KVStore(2, 1, 64, windows=(0, -3), threads=1)
    with pytest.raises(ValueError, match="3 values for 2 layers"):
        KVStore(2, 1, 64, windows=(0, 1, 2), threads=1)
    with pytest.raises(ValueError, match="layer 0 has window 1.5"):
        KVStore(2, 1, 64, windows=(1.5, 2), threads=1)
    with pytest.raises(ValueError, match="windows must be a sequence"):
        KVStore(2, 1, 64, windows=512, threads=1)
    for bad in (0, -1.0, float("nan"), float("inf"), "x"):
        with pytest.raises(ValueError, match="softcap"):
            KVStore(1, 1, 64, softcap=bad, threads=1)
    st = KVStore(2, 2, 64, threads=1, windows=(0, 64), softcap=30)
    assert st.windows == (0, 64) and st.softcap == 30.0 and st.sinks(1) is None
    for bad, what in (([1.0, np.nan, 0, 0], "head 1 is nan"), ([np.inf, 0], "head 0 is inf"),
                      ([1.0, 2.0, 3.0], "3 sinks, not a multiple"), (np.zeros((2, 2)), "1-d")):
        with pytest.raises(ValueError, match=what):
            st.set_sinks(1, bad)
    with pytest.raises(ValueError, match="layer 2 out of range"):
        st.set_sinks(2, [0.0, 0.0])
    st.set_sinks(1, [0.5, 1.0, 1.5, 2.0])
    assert st.sinks(1).tolist() == [0.5, 1.0, 1.5, 2.0] and not st.sinks(1).flags.writeable
    r = repr(st)
    assert "windows=(0, 64)" in r and "softcap=30" in r and "sinks at layers [1]" in r
    kv = np.ones((1, 2, 64), np.float32)
    st.append(1, [0], kv, kv)
    with pytest.raises(ValueError, match="layer 1 has sinks for 4 query heads, q has 8"):
        st.attend(1, [0], np.ones((1, 8, 64), np.float32))
    with pytest.raises(ValueError, match="layer 1 has sinks for 4 query heads, q has 2"):
        st.append_attend(1, [0], np.ones((1, 2, 64), np.float32), kv, kv)
    assert st.num_tokens(0, 1) == 1                            # the refused step stored nothing
    st.set_sinks(1, None)
    assert st.sinks(1) is None and "sinks" not in repr(st)
    st.attend(1, [0], np.ones((1, 8, 64), np.float32))
    with pytest.raises(ValueError, match="sliding windows"):
        st.fork(0, 1, 1)
    assert "windows" not in repr(KVStore(1, 1, 64, threads=1, windows=[0]))
