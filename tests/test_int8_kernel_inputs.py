"""int8 KV store (csrc/avx512/quant.h): its inputs (bf16 rows, one token, zero rows and queries, NaN
and inf rows, bad k and v arrays), checked against the bounds of tests/int8_ref.py where there is an
output, and its size in bytes. The accuracy and bitwise tests: tests/test_int8_kernel.py.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from int8_cases import ALL_PATHS, PATHS, append_ragged, make_kv, open_i8, path_id  # noqa: E402
from int8_ref import F32, PT, check_seq, quant_rows  # noqa: E402
from kernel_ref import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402

from rworker.kvstore import KVStore  # noqa: E402

# ---------------------------------------------------------------------------------------------
# inputs: bf16 rows, zero rows, NaN rows, bad arrays


@pytest.mark.parametrize("path", ALL_PATHS, ids=path_id)
def test_bf16_rows_quantize_from_their_bf16_values(monkeypatch, path):
    """k, v (and q) as bf16 bits give the bits of float32 inputs holding the same values, within
    the bound around the bf16 values; a bf16 output is the fp32 output rounded to bf16."""
    rng = np.random.default_rng(16)
    Hkv, g, D = 2, 2, 64
    lengths = [1, 45, 300]
    kb = {s: tuple(f32_to_bf16_bits(x) for x in make_kv(rng, T, Hkv, D, "outliers")) for s, T in enumerate(lengths)}
    kf = {s: tuple(bf16_bits_to_f32(x) for x in kv) for s, kv in kb.items()}
    ids = np.arange(len(lengths), dtype=np.int64)
    qb = f32_to_bf16_bits((rng.standard_normal((len(ids), Hkv * g, D)) * 2).astype(F32))
    qf = bf16_bits_to_f32(qb)
    a = open_i8(monkeypatch, path, 1, Hkv, D)
    b = open_i8(monkeypatch, path, 1, Hkv, D)
    append_ragged(a, 0, kb, np.random.default_rng(4), 40)
    append_ragged(b, 0, kf, np.random.default_rng(4), 40)
    oa, ob = a.attend(0, ids, qb), b.attend(0, ids, qf)
    assert np.array_equal(oa, ob)
    assert np.array_equal(a.attend(0, ids, qf), oa)
    for i in ids:
        check_seq(oa[i], qf[i], *kf[i], a, f"{path_id(path)} bf16 len {lengths[i]}")
    o16 = a.attend(0, ids, qb, out=np.empty(qb.shape, np.uint16))
    assert np.array_equal(o16, f32_to_bf16_bits(oa))


@pytest.mark.parametrize("path", ALL_PATHS, ids=path_id)
def test_one_token_returns_its_dequantized_value(monkeypatch, path):
    """With one token the weights are exactly 1 (page weight 127 of scale w/127), so the output is
    the store's v^ = s_v * vq up to a few fp32 roundings: the numpy quantizer matches the store's to
    the integer (one step off would be ~1e-2 here), ties to even included (amax 127: inv = 1)."""
    rng = np.random.default_rng(11)
    Hkv, D = 3, 64
    v = rng.standard_normal((4, Hkv, D)).astype(F32)
    v[0, 0, :8] = [127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]     # exact halves: round to even
    v[0, 0, 8:] = np.round(v[0, 0, 8:] * 8) / 8
    v[1, 1] = 0                                                        # scale 0
    v[2] *= F32(1e-30)                                                 # tiny scales
    v[3] *= F32(1e30)                                                  # huge ones
    k = rng.standard_normal((4, Hkv, D)).astype(F32)
    st = open_i8(monkeypatch, path, 1, Hkv, D)
    st.append(0, np.arange(4), k, v)
    o = st.attend(0, np.arange(4), rng.standard_normal((4, 2 * Hkv, D)).astype(F32))
    vq, sv = quant_rows(v)
    vhat = np.repeat(vq * sv[..., None], 2, axis=1)
    assert vq[0, 0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    err = np.abs(o - vhat)
    assert (err <= 1e-6 * np.abs(vhat) + 1e-45).all(), f"max rel err {(err / (np.abs(vhat) + 1e-45)).max():.3g}"


@pytest.mark.parametrize("path", ALL_PATHS, ids=path_id)
def test_zero_rows_and_zero_queries(monkeypatch, path):
    """All-zero k or v rows (scale 0) and all-zero queries (query scale 0: uniform weights)."""
    rng = np.random.default_rng(0)
    Hkv, g, D = 2, 2, 64
    st = open_i8(monkeypatch, path, 1, Hkv, D)
    z = np.zeros((1, Hkv, D), F32)
    st.append(0, [7], z, z)                                   # a sequence of one zero token
    k, v = make_kv(rng, 70, Hkv, D, "gaussian")
    k[[0, 31, 32, 50]] = 0                                    # zero keys (score exactly 0)
    v[[1, 32, 69]] = 0                                        # zero values
    k[5, 1] = 0                                               # one head's row only
    v[6, 0] = 0
    st.append(0, np.full(70, 8), k, v)
    q = rng.standard_normal((3, Hkv * g, D)).astype(F32)
    q[2, 1] = 0                                               # a zero query head
    o = st.attend(0, [7, 8, 8], q)
    assert np.array_equal(o[0], np.zeros((Hkv * g, D), F32))
    check_seq(o[1], q[1], k, v, st, f"{path_id(path)} zero rows")
    check_seq(o[2], q[2], k, v, st, f"{path_id(path)} zero query")
    # the zero query head: uniform weights over the dequantized values, up to page weights and fp32
    vq, sv = quant_rows(v)
    mean = (vq * sv[..., None])[:, 0].mean(axis=0)
    assert np.abs(o[2, 1] - mean).max() < 0.02 * np.abs(v[:, 0]).max()


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("path", ALL_PATHS, ids=path_id)
def test_nan_row_poisons_only_its_sequence(monkeypatch, path, where, bad):
    """A NaN (or inf) in an appended k or v row: that row's scale is NaN, and the outputs of that
    sequence's heads that read it are NaN; other sequences in the same call (and their bits), and
    the other kv head of the poisoned sequence, are unaffected."""
    rng = np.random.default_rng(3)
    Hkv, g, D = 2, 2, 64
    data = {s: make_kv(rng, T, Hkv, D, "gaussian") for s, T in enumerate([40, 40, 600])}
    ids = np.arange(3, dtype=np.int64)
    q = rng.standard_normal((3, Hkv * g, D)).astype(F32)
    clean = open_i8(monkeypatch, path, 1, Hkv, D)
    append_ragged(clean, 0, data, np.random.default_rng(1), 30)
    ref = clean.attend(0, ids, q)
    poisoned = {s: (k.copy(), v.copy()) for s, (k, v) in data.items()}
    kv = poisoned[1][0 if where == "k" else 1]
    kv[35, 0, 3] = bad                                        # seq 1, token 35 (second page), kv head 0
    st = open_i8(monkeypatch, path, 1, Hkv, D)
    append_ragged(st, 0, poisoned, np.random.default_rng(1), 30)
    o = st.attend(0, ids, q)
    assert np.isnan(o[1, :g]).all(), (f"{path_id(path)}: {where}={bad} in a row, yet {np.isfinite(o[1, :g]).sum()} of "
                                      f"{o[1, :g].size} outputs of its heads are finite, e.g. {o[1, 0, :3]}")
    assert np.array_equal(o[1, g:], ref[1, g:]), "the other kv head of the sequence changed"
    assert np.array_equal(o[[0, 2]], ref[[0, 2]]), "other sequences changed"
    # later appends and calls stay sound for the others
    k1, v1 = make_kv(rng, 1, Hkv, D, "gaussian")
    st.append(0, [0], k1, v1)
    o2 = st.attend(0, [0, 2], q[[0, 2]])
    assert np.isfinite(o2).all()
    check_seq(o2[0], q[0], np.concatenate([data[0][0], k1]), np.concatenate([data[0][1], v1]), st, "after NaN")


def test_bad_k_v_arrays_raise_value_error_naming_them(monkeypatch):
    Hkv, D = 2, 64
    st = open_i8(monkeypatch, (PATHS[0][0], PATHS[0][1]), 1, Hkv, D)
    k = np.zeros((3, Hkv, D), F32)
    st.append(0, [0, 1, 2], k, k)
    z = np.zeros
    bad_k = [k.astype(np.int8), k.astype(np.float64), k.astype(np.float16), k[:, :1], z((3, Hkv, D + 1), F32),
             k[:2], k.reshape(3, Hkv * D), z((3, Hkv, 2 * D), F32)[:, :, ::2]]            # the last: not contiguous
    bad_v = [k.astype(np.int8), k.astype(np.float64), k.astype(np.int16), k[:, :, :32], z((3, Hkv + 1, D), F32),
             k[1:], k.reshape(3, Hkv * D), z((3, 2 * Hkv, D), F32)[:, ::2]]
    for name, kk, vv in [("k", x, k) for x in bad_k] + [("v", k, x) for x in bad_v]:
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            st.append(0, [0, 1, 2], kk, vv)
    with pytest.raises(ValueError, match="same dtype"):
        st.append(0, [0, 1, 2], k, k.view(np.uint16)[:, :, :D].copy())
    assert [st.num_tokens(s) for s in range(3)] == [1, 1, 1]            # nothing stored by failed calls


# ---------------------------------------------------------------------------------------------
# size


@pytest.mark.parametrize("L,Hkv,D", [(1, 1, 64), (3, 2, 128), (2, 4, 72), (1, 2, 33)])
def test_int8_bytes(L, Hkv, D):
    """kv_bytes_per_token = L * 2 * Hkv * (D + 4); a page of one (sequence, layer, kv head) is
    2 * (32 * Dp + 128) bytes (Dp = D rounded up to 16), bytes_used = pages * that."""
    st = KVStore(L, Hkv, D, "int8", threads=1)
    st.extent_pages = 1                           # pages one at a time: no extent slack in bytes_used
    assert st.kv_bytes_per_token() == L * 2 * Hkv * (D + 4)
    Dp = -(-D // 16) * 16
    page = 2 * (PT * Dp + 4 * PT)
    rng = np.random.default_rng(0)
    held = 0
    for seq, n in [(0, 1), (1, 32), (2, 33), (3, 100)]:
        for layer in range(L):
            k, v = make_kv(rng, n, Hkv, D, "gaussian")
            st.append(layer, np.full(n, seq), k, v)
            held += -(-n // PT) * Hkv * page
            assert st.bytes_used() == held and st.bytes_committed() == held, (seq, layer)
    k, v = make_kv(rng, 1, Hkv, D, "gaussian")
    st.append(0, [3], k, v)                       # 101 tokens: still 4 pages
    assert st.bytes_used() == held
    st.free(1)
    assert st.bytes_used() == held - L * Hkv * page
